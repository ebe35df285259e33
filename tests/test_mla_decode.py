"""The MLA decode kernel (interpreted on the CPU) and its plain-JAX reference against a hand
computation in numpy float64 (``mla_checks``): the step's latent row written by hand at the slot
its page table gives its position, then each head over the request's rows 0..its position.

The batches mix positions inside a page, on a page's first and last row, position 0 (no cached
context), padding rows and page tables wider than the context; head counts a head block divides,
does not divide, and that are smaller than one block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import mla_checks as hand
import numpy as np
import pytest
from mla_checks import PAGE, RANK, ROPE, SCALE, WIDTH

from tokenspeed_jax.kernels.mla_decode import (
    MANY_REQUEST_BLOCKS,
    MANY_REQUEST_KEYS,
    MANY_REQUESTS,
    MLADecodeBlocks,
    mla_decode,
    mla_decode_blocks,
    mla_decode_problem,
    mla_decode_reference,
    mla_split_count,
)
from tokenspeed_jax.models.mla import paged_latent_decode, write_latent

NUM_PAGES = 40
BLOCKS = MLADecodeBlocks(pages_per_block=4)  # 16-key blocks
KEYS_AS_ROWS = MLADecodeBlocks(block_h=32, pages_per_block=2, keys_as_rows=True)  # 8-key blocks
# Per batch size, the positions: inside a page, on a page's last (19) and first (4, 8, 16) row,
# 0 (the new row is the whole context), padding (-1).
POSITIONS = {1: [13], 4: [9, 19, 0, -1], 7: [4, 8, 23, 3, -1, 16, 1]}


def decode_inputs(rng, batch: int, num_heads: int, dtype=jnp.float32):
    """q, the step's latent rows, the pages, page tables and positions (numpy, in ``dtype``)."""
    positions = np.array(POSITIONS[batch], np.int32)
    tables = hand.distinct_tables(rng, np.maximum(positions + 1, 0), num_pages=NUM_PAGES,
                             page_size=PAGE, width=WIDTH)
    q, latent, pages = hand.random_arrays(rng, dtype, (batch, num_heads, RANK + ROPE),
                                     (batch, RANK + ROPE), (NUM_PAGES, PAGE, RANK + ROPE))
    return q, latent, pages, tables, positions


def expected(q, latent, pages, tables, positions):
    """(output [B, H, R], pages) by hand."""
    requests = np.arange(len(positions))
    written = hand.write_by_hand(pages, latent, tables, requests, positions)
    return hand.attention_by_hand(q, written, tables, requests, positions, scale=SCALE,
                             rank=RANK), written


def run_kernel(inputs, splits, blocks=BLOCKS):
    return mla_decode(*(jnp.asarray(x) for x in inputs), scale=SCALE, kv_lora_rank=RANK,
                      splits=splits, blocks=blocks, interpret=True)


@pytest.mark.parametrize("batch,num_heads,splits,blocks", [
    *[(batch, heads, splits, BLOCKS) for batch, heads in [(1, 16), (4, 40), (7, 8)]
      for splits in (1, 3)],
    (1, 16, 1, KEYS_AS_ROWS), (4, 40, 3, KEYS_AS_ROWS), (7, 8, 3, KEYS_AS_ROWS)])
def test_kernel_writes_the_row_and_attends_like_the_hand_computation(batch, num_heads, splits,
                                                                      blocks):
    """The pages equal the hand-written ones bit for bit (the row in its slot, nothing else
    changed); the output matches the hand attention; padding rows get zeros. Three splits of
    contexts of one or two key blocks leave some splits empty; 40 heads make three head blocks
    of 16 (two of 32), the last one padded. Both layouts of the dots: keys-as-rows carries each
    block's loads into the next step, so a split's last and empty splits' loads are clamped."""
    inputs = decode_inputs(np.random.default_rng(batch * 10 + splits), batch, num_heads)
    want_out, want_pages = expected(*inputs)
    out, pages = run_kernel(inputs, splits, blocks)
    np.testing.assert_array_equal(np.asarray(pages), want_pages)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=2e-5, atol=2e-5)
    padding = inputs[-1] < 0
    assert not np.asarray(out)[padding].any()


@pytest.mark.parametrize("batch", [1, 4, 7])
def test_reference_and_model_route_match_the_hand_computation(batch):
    """``mla_decode_reference`` and the model's unfused route (``mla.write_latent`` then
    ``mla.paged_latent_decode``) against the same hand computation."""
    q, latent, pages, tables, positions = decode_inputs(np.random.default_rng(batch), batch, 40)
    want_out, want_pages = expected(q, latent, pages, tables, positions)
    out, got_pages = mla_decode_reference(q, latent, pages, tables, positions, scale=SCALE,
                                          kv_lora_rank=RANK)
    np.testing.assert_array_equal(np.asarray(got_pages), want_pages)
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=2e-5, atol=2e-5)
    slots = np.where(positions >= 0, tables[np.arange(batch), np.maximum(positions, 0) // PAGE]
                     * PAGE + positions % PAGE, -1)
    model_pages = write_latent(jnp.asarray(pages), jnp.asarray(latent), jnp.asarray(slots))
    np.testing.assert_array_equal(np.asarray(model_pages), want_pages)
    model_out = paged_latent_decode(jnp.asarray(q), model_pages, jnp.asarray(tables),
                                    jnp.asarray(positions), scale=SCALE, kv_lora_rank=RANK)
    np.testing.assert_allclose(np.asarray(model_out), want_out, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("splits,blocks", [(1, BLOCKS), (4, BLOCKS), (4, KEYS_AS_ROWS)])
def test_kernel_in_bfloat16(splits, blocks):
    """bf16 query, row and cache: the written row exactly the new row, every other slot
    unchanged, the output within bf16 rounding of the float64 attention over the same values."""
    inputs = decode_inputs(np.random.default_rng(5 + splits), 4, 40, jnp.bfloat16)
    out, pages = run_kernel(inputs, splits, blocks)
    assert out.dtype == pages.dtype == jnp.bfloat16
    q, latent, pages_in, tables, positions = inputs
    want_out, want_pages = expected(*(np.asarray(x, np.float32) for x in (q, latent, pages_in)),
                                    tables, positions)
    np.testing.assert_array_equal(np.asarray(pages, np.float32), want_pages)
    np.testing.assert_allclose(np.asarray(out, np.float32), want_out, rtol=2e-2, atol=2e-2)


def test_one_kernel_and_a_merge_only_when_split():
    """The op is one pallas_call with no scatter (the kernel writes the row in place); with
    splits the merge (its exp2) runs beside it, without splits there is none."""
    inputs = [jnp.asarray(x) for x in decode_inputs(np.random.default_rng(0), 4, 16)]

    def primitives(splits):  # the names in the op's own jaxpr (the kernel body not included)
        closed = jax.make_jaxpr(lambda *a: mla_decode(
            *a, scale=SCALE, kv_lora_rank=RANK, splits=splits, blocks=BLOCKS,
            interpret=True))(*inputs)
        (call,) = closed.jaxpr.eqns
        return [eqn.primitive.name for eqn in call.params["jaxpr"].jaxpr.eqns]

    unsplit, split = primitives(1), primitives(3)
    for names in (unsplit, split):
        assert names.count("pallas_call") == 1 and "scatter" not in names
    assert "exp2" in split and "exp2" not in unsplit


def test_split_count_fills_the_gpu_at_small_batches():
    """Hand-computed: the fewest splits (at most most_splits) that give (request, head block,
    split) programs fill_programs many (256 by default)."""
    blocks = MLADecodeBlocks(block_h=16, most_splits=8, fill_programs=128)
    assert mla_split_count(1, 32, blocks) == 8  # 2 head blocks: 64 would fill, capped
    assert mla_split_count(8, 32, blocks) == 8  # 16 programs: 8 splits make 128
    assert mla_split_count(16, 40, blocks) == 3  # 3 head blocks: 48 programs, 3 splits 144
    assert mla_split_count(64, 32, blocks) == 1  # 128 already
    assert mla_split_count(1, 8, MLADecodeBlocks(most_splits=2)) == 2
    assert mla_split_count(1, 16) == 32  # the default cap: one head block, 256 would fill
    assert mla_split_count(2, 32) == 32  # a 2-row bucket of Kimi-Linear's 32 heads: 64 would
    assert mla_split_count(8, 32) == 16  # 16 programs: 16 splits make 256
    assert mla_split_count(64, 32) == 2  # 128 programs: 2 splits make 256
    assert mla_split_count(16, 40) == 6  # 48 programs: 6 splits make 288
    assert mla_split_count(2, 128, MLADecodeBlocks(block_h=32)) == 32  # 8 programs: 32 fill


def test_many_requests_over_a_2_byte_cache_take_the_keys_as_rows_form():
    """``mla_decode_blocks``: the default knobs below ``MANY_REQUESTS``, over fp32 or over pages
    longer than a keys-as-rows block; the keys-as-rows knobs from it on over bf16, with key
    blocks of ``MANY_REQUEST_KEYS`` rows whatever the page size. At Kimi-Linear's 32 heads a
    64-request batch is 64 programs of all 32 heads, so 2 splits make the 128 it fills."""
    bf16, default = jnp.bfloat16, MLADecodeBlocks()
    assert mla_decode_blocks(1, bf16, 16) == mla_decode_blocks(MANY_REQUESTS - 1, bf16, 16) == (
        default)
    assert mla_decode_blocks(MANY_REQUESTS, bf16, 16) == mla_decode_blocks(64, jnp.float16, 16) == (
        MANY_REQUEST_BLOCKS)
    assert mla_decode_blocks(64, jnp.float32, 16) == default
    assert mla_decode_blocks(64, bf16, 2 * MANY_REQUEST_KEYS) == default
    for page_size in (16, 32, MANY_REQUEST_KEYS):
        blocks = mla_decode_blocks(64, bf16, page_size)
        assert blocks.keys_as_rows and blocks.pages_per_block * page_size == MANY_REQUEST_KEYS
    assert not default.keys_as_rows
    assert mla_split_count(64, 32, mla_decode_blocks(64, bf16, 16)) == 2
    assert mla_split_count(16, 32, mla_decode_blocks(16, bf16, 16)) == 8


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_heads,splits,blocks", [
    (32, 1, MLADecodeBlocks()), (32, 16, MLADecodeBlocks()), (128, 4, MLADecodeBlocks()),
    (8, 16, MLADecodeBlocks()),  # fewer heads than a block (a tensor-parallel shard)
    (32, 16, MLADecodeBlocks(block_h=32, num_warps=8)),
    (32, 16, MLADecodeBlocks(pages_per_block=4)), (32, 16, MLADecodeBlocks(pages_per_block=1)),
    (32, 2, MANY_REQUEST_BLOCKS), (128, 1, MANY_REQUEST_BLOCKS),
])
def test_lowers_to_triton_at_the_model_shape(num_heads, splits, blocks, dtype):
    """The kernel for the GPU at R = 512, r = 64, 16-token pages: Pallas lowers it to Triton IR
    (on this machine, ``mla_checks.triton_kernels``) with the default knobs and the others the
    benchmark times; split, the merge is a second Triton kernel (``split_merge``)."""
    width = hand.MODEL_RANK + hand.MODEL_ROPE
    spec = jax.ShapeDtypeStruct
    shapes = (spec((8, num_heads, width), dtype), spec((8, width), dtype),
              spec((512, hand.MODEL_PAGE, width), dtype), spec((8, 33), jnp.int32),
              spec((8,), jnp.int32))
    assert hand.triton_kernels(lambda *a: mla_decode(
        *a, scale=SCALE, kv_lora_rank=hand.MODEL_RANK, splits=splits, blocks=blocks,
        interpret=False), *shapes) == (1 if splits == 1 else 2)


def test_problems_are_named():
    shape = {"kv_lora_rank": 512, "rope_dim": 64, "page_size": 16, "dtype": jnp.bfloat16}
    assert mla_decode_problem(**shape) is None
    assert "kv_lora_rank" in mla_decode_problem(**{**shape, "kv_lora_rank": 576})
    assert "rope_dim" in mla_decode_problem(**{**shape, "rope_dim": 8})
    assert "page_size=4" in mla_decode_problem(**{**shape, "page_size": 4})
    assert "int8" in mla_decode_problem(**{**shape, "dtype": jnp.int8})
    with pytest.raises(ValueError, match="block_h=8"):
        MLADecodeBlocks(block_h=8)
    with pytest.raises(ValueError, match="pages_per_block=3"):
        MLADecodeBlocks(pages_per_block=3)
    with pytest.raises(ValueError, match="fill_programs=0"):
        MLADecodeBlocks(fill_programs=0)


def test_bad_shapes_are_named():
    q, latent, pages, tables, positions = (
        jnp.asarray(x) for x in decode_inputs(np.random.default_rng(0), 4, 16))
    call = {"scale": SCALE, "kv_lora_rank": RANK, "interpret": True}
    with pytest.raises(ValueError, match="latent shape"):
        mla_decode(q, latent[:3], pages, tables, positions, **call)
    with pytest.raises(ValueError, match="pages shape"):
        mla_decode(q, latent, pages[..., :RANK], tables, positions, **call)
    with pytest.raises(ValueError, match="positions shape"):
        mla_decode(q, latent, pages, tables, positions[:2], **call)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_decode(q, latent, pages, tables, positions, **{**call, "kv_lora_rank": RANK + ROPE})
    with pytest.raises(ValueError, match="splits=0"):
        mla_decode(q, latent, pages, tables, positions, splits=0, **call)
