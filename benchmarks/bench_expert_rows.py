"""Time the routed experts of one MoE call at decode sizes on the GPU: the sorted grouped path
(``moe.routed_through_groups``: sort, grouped matmuls, scatter) against the expert-rows path
(``moe.routed_through_rows``, ``kernels/expert_rows.py``) at several ``ExpertRowsBlocks``.

    python3 benchmarks/bench_expert_rows.py [--shapes kimi deepseek] [--tokens 1 2 4 8 16 32]
        [--out FILE] [--budget-s SECONDS] [--tiny]

Shapes, bf16, 256 experts, 8 per token, random weights made on the device: ``kimi``
(Kimi-Linear: hidden 2304, expert width 1024) and ``deepseek`` (DeepSeek-V3: hidden 7168, width
2048). At each token count T, ``CALLS`` routings (each token to 8 distinct experts drawn
uniformly, random weights) are made; every route is first checked on the first routing against
the rows path's plain-JAX reference (max |diff|, ||diff|| / ||reference||, ``ok`` within
``TOLERANCE``), then timed: jitted, microseconds per call as the median over ``--rounds`` of
the wall time of ``CALLS`` calls issued back to back (one routing each, so no call finds the
previous call's experts in L2) and ended by one ``block_until_ready``, divided by ``CALLS``. A
call whose device time is below the host's dispatch time shows the dispatch time. Beside each:
the weight-read floor (the bytes of the distinct experts a call touches, w1, w3 and w2, over
``BANDWIDTH``, averaged over the routings) and the ratio to it.

Each case prints a table row as it finishes; with ``--out`` every row so far is rewritten to
FILE as JSON after each case, so a run cut short keeps what it measured. Once ``--budget-s`` has
passed, the remaining cases are skipped. A case that raises is an error row; the run goes on.

``--tiny`` runs small shapes on the CPU with the kernels interpreted: a smoke test of the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from bench_moe import TINY, Problem, expert_weights
from bench_prefill_attention import errors

from tokenspeed_jax.kernels.expert_rows import ExpertRowsBlocks, ExpertRowsKernel
from tokenspeed_jax.kernels.grouped_matmul import GroupedMatmulBlocks, GroupedMatmulKernel
from tokenspeed_jax.kernels.paged_attention_backend import PALLAS, REFERENCE
from tokenspeed_jax.models.moe import routed_through_groups, routed_through_rows

DTYPE = jnp.bfloat16
BANDWIDTH = 4.3e12  # bytes per second: an H200's HBM read bandwidth, as the other floors take it
CALLS = 16  # routings per token count; a timing round issues one call of each
TOLERANCE = 2e-2  # ||route - reference|| / ||reference|| in bf16 (summation order only)
TOKENS = (1, 2, 4, 8, 16, 32)
GROUPED = GroupedMatmulBlocks()  # the engine's default on GPUs (choose_grouped_kernel)
PROBLEMS = {
    "kimi": Problem(2304, 1024, 256, 8, TOKENS, (GROUPED,), interpret=False),
    "deepseek": Problem(7168, 2048, 256, 8, TOKENS, (GROUPED,), interpret=False),
}
ROW_VARIANTS = (  # the default first, then one or two knobs moved at a time
    ExpertRowsBlocks(),
    ExpertRowsBlocks(fill_programs=1),  # never split the contraction
    ExpertRowsBlocks(fill_programs=128),  # about one program per SM
    ExpertRowsBlocks(fill_programs=1056),  # about 8 programs per SM
    ExpertRowsBlocks(dot_rows=False),  # a multiply-and-sum per row
    ExpertRowsBlocks(block_k=32),
    ExpertRowsBlocks(block_n=64, block_k=128),
    ExpertRowsBlocks(num_warps=8),
)
TINY_ROW_VARIANTS = (ExpertRowsBlocks(16, 16), ExpertRowsBlocks(16, 16, dot_rows=False))
TINY_TOKENS = (1, 4)


@dataclasses.dataclass(frozen=True)
class Route:
    """One timed implementation: a label for the table and the jitted function of (x, experts,
    weights, w1, w3, w2)."""

    name: str
    blocks: str
    fn: Callable[..., jax.Array]


def routes(problem: Problem, row_variants: tuple[ExpertRowsBlocks, ...]) -> list[Route]:
    """The sorted grouped path with the engine's grouped kernel, then the rows path per
    variant."""
    grouped = GroupedMatmulKernel(PALLAS, problem.variants[0], interpret=problem.interpret)
    found = [Route("grouped", blocks_label(grouped.blocks), jax.jit(functools.partial(
        routed_through_groups, first=0, dtype=DTYPE, kernel=grouped)))]
    for blocks in row_variants:
        kernel = ExpertRowsKernel(PALLAS, blocks=blocks, interpret=problem.interpret)
        found.append(Route("rows", blocks_label(blocks), jax.jit(functools.partial(
            routed_through_rows, first=0, dtype=DTYPE, kernel=kernel))))
    return found


def blocks_label(blocks) -> str:
    """The knobs of a block dataclass as ``name=value`` pairs (``block_`` and ``num_`` left
    off), defaults included."""
    return " ".join(f"{field.name.removeprefix('block_').removeprefix('num_')}="
                    f"{getattr(blocks, field.name)}" for field in dataclasses.fields(blocks))


def routings(problem: Problem, num_tokens: int) -> list[tuple[jax.Array, ...]]:
    """``CALLS`` (x [T, D], experts i32[T, k], weights f32[T, k]): each token's k distinct
    experts drawn uniformly, its weights uniform in [0, 1)."""
    made = []
    for call in range(CALLS):
        key_x, key_route, key_weights = jax.random.split(jax.random.PRNGKey(call), 3)
        x = jax.random.normal(key_x, (num_tokens, problem.hidden), DTYPE)
        scores = jax.random.uniform(key_route, (num_tokens, problem.experts))
        experts = jax.lax.top_k(scores, problem.top_k)[1].astype(jnp.int32)
        weights = jax.random.uniform(key_weights, (num_tokens, problem.top_k), jnp.float32)
        made.append((x, experts, weights))
    return made


def floor_us(problem: Problem, calls: list[tuple[jax.Array, ...]]) -> float:
    """Microseconds to read the distinct experts of a call once, averaged over ``calls``."""
    expert_bytes = 3 * problem.hidden * problem.intermediate * jnp.dtype(DTYPE).itemsize
    distinct = statistics.mean(len(set(experts.reshape(-1).tolist())) for _, experts, _ in calls)
    return distinct * expert_bytes / BANDWIDTH * 1e6


def us_per_call(fn, calls: list[tuple[jax.Array, ...]], weights: tuple[jax.Array, ...],
                rounds: int) -> float:
    """The median over ``rounds`` of one round's wall time per call (module docstring)."""
    jax.block_until_ready(fn(*calls[0], *weights))
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for args in calls:
            out = fn(*args, *weights)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / len(calls) * 1e6)
    return statistics.median(samples)


def measure(route: Route, calls, weights, expected, floor: float, *, rounds: int) -> dict:
    """A route's check on the first routing against ``expected()`` and its timing."""
    start = time.perf_counter()
    compiled = route.fn.lower(*calls[0], *weights).compile()
    row = {"compile_s": round(time.perf_counter() - start, 2)}
    row.update(errors(compiled(*calls[0], *weights), expected()))
    row["ok"] = row["rel"] < TOLERANCE
    row["us"] = us_per_call(compiled, calls, weights, rounds)
    row["ratio"] = row["us"] / floor
    return row


def print_row(row: dict) -> None:
    nan = float("nan")
    if "error" in row or "skipped" in row:
        print(f"{row['shape']:<9} {row['tokens']:>4} {row['route']:<8} "
              f"{row.get('error', 'skipped (budget)')}  [{row['blocks']}]", flush=True)
        return
    print(f"{row['shape']:<9} {row['tokens']:>4} {row['route']:<8} {row['us']:>9.1f} "
          f"{row['floor_us']:>9.1f} {row['ratio']:>6.2f} {row.get('rel', nan):>9.2e} "
          f"{'ok' if row['ok'] else 'WRONG':<5} {row['compile_s']:>6.1f}  [{row['blocks']}]",
          flush=True)


def cases(problems: dict[str, Problem], token_counts, variants) -> list[tuple[dict, object]]:
    """(label, measurement) per row, token count by token count (so a budget cut skips the
    largest counts of every shape), each shape's routes in ``routes`` order. The weights of
    every shape are made first and stay on the device."""
    found = []
    for num_tokens in token_counts:
        for shape, (problem, weights) in problems.items():
            calls = routings(problem, num_tokens)
            floor = floor_us(problem, calls)
            expected = functools.partial(reference_output, calls[0], weights)
            for route in routes(problem, variants):
                label = {"shape": shape, "tokens": num_tokens,
                         "pairs": num_tokens * problem.top_k, "route": route.name,
                         "blocks": route.blocks, "floor_us": floor}
                found.append((label, functools.partial(measure, route, calls, weights,
                                                       expected, floor)))
    return found


@functools.cache
def _reference_fn():
    return jax.jit(functools.partial(routed_through_rows, first=0, dtype=DTYPE,
                                     kernel=ExpertRowsKernel(REFERENCE)))


def reference_output(call: tuple[jax.Array, ...], weights: tuple[jax.Array, ...]) -> jax.Array:
    """The rows path's plain-JAX reference on one routing."""
    return _reference_fn()(*call, *weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(PROBLEMS), default=list(PROBLEMS))
    parser.add_argument("--tokens", nargs="+", type=int, default=None,
                        help=f"token counts (default {TOKENS}; --tiny: {TINY_TOKENS})")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="JSON file of the rows")
    parser.add_argument("--budget-s", type=float, default=210.0)
    parser.add_argument("--tiny", action="store_true", help="small shapes, kernels interpreted")
    args = parser.parse_args()
    if not args.tiny and jax.default_backend() != "gpu":
        parser.error("the model shapes need a GPU; --tiny runs small shapes on the CPU")
    chosen = {"tiny": TINY} if args.tiny else {name: PROBLEMS[name] for name in args.shapes}
    problems = {name: (problem, expert_weights(problem)) for name, problem in chosen.items()}
    variants = TINY_ROW_VARIANTS if args.tiny else ROW_VARIANTS
    device = jax.devices()[0].device_kind
    print(f"jax {jax.__version__} on {device}; us per call, floor at {BANDWIDTH:.2e} B/s",
          flush=True)
    print(f"{'shape':<9} {'T':>4} {'route':<8} {'us':>9} {'floor us':>9} {'ratio':>6} "
          f"{'rel err':>9} {'check':<5} {'comp s':>6}  [knobs]", flush=True)
    rows, start = [], time.perf_counter()
    token_counts = args.tokens or (TINY_TOKENS if args.tiny else TOKENS)
    for label, measurement in cases(problems, token_counts, variants):
        if time.perf_counter() - start > args.budget_s:
            row = {**label, "skipped": "budget"}
        else:
            try:
                row = {**label, **measurement(rounds=args.rounds)}
            except Exception as error:  # noqa: BLE001 - report and go on: the table must print
                row = {**label, "error": f"{type(error).__name__}: {error}"[:400]}
        print_row(row)
        rows.append(row)
        if args.out:
            args.out.write_text(json.dumps({"jax": jax.__version__, "device": device,
                                            "rows": rows}, indent=1))

if __name__ == "__main__":
    main()
