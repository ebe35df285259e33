"""Ragged paged prefill attention: the Pallas kernel (interpreted on the CPU) and the plain-JAX
reference against ``attention_ref.masked_attention`` over each token's dense context, read from
the pages by hand, and against each other.

The batch is ragged on purpose: cached prefixes ending mid-page and on a page boundary, new
tokens straddling pages and query blocks, a one-token request, padding tokens, unused page-table
rows, page tables whose width the kernel's key blocks do not divide.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax.kernels.attention import write_kv
from tokenspeed_jax.kernels.attention_ref import masked_attention
from tokenspeed_jax.kernels.paged_attention_backend import PALLAS, REFERENCE
from tokenspeed_jax.kernels.paged_prefill_attention import (
    PrefillBlocks,
    PrefillKernel,
    choose_prefill_kernel,
    num_work_items,
    paged_prefill_attention,
    prefill_unsupported_reason,
    prefill_work,
    ragged_paged_prefill_attention,
    ragged_paged_prefill_attention_reference,
)

PAGE = 4
NUM_PAGES = 40
WIDTH = 10  # page-table width: not a multiple of pages_per_block = 4
SCALE = 0.3
BLOCKS = PrefillBlocks(block_q=16, pages_per_block=4)
# (cached prefix, new tokens) per request row: a prefix ending mid-page with new tokens crossing
# pages, a fresh prompt longer than one query block, one token after a page-aligned prefix, a
# prefix ending mid-page with a short piece.
REQUESTS = ((5, 7), (0, 20), (8, 1), (13, 3))
NUM_ROWS = 6  # two unused page-table rows
NUM_PADDING = 4


def ragged_batch(rng, requests=REQUESTS, num_padding=NUM_PADDING):
    """Per-token rows and positions, page tables (distinct random pages per row)."""
    token_request, positions = [], []
    for row, (cached, new) in enumerate(requests):
        token_request += [row] * new
        positions += range(cached, cached + new)
    token_request += [-1] * num_padding
    positions += [-1] * num_padding
    pages = rng.permutation(np.arange(1, NUM_PAGES)).astype(np.int32)
    tables = np.zeros((NUM_ROWS, WIDTH), np.int32)
    for row, (cached, new) in enumerate(requests):
        count = -(-(cached + new) // PAGE)
        tables[row, :count] = pages[:count]
        pages = pages[count:]
    return np.array(token_request, np.int32), np.array(positions, np.int32), tables


def filled_cache(rng, token_request, positions, tables, num_q_heads, num_kv_heads, head_dim,
                 dtype):
    """Random pages (the cached prefixes) with the step's new K/V written as the break does;
    returns q and the pages."""
    shape = (num_kv_heads, NUM_PAGES, PAGE, head_dim)
    k_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    v_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    num_tokens = len(token_request)
    real = (token_request >= 0) & (positions >= 0)
    table_of_token = tables[np.maximum(token_request, 0)]
    page_of_token = table_of_token[np.arange(num_tokens), np.maximum(positions, 0) // PAGE]
    slots = np.where(real, page_of_token * PAGE + positions % PAGE, -1).astype(np.int32)
    k_new = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), dtype)
    v_new = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), dtype)
    k_pages = write_kv(k_pages, k_new, jnp.asarray(slots))
    v_pages = write_kv(v_pages, v_new, jnp.asarray(slots))
    q = jnp.asarray(rng.standard_normal((num_tokens, num_q_heads, head_dim)), dtype)
    return q, k_pages, v_pages


def expected(q, k_pages, v_pages, token_request, positions, tables):
    """Each token over its row's positions 0..its own, gathered densely by hand, in float32."""
    q, k_pages, v_pages = (np.asarray(x, np.float32) for x in (q, k_pages, v_pages))
    num_keys = positions.max() + 1
    keys = np.arange(num_keys)
    pages = tables[np.maximum(token_request, 0)][:, keys // PAGE]  # [T, S]
    k = k_pages[:, pages, keys % PAGE].transpose(1, 2, 0, 3)  # [T, S, Hkv, Dh]
    v = v_pages[:, pages, keys % PAGE].transpose(1, 2, 0, 3)
    real = (token_request >= 0) & (positions >= 0)
    mask = (keys[None, :] <= positions[:, None]) & real[:, None]
    return np.asarray(masked_attention(q[:, None], k, v, mask[:, None, :], scale=SCALE))[:, 0]


def run_both(q, k_pages, v_pages, token_request, positions, tables, blocks=BLOCKS):
    work = prefill_work(token_request, positions, num_rows=NUM_ROWS, block_q=blocks.block_q)
    kernel = ragged_paged_prefill_attention(
        q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(positions), jnp.asarray(work),
        scale=SCALE, blocks=blocks, interpret=True)
    reference = ragged_paged_prefill_attention_reference(
        q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(token_request),
        jnp.asarray(positions), scale=SCALE)
    return (np.asarray(kernel.astype(jnp.float32)), np.asarray(reference.astype(jnp.float32)))


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_kernel_and_reference_match_dense_attention_fp32(num_q_heads, num_kv_heads):
    rng = np.random.default_rng(num_q_heads * 10 + num_kv_heads)
    token_request, positions, tables = ragged_batch(rng)
    q, k_pages, v_pages = filled_cache(rng, token_request, positions, tables, num_q_heads,
                                       num_kv_heads, 16, jnp.float32)
    kernel, reference = run_both(q, k_pages, v_pages, token_request, positions, tables)
    want = expected(q, k_pages, v_pages, token_request, positions, tables)
    np.testing.assert_allclose(kernel, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(reference, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(kernel, reference, rtol=2e-5, atol=2e-5)
    padding = token_request < 0
    assert not np.any(kernel[padding]) and not np.any(reference[padding])


def test_kernel_and_reference_match_dense_attention_bf16():
    """bf16 inputs: float32 scores and softmax; the kernel's probabilities are rounded to bf16
    for the value dot, hence the looser tolerance."""
    rng = np.random.default_rng(7)
    token_request, positions, tables = ragged_batch(rng)
    q, k_pages, v_pages = filled_cache(rng, token_request, positions, tables, 8, 2, 32,
                                       jnp.bfloat16)
    kernel, reference = run_both(q, k_pages, v_pages, token_request, positions, tables)
    want = expected(q, k_pages, v_pages, token_request, positions, tables)
    np.testing.assert_allclose(reference, want, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(kernel, want, rtol=3e-2, atol=3e-2)


def test_bucket_smaller_than_a_query_block_and_wide_key_blocks():
    """8 tokens under block_q = 16 (the kernel pads the block), keys in blocks of 8 pages."""
    rng = np.random.default_rng(3)
    token_request, positions, tables = ragged_batch(rng, ((6, 3), (0, 2), (9, 1)), 2)
    q, k_pages, v_pages = filled_cache(rng, token_request, positions, tables, 4, 2, 16,
                                       jnp.float32)
    blocks = PrefillBlocks(block_q=16, pages_per_block=8)
    kernel, reference = run_both(q, k_pages, v_pages, token_request, positions, tables, blocks)
    want = expected(q, k_pages, v_pages, token_request, positions, tables)
    np.testing.assert_allclose(kernel, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(reference, want, rtol=2e-5, atol=2e-5)


def test_dispatch_follows_the_kernel_choice():
    rng = np.random.default_rng(5)
    token_request, positions, tables = ragged_batch(rng)
    q, k_pages, v_pages = filled_cache(rng, token_request, positions, tables, 4, 2, 16,
                                       jnp.float32)
    work = jnp.asarray(prefill_work(token_request, positions, num_rows=NUM_ROWS,
                                    block_q=BLOCKS.block_q))
    args = (q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(token_request),
            jnp.asarray(positions))
    pallas = paged_prefill_attention(*args, work, scale=SCALE,
                                     kernel=PrefillKernel(PALLAS, BLOCKS, interpret=True))
    reference = paged_prefill_attention(*args, None, scale=SCALE)
    want = expected(q, k_pages, v_pages, token_request, positions, tables)
    np.testing.assert_allclose(np.asarray(pallas), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(reference), want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="work items"):
        paged_prefill_attention(*args, None, scale=SCALE, kernel=PrefillKernel(PALLAS))


def test_work_items_cover_each_run_in_query_blocks():
    token_request = np.array([0] * 20 + [1] * 3 + [-1] * 5, np.int32)
    positions = np.array([*range(4, 24), *range(7, 10), *[-1] * 5], np.int32)
    work = prefill_work(token_request, positions, num_rows=3, block_q=8)
    assert work.shape == (num_work_items(28, 3, 8), 4) == (8, 4)
    np.testing.assert_array_equal(work[:5], [[0, 0, 8, 12], [0, 8, 16, 20], [0, 16, 20, 24],
                                             [1, 20, 23, 10], [-1, 23, 28, 0]])
    np.testing.assert_array_equal(work[5:], [[-1, 0, 0, 0]] * 3)


def test_work_items_reject_a_row_split_in_two_runs():
    token_request = np.array([0, 1, 0, 1, 0, 1], np.int32)
    positions = np.array([0, 0, 1, 1, 2, 2], np.int32)
    with pytest.raises(ValueError, match="6 work items exceed 5"):
        prefill_work(token_request, positions, num_rows=2, block_q=4)


def test_backend_choice_is_static_and_declared():
    assert choose_prefill_kernel(head_dim=64, page_size=16, dtype=jnp.bfloat16,
                                 platform="cpu").backend == REFERENCE
    assert choose_prefill_kernel(head_dim=128, page_size=16, dtype=jnp.bfloat16,
                                 platform="gpu").backend == PALLAS
    assert choose_prefill_kernel(head_dim=128, page_size=16, dtype=jnp.bfloat16,
                                 platform="gpu", devices=2).backend == REFERENCE
    assert "head_dim=80" in prefill_unsupported_reason(head_dim=80, page_size=16,
                                                       dtype=jnp.bfloat16)
