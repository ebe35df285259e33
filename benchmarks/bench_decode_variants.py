"""Decode-step variants side by side in one process, taking turns.

    python benchmarks/bench_decode_variants.py --model smollm2 --batches 1,8,32 --rounds 5 \\
        --variants default serialize one-split

A host-bound step (SmolLM2's shape on a GPU) moves by tens of percent between processes and
runs, so settings are compared here within one process: each variant is a ``ModelRunner`` with
only the decode graph (``bench_graph.decode_runner``) on the same random weights, and in every
round, for every batch, each variant in turn times a whole step (median of 20) and a stretch of
60 steps that run ahead (``bench_graph.run_ahead_steps``). Prints, per batch and variant, the
median over rounds and the min-max spread, in ms. ``VARIANTS`` names what can be compared: XLA
compiler options (``EngineConfig.xla_compiler_options``), the fused decode kernel's knobs
(most key splits, pages per key block; None = JAX's paged-attention op),
``EngineConfig.stack_decode_weights`` and ``alternate_decode_executables`` (None = auto):
each variant is the keyword arguments it gives ``bench_graph.decode_runner``. Each variant
compiles its own executables (the options are part of the cache key).
"""

from __future__ import annotations

import argparse
import statistics

import bench_graph
import jax

from tokenspeed_jax.engine.batch import StepBatch

SERIALIZE = ("xla_gpu_command_buffer_scheduling_mode=SERIALIZE",)
ONE_SPLIT = (1, bench_graph.DEFAULT_FUSED[1])
VARIANTS: dict[str, dict] = {
    "default": {},
    "serialize": {"xla_compiler_options": SERIALIZE},
    "one-split": {"fused": ONE_SPLIT},
    "serialize-one-split": {"xla_compiler_options": SERIALIZE, "fused": ONE_SPLIT},
    "op-route": {"fused": None},
    "stacked-weights": {"stack_decode_weights": True},
    "per-layer-weights": {"stack_decode_weights": False},
    "cublas-gemm": {"xla_compiler_options": ("xla_gpu_enable_triton_gemm=false",)},
    "no-autotune": {"xla_compiler_options": ("xla_gpu_autotune_level=0",)},
    "exhaustive-tiling": {"xla_compiler_options": ("xla_gpu_exhaustive_tiling_search=true",)},
    "no-command-buffer": {"xla_compiler_options": ("xla_gpu_enable_command_buffer=",)},
    "alternate-copies": {"alternate_decode_executables": True},
    "one-copy": {"alternate_decode_executables": False},
}
STEP_ITERS = 20
AHEAD_STEPS = 60


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=sorted(bench_graph.SHAPES))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--variants", nargs="+", default=["default", "serialize"],
                        choices=sorted(VARIANTS))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    model = bench_graph.load_model(args.model, args.dtype, random_weights=True)
    runners = {name: bench_graph.decode_runner(
                   model, batches, args.context,
                   **{"fused": bench_graph.DEFAULT_FUSED, **VARIANTS[name]})
               for name in args.variants}
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for _ in range(args.rounds):
        for batch in batches:
            requests = bench_graph.decode_requests(batch, args.context)
            for name, runner in runners.items():
                step = StepBatch(requests)
                whole = bench_graph.timed(lambda r=runner, s=step: r.step(s), STEP_ITERS,
                                          warmup=2)
                ahead = bench_graph.timed(
                    lambda r=runner, q=requests: bench_graph.run_ahead_steps(r, q, AHEAD_STEPS),
                    1) / AHEAD_STEPS
                times.setdefault((name, batch), []).append((whole * 1e3, ahead * 1e3))
    print(f"\n{args.model} ({args.dtype}) on {jax.devices()[0].device_kind}, jax "
          f"{jax.__version__}, context {args.context}, median over {args.rounds} rounds "
          f"[min-max], ms")
    print(f"{'batch':>5}  {'variant':<20} {'step':>18} {'run ahead':>18}")
    for batch in batches:
        for name in runners:
            cells = []
            for column in zip(*times[(name, batch)]):
                cells.append(f"{statistics.median(column):6.3f} [{min(column):.2f}-"
                             f"{max(column):.2f}]")
            print(f"{batch:>5}  {name:<20} {cells[0]:>18} {cells[1]:>18}")
    compiles = {name: r.stats()["runtime_compiles"] for name, r in runners.items()}
    if any(compiles.values()):
        raise RuntimeError(f"decode steps compiled while timed: {compiles}")


if __name__ == "__main__":
    main()
