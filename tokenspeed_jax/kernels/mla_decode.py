"""MLA decode attention: one Pallas kernel per layer writes the step's latent row into the paged
latent cache and attends every head of each request's single query over it, in absorbed form.

Layouts are ``models/mla.py``'s: one latent cache per layer, pages ``[num_pages, page_size,
R + r]`` (R = kv_lora_rank latent columns, then r = qk_rope_head_dim rope columns); per request
one query ``q [B, H, R + r]`` (each head's absorbed latent query, then its rope query) and the
step's latent row ``latent [B, R + r]``. A head's score against a cached row is
``(q_lat . c + q_rope . k_rope) * scale`` and its output ``[R]`` is the softmax-weighted sum of the
rows' latent columns: the cache is one key/value head shared by all query heads.
``mla_decode_reference`` is the same function in plain JAX.

Invariants:

* A request's row goes to page ``page_tables[b, pos // page_size]``, row ``pos % page_size``: the
  slot ``mla.write_latent`` is handed. A request with position < 0 is padding: it writes nothing
  and gets zeros. No other slot changes (the pages are aliased in and out).
* Reads and the write never meet: a program reads cached positions 0..pos-1 from the pages and
  takes the new row from its input, so the in-place write needs no ordering against any read.
* One program per (request, head block, split): ``block_h`` query heads against each key block,
  so all heads of a block share one read of the latent rows. A head count that ``block_h`` does
  not divide repeats the last head in the last block (the repeated rows compute and store
  identical values at identical addresses). Only head block 0 of split 0 writes the row.
* Two layouts of the same arithmetic (``MLADecodeBlocks.keys_as_rows``): the heads are the dots'
  rows (scores ``[block_h, block_k]``), or the keys are (scores ``[block_k, block_h]``, the
  output accumulated as ``[R, block_h]`` and transposed once at the end, and each key block's
  loads issued before the previous block's arithmetic). ``mla_decode_blocks`` picks one per
  batch size.
* A latent row is read as its two parts, R and r columns wide, never as one ``R + r`` block:
  Triton loads whole power-of-2 blocks, and ``R + r`` (576 in Kimi-Linear and DeepSeek-V3) is
  not one. The score block is the sum of the two dots.
* With ``splits`` = 1 the kernel writes the normalised output. With more, the cached positions are
  cut into that many ranges, split 0 also takes the new row, and each split writes its
  unnormalised sums and base-2 running maxima, merged by ``split_merge.merge_split_results``.
  ``mla_split_count`` picks the count per compiled batch size.
* Scores and softmax run in float32 (exact dots for fp32 caches): the arithmetic of
  ``attention_ref.masked_attention``, up to summation order.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tokenspeed_jax.kernels import pallas_backend
from tokenspeed_jax.kernels.attention_ref import HIGHEST
from tokenspeed_jax.kernels.kernel_math import (
    LOG2E,
    MASK_VALUE,
    dot_nt,
    is_power_of_2,
    online_softmax_update,
)
from tokenspeed_jax.kernels.paged_attention_backend import MIN_DOT_DIM, paged_cache_problem
from tokenspeed_jax.kernels.paged_decode import (
    fused_paged_decode_reference,
    fused_split_count,
    store_split_result,
)
from tokenspeed_jax.kernels.split_merge import merge_split_results


@dataclasses.dataclass(frozen=True)
class MLADecodeBlocks:
    """Tuning knobs of the MLA decode kernel."""

    block_h: int = 16  # query heads per program: the rows of its dots (a power of 2 >= 16)
    pages_per_block: int = 2  # pages per key block; block_k = pages_per_block * page_size >= 16
    # Splits of a request's pages (``mla_split_count``): the fewest that give ``fill_programs``
    # (request, head block, split) programs, at most ``most_splits``. A request has only
    # cdiv(H, block_h) programs unsplit, so it takes more splits than the fused GQA kernel's. On
    # an H200 at Kimi-Linear's shape (32 heads), the kernel alone with one stage: 2 rows 10.3 us
    # at context 1024 with 32 splits; 64 rows 79 us at 1024 and 533 at 8192 with 2 splits, 87 and
    # 544 with 4, 132 and 1000 unsplit (the 128-program rule's count); past 32 splits the merge
    # of a 2-row call took 67 us against 3 at 32.
    fill_programs: int = 256
    most_splits: int = 32
    num_warps: int = 4
    # One stage: the key blocks' loads are not pipelined, but twice the programs fit on an SM,
    # which hides more latency: on an H200 at Kimi-Linear's shape 5.5 against 7.1 us (2 rows,
    # context 1024, 32 splits), 22.7 against 33.0 (2 rows, 8192), 535 against 872 (64 rows,
    # 8192, 4 splits) with two stages.
    num_stages: int = 1
    # The keys as the dots' rows (module docstring), with block_h the dots' columns.
    keys_as_rows: bool = False

    def __post_init__(self) -> None:
        if not is_power_of_2(self.block_h) or self.block_h < MIN_DOT_DIM:
            raise ValueError(f"block_h={self.block_h} must be a power of 2 >= {MIN_DOT_DIM}")
        if not is_power_of_2(self.pages_per_block):
            raise ValueError(f"pages_per_block={self.pages_per_block} must be a power of 2")
        if self.most_splits < 1 or self.fill_programs < 1:
            raise ValueError(f"most_splits={self.most_splits} and fill_programs="
                             f"{self.fill_programs} must be >= 1")


def _mla_decode_kernel(
    positions_ref,  # i32[B]
    page_tables_ref,  # i32[B, P], P a multiple of pages_per_block
    q_ref,  # [B, H, R + r]: each head's latent query, then its rope query
    latent_ref,  # [B, R + r]: the step's latent rows
    pages_ref,  # [num_pages, page_size, R + r]: aliased with pages_out_ref
    *refs,  # the results: splits == 1: o [B, H, R]; else acc [S, B, H, R], max, sum [S, B, H]
    # (fp32); then pages_out_ref [num_pages, page_size, R + r]
    scale: float,
    rank: int,
    block_h: int,
    pages_per_block: int,
    splits: int,
    keys_as_rows: bool,
    precision,
):
    *result_refs, pages_out_ref = refs
    request, head_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f32 = jnp.float32
    num_heads, rope_dim = q_ref.shape[1], q_ref.shape[2] - rank
    page_size = pages_ref.shape[1]
    block_k = pages_per_block * page_size
    latent_cols, rope_cols = pl.ds(0, rank), pl.ds(rank, rope_dim)
    position = positions_ref[request]
    cached = jnp.maximum(position, 0)  # keys 0..position-1 come from the pages
    heads = jnp.minimum(head_block * block_h + lax.iota(jnp.int32, block_h), num_heads - 1)
    q_lat = q_ref[request, heads, latent_cols]  # [block_h, R]
    q_rope = q_ref[request, heads, rope_cols]  # [block_h, r]
    c_new = latent_ref[request, latent_cols]  # [R]
    k_new = latent_ref[request, rope_cols]  # [r]

    takes_new = (split == 0) & (position >= 0)
    new_score = (jnp.sum(q_lat.astype(f32) * c_new.astype(f32)[None, :], axis=1)
                 + jnp.sum(q_rope.astype(f32) * k_new.astype(f32)[None, :], axis=1))
    init = (jnp.where(takes_new, jnp.broadcast_to(c_new.astype(f32)[None, :], (block_h, rank)),
                      0.0),
            jnp.where(takes_new, new_score * (scale * LOG2E), -jnp.inf),
            jnp.where(takes_new, jnp.ones((block_h,), f32), 0.0))

    num_blocks = pl.cdiv(cached, block_k)
    per_split = pl.cdiv(num_blocks, splits)
    first = split * per_split
    last = jnp.minimum(first + per_split, num_blocks)
    if keys_as_rows:
        carry = _keys_as_rows_attention(q_lat, q_rope, pages_ref, page_tables_ref, request,
                                        cached, num_blocks, first, last, init, scale=scale,
                                        pages_per_block=pages_per_block, precision=precision)
    else:
        key_block = functools.partial(
            latent_softmax_step, q_lat, q_rope, pages_ref, page_tables_ref, request, cached,
            scale=scale, pages_per_block=pages_per_block, precision=precision)
        carry = lax.fori_loop(first, last, key_block, init)

    @pl.when(takes_new & (head_block == 0))
    def _():
        page = page_tables_ref[request, position // page_size]
        row = position % page_size
        pages_out_ref[page, row, latent_cols] = c_new.astype(pages_out_ref.dtype)
        pages_out_ref[page, row, rope_cols] = k_new.astype(pages_out_ref.dtype)

    store_split_result(result_refs, carry, split=split, request=request, heads=heads)


def latent_softmax_step(q_lat, q_rope, pages_ref, page_tables_ref, table_row, limit, index,
                        carry, *, scale: float, pages_per_block: int, precision):
    """Key block ``index`` of flash attention over latent rows read through page-table row
    ``table_row``: query rows ``q_lat [rows, R]`` and ``q_rope [rows, r]`` against the block's
    latent and rope columns, keys at positions < ``limit`` (a scalar or ``[rows, 1]``) visible,
    values the latent columns; ``carry`` as ``kernel_math.online_softmax_step``'s."""
    rank, rope_dim = q_lat.shape[1], q_rope.shape[1]
    block_k = pages_per_block * pages_ref.shape[1]
    pages = page_tables_ref[table_row, pl.ds(index * pages_per_block, pages_per_block)]
    c = pages_ref[pages, :, pl.ds(0, rank)].reshape(block_k, rank)
    k_rope = pages_ref[pages, :, pl.ds(rank, rope_dim)].reshape(block_k, rope_dim)
    scores = dot_nt(q_lat, c, precision) + dot_nt(q_rope, k_rope, precision)
    key_pos = index * block_k + lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    scores = jnp.where(key_pos < limit, scores * (scale * LOG2E), MASK_VALUE)
    return online_softmax_update(scores, c, carry, precision)


def _keys_as_rows_attention(q_lat, q_rope, pages_ref, page_tables_ref, request, cached,
                            num_blocks, first, last, init, *, scale: float, pages_per_block: int,
                            precision):
    """Key blocks ``first``..``last - 1`` of the request's ``num_blocks`` (its ``cached`` rows)
    with the keys as the dots' rows: scores ``[block_k, rows]``, the output summed as ``[R,
    rows]``. Block ``i + 1``'s rows are loaded before block ``i``'s arithmetic (carried), so
    their reads overlap it. Loads past the request's last block read that block again, and a
    request with no cached row reads page 0; neither is folded in. ``init`` and the result are
    ``latent_softmax_step``'s carry."""
    rank, rope_dim = q_lat.shape[1], q_rope.shape[1]
    block_k = pages_per_block * pages_ref.shape[1]
    final = jnp.maximum(num_blocks - 1, 0)

    def load(index):
        index = jnp.minimum(index, final)
        pages = page_tables_ref[request, pl.ds(index * pages_per_block, pages_per_block)]
        pages = jnp.where(num_blocks > 0, pages, 0)
        return (pages_ref[pages, :, pl.ds(0, rank)].reshape(block_k, rank),
                pages_ref[pages, :, pl.ds(rank, rope_dim)].reshape(block_k, rope_dim))

    def step(index, carry):
        *state, c, k_rope = carry
        following = load(index + 1)
        scores = dot_nt(c, q_lat, precision) + dot_nt(k_rope, q_rope, precision)
        key_pos = index * block_k + lax.broadcasted_iota(jnp.int32, scores.shape, 0)
        scores = jnp.where(key_pos < cached, scores * (scale * LOG2E), MASK_VALUE)
        state = online_softmax_update(scores, c, state, precision, keys_axis=0)
        return (*state, *following)

    acc, row_max, row_sum = init
    acc, row_max, row_sum, _, _ = lax.fori_loop(first, last, step,
                                                (acc.T, row_max, row_sum, *load(first)))
    return acc.T, row_max, row_sum


def _check_shapes(q, latent, pages, page_tables, positions, kv_lora_rank: int) -> None:
    """Raise a ValueError naming the first operand whose shape does not fit the others."""
    batch, _, width = q.shape
    if pages.ndim != 3 or pages.shape[2] != width:
        raise ValueError(f"pages shape {pages.shape} must be [num_pages, page_size, {width}] "
                         f"(q's R + r)")
    if latent.shape != (batch, width):
        raise ValueError(f"latent shape {latent.shape} must be {(batch, width)}")
    if not 0 < kv_lora_rank < width:
        raise ValueError(f"{kv_lora_rank=} must leave rope columns in R + r = {width}")
    if page_tables.ndim != 2 or page_tables.shape[0] != batch or positions.shape != (batch,):
        raise ValueError(f"page_tables shape {page_tables.shape} must be [{batch}, P] and "
                         f"positions shape {positions.shape} ({batch},)")


@functools.partial(jax.jit, static_argnames=("scale", "kv_lora_rank", "splits", "blocks",
                                             "interpret"))
def mla_decode(
    q: jax.Array,  # [B, H, R + r]
    latent: jax.Array,  # [B, R + r]: this step's latent rows, one per request
    pages: jax.Array,  # [num_pages, page_size, R + r]
    page_tables: jax.Array,  # i32[B, P]
    positions: jax.Array,  # i32[B]; < 0 = padding
    *,
    scale: float,
    kv_lora_rank: int,
    splits: int = 1,
    blocks: MLADecodeBlocks = MLADecodeBlocks(),
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(attention [B, H, R], pages): each request's latent row written at its position and
    its query over positions 0..position, in one Pallas call (pages in place)."""
    interpret = pallas_backend.resolve_interpret(interpret)
    _check_shapes(q, latent, pages, page_tables, positions, kv_lora_rank)
    if splits < 1:
        raise ValueError(f"splits={splits} must be >= 1")
    batch, num_heads, _ = q.shape
    per_block = blocks.pages_per_block
    width = page_tables.shape[1]
    tables = jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, -width % per_block)))
    precision = HIGHEST if pages.dtype == jnp.float32 else lax.Precision.DEFAULT
    out_shape = (batch, num_heads, kv_lora_rank)
    if splits == 1:
        results = [jax.ShapeDtypeStruct(out_shape, q.dtype)]
    else:
        results = [jax.ShapeDtypeStruct((splits, *out_shape), jnp.float32),
                   *[jax.ShapeDtypeStruct((splits, batch, num_heads), jnp.float32)] * 2]
    kernel = functools.partial(_mla_decode_kernel, scale=scale, rank=kv_lora_rank,
                               block_h=blocks.block_h, pages_per_block=per_block, splits=splits,
                               keys_as_rows=blocks.keys_as_rows, precision=precision)
    whole = pl.BlockSpec()
    *out, pages = pl.pallas_call(
        kernel,
        grid=(batch, pl.cdiv(num_heads, blocks.block_h), splits),
        in_specs=[whole] * 5,
        out_specs=[whole] * (len(results) + 1),
        out_shape=[*results, jax.ShapeDtypeStruct(pages.shape, pages.dtype)],
        input_output_aliases={4: len(results)},
        compiler_params=pallas_backend.compiler_params(num_warps=blocks.num_warps,
                                                       num_stages=blocks.num_stages),
        interpret=interpret,
        name="mla_decode",
    )(positions.astype(jnp.int32), tables, q, latent, pages)
    attention = (out[0] if splits == 1
                 else merge_split_results(*out, dtype=q.dtype, interpret=interpret))
    return attention, pages


# The keys-as-rows form for this many requests or more, over a 2-byte cache
# (``mla_decode_blocks``). On an H200 at Kimi-Linear's shape, the kernel alone with the pages
# donated and 256-program splits for both forms: at context 8192, 16 rows 133 against 149 us
# with the default knobs, 32 rows 227 against 275, 64 rows 413 against 535, 8 rows even (83 /
# 81); at context 1024 it loses (64 rows 83 against 80, 16 rows 32 against 24, 4 rows 23
# against 14). It fills 128 programs: 2 splits at 64 rows, with which the whole Kimi-Linear
# step (7 MLA layers) at 64 requests took 28.60 against 29.62 ms at 8192 and 26.93 against
# 26.85 at 1024. Over fp32 it keeps the default: its 128-key block of fp32 latent rows asks for
# 360 KB of shared memory, the H200 has 227 KB. Its key blocks are 128 rows whatever the page
# size (8 pages of 16 rows as measured, 4 of 32, ...; pages of more rows keep the default).
MANY_REQUESTS = 16
MANY_REQUEST_KEYS = 128
MANY_REQUEST_BLOCKS = MLADecodeBlocks(block_h=32, pages_per_block=8, num_warps=8,
                                      fill_programs=128, keys_as_rows=True)  # 16-row pages


def mla_decode_blocks(batch: int, dtype: jnp.dtype, page_size: int) -> MLADecodeBlocks:
    """The decode kernel's knobs for a batch of ``batch`` requests over a ``dtype`` cache of
    ``page_size``-row pages: the default (heads as the dots' rows), or from ``MANY_REQUESTS``
    on, over a 2-byte cache with pages of at most ``MANY_REQUEST_KEYS`` rows,
    ``MANY_REQUEST_BLOCKS`` with key blocks of ``MANY_REQUEST_KEYS`` rows."""
    if (batch >= MANY_REQUESTS and jnp.dtype(dtype).itemsize == 2
            and page_size <= MANY_REQUEST_KEYS):
        return dataclasses.replace(MANY_REQUEST_BLOCKS,
                                   pages_per_block=MANY_REQUEST_KEYS // page_size)
    return MLADecodeBlocks()


def mla_split_count(batch: int, num_heads: int,
                    blocks: MLADecodeBlocks = MLADecodeBlocks()) -> int:
    """Splits of each request's pages for a batch of ``batch`` requests with ``num_heads`` query
    heads: the fewest (at most ``blocks.most_splits``) that give ``blocks.fill_programs``
    (request, head block, split) programs, as the fused GQA kernel counts them
    (``fused_split_count``)."""
    return fused_split_count(batch, -(-num_heads // blocks.block_h), blocks.most_splits,
                             blocks.fill_programs)


def mla_decode_problem(*, kv_lora_rank: int, rope_dim: int, page_size: int, dtype: jnp.dtype,
                       blocks: MLADecodeBlocks = MLADecodeBlocks()) -> str | None:
    """Why the kernel cannot run this latent cache shape, or None when it can
    (``latent_cache_problem``)."""
    return latent_cache_problem(kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                                page_size=page_size, dtype=dtype,
                                pages_per_block=blocks.pages_per_block)


def latent_cache_problem(*, kv_lora_rank: int, rope_dim: int, page_size: int, dtype: jnp.dtype,
                         pages_per_block: int) -> str | None:
    """Why a Triton-lowered kernel cannot read this latent cache in key blocks of
    ``pages_per_block`` pages, or None: each part of a row must be a block a dot takes (a power
    of 2 >= 16), and so must a key block."""
    if page_size * pages_per_block < MIN_DOT_DIM:
        return f"page_size={page_size} x pages_per_block={pages_per_block} < {MIN_DOT_DIM}"
    for name, columns in (("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim)):
        problem = paged_cache_problem(head_dim=columns, page_size=page_size, dtype=dtype)
        if problem is not None:
            return f"{name}: {problem}"
    return None


@functools.partial(jax.jit, static_argnames=("scale", "kv_lora_rank"))
def mla_decode_reference(q, latent, pages, page_tables, positions, *, scale: float,
                         kv_lora_rank: int) -> tuple[jax.Array, jax.Array]:
    """``mla_decode`` in plain JAX: the latent cache as the one key and value head of the fused
    GQA kernel's reference (which writes each row at its slot, then attends), keeping the
    output's first R columns."""
    _check_shapes(q, latent, pages, page_tables, positions, kv_lora_rank)
    rows, head_pages = latent[:, None, :], pages[None]
    out, written, _ = fused_paged_decode_reference(q, rows, rows, head_pages, head_pages,
                                                   page_tables, positions, scale=scale)
    return out[..., :kv_lora_rank], written[0]
