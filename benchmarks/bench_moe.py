"""Time the routed-expert MLP of Kimi-Linear-48B-A3B on the GPU: ``lax.ragged_dot`` against the
Pallas grouped matmul of ``kernels.grouped_matmul``.

    python3 benchmarks/bench_moe.py [--out DIR] [--budget-s SECONDS] [--tiny]

Shape: hidden 2304, 256 experts of 1024, 8 per token, bf16, at T = 64, 512, 2048 and 8192
tokens, each token routed to 8 distinct experts drawn uniformly. Each case times
``moe.expert_mlp`` (w1 and w3, silu * mul, w2 over the (token, expert) pairs sorted by expert)
through ragged_dot, then through the Pallas kernel with each of ``VARIANTS``: compile seconds,
milliseconds per call (median of wall times around ``block_until_ready``), TFLOP/s of useful work
(2 * T * k * hidden * intermediate per projection, three projections) and the Pallas result's
max |pallas - ragged_dot| and ||pallas - ragged_dot|| / ||ragged_dot||. The table ends with the
best block config per T. Once --budget-s has passed the rest is skipped, so the table always
prints. Every result is a JSON line, appended to DIR/bench_moe.jsonl.

``--tiny`` runs small shapes on the CPU with the kernel interpreted: a smoke test of the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import time

import jax
import jax.numpy as jnp
from bench_prefill_attention import errors, run_and_record, wall_ms

from tokenspeed_jax.kernels.grouped_matmul import (
    REFERENCE_GROUPED_MATMUL,
    GroupedMatmulBlocks,
    GroupedMatmulKernel,
)
from tokenspeed_jax.kernels.paged_attention_backend import PALLAS
from tokenspeed_jax.models.moe import expert_mlp

DTYPE = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Problem:
    """The MoE shape, the token counts timed and the Pallas block configs tried."""

    hidden: int
    intermediate: int
    experts: int
    top_k: int
    tokens: tuple[int, ...]
    variants: tuple[GroupedMatmulBlocks, ...]
    interpret: bool


KIMI = Problem(2304, 1024, 256, 8, (64, 512, 2048, 8192), (
    GroupedMatmulBlocks(64, 128, 64, num_warps=4, num_stages=3),
    GroupedMatmulBlocks(128, 128, 64, num_warps=8, num_stages=3),
    GroupedMatmulBlocks(32, 128, 128, num_warps=4, num_stages=3),
    GroupedMatmulBlocks(16, 256, 64, num_warps=4, num_stages=4),
), interpret=False)
TINY = Problem(64, 32, 8, 2, (8, 40), (GroupedMatmulBlocks(16, 16, 16),
                                       GroupedMatmulBlocks(32, 32, 32)), interpret=True)


def kernel_label(kernel: GroupedMatmulKernel) -> dict:
    """The implementation and, for the Pallas kernel, its blocks as m/n/k/warps/stages."""
    if kernel.backend != PALLAS:
        return {"impl": "ragged_dot", "blocks": "-"}
    blocks = kernel.blocks
    return {"impl": "pallas", "blocks": f"{blocks.block_m}/{blocks.block_n}/{blocks.block_k}"
                                       f"/w{blocks.num_warps}/s{blocks.num_stages}"}


def expert_weights(problem: Problem):
    """w1, w3 [E, D, F] and w2 [E, F, D], N(0, 0.02^2) as the checkpoints' init."""
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    up = (problem.experts, problem.hidden, problem.intermediate)
    down = (problem.experts, problem.intermediate, problem.hidden)
    return tuple(0.02 * jax.random.normal(key, shape, DTYPE)
                 for key, shape in zip(keys, (up, up, down)))


def routed_rows(problem: Problem, num_tokens: int):
    """(rows [T * k, D] sorted by expert, rows per expert i32[E]) for tokens routed to k
    distinct experts drawn uniformly."""
    key_x, key_route = jax.random.split(jax.random.PRNGKey(num_tokens))
    x = jax.random.normal(key_x, (num_tokens, problem.hidden), DTYPE)
    _, experts = jax.lax.top_k(jax.random.uniform(key_route, (num_tokens, problem.experts)),
                               problem.top_k)
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=problem.experts).astype(jnp.int32)
    return jnp.take(x, order // problem.top_k, axis=0), sizes


def useful_flops(problem: Problem, num_tokens: int) -> float:
    return 3 * 2.0 * num_tokens * problem.top_k * problem.hidden * problem.intermediate


def timing(problem: Problem, weights, num_tokens: int, kernel: GroupedMatmulKernel,
           reference: dict) -> dict:
    """One (T, kernel) row; the ragged_dot row leaves its output in ``reference`` for the
    Pallas rows of the same T to be checked against."""
    if kernel.backend != PALLAS:
        reference.clear()
    args = (*routed_rows(problem, num_tokens), *weights)
    mlp = jax.jit(functools.partial(expert_mlp, dtype=DTYPE, kernel=kernel))
    start = time.perf_counter()
    compiled = mlp.lower(*args).compile()
    row = {"item": "time", "tokens": num_tokens, **kernel_label(kernel),
           "compile_s": round(time.perf_counter() - start, 2)}
    row["ms"] = wall_ms(lambda: compiled(*args), repeats=3 if num_tokens >= 8192 else 7)
    row["tflops"] = useful_flops(problem, num_tokens) / row["ms"] / 1e9
    out = compiled(*args)
    if kernel.backend != PALLAS:
        reference[num_tokens] = out
    elif num_tokens in reference:
        row.update(errors(out, reference[num_tokens]))
    return row


def plan(problem: Problem, weights) -> list:
    """(label, measure) per row: for each T, ragged_dot first, then every Pallas variant."""
    reference = {}
    kernels = [REFERENCE_GROUPED_MATMUL] + [
        GroupedMatmulKernel(PALLAS, blocks, interpret=problem.interpret)
        for blocks in problem.variants]
    return [({"tokens": num_tokens, **kernel_label(kernel)},
             functools.partial(timing, problem, weights, num_tokens, kernel, reference))
            for num_tokens in problem.tokens for kernel in kernels]


def print_table(rows: list[dict]) -> None:
    nan = float("nan")
    ragged_ms = {row["tokens"]: row["ms"] for row in rows
                 if row["item"] == "time" and row["impl"] == "ragged_dot"}
    print(f"\n{'T':>6} {'impl':<11} {'blocks':<18} {'compile s':>9} {'ms':>10} {'TFLOP/s':>8} "
          f"{'speedup':>8} {'rel err':>9}")
    best = {}
    for row in rows:
        if row["item"] != "time":
            print(row)
            continue
        speedup = ragged_ms.get(row["tokens"], nan) / row["ms"]
        print(f"{row['tokens']:>6} {row['impl']:<11} {row['blocks']:<18} {row['compile_s']:>9.2f} "
              f"{row['ms']:>10.3f} {row['tflops']:>8.1f} {speedup:>8.1f} "
              f"{row.get('rel', nan):>9.2e}")
        fastest = best.get(row["tokens"])
        if row["impl"] == "pallas" and (fastest is None or row["ms"] < fastest["ms"]):
            best[row["tokens"]] = row
    for num_tokens, row in best.items():
        print(f"best at T={num_tokens}: {row['blocks']} {row['ms']:.3f} ms "
              f"({row['tflops']:.1f} TFLOP/s, ragged_dot {ragged_ms.get(num_tokens, nan):.3f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--budget-s", type=float, default=70.0)
    parser.add_argument("--tiny", action="store_true", help="small shapes, kernel interpreted")
    args = parser.parse_args()
    if not args.tiny and jax.default_backend() != "gpu":
        parser.error("the Kimi shapes need a GPU; --tiny runs small shapes on the CPU")
    problem = TINY if args.tiny else KIMI
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    weights = expert_weights(problem)
    rows, start = [], time.perf_counter()
    for label, measure in plan(problem, weights):
        if time.perf_counter() - start > args.budget_s:
            rows.append({"item": "skipped (budget)", **label})
            continue
        rows.append(run_and_record(measure, label, args.out, "bench_moe.jsonl"))
    print_table(rows)


if __name__ == "__main__":
    main()
