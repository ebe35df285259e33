"""The routed experts of a few (token, expert) pairs, each pair's row through its own expert's
weights in place: no sort by expert, no weight copy. The MoE's decode-sized path.

Contract: ``x [T, D]``, ``token i32[P]``, ``expert i32[P]``, ``w1, w3 [E, D, F]``,
``w2 [E, F, D]``, all floats of one dtype -> ``[P, D]`` in that dtype: row ``p`` is the SwiGLU
expert MLP ``w2[e] (silu(x[t] @ w1[e]) * (x[t] @ w3[e]))`` with ``t = token[p]``,
``e = expert[p]``. An optional second stack ``shared`` (w1, w3, w2 of ``E_s`` more experts: the
MoE's shared expert) continues the ids: ``E .. E + E_s - 1`` index it. Invariants:

* A pair whose expert id is outside ``[0, E + E_s)`` (under expert parallelism, an expert of
  another device) gives a row of zeros; its programs read no weight. Token ids are data, not
  checked: they must be in ``[0, T)``.
* The arithmetic of ``moe.expert_mlp`` over the same pairs (the sorted grouped matmuls): each
  projection sums in float32 (float32 operands exactly, ``kernel_math.dot_precision``) and is
  rounded once to the dtype; silu and the product run in the dtype (``swiglu``).
* Pairs may repeat experts and tokens in any order; each pair is computed on its own, so a
  repeated expert's weights are requested once per pair (the repeats hit L2 only when they come
  close together in time).

Two implementations of one function, chosen statically by an ``ExpertRowsKernel``:

* ``expert_rows_mlp``, two Pallas calls (Triton lowering, ``pallas_backend``): the gate and up
  projections together, then the down projection. A call has one program per (pair, block of
  ``block_n`` output columns, split of the contraction), pairs varying fastest in the launch order
  so that the pairs of one expert ask for each weight block at about the same time. Each program
  reads its pair's expert id and indexes the stack it falls in (one loop per stack, of no step in
  the others). The contraction is cut into ``split_count`` equal ranges of whole ``block_k`` steps
  when the (pair, column block) programs alone are fewer than ``fill_programs``; every split
  writes float32 partial sums ``[S, P, N]``, added after the call, so the activation and the
  rounding see whole sums. A pair's single row is either multiplied and summed (products
  accumulated in a ``[block_k, block_n]`` float32 block, reduced once at the end) or, with
  ``dot_rows``, taken as a dot of 16 rows, the other 15 zero (Triton's smallest dot; zero rows add
  exact zeros).
* ``expert_rows_mlp_reference``: the stacks concatenated, each pair's expert weights gathered,
  then einsums.

``ExpertRowsKernel.max_pairs`` is where the MoE switches to this path (``takes``); above it, the
sorted grouped matmuls read each touched expert once however many pairs share it.
``choose_expert_rows_kernel`` picks the Pallas kernel on GPUs and turns the path off
(``max_pairs=0``) elsewhere, and on a GPU for a shape the kernel cannot take (the reason logged);
the reference runs where a caller names it (tests, benchmarks). The
kernel raises on what it cannot run; nothing falls back at run time.
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
from tokenspeed_jax.kernels.kernel_math import dot, dot_precision, is_power_of_2
from tokenspeed_jax.kernels.paged_attention_backend import (
    MIN_DOT_DIM,
    PALLAS,
    PALLAS_DTYPES,
    REFERENCE,
    check_pallas_or_reference,
    on_gpu,
)

logger = logging.getLogger(__name__)

# Pairs per call at most on this path: a decode step of up to 8 tokens at top-8. More pairs
# share more experts, whose weights this path reads once per pair and the sorted grouped matmuls
# once per expert (bench_expert_rows.py times both sides of the switch).
MAX_PAIRS = 64

Stack = tuple[jax.Array, jax.Array, jax.Array]  # w1, w3 [E, D, F] and w2 [E, F, D] of E experts


@dataclasses.dataclass(frozen=True)
class ExpertRowsBlocks:
    """Tuning knobs of the Pallas kernel, shared by its two calls."""

    block_n: int = 128  # output columns per program; must divide D and F
    block_k: int = 64  # contraction step; must divide D and F
    # a pair's row as a dot of 16 rows (zero-padded), not a multiply-and-sum: faster at every
    # decode size measured on an H200 (benchmarks/bench_expert_rows.py)
    dot_rows: bool = True
    # split the contraction until this many programs: about 4 per SM of an H200 (132 SMs). Of
    # 128 / 264 / 528 / 1056 in benchmarks/bench_expert_rows.py the fastest for one Kimi-Linear
    # token (47.8 us against 58.8 at 128 and 62.6 at 1056), within 5% of the best at 8 tokens
    # and for DeepSeek-V3
    fill_programs: int = 528
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        blocks = (self.block_n, self.block_k)
        if not all(is_power_of_2(block) and block >= MIN_DOT_DIM for block in blocks):
            raise ValueError(f"block_n, block_k = {blocks} must be powers of 2 >= {MIN_DOT_DIM}")
        if self.fill_programs < 1:
            raise ValueError(f"fill_programs={self.fill_programs} must be >= 1")


@dataclasses.dataclass(frozen=True)
class ExpertRowsKernel:
    """Whether a call's routed pairs take this path (at most ``max_pairs`` of them; 0: never) and
    how it runs: the backend, the Pallas kernel's knobs, and interpretation (``None``: interpret
    on the CPU, compile on the GPU)."""

    backend: str = REFERENCE
    max_pairs: int = MAX_PAIRS
    blocks: ExpertRowsBlocks = ExpertRowsBlocks()
    interpret: bool | None = None

    def __post_init__(self) -> None:
        check_pallas_or_reference(self.backend)
        if self.max_pairs < 0:
            raise ValueError(f"max_pairs={self.max_pairs} must be >= 0")

    def takes(self, num_pairs: int) -> bool:
        """Whether a call of ``num_pairs`` (token, expert) pairs runs through this module."""
        return num_pairs <= self.max_pairs


NO_EXPERT_ROWS = ExpertRowsKernel(max_pairs=0)  # every pair count takes the grouped matmuls


def expert_rows_problem(*, hidden: int, intermediate: int, dtype: jnp.dtype,
                        blocks: ExpertRowsBlocks = ExpertRowsBlocks()) -> str | None:
    """Why the Pallas kernel cannot run experts of this shape, or None when it can: both
    projections' sizes are multiples of both blocks, and the dtype is one it takes."""
    if jnp.dtype(dtype).name not in PALLAS_DTYPES:
        return f"dtype {jnp.dtype(dtype).name} is not one of {PALLAS_DTYPES}"
    step = max(blocks.block_n, blocks.block_k)
    if hidden % step or intermediate % step:
        return (f"hidden={hidden} and intermediate={intermediate} must be multiples of "
                f"block_n={blocks.block_n} and block_k={blocks.block_k}")
    return None


def choose_expert_rows_kernel(*, hidden: int, intermediate: int, dtype: jnp.dtype,
                              platform: str | None = None) -> ExpertRowsKernel:
    """The decode-sized expert path for this platform (default: JAX's default backend): the
    Pallas kernel on a GPU; off elsewhere and on a GPU for a shape the kernel cannot take (the
    reason logged), since the reference copies each pair's weights and sums in another order
    than the sorted path (the CPU keeps that path's numerics; tests choose the reference or
    the interpreted kernel explicitly)."""
    if not on_gpu(platform):
        return NO_EXPERT_ROWS
    problem = expert_rows_problem(hidden=hidden, intermediate=intermediate, dtype=dtype)
    if problem is not None:
        _log_off_once(problem)
        return NO_EXPERT_ROWS
    return ExpertRowsKernel(PALLAS)


@functools.cache
def _log_off_once(reason: str) -> None:
    logger.warning("routed experts take the sorted grouped matmuls at every batch: the "
                   "expert-rows kernel cannot run here: %s", reason)


def split_count(programs: int, steps: int, fill_programs: int) -> int:
    """Splits of a contraction of ``steps`` block steps over ``programs`` (pair, column block)
    programs: the fewest that divide ``steps`` and give ``fill_programs`` programs in all, or one
    per step when none does."""
    return next((splits for splits in range(1, steps + 1)
                 if steps % splits == 0 and programs * splits >= fill_programs), steps)


def swiglu(gate: jax.Array, up: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """silu(gate) * up of whole float32 projection sums, each rounded once to ``dtype`` and
    combined in it (``moe.expert_mlp``'s arithmetic)."""
    return jax.nn.silu(gate.astype(dtype)) * up.astype(dtype)


def _check_operands(x, token, expert, w1, w3, w2, shared) -> tuple[Stack, ...]:
    """The operands' problems raised; the weight stacks, routed then shared when given."""
    if x.ndim != 2 or w1.ndim != 3 or w1.shape[1] != x.shape[1]:
        raise ValueError(f"x {x.shape} and w1 {w1.shape} must be [T, D] and [E, D, F]")
    stacks = ((w1, w3, w2),) if shared is None else ((w1, w3, w2), tuple(shared))
    for s1, s3, s2 in stacks:
        num_experts, hidden, intermediate = s1.shape
        if (s1.shape[1:] != w1.shape[1:] or s3.shape != s1.shape
                or s2.shape != (num_experts, intermediate, hidden)):
            raise ValueError(f"each stack's w1 {s1.shape}, w3 {s3.shape} and w2 {s2.shape} "
                             f"must be [E, {w1.shape[1]}, {w1.shape[2]}] twice and "
                             f"[E, {w1.shape[2]}, {w1.shape[1]}]")
    if token.ndim != 1 or expert.shape != token.shape:
        raise ValueError(f"token {token.shape} and expert {expert.shape} must be one [P] shape")
    if not all(jnp.issubdtype(ids.dtype, jnp.integer) for ids in (token, expert)):
        raise ValueError(f"token and expert ids must be integers, not {token.dtype} and "
                         f"{expert.dtype}")
    dtypes = {x.dtype} | {weight.dtype for stack in stacks for weight in stack}
    if len(dtypes) != 1:
        raise ValueError(f"x and the weights must share one dtype, not {sorted(map(str, dtypes))}")
    return stacks


# ----------------------------------------------------------------------------- Pallas kernel


def _row_products(lhs, weights, *, dot_rows: bool, precision: lax.Precision) -> jax.Array:
    """One contraction step of a single row ``lhs [block_k]`` against ``weights
    [block_k, block_n]``, float32, to be summed over axis 0 once the steps are done:
    ``[block_k, block_n]`` products, or with ``dot_rows`` a ``[16, block_n]`` dot whose rows
    but the first are zeros."""
    if not dot_rows:
        return lhs.astype(jnp.float32)[:, None] * weights.astype(jnp.float32)
    rows = (MIN_DOT_DIM, lhs.shape[0])
    padded = jnp.where(lax.broadcasted_iota(jnp.int32, rows, 0) == 0,
                       jnp.broadcast_to(lhs[None, :], rows), jnp.zeros(rows, lhs.dtype))
    return dot(padded, weights, precision)


def _expert_rows_kernel(
    *refs,  # [rows i32[P]: the lhs row of each pair, unless rows_are_pairs], experts i32[P]
    # (each pair's id in the stacks' concatenation; outside it gives zeros), lhs [M, K], each
    # stack's weights [experts, K, N] (``per_stack`` of them, stack by stack), then a float32
    # [S, P, N] result for each weight of a stack
    per_stack: int,
    block_k: int,
    block_n: int,
    steps: int,  # block_k steps per split
    dot_rows: bool,
    rows_are_pairs: bool,  # pair p reads lhs row p (no rows operand)
    precision: lax.Precision,
):
    pair, column, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    if rows_are_pairs:
        row, (experts_ref, lhs_ref, *refs) = pair, refs
    else:
        rows_ref, experts_ref, lhs_ref, *refs = refs
        row = rows_ref[pair]
    weight_refs, sum_refs = refs[:-per_stack], refs[-per_stack:]
    cols = pl.ds(column * block_n, block_n)

    def k_step(stack, expert, index, accs):
        depth = pl.ds((split * steps + index) * block_k, block_k)
        lhs = lhs_ref[row, depth]
        return tuple(acc + _row_products(lhs, weight_ref[expert, depth, cols],
                                         dot_rows=dot_rows, precision=precision)
                     for acc, weight_ref in zip(accs, stack))

    accs = (jnp.zeros((MIN_DOT_DIM if dot_rows else block_k, block_n), jnp.float32),) * per_stack
    expert = experts_ref[pair]
    for first in range(0, len(weight_refs), per_stack):
        stack = weight_refs[first:first + per_stack]
        local = (expert >= 0) & (expert < stack[0].shape[0])
        # int32 bounds: Triton's loop needs one type for all three; a pair of another stack
        # runs no step of this one, so its id never indexes past the stack
        count = jnp.where(local, jnp.int32(steps), jnp.int32(0))
        accs = lax.fori_loop(0, count, functools.partial(k_step, stack, expert), accs)
        expert = expert - stack[0].shape[0]
    for sum_ref, acc in zip(sum_refs, accs):
        sum_ref[split, pair, cols] = jnp.sum(acc, axis=0)


def _project(lhs: jax.Array, rows: jax.Array | None, expert: jax.Array,
             stacks: tuple[tuple[jax.Array, ...], ...], *, blocks: ExpertRowsBlocks,
             interpret: bool, name: str) -> list[jax.Array]:
    """float32 ``lhs[rows[p]] @ w[expert[p]]`` [P, N] for each ``w`` of a stack (``rows`` None:
    row p for pair p), ``expert`` indexing the stacks' concatenation: one Pallas call, its
    splits' partial sums added."""
    num_pairs = expert.shape[0]
    row_operands = () if rows is None else (rows,)
    weights = [weight for stack in stacks for weight in stack]
    per_stack = len(stacks[0])
    _, depth, width = weights[0].shape
    steps = depth // blocks.block_k
    columns = width // blocks.block_n
    splits = split_count(num_pairs * columns, steps, blocks.fill_programs)
    kernel = functools.partial(_expert_rows_kernel, per_stack=per_stack, block_k=blocks.block_k,
                               block_n=blocks.block_n, steps=steps // splits,
                               dot_rows=blocks.dot_rows, rows_are_pairs=rows is None,
                               precision=dot_precision(lhs.dtype))
    whole = pl.BlockSpec()
    partial_sums = pl.pallas_call(
        kernel,
        grid=(num_pairs, columns, splits),
        in_specs=[whole] * (len(row_operands) + 2 + len(weights)),
        out_specs=[whole] * per_stack,
        out_shape=[jax.ShapeDtypeStruct((splits, num_pairs, width), jnp.float32)] * per_stack,
        compiler_params=pallas_backend.compiler_params(num_warps=blocks.num_warps,
                                                       num_stages=blocks.num_stages),
        interpret=interpret,
        name=name,
    )(*row_operands, expert, lhs, *weights)
    return [sums.sum(axis=0) for sums in partial_sums]


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def expert_rows_mlp(
    x: jax.Array,  # [T, D]
    token: jax.Array,  # i32[P]
    expert: jax.Array,  # i32[P]
    w1: jax.Array,  # [E, D, F]
    w3: jax.Array,  # [E, D, F]
    w2: jax.Array,  # [E, F, D]
    shared: Stack | None = None,  # (w1, w3, w2) of E_s more experts, ids E .. E + E_s - 1
    *,
    blocks: ExpertRowsBlocks = ExpertRowsBlocks(),
    interpret: bool | None = None,
) -> jax.Array:  # [P, D], x's dtype
    """Each pair's expert MLP through the Pallas kernel (module docstring)."""
    interpret = pallas_backend.resolve_interpret(interpret)
    stacks = _check_operands(x, token, expert, w1, w3, w2, shared)
    problem = expert_rows_problem(hidden=x.shape[1], intermediate=w1.shape[2], dtype=x.dtype,
                                  blocks=blocks)
    if problem is not None:
        raise ValueError(problem)
    if token.shape[0] == 0:
        raise ValueError("the kernel needs at least one pair")
    expert = expert.astype(jnp.int32)
    run = functools.partial(_project, expert=expert, blocks=blocks, interpret=interpret)
    gate, up = run(x, token.astype(jnp.int32), stacks=tuple(stack[:2] for stack in stacks),
                   name="expert_rows_gate_up")
    hidden = swiglu(gate, up, x.dtype)
    (out,) = run(hidden, None, stacks=tuple(stack[2:] for stack in stacks),
                 name="expert_rows_down")
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------- reference


def expert_rows_mlp_reference(x: jax.Array, token: jax.Array, expert: jax.Array, w1: jax.Array,
                              w3: jax.Array, w2: jax.Array,
                              shared: Stack | None = None) -> jax.Array:
    """The same function: the stacks concatenated, each pair's row and expert weights
    gathered, then einsums."""
    stacks = _check_operands(x, token, expert, w1, w3, w2, shared)
    w1, w3, w2 = (jnp.concatenate(weights) for weights in zip(*stacks))
    local = (expert >= 0) & (expert < w1.shape[0])
    ids = jnp.where(local, expert, 0)

    def project(lhs: jax.Array, weight: jax.Array) -> jax.Array:
        return jnp.einsum("PK,PKN->PN", lhs, jnp.take(weight, ids, axis=0),
                          precision=dot_precision(x.dtype), preferred_element_type=jnp.float32)

    rows = jnp.take(x, token, axis=0)
    out = project(swiglu(project(rows, w1), project(rows, w3), x.dtype), w2)
    return jnp.where(local[:, None], out, 0.0).astype(x.dtype)


def apply_expert_rows(x: jax.Array, token: jax.Array, expert: jax.Array, w1: jax.Array,
                      w3: jax.Array, w2: jax.Array, shared: Stack | None = None, *,
                      kernel: ExpertRowsKernel) -> jax.Array:
    """Each pair's expert MLP through ``kernel``'s backend."""
    if kernel.backend == PALLAS:
        return expert_rows_mlp(x, token, expert, w1, w3, w2, shared, blocks=kernel.blocks,
                               interpret=kernel.interpret)
    return expert_rows_mlp_reference(x, token, expert, w1, w3, w2, shared)
