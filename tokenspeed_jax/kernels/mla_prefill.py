"""MLA prefill attention: packed query tokens over the paged latent cache, causal, prefix
(cached) context included, in absorbed form, as one Pallas GPU kernel.

Layouts are ``models/mla.py``'s: pages ``[num_pages, page_size, R + r]`` (R latent columns, then
r rope columns), queries ``q [T, H, R + r]`` of packed requests, each token with its page-table
row (``token_request``) and ``position``; output ``[T, H, R]``. A head's score against a row is
``(q_lat . c + q_rope . k_rope) * scale``; its output the softmax-weighted sum of the rows' latent
columns. ``mla_prefill_reference`` is the same function in plain JAX (the cache as the one
key/value head of ``paged_prefill_attention``'s reference).

Invariants:

* The break writes the step's latent rows first (``mla.write_latent``), so a request's cached
  prefix, earlier chunks of its prompt and this step's tokens are all slots of its page table;
  every token reads its row's positions 0..its own position. Shapes never depend on the context.
* A token with ``token_request < 0`` or position < 0 is padding: it reads nothing and gets zeros.
  Page-table entries past a row's last position may hold any valid page id: they are masked.
* Work is cut as ``paged_prefill_attention``'s is (``prefill_work`` items with the same
  ``block_q``): one program per (work item, head block) takes the item's ``block_q`` tokens times
  ``block_h`` heads as the rows of its dots, so the heads of a block share one read of the latent
  rows, and loops over ``cdiv(live keys, block_k)`` key blocks. It stores only its own tokens.
* A latent row is read as its two parts, R and r columns wide (Triton loads whole power-of-2
  blocks; ``R + r`` is not one); the score block is the sum of the two dots.
* Scores and softmax run in float32 (exact dots for fp32 inputs): the arithmetic of
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
from tokenspeed_jax.kernels.kernel_math import is_power_of_2
from tokenspeed_jax.kernels.mla_decode import latent_cache_problem, latent_softmax_step
from tokenspeed_jax.kernels.paged_attention_backend import MIN_DOT_DIM
from tokenspeed_jax.kernels.paged_prefill_attention import (
    WORK_FIELDS,
    ragged_paged_prefill_attention_reference,
    read_work_item,
    store_item_tokens,
)


@dataclasses.dataclass(frozen=True)
class MLAPrefillBlocks:
    """Tuning knobs of the MLA prefill kernel. A program's dot rows are ``block_q * block_h``
    (at least 16)."""

    block_q: int = 16  # query tokens per program; work items must be cut with the same
    block_h: int = 4  # query heads per program
    pages_per_block: int = 2  # pages per key block; block_k = pages_per_block * page_size >= 16
    num_warps: int = 8
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_q", "block_h", "pages_per_block"):
            if not is_power_of_2(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)} must be a power of 2")
        if self.block_q * self.block_h < MIN_DOT_DIM:
            raise ValueError(f"block_q={self.block_q} x block_h={self.block_h} must be >= "
                             f"{MIN_DOT_DIM} (the rows of a dot)")


def _mla_prefill_kernel(
    work_ref,  # i32[items, 4]: row, first token, end token, live keys
    positions_ref,  # i32[T]
    page_tables_ref,  # i32[rows, pages_per_row]
    q_ref,  # [T, block_h, R + r]: this program's heads
    pages_ref,  # [num_pages, page_size, R + r]
    o_ref,  # [T, block_h, R]
    *,
    scale: float,
    rank: int,
    block_q: int,
    pages_per_block: int,
    precision: lax.Precision,
):
    row, first, end, keys, tokens = read_work_item(work_ref, q_ref.shape[0], block_q)
    block_h, width = q_ref.shape[1:]
    rows = block_q * block_h  # the dots' rows: token-major, head-minor
    q_lat = q_ref[tokens, :, pl.ds(0, rank)].reshape(rows, rank)
    q_rope = q_ref[tokens, :, pl.ds(rank, width - rank)].reshape(rows, width - rank)
    limit = jnp.broadcast_to(positions_ref[tokens][:, None] + 1, (block_q, block_h))
    key_block = functools.partial(
        latent_softmax_step, q_lat, q_rope, pages_ref, page_tables_ref, jnp.maximum(row, 0),
        limit.reshape(rows, 1), scale=scale, pages_per_block=pages_per_block,
        precision=precision)
    init = (jnp.zeros((rows, rank), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    block_k = pages_per_block * pages_ref.shape[1]
    acc, _, row_sum = lax.fori_loop(0, pl.cdiv(keys, block_k), key_block, init)
    out = acc / jnp.where(row_sum > 0, row_sum, 1.0)[:, None]  # padding items: 0 / 1
    store_item_tokens(o_ref, out.reshape(block_q, block_h, rank), tokens, first, end)


@functools.partial(jax.jit, static_argnames=("scale", "kv_lora_rank", "blocks", "interpret"))
def mla_prefill(
    q: jax.Array,  # [T, H, R + r]
    pages: jax.Array,  # [num_pages, page_size, R + r], this step's rows already written
    page_tables: jax.Array,  # i32[rows, pages_per_row]
    positions: jax.Array,  # i32[T]; < 0 = padding
    work: jax.Array,  # i32[items, 4] from ``prefill_work`` with blocks.block_q
    *,
    scale: float,
    kv_lora_rank: int,
    blocks: MLAPrefillBlocks = MLAPrefillBlocks(),
    interpret: bool | None = None,
) -> jax.Array:  # [T, H, R]
    """Each query token's heads over its row's latent rows 0..its position, as one Pallas
    call."""
    interpret = pallas_backend.resolve_interpret(interpret)
    num_tokens, num_heads, width = q.shape
    if pages.ndim != 3 or pages.shape[2] != width:
        raise ValueError(f"pages shape {pages.shape} must be [num_pages, page_size, {width}] "
                         f"(q's R + r)")
    if not 0 < kv_lora_rank < width:
        raise ValueError(f"{kv_lora_rank=} must leave rope columns in R + r = {width}")
    if work.ndim != 2 or work.shape[1] != WORK_FIELDS or positions.shape != (num_tokens,):
        raise ValueError(f"work shape {work.shape} must be [items, {WORK_FIELDS}] and positions "
                         f"shape {positions.shape} must be ({num_tokens},)")
    block_q, block_h, per_block = blocks.block_q, blocks.block_h, blocks.pages_per_block
    # A bucket smaller than one query block, or heads that block_h does not divide, are padded.
    padded_tokens = max(num_tokens, block_q)
    padded_heads = -(-num_heads // block_h) * block_h
    q = jnp.pad(q, ((0, padded_tokens - num_tokens), (0, padded_heads - num_heads), (0, 0)))
    positions = jnp.pad(positions.astype(jnp.int32), (0, padded_tokens - num_tokens),
                        constant_values=-1)
    width_pages = page_tables.shape[1]
    tables = jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, -width_pages % per_block)))
    precision = HIGHEST if pages.dtype == jnp.float32 else lax.Precision.DEFAULT
    whole = pl.BlockSpec()
    per_head_block = functools.partial(pl.BlockSpec, index_map=lambda item, head: (0, head, 0))
    kernel = functools.partial(_mla_prefill_kernel, scale=scale, rank=kv_lora_rank,
                               block_q=block_q, pages_per_block=per_block, precision=precision)
    out = pl.pallas_call(
        kernel,
        grid=(work.shape[0], padded_heads // block_h),
        in_specs=[whole, whole, whole, per_head_block((padded_tokens, block_h, width)), whole],
        out_specs=per_head_block((padded_tokens, block_h, kv_lora_rank)),
        out_shape=jax.ShapeDtypeStruct((padded_tokens, padded_heads, kv_lora_rank), q.dtype),
        compiler_params=pallas_backend.compiler_params(num_warps=blocks.num_warps,
                                                       num_stages=blocks.num_stages),
        interpret=interpret,
        name="mla_prefill",
    )(work.astype(jnp.int32), positions, tables, q, pages)
    return out[:num_tokens, :num_heads]


def mla_prefill_blocks(dtype: jnp.dtype) -> MLAPrefillBlocks:
    """The knobs for a latent cache of ``dtype``: the defaults, with one page per key block for
    fp32 (two pages of fp32 rows beside the 64 query rows asked an H200 for 344 KB of shared
    memory, over its 227 KB)."""
    if jnp.dtype(dtype) == jnp.float32:
        return MLAPrefillBlocks(pages_per_block=1)
    return MLAPrefillBlocks()


def mla_prefill_problem(*, kv_lora_rank: int, rope_dim: int, page_size: int, dtype: jnp.dtype,
                        blocks: MLAPrefillBlocks | None = None) -> str | None:
    """Why the kernel cannot run this latent cache shape with ``blocks`` (default:
    ``mla_prefill_blocks``), or None when it can (``mla_decode.latent_cache_problem``)."""
    blocks = blocks or mla_prefill_blocks(dtype)
    return latent_cache_problem(kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                                page_size=page_size, dtype=dtype,
                                pages_per_block=blocks.pages_per_block)


def mla_prefill_reference(q, pages, page_tables, token_request, positions, *, scale: float,
                          kv_lora_rank: int) -> jax.Array:
    """``mla_prefill`` in plain JAX: ``paged_prefill_attention``'s reference with the latent
    cache as its one key and value head, keeping the output's first R columns. It needs no work
    items."""
    head_pages = pages[None]
    return ragged_paged_prefill_attention_reference(
        q, head_pages, head_pages, page_tables, token_request, positions,
        scale=scale)[..., :kv_lora_rank]
