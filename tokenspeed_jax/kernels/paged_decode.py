"""Fused paged decode attention: one Pallas kernel per layer writes the step's K/V into the paged
cache and attends each request's single query over its pages.

The unfused route (``attention.write_kv`` twice, then JAX's paged-attention op, which pads the
query heads and merges its key splits in separate ops) launches about six kernels per layer for
this; a decode step is one CUDA graph whose launch time grows with its kernel count. Layouts are
``attention.py``'s: pages ``[Hkv, num_pages, page_size, Dh]``, one query per request
``q [B, Hq, Dh]``, the step's ``k, v [B, Hkv, Dh]``. ``fused_paged_decode_reference`` is the
same function in plain JAX (the unfused route with the reference attention), and
``decode_attention_step`` is a decode layer's attention on whichever route a ``DecodeKernel``
names.

Invariants:

* A request's new K/V go to page ``page_tables[b, pos // page_size]``, row ``pos % page_size``:
  the slot the page table gives its position, the slot ``write_kv`` is handed. A request with
  position < 0 is padding: it writes nothing and gets zeros.
* Reads and the write never meet: a program reads cached positions 0..pos-1 from the pages and
  takes the new token's key and value from its inputs, so the in-place write (pages aliased in and
  out) needs no ordering against any read.
* One program per (request, KV head, split). Its query heads are the rows of one block: the group,
  padded to ``block_h`` rows by repeating the group's last head (the repeated rows compute and
  store identical values to the same addresses).
* ``decode_attention_step`` splits only small batches (``fused_split_count``): a split count is
  fixed per compiled shape, as a decode bucket is.
* With ``splits`` = 1 the kernel writes the normalised output. With more, the cached positions are
  cut into that many ranges, split 0 also takes the new token and writes the K/V, and each split
  writes its unnormalised sums and base-2 running maximum, merged by ``split_merge.merge_splits``
  in plain JAX (the Pallas merge ``mla_decode`` takes cost Llama-3-8B's batch-1 step 37 us more
  on an H200).
* Scores and softmax run in float32 (exact dots for fp32 caches): the arithmetic of
  ``attention_ref.masked_attention``, up to summation order.
* The kernel takes q, k and v as one array ``[B, Hq + 2 * Hkv, Dh]`` (the query heads, then the
  keys, then the values: the order of XLA's merged q/k/v projection, which it then hands over
  without a copy), and with RoPE tables it rotates q and k itself. Separate operands and XLA's
  rope had cost a copy each and two rope fusions; operands grouped by KV head, one
  concatenation; this layout costs no kernel of its own.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tokenspeed_jax.kernels import pallas_backend
from tokenspeed_jax.kernels.attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    write_kv,
)
from tokenspeed_jax.kernels.attention_ref import HIGHEST
from tokenspeed_jax.kernels.kernel_math import LOG2E, online_softmax_step
from tokenspeed_jax.kernels.paged_attention_backend import (
    FUSED,
    REFERENCE_KERNEL,
    DecodeKernel,
    shard_by_kv_head,
)
from tokenspeed_jax.kernels.rotary import rotate, rotate_with, swapped_features
from tokenspeed_jax.kernels.split_merge import merge_splits

# About one program per SM of an H200 (132 SMs): while batch x KV heads is below this, splitting
# each request's pages keeps the SMs busy; above it, unsplit pages were faster.
FILL_PROGRAMS = 128


def _decode_kernel(
    positions_ref,  # i32[B]
    page_tables_ref,  # i32[B, P], P a multiple of pages_per_block
    qkv_ref,  # [B, Hq + 2 * Hkv, Dh]: the query heads, then the keys, then the values
    k_pages_ref,  # [num_pages, page_size, Dh]: this program's KV head, aliased with k_out_ref
    v_pages_ref,  # [num_pages, page_size, Dh]
    *refs,  # with rotary: cos, sin [B, Dh] fp32; then the results: splits == 1: o [B, Hq, Dh],
    # else acc [S, B, Hq, Dh], max, sum [S, B, Hq]; then k_out_ref, v_out_ref (the pages)
    scale: float,
    group: int,
    block_h: int,
    pages_per_block: int,
    splits: int,
    rotary: bool,
    precision,
):
    cos_ref, sin_ref, *out_refs = refs if rotary else (None, None, *refs)
    *result_refs, k_out_ref, v_out_ref = out_refs
    request, kv_head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    f32 = jnp.float32
    head_dim = qkv_ref.shape[-1]
    num_kv_heads = qkv_ref.shape[1] // (group + 2)
    key_row = num_kv_heads * group + kv_head  # this KV head's key; its value num_kv_heads on
    page_size = k_pages_ref.shape[1]
    block_k = pages_per_block * page_size
    position = positions_ref[request]
    cached = jnp.maximum(position, 0)  # keys 0..position-1 come from the pages
    in_group = jnp.minimum(lax.iota(jnp.int32, block_h), group - 1)
    heads = kv_head * group + in_group  # the query heads, as the output numbers them
    q = qkv_ref[request, heads, :]  # [block_h, Dh]
    k_new = qkv_ref[request, key_row, :]
    v_new = qkv_ref[request, key_row + num_kv_heads, :]
    if rotary:
        partner = swapped_features(head_dim)
        cos, sin = cos_ref[request, :], sin_ref[request, :]
        q = rotate_with(q, qkv_ref[request, heads[:, None], partner[None, :]],
                        cos[None, :], sin[None, :])
        k_new = rotate_with(k_new, qkv_ref[request, key_row, partner], cos, sin)

    takes_new = (split == 0) & (position >= 0)
    new_score = jnp.sum(q.astype(f32) * k_new.astype(f32)[None, :], axis=1) * (scale * LOG2E)
    init = (jnp.where(takes_new, jnp.broadcast_to(v_new.astype(f32)[None, :],
                                                  (block_h, head_dim)), 0.0),
            jnp.where(takes_new, new_score, -jnp.inf),
            jnp.where(takes_new, jnp.ones((block_h,), f32), 0.0))

    def key_block(index, carry):
        pages = page_tables_ref[request, pl.ds(index * pages_per_block, pages_per_block)]
        key_pos = index * block_k + lax.broadcasted_iota(jnp.int32, (block_h, block_k), 1)
        return online_softmax_step(q, k_pages_ref, v_pages_ref, pages, key_pos < cached,
                                   carry, scale=scale, precision=precision)

    num_blocks = pl.cdiv(cached, block_k)
    per_split = pl.cdiv(num_blocks, splits)
    first = split * per_split
    carry = lax.fori_loop(first, jnp.minimum(first + per_split, num_blocks), key_block, init)

    @pl.when(takes_new)
    def _():
        page = page_tables_ref[request, position // page_size]
        row = position % page_size
        k_out_ref[page, row, :] = k_new.astype(k_out_ref.dtype)
        v_out_ref[page, row, :] = v_new.astype(v_out_ref.dtype)

    store_split_result(result_refs, carry, split=split, request=request, heads=heads)


def store_split_result(result_refs, carry, *, split, request, heads) -> None:
    """Store a decode program's flash-attention state ``carry`` (``online_softmax_step``'s) for
    the query rows ``heads`` of ``request``: with one result ref ``o [B, Hq, Dv]`` (one split),
    the normalised output; with three, ``acc [S, B, Hq, Dv]``, ``max`` and ``sum [S, B, Hq]``,
    this split's unnormalised state for a merge (``split_merge``)."""
    acc, row_max, row_sum = carry
    if len(result_refs) == 1:
        (o_ref,) = result_refs
        out = acc / jnp.where(row_sum > 0, row_sum, 1.0)[:, None]  # padding rows: 0 / 1
        o_ref[request, heads, :] = out.astype(o_ref.dtype)
    else:
        acc_ref, max_ref, sum_ref = result_refs
        acc_ref[split, request, heads, :] = acc
        max_ref[split, request, heads] = row_max
        sum_ref[split, request, heads] = row_sum


@functools.partial(jax.jit, static_argnames=("scale", "block_h", "pages_per_block", "splits",
                                             "num_warps", "num_stages", "interpret"))
def fused_paged_decode(
    q: jax.Array,  # [B, Hq, Dh]
    k: jax.Array,  # [B, Hkv, Dh]: this step's keys, one per request
    v: jax.Array,  # [B, Hkv, Dh]
    k_pages: jax.Array,  # [Hkv, num_pages, page_size, Dh]
    v_pages: jax.Array,  # [Hkv, num_pages, page_size, Dh]
    page_tables: jax.Array,  # i32[B, P]
    positions: jax.Array,  # i32[B]; < 0 = padding
    rotary: tuple[jax.Array, jax.Array] | None = None,  # (cos, sin) [B, Dh] fp32
    *,
    scale: float,
    block_h: int = 16,
    pages_per_block: int = 4,
    splits: int = 1,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(attention [B, Hq, Dh], k_pages, v_pages): the step's K/V written at each request's
    position and its query over positions 0..position, in one Pallas call (pages in place).
    With ``rotary`` tables (``kernels.rotary``), q and k come unrotated and the kernel rotates
    them. The kernel reads q, k and v as one array in that order, flattened per row before they
    are joined, so XLA recognises the join of its merged projection's slices and copies nothing
    (joined along the head axis, or grouped by KV head, it cost a concatenation kernel)."""
    interpret = pallas_backend.resolve_interpret(interpret)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
    if k.shape != (batch, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} must be {(batch, num_kv_heads, head_dim)}")
    if splits < 1:
        raise ValueError(f"splits={splits} must be >= 1")
    group = num_q_heads // num_kv_heads
    block_h = max(block_h, pl.next_power_of_2(group))
    width = page_tables.shape[1]
    tables = jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, -width % pages_per_block)))
    precision = HIGHEST if k_pages.dtype == jnp.float32 else lax.Precision.DEFAULT
    whole = pl.BlockSpec()
    per_kv_head = pl.BlockSpec((pl.squeezed, num_pages, page_size, head_dim),
                               lambda b, h, s: (h, 0, 0, 0))
    if splits == 1:
        results = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    else:
        results = [jax.ShapeDtypeStruct((splits, *q.shape), jnp.float32),
                   *[jax.ShapeDtypeStruct((splits, batch, num_q_heads), jnp.float32)] * 2]
    kernel = functools.partial(_decode_kernel, scale=scale, group=group, block_h=block_h,
                               pages_per_block=pages_per_block, splits=splits,
                               rotary=rotary is not None, precision=precision)
    rotary = () if rotary is None else tuple(table.astype(jnp.float32) for table in rotary)
    qkv = jnp.concatenate([x.reshape(batch, -1) for x in (q, k, v)], axis=1)
    qkv = qkv.reshape(batch, -1, head_dim)
    *out, k_pages, v_pages = pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, splits),
        in_specs=[whole] * 3 + [per_kv_head] * 2 + [whole] * len(rotary),
        out_specs=[whole] * len(results) + [per_kv_head] * 2,
        out_shape=[*results, jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
                   jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)],
        input_output_aliases={3: len(results), 4: len(results) + 1},
        compiler_params=pallas_backend.compiler_params(num_warps=num_warps,
                                                       num_stages=num_stages),
        interpret=interpret,
        name="fused_paged_decode",
    )(positions.astype(jnp.int32), tables, qkv, k_pages, v_pages, *rotary)
    attention = out[0] if splits == 1 else merge_splits(*out).astype(q.dtype)
    return attention, k_pages, v_pages


def fused_split_count(batch: int, num_kv_heads: int, most: int,
                      fill: int = FILL_PROGRAMS) -> int:
    """Splits of each request's pages for ``decode_attention_step``: the fewest (at most
    ``most``) that give the kernel ``fill`` programs, since one program per (request, KV head)
    leaves most of the GPU idle at small batches and splits cost a merge."""
    return max(1, min(most, -(-fill // (batch * num_kv_heads))))


def fused_paged_decode_reference(q, k, v, k_pages, v_pages, page_tables, positions,
                                 rotary=None, *, scale: float
                                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``fused_paged_decode`` in plain JAX: q and k rotated by ``rotary`` (if given), ``write_kv``
    at the slot each row's page table gives its position, then
    ``attention.paged_decode_attention_reference``."""
    if rotary is not None:
        q, k = rotate(q, rotary), rotate(k, rotary)
    page_size = k_pages.shape[2]
    rows = jnp.arange(positions.shape[0])
    slots = jnp.where(positions >= 0, page_tables[rows, jnp.maximum(positions, 0) // page_size]
                      * page_size + positions % page_size, -1)
    k_pages, v_pages = write_kv(k_pages, k, slots), write_kv(v_pages, v, slots)
    return (paged_decode_attention_reference(q, k_pages, v_pages, page_tables, positions,
                                             scale=scale), k_pages, v_pages)


def decode_attention_step(
    q: jax.Array,  # [B, Hq, Dh]: one query per request
    k: jax.Array,  # [B, Hkv, Dh]: this step's keys
    v: jax.Array,  # [B, Hkv, Dh]
    k_pages: jax.Array,  # [Hkv, num_pages, page_size, Dh]
    v_pages: jax.Array,
    page_tables: jax.Array,  # i32[B, P]
    positions: jax.Array,  # i32[B]; < 0 = padding row
    slot_mapping: jax.Array,  # i32[B]: each row's slot (its page table's, for its position)
    rotary: tuple[jax.Array, jax.Array] | None = None,  # (cos, sin) [B, Dh] fp32
    *,
    scale: float,
    kernel: DecodeKernel = REFERENCE_KERNEL,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A decode layer's attention: (output [B, Hq, Dh], k_pages, v_pages) with the step's K/V
    written, q and k first rotated by ``rotary`` (``kernels.rotary``) if given. The fused kernel
    does it all in one call (per shard of ``kernel.mesh``); the other backends rotate in XLA,
    write with ``write_kv`` and read with ``paged_decode_attention``."""
    if kernel.backend != FUSED:
        if rotary is not None:
            q, k = rotate(q, rotary), rotate(k, rotary)
        k_pages, v_pages = write_kv(k_pages, k, slot_mapping), write_kv(v_pages, v, slot_mapping)
        return (paged_decode_attention(q, k_pages, v_pages, page_tables, positions, scale=scale,
                                       kernel=kernel), k_pages, v_pages)

    def op(q, k, v, k_pages, v_pages, page_tables, positions, *rotary):  # a shard's, with a mesh
        splits = fused_split_count(q.shape[0], k_pages.shape[0], kernel.k_splits)
        return fused_paged_decode(q, k, v, k_pages, v_pages, page_tables, positions,
                                  rotary or None, scale=scale, block_h=kernel.block_h,
                                  pages_per_block=kernel.pages_per_compute_block, splits=splits,
                                  interpret=kernel.interpret)

    rotary = () if rotary is None else tuple(rotary)
    if kernel.mesh is not None:
        op = shard_by_kv_head(op, kernel.mesh, ins="hhhpprr" + "r" * len(rotary), outs="hpp")
    return op(q, k, v, k_pages, v_pages, page_tables, positions, *rotary)
