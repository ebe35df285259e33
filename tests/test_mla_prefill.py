"""The MLA prefill kernel (interpreted on the CPU) and its plain-JAX reference against a hand
computation in numpy float64 (``mla_checks``): each packed token's heads over its request's
latent rows 0..its position, read through its page table.

The packed batch is ragged on purpose: a cached prefix ending mid-page with new tokens crossing
pages, a fresh prompt longer than a query block, one token after a page-aligned prefix, a
prefix-cache hit (a request whose first page is another request's cached page), padding tokens,
an unused page-table row, a table width the key blocks do not divide. A chunked prefill runs a
prompt in two steps, the second chunk reading the rows the first one wrote.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import mla_checks as hand
import numpy as np
import pytest
from mla_checks import PAGE, RANK, ROPE, SCALE, WIDTH

from tokenspeed_jax.kernels.mla_prefill import (
    MLAPrefillBlocks,
    mla_prefill,
    mla_prefill_problem,
    mla_prefill_reference,
)
from tokenspeed_jax.kernels.paged_prefill_attention import prefill_work

NUM_PAGES = 48
BLOCKS = MLAPrefillBlocks(block_q=8, block_h=2, pages_per_block=4)  # 16 rows, 16-key blocks
# (cached prefix, new tokens) per page-table row; row 3 is a prefix-cache hit on row 0's first
# page (4 cached tokens), row 4 is unused.
REQUESTS = ((5, 7), (0, 20), (8, 1), (4, 6))
NUM_ROWS = 5


def packed_step(rng, requests, num_heads, *, num_padding=3, dtype=jnp.float32):
    """A packed step: per-token rows and positions, page tables, q, the step's latent rows and
    the pages before they are written (numpy, values in ``dtype``)."""
    token_request, positions = [], []
    for row, (cached, new) in enumerate(requests):
        token_request += [row] * new
        positions += range(cached, cached + new)
    token_request = np.array(token_request + [-1] * num_padding, np.int32)
    positions = np.array(positions + [-1] * num_padding, np.int32)
    lengths = [cached + new for cached, new in requests] + [0] * (NUM_ROWS - len(requests))
    tables = hand.distinct_tables(rng, lengths, num_pages=NUM_PAGES, page_size=PAGE, width=WIDTH)
    q, latent, pages = hand.random_arrays(rng, dtype, (len(positions), num_heads, RANK + ROPE),
                                     (len(positions), RANK + ROPE), (NUM_PAGES, PAGE, RANK + ROPE))
    return token_request, positions, tables, q, latent, pages


def run_kernel(q, pages, tables, token_request, positions, blocks=BLOCKS):
    work = prefill_work(token_request, positions, num_rows=tables.shape[0], block_q=blocks.block_q)
    out = mla_prefill(jnp.asarray(q), jnp.asarray(pages), jnp.asarray(tables),
                      jnp.asarray(positions), jnp.asarray(work), scale=SCALE, kv_lora_rank=RANK,
                      blocks=blocks, interpret=True)
    return np.asarray(out.astype(jnp.float32))


def run_reference(q, pages, tables, token_request, positions):
    out = mla_prefill_reference(jnp.asarray(q), jnp.asarray(pages), jnp.asarray(tables),
                                jnp.asarray(token_request), jnp.asarray(positions), scale=SCALE,
                                kv_lora_rank=RANK)
    return np.asarray(out.astype(jnp.float32))


@pytest.mark.parametrize("num_heads,blocks", [
    (5, BLOCKS),  # three head blocks, the last one padded
    (4, MLAPrefillBlocks(block_q=16, block_h=1, pages_per_block=2)),  # one head a program
    (4, MLAPrefillBlocks(block_q=4, block_h=4, pages_per_block=8)),  # 32-key blocks
], ids=["5-heads-by-2", "4-heads-by-1", "4-heads-by-4"])
def test_ragged_step_with_a_prefix_hit_matches_the_hand_computation(num_heads, blocks):
    rng = np.random.default_rng(num_heads * 10 + blocks.block_h)
    token_request, positions, tables, q, latent, pages = packed_step(rng, REQUESTS, num_heads)
    tables[3, 0] = tables[0, 0]  # row 3's first page is row 0's: a prefix-cache hit
    written = hand.write_by_hand(pages, latent, tables, token_request, positions)
    want = hand.attention_by_hand(q, written, tables, token_request, positions, scale=SCALE,
                             rank=RANK)
    got = run_kernel(q, written, tables, token_request, positions, blocks)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(run_reference(q, written, tables, token_request, positions),
                               want, rtol=2e-5, atol=2e-5)
    assert not got[token_request < 0].any()


def test_chunked_prefill_second_chunk_reads_the_first_chunks_rows():
    """A 19-token prompt (row 0) prefilled as 11 then 8 tokens, packed with another request and
    padding, each step writing its rows before attending: the two chunks' outputs are the
    whole prompt's, computed by hand in one go."""
    rng = np.random.default_rng(3)
    _, _, tables, q, latent, pages = packed_step(rng, ((0, 19), (0, 6)), 4, num_padding=0)
    prompt = np.arange(19, dtype=np.int32)
    whole = hand.write_by_hand(pages, latent[:19], tables, np.zeros(19, np.int32), prompt)
    want = hand.attention_by_hand(q[:19], whole, tables, np.zeros(19, np.int32), prompt,
                             scale=SCALE, rank=RANK)
    other_q, other_latent = q[19:], latent[19:]
    for chunk in (prompt[:11], prompt[11:]):
        token_request = np.r_[np.zeros(len(chunk)), np.ones(6), -np.ones(2)].astype(np.int32)
        positions = np.r_[chunk, np.arange(6), [-1, -1]].astype(np.int32)
        step_q = np.concatenate([q[chunk], other_q, q[:2]])
        step_latent = np.concatenate([latent[chunk], other_latent, latent[:2]])
        pages = hand.write_by_hand(pages, step_latent, tables, token_request, positions)
        got = run_kernel(step_q, pages, tables, token_request, positions)
        np.testing.assert_allclose(got[:len(chunk)], want[chunk], rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(
            run_reference(step_q, pages, tables, token_request, positions)[:len(chunk)],
            want[chunk], rtol=2e-5, atol=2e-5)
        assert not got[-2:].any()


def test_bfloat16_step():
    """bf16 queries and cache: float32 scores and softmax; the probabilities are rounded to
    bf16 for the value dot, hence the looser tolerance."""
    rng = np.random.default_rng(7)
    token_request, positions, tables, q, latent, pages = packed_step(rng, REQUESTS, 4,
                                                                     dtype=jnp.bfloat16)
    written = hand.write_by_hand(pages, latent, tables, token_request, positions)
    want = hand.attention_by_hand(np.asarray(q, np.float32), np.asarray(written, np.float32), tables,
                             token_request, positions, scale=SCALE, rank=RANK)
    got = run_kernel(q, written, tables, token_request, positions)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_bucket_smaller_than_a_query_block():
    """Five tokens (one request after a 3-token prefix, two padding) in 16-token query blocks."""
    rng = np.random.default_rng(11)
    token_request, positions, tables, q, latent, pages = packed_step(rng, ((3, 3),), 2,
                                                                     num_padding=2)
    written = hand.write_by_hand(pages, latent, tables, token_request, positions)
    blocks = MLAPrefillBlocks(block_q=16, block_h=1, pages_per_block=4)
    got = run_kernel(q, written, tables, token_request, positions, blocks)
    assert got.shape == (5, 2, RANK)
    np.testing.assert_allclose(got, hand.attention_by_hand(q, written, tables, token_request,
                                                      positions, scale=SCALE, rank=RANK),
                               rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_heads,blocks", [
    (32, MLAPrefillBlocks()), (128, MLAPrefillBlocks()), (4, MLAPrefillBlocks(32, 1, 2, 8)),
    (32, MLAPrefillBlocks(16, 4, 2, 8)), (32, MLAPrefillBlocks(64, 1, 2, 8)),
    (32, MLAPrefillBlocks(16, 2, 4, 4)),
])
def test_lowers_to_one_triton_kernel_at_the_model_shape(num_heads, blocks, dtype):
    """The kernel for the GPU at R = 512, r = 64, 16-token pages: Pallas lowers it to Triton IR
    (on this machine, ``mla_checks.triton_kernels``) with the default knobs and the others the
    benchmark times; 4 heads is a tensor-parallel shard."""
    width = hand.MODEL_RANK + hand.MODEL_ROPE
    spec = jax.ShapeDtypeStruct
    shapes = (spec((1000, num_heads, width), dtype),
              spec((512, hand.MODEL_PAGE, width), dtype), spec((6, 40), jnp.int32),
              spec((1000,), jnp.int32), spec((80, 4), jnp.int32))
    assert hand.triton_kernels(lambda *a: mla_prefill(
        *a, scale=SCALE, kv_lora_rank=hand.MODEL_RANK, blocks=blocks, interpret=False),
        *shapes) == 1


def test_problems_and_bad_inputs_are_named():
    shape = {"kv_lora_rank": 512, "rope_dim": 64, "page_size": 16, "dtype": jnp.bfloat16}
    assert mla_prefill_problem(**shape) is None
    assert "rope_dim" in mla_prefill_problem(**{**shape, "rope_dim": 48})
    assert "page_size=4" in mla_prefill_problem(**{**shape, "page_size": 4})
    with pytest.raises(ValueError, match="block_q=4 x block_h=2"):
        MLAPrefillBlocks(block_q=4, block_h=2)
    with pytest.raises(ValueError, match="block_h=3"):
        MLAPrefillBlocks(block_h=3)
    token_request, positions, tables, q, _, pages = packed_step(np.random.default_rng(0),
                                                                REQUESTS, 2)
    work = jnp.asarray(prefill_work(token_request, positions, num_rows=NUM_ROWS, block_q=8))
    call = {"scale": SCALE, "kv_lora_rank": RANK, "blocks": BLOCKS, "interpret": True}
    with pytest.raises(ValueError, match="pages shape"):
        mla_prefill(q, pages[..., :RANK], tables, positions, work, **call)
    with pytest.raises(ValueError, match="positions shape"):
        mla_prefill(q, pages, tables, positions[:3], work, **call)
    with pytest.raises(ValueError, match="work shape"):
        mla_prefill(q, pages, tables, positions, work[:, :3], **call)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_prefill(q, pages, tables, positions, work, **{**call, "kv_lora_rank": 0})
