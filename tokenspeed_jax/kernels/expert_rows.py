"""The routed experts of a few tokens, each (token, expert) pair's row through its own expert's
weights in place: no sort by expert, no weight copy. The MoE's decode-sized path.

Contract: ``x [T, D]``, ``experts i32[T, n]`` (each token's routed experts), ``w1, w3 [E, D,
F]``, ``w2 [E, F, D]``, an optional second stack ``shared`` (w1, w3, w2 of ``E_s`` more experts:
the MoE's shared experts) and an optional ``live bool[T]``, all floats of one dtype -> ``[T, n +
E_s, D]`` in that dtype: entry ``[t, j]`` is the SwiGLU expert MLP ``w2[e] (silu(x[t] @ w1[e]) *
(x[t] @ w3[e]))`` of routed expert ``e = experts[t, j]`` for ``j < n`` and of shared expert
``j - n`` after them. The pairs are token-major, ``P = T (n + E_s)`` of them. Invariants:

* A routed pair whose expert is outside ``[0, E)`` (under expert parallelism, an expert of
  another device; ``NO_EXPERT``) or whose token is not ``live`` (a compiled step's padding
  row) gives zeros and its programs read no weight; shared pairs always run. The ids and the
  live rows are read inside the kernels, so a decode step runs no XLA kernel to build pairs.
* The arithmetic of ``moe.expert_mlp`` over the same pairs (the sorted grouped matmuls): each
  projection sums in float32 (float32 operands exactly, ``kernel_math.dot_precision``) and is
  rounded once to the dtype; silu and the product run in the dtype (``swiglu``).
* Each pair is computed on its own, so an expert two tokens share is requested once per pair
  (the repeats hit L2 only when they come close together in time).

Two implementations of one function, chosen statically by an ``ExpertRowsKernel``:

* ``expert_rows_mlp``, two Pallas calls (Triton lowering, ``pallas_backend``): the gate and up
  projections together, then the down projection. A call has one program per (pair, block of
  ``block_n`` output columns, split of the contraction), pairs varying fastest in the launch order
  so that the pairs of one expert ask for each weight block at about the same time. Each program
  finds its pair's row and expert from the ids and indexes the stack the pair falls in (one loop
  per stack, of no step in the others). The contraction is cut into ``split_count`` equal ranges
  of whole ``block_k`` steps when the (pair, column block) programs alone are fewer than
  ``fill_programs``; every split writes float32 partial sums ``[S, P, N]``. The down call's
  programs add the gate and up partial sums of their contraction range and take the activation
  themselves (``swiglu``'s operations in float32, each rounded to the dtype), so the
  activation sees whole sums and no XLA kernel runs between the calls; the down call's own
  partial sums are added after it. A pair's single row is either multiplied and
  summed (products accumulated in a ``[block_k, block_n]`` float32 block, reduced once at the
  end) or, with ``dot_rows``, taken as a dot of 16 rows, the other 15 zero (Triton's smallest
  dot; zero rows add exact zeros). (One call per MoE, a program per (pair, block of intermediate
  columns) running gate, up, activation and its share of down, measured slower on an H200: see
  docs/benchmarks.md, "Tried and rejected".)
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
from tokenspeed_jax.kernels.kernel_math import dot, dot_precision, is_power_of_2, rounded_to
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


NO_EXPERT = -1  # an expert id no stack holds: its pair reads no weight and gives zeros
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


def check_operands(x, experts, w1, w3, w2, shared, live) -> tuple[Stack, ...]:
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
    if experts.ndim != 2 or experts.shape[0] != x.shape[0] or experts.shape[1] == 0:
        raise ValueError(f"experts {experts.shape} must be [{x.shape[0]}, n] with n >= 1")
    if not jnp.issubdtype(experts.dtype, jnp.integer):
        raise ValueError(f"expert ids must be integers, not {experts.dtype}")
    if live is not None and live.shape != (x.shape[0],):
        raise ValueError(f"live {live.shape} must be [{x.shape[0]}]")
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


def _pairs_per_token(experts, stacks: tuple) -> int:
    """A token's pairs: its routed experts (``experts`` [T, n], an array or a ref) plus the
    shared stack's experts."""
    return experts.shape[1] + (stacks[1][0].shape[0] if len(stacks) > 1 else 0)


def _pair_runs(pair, experts_ref, live_ref, stacks, expert_at=None) -> tuple:
    """Pair ``pair``'s row of x and, per stack, (its weights, the pair's expert in it, int32 1
    when the pair runs that expert else 0). Pairs are token-major: each token's routed experts,
    then one pair per shared expert (module contract). ``expert_at(row, slot, routed_and_live)``
    reads a routed pair's expert id (default: ``experts_ref[row, slot]``)."""
    routed, per_token = experts_ref.shape[1], _pairs_per_token(experts_ref, stacks)
    row, slot = pair // per_token, pair % per_token
    wanted = (slot < routed) & (live_ref[row] != 0)
    if expert_at is None:
        expert = experts_ref[row, jnp.minimum(slot, routed - 1)]
    else:
        expert = expert_at(row, jnp.minimum(slot, routed - 1), wanted)
    runs = [wanted & (expert >= 0) & (expert < stacks[0][0].shape[0])]
    found = [(stacks[0], expert)]
    if len(stacks) > 1:
        runs.append(slot >= routed)
        found.append((stacks[1], slot - routed))
    # int32 loop bounds: Triton's loop needs one type for all three; a pair runs no step of a
    # stack it is not in, so its id never indexes past that stack
    return row, [(*stack_expert, jnp.where(run, jnp.int32(1), jnp.int32(0)))
                 for stack_expert, run in zip(found, runs)]


def _swiglu_rounded(gate, up, dtype: jnp.dtype):
    """``swiglu`` inside a kernel (Triton has no bf16 arithmetic): its operations in float32,
    each result rounded to ``dtype`` (XLA's own bf16 sigmoid may differ by an ulp or two)."""
    rounded = functools.partial(rounded_to, dtype=dtype)
    gate, up = rounded(gate), rounded(up)
    return (rounded(gate * rounded(jax.nn.sigmoid(gate))) * up).astype(dtype)


def project_item(
    pair, column, split,  # the program's item: its pair, block of output columns, contraction split
    experts_ref,  # i32[T, n]: each token's routed experts
    live_ref,  # i32[T]: 0 for a row whose routed pairs are skipped
    *refs,  # the lhs: x [T, K], or with ``swiglu_of`` the gate and up projections' float32
    # partial sums [S', P, K] of the call before; each stack's weights [E, K, N] (``per_stack``
    # of them, stack by stack); then a float32 [S, P, N] result for each weight of a stack
    per_stack: int,
    block_k: int,
    block_n: int,
    steps: int,  # block_k steps per split
    dot_rows: bool,
    swiglu_of: jnp.dtype | None,  # the lhs is swiglu(gate, up) in this dtype, row = pair
    precision: lax.Precision,
    expert_at=None,  # ``_pair_runs``' reader of a routed pair's expert id
):
    """One program's work in a projection call (module docstring)."""
    lhs_refs = refs[:1] if swiglu_of is None else refs[:2]
    weight_refs, sum_refs = refs[len(lhs_refs):-per_stack], refs[-per_stack:]
    stacks = [weight_refs[first:first + per_stack]
              for first in range(0, len(weight_refs), per_stack)]
    row, runs = _pair_runs(pair, experts_ref, live_ref, stacks, expert_at)
    cols = pl.ds(column * block_n, block_n)

    def lhs_at(depth):
        if swiglu_of is None:
            return lhs_refs[0][row, depth]
        gate, up = (sum(ref[part, pair, depth] for part in range(ref.shape[0]))
                    for ref in lhs_refs)
        return _swiglu_rounded(gate, up, swiglu_of)

    def k_step(stack, expert, index, accs):
        depth = pl.ds((split * steps + index) * block_k, block_k)
        lhs = lhs_at(depth)
        return tuple(acc + _row_products(lhs, weight_ref[expert, depth, cols],
                                         dot_rows=dot_rows, precision=precision)
                     for acc, weight_ref in zip(accs, stack))

    accs = (jnp.zeros((MIN_DOT_DIM if dot_rows else block_k, block_n), jnp.float32),) * per_stack
    for stack, expert, run in runs:
        accs = lax.fori_loop(0, run * steps, functools.partial(k_step, stack, expert), accs)
    for sum_ref, acc in zip(sum_refs, accs):
        sum_ref[split, pair, cols] = jnp.sum(acc, axis=0)


def _projection_kernel(experts_ref, live_ref, *refs, **static):
    project_item(pl.program_id(0), pl.program_id(1), pl.program_id(2), experts_ref, live_ref,
                 *refs, **static)


def projection_plan(num_pairs: int, weight: jax.Array, blocks: ExpertRowsBlocks) -> tuple:
    """(columns, splits, block steps per split) of a call over ``num_pairs`` pairs through
    weights shaped like ``weight [E, K, N]``."""
    _, depth, width = weight.shape
    steps = depth // blocks.block_k
    columns = width // blocks.block_n
    splits = split_count(num_pairs * columns, steps, blocks.fill_programs)
    return columns, splits, steps // splits


def _project(lhs: tuple[jax.Array, ...], experts: jax.Array, live: jax.Array,
             stacks: tuple[tuple[jax.Array, ...], ...], *, swiglu_of: jnp.dtype | None,
             blocks: ExpertRowsBlocks, interpret: bool, name: str) -> list[jax.Array]:
    """float32 partial sums [S, P, N] of ``lhs[row] @ w[expert]`` for every pair and each ``w``
    of a stack, in one Pallas call: ``lhs`` is ``(x,)`` and the row the pair's token, or with
    ``swiglu_of`` the (gate, up) partial sums of the call before, whose swiglu the kernel
    takes, and the row the pair."""
    weights = [weight for stack in stacks for weight in stack]
    per_stack = len(stacks[0])
    num_pairs = experts.shape[0] * _pairs_per_token(experts, stacks)
    columns, splits, steps = projection_plan(num_pairs, weights[0], blocks)
    dtype = lhs[0].dtype if swiglu_of is None else swiglu_of
    kernel = functools.partial(_projection_kernel, per_stack=per_stack, block_k=blocks.block_k,
                               block_n=blocks.block_n, steps=steps, dot_rows=blocks.dot_rows,
                               swiglu_of=swiglu_of, precision=dot_precision(dtype))
    whole = pl.BlockSpec()
    return pl.pallas_call(
        kernel,
        grid=(num_pairs, columns, splits),
        in_specs=[whole] * (2 + len(lhs) + len(weights)),
        out_specs=[whole] * per_stack,
        out_shape=[jax.ShapeDtypeStruct((splits, num_pairs, weights[0].shape[2]), jnp.float32)]
        * per_stack,
        compiler_params=pallas_backend.compiler_params(num_warps=blocks.num_warps,
                                                       num_stages=blocks.num_stages),
        interpret=interpret,
        name=name,
    )(experts, live, *lhs, *weights)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def expert_rows_mlp(
    x: jax.Array,  # [T, D]
    experts: jax.Array,  # i32[T, n]
    w1: jax.Array,  # [E, D, F]
    w3: jax.Array,  # [E, D, F]
    w2: jax.Array,  # [E, F, D]
    shared: Stack | None = None,  # (w1, w3, w2) of E_s shared experts
    live: jax.Array | None = None,  # bool[T]
    *,
    blocks: ExpertRowsBlocks = ExpertRowsBlocks(),
    interpret: bool | None = None,
) -> jax.Array:  # [T, n + E_s, D], x's dtype
    """Every pair's expert MLP through the Pallas kernel (module docstring)."""
    interpret = pallas_backend.resolve_interpret(interpret)
    stacks = check_operands(x, experts, w1, w3, w2, shared, live)
    problem = expert_rows_problem(hidden=x.shape[1], intermediate=w1.shape[2], dtype=x.dtype,
                                  blocks=blocks)
    if problem is not None:
        raise ValueError(problem)
    experts = experts.astype(jnp.int32)
    live = live_rows(live, x.shape[0])
    gate_up = _project((x,), experts, live, tuple(stack[:2] for stack in stacks),
                       swiglu_of=None, blocks=blocks, interpret=interpret,
                       name="expert_rows_gate_up")
    return down_rows(gate_up, experts, live, stacks, x.dtype, blocks=blocks, interpret=interpret)


def live_rows(live: jax.Array | None, num_tokens: int) -> jax.Array:
    """The kernels' ``live`` operand: int32 [T], every row live when ``live`` is None."""
    return jnp.ones(num_tokens, jnp.int32) if live is None else live.astype(jnp.int32)


def down_rows(gate_up: list[jax.Array], experts: jax.Array, live: jax.Array,
              stacks: tuple[Stack, ...], dtype: jnp.dtype, *, blocks: ExpertRowsBlocks,
              interpret: bool) -> jax.Array:
    """[T, n + E_s, D] in ``dtype``: the down call over the gate and up partial sums
    ``gate_up`` of every pair (``experts`` i32 [T, n]), its partial sums added."""
    (out,) = _project(tuple(gate_up), experts, live, tuple(stack[2:] for stack in stacks),
                      swiglu_of=dtype, blocks=blocks, interpret=interpret,
                      name="expert_rows_down")
    return out.sum(axis=0).astype(dtype).reshape(experts.shape[0],
                                                 _pairs_per_token(experts, stacks), -1)


# ----------------------------------------------------------------------------- reference


def expert_rows_mlp_reference(x: jax.Array, experts: jax.Array, w1: jax.Array, w3: jax.Array,
                              w2: jax.Array, shared: Stack | None = None,
                              live: jax.Array | None = None) -> jax.Array:
    """The same function: each pair's id in the stacks' concatenation, its row and expert
    weights gathered, then einsums."""
    stacks = check_operands(x, experts, w1, w3, w2, shared, live)
    num_tokens = experts.shape[0]
    runs = (experts >= 0) & (experts < w1.shape[0])
    if live is not None:
        runs = runs & live[:, None]
    ids = jnp.where(runs, experts, -1)
    if shared is not None:
        shared_ids = w1.shape[0] + jnp.arange(shared[0].shape[0], dtype=ids.dtype)
        ids = jnp.concatenate([ids, jnp.broadcast_to(shared_ids, (num_tokens, len(shared_ids)))],
                              axis=1)
    w1, w3, w2 = (jnp.concatenate(weights) for weights in zip(*stacks))
    ids = ids.reshape(-1)
    local = ids >= 0

    def project(lhs: jax.Array, weight: jax.Array) -> jax.Array:
        return jnp.einsum("PK,PKN->PN", lhs, jnp.take(weight, jnp.maximum(ids, 0), axis=0),
                          precision=dot_precision(x.dtype), preferred_element_type=jnp.float32)

    rows = jnp.repeat(x, ids.shape[0] // num_tokens, axis=0)
    out = project(swiglu(project(rows, w1), project(rows, w3), x.dtype), w2)
    return jnp.where(local[:, None], out, 0.0).astype(x.dtype).reshape(num_tokens, -1,
                                                                       x.shape[1])


def apply_expert_rows(x: jax.Array, experts: jax.Array, w1: jax.Array, w3: jax.Array,
                      w2: jax.Array, shared: Stack | None = None, live: jax.Array | None = None,
                      *, kernel: ExpertRowsKernel) -> jax.Array:
    """Every pair's expert MLP through ``kernel``'s backend."""
    if kernel.backend == PALLAS:
        return expert_rows_mlp(x, experts, w1, w3, w2, shared, live, blocks=kernel.blocks,
                               interpret=kernel.interpret)
    return expert_rows_mlp_reference(x, experts, w1, w3, w2, shared, live)
