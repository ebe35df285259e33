"""The MLA decode and prefill kernels compiled for the GPU (Triton) at the latent cache shape of
Kimi-Linear and DeepSeek-V3 (R = 512, r = 64, 16-token pages) with their default knobs, against
their plain-JAX references (which test_mla_decode.py and test_mla_prefill.py check by hand on
the CPU). What interpret mode cannot show: that the kernels lower, and that the compiled
arithmetic (bf16 dots with fp32 accumulation, TF32-free fp32) matches.

Skipped without a GPU; on a GPU machine: ``pytest -m gpu tests/test_mla_kernels_gpu.py``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import mla_checks as hand
import numpy as np
import pytest

from tokenspeed_jax.kernels.mla_decode import (
    MANY_REQUEST_BLOCKS,
    MANY_REQUESTS,
    MLADecodeBlocks,
    mla_decode,
    mla_decode_blocks,
    mla_decode_reference,
    mla_split_count,
)
from tokenspeed_jax.kernels.mla_prefill import (
    mla_prefill,
    mla_prefill_blocks,
    mla_prefill_reference,
)
from tokenspeed_jax.kernels.paged_prefill_attention import prefill_work

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")]

RANK, ROPE, PAGE = hand.MODEL_RANK, hand.MODEL_ROPE, hand.MODEL_PAGE
SCALE = 192 ** -0.5  # (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 of both families
NUM_PAGES = 1024
TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 3e-2}


def tables_for(rng, lengths, width):
    return hand.distinct_tables(rng, lengths, num_pages=NUM_PAGES, page_size=PAGE, width=width)


@pytest.mark.parametrize("dtype,blocks", [
    (jnp.float32, MLADecodeBlocks()), (jnp.bfloat16, MLADecodeBlocks()),
    (jnp.bfloat16, MANY_REQUEST_BLOCKS)], ids=["fp32", "bf16", "bf16-keys-as-rows"])
@pytest.mark.parametrize("num_heads", [32, 128])
def test_decode_kernel_matches_reference(num_heads, dtype, blocks):
    """Positions 0, mid-page, on a page's last row and after 2000 tokens, and padding; unsplit
    and with the split count the batch size gets; both layouts of the dots at the knobs
    ``mla_decode_blocks`` gives them (keys-as-rows only over 2-byte caches)."""
    rng = np.random.default_rng(num_heads)
    positions = jnp.asarray([0, 700, 1023, 2050, -1], jnp.int32)
    tables = jnp.asarray(tables_for(rng, [1, 701, 1024, 2051, 0], 160))
    q, latent, pages = map(jnp.asarray, hand.random_arrays(
        rng, dtype, (5, num_heads, RANK + ROPE), (5, RANK + ROPE), (NUM_PAGES, PAGE, RANK + ROPE)))
    want, want_pages = mla_decode_reference(q, latent, pages, tables, positions, scale=SCALE,
                                            kv_lora_rank=RANK)
    for splits in sorted({1, mla_split_count(5, num_heads, blocks)}):
        out, got_pages = mla_decode(q, latent, pages, tables, positions, scale=SCALE,
                                    kv_lora_rank=RANK, splits=splits, blocks=blocks,
                                    interpret=False)
        assert np.array_equal(np.asarray(got_pages), np.asarray(want_pages)), splits
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                                   rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
        assert not np.asarray(out)[-1].any()


@pytest.mark.parametrize("page_size", [32, 128])
def test_many_requests_over_longer_pages_take_128_row_key_blocks(page_size):
    """``mla_decode_blocks`` for ``MANY_REQUESTS`` requests over bf16 pages of 32 and 128 rows:
    the keys-as-rows kernel with key blocks of 4 pages and of 1, at its split count, against
    the reference; positions 0 and up to 600, and padding."""
    rng = np.random.default_rng(page_size)
    batch, num_heads = MANY_REQUESTS, 32
    positions = rng.integers(1, 600, batch).astype(np.int32)
    positions[0], positions[-1] = 0, -1
    width = -(-600 // page_size)
    num_pages = batch * width + 1
    tables = jnp.asarray(hand.distinct_tables(rng, np.maximum(positions + 1, 0),
                                              num_pages=num_pages, page_size=page_size,
                                              width=width))
    q, latent, pages = map(jnp.asarray, hand.random_arrays(
        rng, jnp.bfloat16, (batch, num_heads, RANK + ROPE), (batch, RANK + ROPE),
        (num_pages, page_size, RANK + ROPE)))
    blocks = mla_decode_blocks(batch, jnp.bfloat16, page_size)
    assert blocks.keys_as_rows and blocks.pages_per_block * page_size == 128
    want, want_pages = mla_decode_reference(q, latent, pages, tables, jnp.asarray(positions),
                                            scale=SCALE, kv_lora_rank=RANK)
    out, got_pages = mla_decode(q, latent, pages, tables, jnp.asarray(positions), scale=SCALE,
                                kv_lora_rank=RANK, splits=mla_split_count(batch, num_heads, blocks),
                                blocks=blocks, interpret=False)
    assert np.array_equal(np.asarray(got_pages), np.asarray(want_pages))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               rtol=TOLERANCE[jnp.bfloat16], atol=TOLERANCE[jnp.bfloat16])
    assert not np.asarray(out)[-1].any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("knobs", [{}, {"block_q": 32, "block_h": 1}], ids=["default", "32x1"])
def test_prefill_kernel_matches_reference(knobs, dtype):
    """A fresh 300-token prompt, 200 tokens after a 37-token prefix, one token after 1000, a
    chunk of 333 after 1000 cached tokens sharing the first rows' pages (a prefix hit), and
    padding; the dtype's default knobs (``mla_prefill_blocks``), and those with 32 x 1 rows."""
    blocks = dataclasses.replace(mla_prefill_blocks(dtype), **knobs)
    rng = np.random.default_rng(blocks.block_q)
    requests = [(0, 300), (37, 200), (1000, 1), (1000, 333)]
    token_request = np.concatenate([np.full(new, row) for row, (_, new) in enumerate(requests)]
                                   + [np.full(13, -1)]).astype(np.int32)
    positions = np.concatenate([np.arange(cached, cached + new) for cached, new in requests]
                               + [np.full(13, -1)]).astype(np.int32)
    tables = tables_for(rng, [c + n for c, n in requests] + [0, 0], 96)
    tables[3, :18] = tables[0, :18]  # row 3's first 288 cached tokens are row 0's pages
    q, pages = map(jnp.asarray, hand.random_arrays(rng, dtype, (len(positions), 32, RANK + ROPE),
                                                   (NUM_PAGES, PAGE, RANK + ROPE)))
    work = prefill_work(token_request, positions, num_rows=len(tables), block_q=blocks.block_q)
    out = mla_prefill(q, pages, jnp.asarray(tables), jnp.asarray(positions), jnp.asarray(work),
                      scale=SCALE, kv_lora_rank=RANK, blocks=blocks, interpret=False)
    want = mla_prefill_reference(q, pages, jnp.asarray(tables), jnp.asarray(token_request),
                                 jnp.asarray(positions), scale=SCALE, kv_lora_rank=RANK)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    assert not np.asarray(out)[token_request < 0].any()
