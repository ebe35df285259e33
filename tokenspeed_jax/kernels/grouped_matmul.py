"""Grouped matmul, ``jax.lax.ragged_dot``'s function, as a Pallas GPU kernel.

Contract: ``lhs [M, K]``, ``rhs [G, K, N]``, ``group_sizes i32[G]`` -> ``[M, N]`` in lhs's
dtype. Rows are grouped contiguously and in order: group ``g`` owns rows
``[sum(sizes[:g]), sum(sizes[:g + 1]))`` and each of them is ``lhs[row] @ rhs[g]``. Invariants:

* Rows at or past ``sum(group_sizes)`` are zeros; sizes adding up past ``M`` are cut at ``M``
  (both as ``ragged_dot`` does). Sizes are data and are not checked: they must be >= 0 (the
  kernel's schedule reads a negative size as 0, so it never touches a row outside ``[0, M)``).
* Sums run in float32; float32 operands use exact float32 dots (``HIGHEST``), others the
  default precision; the result is rounded once to lhs's dtype.
* lhs and rhs share one dtype; ``K`` and ``N`` are multiples of the kernel's ``block_k`` and
  ``block_n`` (checked, with the shapes in the error); blocks are static powers of 2 >= 16.

Two implementations of one function, chosen statically by a ``GroupedMatmulKernel``:

* ``grouped_matmul``, the Pallas kernel (Triton lowering, ``pallas_backend``). The host cannot
  see the group boundaries (they are data), so the device first builds a static-size *tile
  schedule* (``tile_schedule``): each group's rows, and the rows past the last group, cut into
  tiles of at most ``block_m`` rows, ``i32[num_tiles, 3]`` = (group, first row, end row). At most
  ``cdiv(M, block_m) + min(G, M)`` tiles are needed (``num_tiles``); the unused ones are
  (-1, 0, 0). One program per (tile, block of N columns) loops over K in ``block_k`` steps,
  the dot of ``block_m`` rows read at a dynamic offset kept inside ``[0, M)`` by its group's
  ``[block_k, block_n]`` weight block, and stores only its own rows. A tile of group -1 (rows
  past the last group) runs no step and stores zeros; an unused tile stores nothing. Every row
  belongs to exactly one tile, so the output needs no initialisation.
* ``grouped_matmul_reference``, ``lax.ragged_dot`` itself with the same precision rule (XLA on
  the GPU lowers it densely, every row times every group's weights).

``choose_grouped_kernel`` picks the Pallas kernel on GPUs and ``ragged_dot`` elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tokenspeed_jax.kernels import pallas_backend
from tokenspeed_jax.kernels.kernel_math import count_at_most, dot, dot_precision, is_power_of_2
from tokenspeed_jax.kernels.paged_attention_backend import (
    MIN_DOT_DIM,
    PALLAS,
    PALLAS_DTYPES,
    REFERENCE,
)

logger = logging.getLogger(__name__)

TILE_FIELDS = 3  # group (-1: rows past the last group), first row, end row


@dataclasses.dataclass(frozen=True)
class GroupedMatmulBlocks:
    """Tuning knobs of the Pallas kernel."""

    block_m: int = 64  # rows per tile
    block_n: int = 128  # output columns per program; must divide N
    block_k: int = 64  # contraction step; must divide K
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        blocks = (self.block_m, self.block_n, self.block_k)
        if not all(is_power_of_2(block) and block >= MIN_DOT_DIM for block in blocks):
            raise ValueError(f"block_m, block_n, block_k = {blocks} must be powers of 2 >= "
                             f"{MIN_DOT_DIM}")


@dataclasses.dataclass(frozen=True)
class GroupedMatmulKernel:
    """How a grouped matmul runs: the backend, the Pallas kernel's knobs, and interpretation
    (``None``: interpret on the CPU, compile on the GPU)."""

    backend: str = REFERENCE
    blocks: GroupedMatmulBlocks = GroupedMatmulBlocks()
    interpret: bool | None = None

    def __post_init__(self) -> None:
        if self.backend not in (PALLAS, REFERENCE):
            raise ValueError(f"backend={self.backend!r} must be {PALLAS!r} or {REFERENCE!r}")


REFERENCE_GROUPED_MATMUL = GroupedMatmulKernel(REFERENCE)


def choose_grouped_kernel(*, sizes: tuple[int, ...], dtype: jnp.dtype,
                          platform: str | None = None) -> GroupedMatmulKernel:
    """The grouped matmul for this platform (default: JAX's default backend): the Pallas kernel
    on a GPU when the default blocks divide every contraction and output size in ``sizes`` and
    the dtype is one it takes; ``ragged_dot`` otherwise, with the reason logged on a GPU (XLA
    lowers it densely there, multiplying every row by every expert's weights)."""
    if (platform or jax.default_backend()) != "gpu":
        return REFERENCE_GROUPED_MATMUL
    blocks = GroupedMatmulBlocks()
    step = max(blocks.block_k, blocks.block_n)
    if jnp.dtype(dtype).name not in PALLAS_DTYPES or any(size % step for size in sizes):
        logger.warning("grouped matmuls use lax.ragged_dot: the Pallas kernel takes %s with sizes "
                       "that are multiples of %d, not %s with %s", PALLAS_DTYPES, step,
                       jnp.dtype(dtype).name, sizes)
        return REFERENCE_GROUPED_MATMUL
    return GroupedMatmulKernel(PALLAS, blocks)


# ----------------------------------------------------------------------------- tile schedule


def num_tiles(num_rows: int, num_groups: int, block_m: int) -> int:
    """The static tile count: enough for any sizes. The non-empty runs (groups, and the rows
    past them) add up to ``num_rows`` M, so there are at most min(G + 1, M) of them, and cut
    into tiles they take at most cdiv(M, block_m) + runs - 1 (each run after the first wastes
    less than one tile). A few rows among many groups (a decode step's experts) so need a few
    tiles, not one per group: unused tiles are programs too."""
    return -(-num_rows // block_m) + min(num_groups, num_rows)


def tile_schedule(group_sizes: jax.Array, num_rows: int, block_m: int) -> jax.Array:
    """i32[num_tiles, 3] (group, first row, end row) covering rows ``[0, num_rows)`` once.

    Runs, in row order: group 0, ..., group G - 1, then the rows past the last group (group
    -1). Each run is cut into tiles of ``block_m`` rows from its start; empty runs have no tile.
    """
    num_groups = group_sizes.shape[0]
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), num_rows)
    run_end = jnp.append(ends, num_rows)
    run_start = jnp.concatenate([jnp.zeros(1, jnp.int32), ends])
    run_group = jnp.append(jnp.arange(num_groups, dtype=jnp.int32), -1)
    run_tiles = -(-(run_end - run_start) // block_m)
    tiles_before_end = jnp.cumsum(run_tiles)
    tile = jnp.arange(num_tiles(num_rows, num_groups, block_m), dtype=jnp.int32)
    used = tile < tiles_before_end[-1]
    run = jnp.minimum(count_at_most(tiles_before_end, tile), num_groups)
    first = run_start[run] + (tile - tiles_before_end[run] + run_tiles[run]) * block_m
    end = jnp.minimum(first + block_m, run_end[run])
    return jnp.stack([jnp.where(used, run_group[run], -1), jnp.where(used, first, 0),
                      jnp.where(used, end, 0)], axis=1).astype(jnp.int32)


# ----------------------------------------------------------------------------- Pallas kernel


def _grouped_kernel(
    tiles_ref,  # i32[tiles, 3]: group, first row, end row
    lhs_ref,  # [M, K]
    rhs_ref,  # [G, K, block_n]: this program's columns of every group
    out_ref,  # [M, block_n]
    *,
    block_m: int,
    block_k: int,
    precision: lax.Precision,
):
    tile = pl.program_id(0)
    group, first, end = (tiles_ref[tile, field] for field in range(TILE_FIELDS))
    num_rows, depth = lhs_ref.shape
    block_n = out_ref.shape[1]
    base = jnp.minimum(first, num_rows - block_m)  # the block stays inside [0, M)
    rows = pl.ds(base, block_m)
    weights = jnp.maximum(group, 0)

    def k_step(index, acc):
        cols = pl.ds(index * block_k, block_k)
        return acc + dot(lhs_ref[rows, cols], rhs_ref[weights, cols, :], precision)

    # rows past the groups: zeros. int32 bounds: Triton's loop needs one type for all three
    steps = jnp.where(group >= 0, jnp.int32(depth // block_k), jnp.int32(0))
    acc = lax.fori_loop(0, steps, k_step, jnp.zeros((block_m, block_n), jnp.float32))
    row = base + lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0)
    own = (row >= first) & (row < end)  # an unused tile (first = end) stores nothing
    pallas_backend.masked_store(out_ref.at[rows, :], acc.astype(out_ref.dtype), own)


def _check_operands(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> None:
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"lhs {lhs.shape} and rhs {rhs.shape} must be [M, K] and [G, K, N]")
    if group_sizes.shape != rhs.shape[:1]:
        raise ValueError(f"group_sizes shape {group_sizes.shape} != ({rhs.shape[0]},)")
    if lhs.dtype != rhs.dtype:
        raise ValueError(f"lhs dtype {lhs.dtype} != rhs dtype {rhs.dtype}")


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def grouped_matmul(
    lhs: jax.Array,  # [M, K]
    rhs: jax.Array,  # [G, K, N]
    group_sizes: jax.Array,  # i32[G]
    *,
    blocks: GroupedMatmulBlocks = GroupedMatmulBlocks(),
    interpret: bool | None = None,
) -> jax.Array:  # [M, N], lhs's dtype
    """``lax.ragged_dot(lhs, rhs, group_sizes)`` as one Pallas call (module docstring)."""
    interpret = pallas_backend.resolve_interpret(interpret)
    _check_operands(lhs, rhs, group_sizes)
    num_rows, depth = lhs.shape
    num_groups, _, width = rhs.shape
    if depth % blocks.block_k or width % blocks.block_n:
        raise ValueError(f"K={depth} and N={width} must be multiples of block_k="
                         f"{blocks.block_k} and block_n={blocks.block_n}")
    if jnp.dtype(lhs.dtype).name not in PALLAS_DTYPES:
        raise ValueError(f"dtype {jnp.dtype(lhs.dtype).name} is not one of {PALLAS_DTYPES}")
    tiles = tile_schedule(group_sizes, num_rows, blocks.block_m)
    padded_rows = max(num_rows, blocks.block_m)  # fewer rows than one tile are padded to it
    if padded_rows > num_rows:
        lhs = jnp.pad(lhs, ((0, padded_rows - num_rows), (0, 0)))
    kernel = functools.partial(_grouped_kernel, block_m=blocks.block_m, block_k=blocks.block_k,
                               precision=dot_precision(lhs.dtype))
    whole = pl.BlockSpec(index_map=lambda tile, column: (0, 0))
    out = pl.pallas_call(
        kernel,
        grid=(tiles.shape[0], width // blocks.block_n),
        in_specs=[whole, whole,
                  pl.BlockSpec((num_groups, depth, blocks.block_n),
                               lambda tile, column: (0, 0, column))],
        out_specs=pl.BlockSpec((padded_rows, blocks.block_n), lambda tile, column: (0, column)),
        out_shape=jax.ShapeDtypeStruct((padded_rows, width), lhs.dtype),
        compiler_params=pallas_backend.compiler_params(num_warps=blocks.num_warps,
                                                       num_stages=blocks.num_stages),
        interpret=interpret,
        name="grouped_matmul",
    )(tiles, lhs, rhs)
    return out[:num_rows]


# ----------------------------------------------------------------------------- reference


def grouped_matmul_reference(lhs: jax.Array, rhs: jax.Array,
                             group_sizes: jax.Array) -> jax.Array:
    """The same function: ``lax.ragged_dot`` with the module's precision rule."""
    _check_operands(lhs, rhs, group_sizes)
    return lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                          precision=dot_precision(lhs.dtype))


def apply_grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                         kernel: GroupedMatmulKernel = REFERENCE_GROUPED_MATMUL) -> jax.Array:
    """A grouped matmul through ``kernel``'s backend (``ragged_dot`` by default)."""
    if kernel.backend == PALLAS:
        return grouped_matmul(lhs, rhs, group_sizes, blocks=kernel.blocks,
                              interpret=kernel.interpret)
    return grouped_matmul_reference(lhs, rhs, group_sizes)
