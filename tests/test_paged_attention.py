"""Paged attention kernels against the plain masked-attention reference on small shapes.

The Pallas decode op (JAX's ``pallas.ops.gpu.paged_attention``) runs in interpret mode on the CPU;
expectations come from ``attention_ref.masked_attention`` over each request's dense context, built
here from the pages by hand.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax.kernels.attention import paged_decode_attention, write_kv
from tokenspeed_jax.kernels.attention_ref import masked_attention
from tokenspeed_jax.kernels.paged_attention_backend import (
    PALLAS,
    REFERENCE,
    DecodeKernel,
    choose_decode_kernel,
    pallas_unsupported_reason,
)

PAGE = 4
NUM_PAGES = 24
SCALE = 0.3


def cache(rng, num_kv_heads, head_dim):
    shape = (num_kv_heads, NUM_PAGES, PAGE, head_dim)
    return (jnp.asarray(rng.standard_normal(shape), jnp.float32),
            jnp.asarray(rng.standard_normal(shape), jnp.float32))


def dense_context(pages, table, length):
    """[length, Hkv, Dh]: a request's positions 0..length-1 read from its pages."""
    pos = np.arange(length)
    return np.asarray(pages)[:, table[pos // PAGE], pos % PAGE].transpose(1, 0, 2)


def expected_decode(q, k_pages, v_pages, tables, positions):
    rows = []
    for i, position in enumerate(positions):
        if position < 0:
            rows.append(np.zeros(q.shape[1:], np.float32))
            continue
        k = dense_context(k_pages, tables[i], position + 1)[None]
        v = dense_context(v_pages, tables[i], position + 1)[None]
        mask = np.ones((1, 1, position + 1), bool)
        rows.append(np.asarray(masked_attention(q[i][None, None], k, v, mask, scale=SCALE))[0, 0])
    return np.stack(rows)


@pytest.mark.parametrize("kernel", [DecodeKernel(REFERENCE),
                                    DecodeKernel(PALLAS, pages_per_compute_block=2, k_splits=2,
                                                 interpret=True)],
                         ids=["reference", "pallas-interpret"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(9, 3), (4, 2), (32, 2)])
def test_decode_matches_dense_attention(kernel, num_q_heads, num_kv_heads):
    """Head groups of 3 (SmolLM2: 9 q / 3 kv heads, padded to block_h=16), 2 and 16; a padding
    row, lengths inside and at the end of a page, a table width (5) the op's blocks don't divide."""
    rng = np.random.default_rng(num_q_heads)
    head_dim = 16
    k_pages, v_pages = cache(rng, num_kv_heads, head_dim)
    tables = np.array([[3, 7, 1, 0, 0], [2, 4, 6, 8, 10], [5, 0, 0, 0, 0], [9, 0, 0, 0, 0]],
                      np.int32)
    positions = np.array([9, 19, 3, -1], np.int32)
    q = rng.standard_normal((4, num_q_heads, head_dim)).astype(np.float32)
    out = paged_decode_attention(jnp.asarray(q), k_pages, v_pages, jnp.asarray(tables),
                                 jnp.asarray(positions), scale=SCALE, kernel=kernel)
    np.testing.assert_allclose(np.asarray(out), expected_decode(q, k_pages, v_pages, tables,
                                                                positions),
                               rtol=2e-5, atol=2e-5)
    assert not np.any(np.asarray(out)[3])


def test_write_kv_drops_padding_slots():
    k_pages = jnp.zeros((2, 3, PAGE, 4), jnp.float32)
    new = jnp.arange(3 * 2 * 4, dtype=jnp.float32).reshape(3, 2, 4) + 1
    out = np.asarray(write_kv(k_pages, new, jnp.asarray([5, -1, 0], jnp.int32)))
    np.testing.assert_array_equal(out[:, 1, 1], np.asarray(new[0]))
    np.testing.assert_array_equal(out[:, 0, 0], np.asarray(new[2]))
    assert np.count_nonzero(out) == 2 * 2 * 4


def test_backend_choice_is_static_and_declared():
    assert choose_decode_kernel(head_dim=64, page_size=16, dtype=jnp.bfloat16,
                                platform="cpu").backend == REFERENCE
    assert choose_decode_kernel(head_dim=64, page_size=16, dtype=jnp.bfloat16,
                                platform="gpu").backend == PALLAS
    assert "head_dim=80" in pallas_unsupported_reason(head_dim=80, page_size=16,
                                                      dtype=jnp.bfloat16)
    assert "page_size=12" in pallas_unsupported_reason(head_dim=64, page_size=12,
                                                       dtype=jnp.bfloat16)
    assert choose_decode_kernel(head_dim=80, page_size=16, dtype=jnp.bfloat16,
                                platform="gpu").backend == REFERENCE
    with pytest.raises(ValueError, match="block_h=8"):
        DecodeKernel(PALLAS, block_h=8)
