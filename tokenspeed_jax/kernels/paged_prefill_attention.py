"""Ragged paged prefill attention: each query token over its own request's pages, 0..its position.

The attention break first writes the step's new K/V into the pages (``attention.write_kv``), so a
request's cached prefix and this step's keys are one thing: slots of its page table. Every query
token then reads its request's keys at positions 0..its own position through that page table.
All shapes are fixed by the token bucket and the number of page-table rows, never by how much
context is cached: one executable per token bucket serves every context length.

Inputs: ``q [T, Hq, Dh]``; pages ``[Hkv, num_pages, page_size, Dh]`` (the cache layout of
``attention.py``); ``page_tables i32[rows, pages_per_row]``; per token ``token_request`` (its
row) and ``positions``. Invariants:

* A token with ``token_request < 0`` or position < 0 is padding: it gets zeros and reads nothing.
* Query head ``h`` reads KV head ``h // (Hq // Hkv)`` (GQA); scores and softmax run in float32,
  fp32 inputs with exact fp32 dots: the arithmetic of ``attention_ref.masked_attention``.
* Page-table entries past a row's last position may hold any valid page id: they are masked.

Two implementations of one function, chosen once and statically by ``choose_prefill_kernel``:

* ``ragged_paged_prefill_attention``, a Pallas GPU kernel (flash-attention online softmax). The
  host cuts the packed tokens into *work items* (``prefill_work``): up to ``block_q`` consecutive
  tokens of one row, ``i32[items, 4]`` = (row, first token, end token, live keys), live keys being
  the last token's position + 1. One program per (item, query head) loops over
  ``cdiv(live keys, block_k)`` key blocks read through the row's page table, so the cost follows
  the live context, not ``max_model_len``. It loads ``block_q`` query rows at a dynamic offset
  kept inside ``[0, T)`` and stores only its own rows.
* ``ragged_paged_prefill_attention_reference``, plain JAX (the CPU path): per page-table row, all
  queries against that row's keys, in chunks of ``REFERENCE_CHUNK_SLOTS`` slots up to the row's
  live keys, each token taking the result of its own row. It needs no work items.

Tensor parallelism, the rule of decode attention (``paged_attention_backend``): a Pallas kernel
with a ``mesh`` runs per shard under ``jax.shard_map`` (``shard_by_kv_head``), q split by head,
pages by KV head, page tables, positions and work items replicated; each device's query heads
read only its own KV heads, so there is no collective. When the KV heads do not split over the
mesh (fewer than the devices: the cache is replicated) ``choose_prefill_kernel`` takes the
reference, logged once. The reference needs no mesh: XLA partitions it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.sharding import Mesh

from tokenspeed_jax.kernels import pallas_backend
from tokenspeed_jax.kernels.attention import gather_slots
from tokenspeed_jax.kernels.attention_ref import HIGHEST
from tokenspeed_jax.kernels.kernel_math import MASK_VALUE, is_power_of_2, online_softmax_step
from tokenspeed_jax.kernels.paged_attention_backend import (
    MIN_DOT_DIM,
    PALLAS,
    REFERENCE,
    check_pallas_or_reference,
    log_reference_once,
    paged_cache_problem,
    pallas_runs,
    shard_by_kv_head,
)

REFERENCE_CHUNK_SLOTS = 256  # key slots per step of the reference's loop over a row's pages
WORK_FIELDS = 4  # row, first token, end token, live keys


@dataclasses.dataclass(frozen=True)
class PrefillBlocks:
    """Tuning knobs of the Pallas kernel."""

    block_q: int = 64  # query tokens per program (a power of 2 >= 16)
    pages_per_block: int = 4  # pages per key block; block_k = pages_per_block * page_size
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        if not is_power_of_2(self.block_q) or not is_power_of_2(self.pages_per_block):
            raise ValueError(f"block_q={self.block_q} and pages_per_block="
                             f"{self.pages_per_block} must be powers of 2")


@dataclasses.dataclass(frozen=True)
class PrefillKernel:
    """How prefill attention runs: the backend, the kernel's knobs, interpretation, the mesh."""

    backend: str = REFERENCE
    blocks: PrefillBlocks = PrefillBlocks()
    interpret: bool = False  # run the Pallas kernel in the interpreter (tests on the CPU)
    mesh: Mesh | None = None  # run the Pallas kernel per shard of the KV heads over this mesh

    def __post_init__(self) -> None:
        check_pallas_or_reference(self.backend)


REFERENCE_PREFILL = PrefillKernel(REFERENCE)


# ----------------------------------------------------------------------------- work items


def num_work_items(num_tokens: int, num_rows: int, block_q: int) -> int:
    """The static work-item count of a token bucket: enough for any packing of ``num_tokens``
    tokens in at most ``num_rows`` rows plus one padding run (each run wastes < one block)."""
    return -(-num_tokens // block_q) + num_rows + 1


def prefill_work(token_request: np.ndarray, positions: np.ndarray, *, num_rows: int,
                 block_q: int) -> np.ndarray:
    """i32[num_work_items, 4] work items of a packed step: (row, first token, end token, keys).

    A run is a stretch of tokens of one row with consecutive positions, or of padding; each run
    is cut into items of at most ``block_q`` tokens. Padding items have row -1 and 0 keys (their
    tokens get zeros); unused items are (-1, 0, 0, 0) and touch nothing.
    """
    token_request = np.asarray(token_request, np.int64)
    positions = np.asarray(positions, np.int64)
    num_tokens = len(token_request)
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions shape {positions.shape} != token_request's ({num_tokens},)")
    if np.any(token_request >= num_rows):
        raise ValueError(f"token_request max {token_request.max()} >= num_rows={num_rows}")
    padding = (token_request < 0) | (positions < 0)
    rows = np.where(padding, -1, token_request)
    starts = np.ones(num_tokens, bool)
    starts[1:] = (rows[1:] != rows[:-1]) | (~padding[1:] & (positions[1:] != positions[:-1] + 1))
    run_start = np.flatnonzero(starts)
    offset = np.arange(num_tokens) - run_start[np.cumsum(starts) - 1]
    first = np.flatnonzero(offset % block_q == 0)
    end = np.append(first[1:], num_tokens)
    count = num_work_items(num_tokens, num_rows, block_q)
    if len(first) > count:
        raise ValueError(f"{len(first)} work items exceed {count} for {num_tokens} tokens in "
                         f"{num_rows} rows (block_q={block_q}): a row's tokens must be one run "
                         f"of consecutive positions")
    work = np.zeros((count, WORK_FIELDS), np.int32)
    work[:, 0] = -1
    item_rows = rows[first]
    work[:len(first), 0] = item_rows
    work[:len(first), 1] = first
    work[:len(first), 2] = end
    work[:len(first), 3] = np.where(item_rows >= 0, positions[end - 1] + 1, 0)
    return work


# ----------------------------------------------------------------------------- Pallas kernel


def _prefill_kernel(
    work_ref,  # i32[items, 4]: row, first token, end token, live keys
    positions_ref,  # i32[T]
    page_tables_ref,  # i32[rows, pages_per_row]
    q_ref,  # [T, Dh]: one query head
    k_pages_ref,  # [num_pages, page_size, Dh]: its KV head
    v_pages_ref,  # [num_pages, page_size, Dh]
    o_ref,  # [T, Dh]
    *,
    scale: float,
    block_q: int,
    pages_per_block: int,
    precision: lax.Precision,
):
    row, first, end, keys, tokens = read_work_item(work_ref, q_ref.shape[0], block_q)
    head_dim = q_ref.shape[1]
    block_k = pages_per_block * k_pages_ref.shape[1]
    q = q_ref[tokens, :]
    query_pos = positions_ref[tokens]
    table_row = jnp.maximum(row, 0)

    def key_block(index, carry):
        pages = page_tables_ref[table_row, pl.ds(index * pages_per_block, pages_per_block)]
        key_pos = index * block_k + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
        return online_softmax_step(q, k_pages_ref, v_pages_ref, pages,
                                   key_pos <= query_pos[:, None], carry, scale=scale,
                                   precision=precision)

    init = (jnp.zeros((block_q, head_dim), jnp.float32),
            jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    acc, _, row_sum = lax.fori_loop(0, pl.cdiv(keys, block_k), key_block, init)
    out = acc / jnp.where(row_sum > 0, row_sum, 1.0)[:, None]  # padding items: 0 / 1
    store_item_tokens(o_ref, out, tokens, first, end)


def read_work_item(work_ref, num_tokens: int, block_q: int):
    """The program's work item (``program_id(0)``): row, first token, end token, live keys, and
    its query block, ``block_q`` tokens (a ``pl.ds``) from a start kept inside
    ``[0, num_tokens)``."""
    row, first, end, keys = (work_ref[pl.program_id(0), field] for field in range(WORK_FIELDS))
    base = jnp.minimum(first, num_tokens - block_q)
    return row, first, end, keys, pl.ds(base, block_q)


def store_item_tokens(o_ref, out, tokens, first, end) -> None:
    """Store ``out [block_q, ...]`` into the rows ``tokens`` of ``o_ref`` that are the work
    item's own (``first`` to ``end`` - 1); the block's other rows keep what they hold."""
    token = tokens.start + lax.broadcasted_iota(jnp.int32, out.shape, 0)
    own = (token >= first) & (token < end)
    pallas_backend.masked_store(o_ref.at[tokens], out.astype(o_ref.dtype), own)


@functools.partial(jax.jit, static_argnames=("scale", "blocks", "interpret", "name"))
def ragged_paged_prefill_attention(
    q: jax.Array,  # [T, Hq, Dh]
    k_pages: jax.Array,  # [Hkv, num_pages, page_size, Dh], this step's K already written
    v_pages: jax.Array,  # [Hkv, num_pages, page_size, Dh]
    page_tables: jax.Array,  # i32[rows, pages_per_row]
    positions: jax.Array,  # i32[T]; < 0 = padding
    work: jax.Array,  # i32[items, 4] from ``prefill_work`` with the same block_q
    *,
    scale: float,
    blocks: PrefillBlocks = PrefillBlocks(),
    interpret: bool | None = None,
    name: str = "ragged_paged_prefill_attention",
) -> jax.Array:  # [T, Hq, Dh]
    """Each query token over its row's keys 0..its position, as one Pallas call."""
    interpret = pallas_backend.resolve_interpret(interpret)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, _ = k_pages.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
    if work.shape[1:] != (WORK_FIELDS,) or positions.shape != (num_tokens,):
        raise ValueError(f"work shape {work.shape} must be [items, {WORK_FIELDS}] and positions "
                         f"shape {positions.shape} must be ({num_tokens},)")
    block_q, per_block = blocks.block_q, blocks.pages_per_block
    padded_tokens = max(num_tokens, block_q)  # a bucket smaller than one block is padded to it
    if padded_tokens > num_tokens:
        q = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))
        positions = jnp.pad(positions, (0, padded_tokens - num_tokens), constant_values=-1)
    width = page_tables.shape[1]
    if width % per_block:
        page_tables = jnp.pad(page_tables, ((0, 0), (0, per_block - width % per_block)))
    group = num_q_heads // num_kv_heads
    precision = HIGHEST if q.dtype == jnp.float32 else lax.Precision.DEFAULT
    whole = pl.BlockSpec(index_map=lambda item, head: (0, 0))
    per_head = pl.BlockSpec((padded_tokens, pl.squeezed, head_dim),
                            lambda item, head: (0, head, 0))
    per_kv_head = pl.BlockSpec((pl.squeezed, num_pages, page_size, head_dim),
                               lambda item, head: (head // group, 0, 0, 0))
    kernel = functools.partial(_prefill_kernel, scale=scale, block_q=block_q,
                               pages_per_block=per_block, precision=precision)
    out = pl.pallas_call(
        kernel,
        grid=(work.shape[0], num_q_heads),
        in_specs=[whole, pl.BlockSpec(index_map=lambda item, head: (0,)), whole, per_head,
                  per_kv_head, per_kv_head],
        out_specs=per_head,
        out_shape=jax.ShapeDtypeStruct((padded_tokens, num_q_heads, head_dim), q.dtype),
        compiler_params=pallas_backend.compiler_params(num_warps=blocks.num_warps,
                                                       num_stages=blocks.num_stages),
        interpret=interpret,
        name=name,
    )(work.astype(jnp.int32), positions.astype(jnp.int32), page_tables.astype(jnp.int32), q,
      k_pages, v_pages)
    return out[:num_tokens]


# ----------------------------------------------------------------------------- reference


@functools.partial(jax.jit, static_argnames=("scale",))
def ragged_paged_prefill_attention_reference(
    q: jax.Array,  # [T, Hq, Dh]
    k_pages: jax.Array,  # [Hkv, num_pages, page_size, Dh], this step's K already written
    v_pages: jax.Array,  # [Hkv, num_pages, page_size, Dh]
    page_tables: jax.Array,  # i32[rows, pages_per_row]
    token_request: jax.Array,  # i32[T]: the row of each token; < 0 = padding
    positions: jax.Array,  # i32[T]; < 0 = padding
    *,
    scale: float,
) -> jax.Array:  # [T, Hq, Dh]
    """The same function in plain JAX: one row at a time, its keys in chunks up to its live
    keys (its tokens' largest position + 1), every query scored and only the row's kept."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
    num_rows, width = page_tables.shape
    per_chunk = max(1, REFERENCE_CHUNK_SLOTS // page_size)
    chunk = per_chunk * page_size
    tables = jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, -width % per_chunk)))
    real = (token_request >= 0) & (positions >= 0)
    row_of_token = jnp.where(real, token_request, -1)
    live_keys = jnp.zeros(num_rows, jnp.int32).at[row_of_token].max(
        positions.astype(jnp.int32) + 1, mode="drop")
    group = num_q_heads // num_kv_heads
    queries = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    offsets = jnp.arange(page_size, dtype=jnp.int32)

    def key_chunk(row, index, carry):
        acc, row_max, row_sum = carry
        pages = lax.dynamic_slice_in_dim(tables[row], index * per_chunk, per_chunk)
        slots = (pages[:, None] * page_size + offsets).reshape(-1)
        k = gather_slots(k_pages, slots).astype(jnp.float32)  # [chunk, Hkv, Dh]
        v = gather_slots(v_pages, slots).astype(jnp.float32)
        scores = jnp.einsum("TKGD,SKD->TKGS", queries, k, precision=HIGHEST) * scale
        key_pos = index * chunk + jnp.arange(chunk, dtype=jnp.int32)
        visible = (key_pos[None, :] <= positions[:, None])[:, None, None, :]
        scores = jnp.where(visible, scores, MASK_VALUE)
        new_max = jnp.maximum(row_max, scores.max(axis=-1))
        correction = jnp.exp(row_max - new_max)
        weights = jnp.exp(scores - new_max[..., None])
        row_sum = row_sum * correction + weights.sum(axis=-1)
        acc = (acc * correction[..., None]
               + jnp.einsum("TKGS,SKD->TKGD", weights, v, precision=HIGHEST))
        return acc, new_max, row_sum

    def one_row(row, out):
        init = (jnp.zeros(queries.shape, jnp.float32),
                jnp.full(queries.shape[:-1], -jnp.inf, jnp.float32),
                jnp.zeros(queries.shape[:-1], jnp.float32))
        num_chunks = -(-live_keys[row] // chunk)
        acc, _, row_sum = lax.fori_loop(0, num_chunks, functools.partial(key_chunk, row), init)
        mine = (row_of_token == row)[:, None, None, None]
        return jnp.where(mine, acc / jnp.where(row_sum > 0, row_sum, 1.0)[..., None], out)

    out = lax.fori_loop(0, num_rows, one_row, jnp.zeros(queries.shape, jnp.float32))
    return out.reshape(q.shape).astype(q.dtype)


# ----------------------------------------------------------------------------- the choice


def prefill_unsupported_reason(*, head_dim: int, page_size: int, dtype: jnp.dtype,
                               blocks: PrefillBlocks = PrefillBlocks()) -> str | None:
    """Why the Pallas kernel cannot run this cache shape, or None when it can: Triton loads
    whole power-of-2 blocks and its dot needs every dimension >= 16."""
    if blocks.block_q < MIN_DOT_DIM or page_size * blocks.pages_per_block < MIN_DOT_DIM:
        return (f"block_q={blocks.block_q} or page_size={page_size} x pages_per_block="
                f"{blocks.pages_per_block} < {MIN_DOT_DIM}")
    return paged_cache_problem(head_dim=head_dim, page_size=page_size, dtype=dtype)


def choose_prefill_kernel(*, head_dim: int, page_size: int, dtype: jnp.dtype,
                          platform: str | None = None, mesh: Mesh | None = None,
                          num_kv_heads: int = 1) -> PrefillKernel:
    """The prefill kernel for this platform (default: JAX's default backend) and cache shape:
    the Pallas kernel on a GPU, the reference elsewhere. With a ``mesh`` (the cache split by KV
    head over it) the kernel runs per shard; a cache that replicates its ``num_kv_heads`` over
    more devices takes the reference (module docstring)."""
    problem = prefill_unsupported_reason(head_dim=head_dim, page_size=page_size, dtype=dtype)
    if not pallas_runs(problem, platform=platform, mesh=mesh, num_kv_heads=num_kv_heads,
                       log=functools.partial(log_reference_once, "prefill attention")):
        return REFERENCE_PREFILL
    return PrefillKernel(PALLAS, mesh=mesh)


def paged_prefill_attention(
    q: jax.Array,  # [T, Hq, Dh]
    k_pages: jax.Array,  # [Hkv, num_pages, page_size, Dh], this step's K already written
    v_pages: jax.Array,
    page_tables: jax.Array,  # i32[rows, pages_per_row]
    token_request: jax.Array,  # i32[T]; < 0 = padding
    positions: jax.Array,  # i32[T]; < 0 = padding
    work: jax.Array | None,  # i32[items, 4] (``prefill_work``); the Pallas kernel's only
    *,
    scale: float,
    kernel: PrefillKernel = REFERENCE_PREFILL,
) -> jax.Array:  # [T, Hq, Dh]
    """Prefill attention through ``kernel``'s backend (the reference by default), per shard of
    ``kernel.mesh`` when it has one."""
    if kernel.backend == PALLAS:
        if work is None:
            raise ValueError("the Pallas prefill kernel needs work items (prefill_work)")
        op = functools.partial(ragged_paged_prefill_attention, scale=scale,
                               blocks=kernel.blocks, interpret=kernel.interpret)
        if kernel.mesh is not None:
            op = shard_by_kv_head(op, kernel.mesh, ins="hpprrr")
        return op(q, k_pages, v_pages, page_tables, positions, work)
    return ragged_paged_prefill_attention_reference(q, k_pages, v_pages, page_tables,
                                                    token_request, positions, scale=scale)
