"""Prefill encoders and full-sampler plans compiled with and without XLA's autotuning, side by side.

    python benchmarks/bench_untuned_plans.py --model smollm2 --out untuned.json
    python benchmarks/bench_untuned_plans.py --model llama8b-shape --layers 8 --no-resample

One process, one random bf16 checkpoint of the shape, an empty executable cache. ``LLM`` starts
with ``prefill_autotune`` off, so its encoders and resamplers are compiled untuned before anything
else of their shapes is autotuned (XLA keeps autotune results in memory for the whole process: a
plan compiled after its autotuned twin could reuse them). The same plans are then compiled by
three more compilers (``VARIANTS``: untuned with XLA's Triton products, autotuned on cuBLAS,
autotuned as every other plan) and each variant's plans take turns in the runner's tables: per round and
variant, one prompt per token bucket through ``generate`` (best of 5) and, with resamplers, 32
requests decoding through the full sampler (top-p; penalties), ms per step. Reports each
variant's compile seconds and threads and the best of ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path

from bench_startup import best_seconds
from random_checkpoint import write_shape_checkpoint

from tokenspeed_jax.engine.compilers import NO_AUTOTUNE, QUICK_COMPILE_THREADS

TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "tests" / "golden" / "tiny_llama"
# Compilers besides the engine's own untuned one: (XLA options, compile threads; autotuned
# plans compile one at a time, as the engine compiles them).
VARIANTS = {
    "untuned-triton": ({**NO_AUTOTUNE, "xla_gpu_enable_triton_gemm": True}, QUICK_COMPILE_THREADS),
    "tuned-cublas": ({"xla_gpu_enable_triton_gemm": False}, 1),
    "tuned": ({}, 1),
}
RESAMPLED = {"top_p": {"top_p": 0.9, "temperature": 0.8},
             "penalties": {"repetition_penalty": 1.1, "temperature": 0.8, "top_k": 50}}
DECODE_ROWS = 32


def prefill_plans(runner) -> dict:
    """The runner's compiled prefill plans, by their key (route, tokens, None)."""
    return {key: plan for key, plan in runner._compiled.items() if key[0] == "prefill"}


def compile_variant(runner, options: dict, threads: int, token_sizes: tuple[int, ...],
                    resample: bool) -> tuple[dict, dict, dict]:
    """The runner's encoders (and resamplers) compiled with XLA ``options`` on ``threads``
    threads, no executable cache: (encoders by runner key, resamplers by key, figures)."""
    from tokenspeed_jax.graph.compile import PlanCompiler

    compiler = PlanCompiler(progress=False, fingerprint=runner.cache_fingerprint(),
                            mesh=runner.mesh, compiler_options=options, threads=threads)
    tokens_of = {}
    for tokens in token_sizes:
        tokens_of[f"prefill T={tokens}"] = ("prefill", tokens, None)
        compiler.add(f"prefill T={tokens}", runner.plans["prefill"],
                     *runner.prefill_specs(tokens, runner.narrow_rows))
    keys = {}
    if resample:
        for rows in sorted({key[1] for key in runner.resampler.compiled}):
            for label, key, plan, inputs, meta in runner.resampler.plans_for(rows):
                compiler.add(label, plan, inputs, meta)
                keys[label] = key
    began = time.perf_counter()
    plans, summary = compiler.compile_all()
    figures = {"compile_wall_s": time.perf_counter() - began, "threads": compiler.threads,
               "compiled": summary.num_compiled}
    encoders = {key: plans[label] for label, key in tokens_of.items()}
    return encoders, {keys[label]: plans[label] for label in keys}, figures


def measure(llm, token_sizes: tuple[int, ...], resample: bool) -> dict[str, float]:
    """Prefill ms per token bucket (a fresh prompt each run) and, with ``resample``, resampled
    decode ms per step of ``DECODE_ROWS`` requests."""
    from tokenspeed_jax.sampling_params import SamplingParams

    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    shifts = itertools.count()
    figures = {}
    for tokens in token_sizes:
        def run(tokens=tokens) -> None:
            shift = next(shifts)
            llm.generate([[(j * 7 + shift) % 300 + 5 for j in range(tokens - 8)]], greedy)

        run()
        figures[f"prefill_ms_T{tokens}"] = best_seconds(run, 5) * 1e3
    if resample:
        prompts = [[(i * 31 + j) % 300 + 5 for j in range(40)] for i in range(DECODE_ROWS)]
        for name, extra in RESAMPLED.items():
            seconds = {}
            for steps in (16, 80):
                params = SamplingParams(max_tokens=steps, ignore_eos=True, seed=1, **extra)
                seconds[steps] = best_seconds(lambda p=params: llm.generate(prompts, p))
            figures[f"decode_ms_{name}"] = (seconds[80] - seconds[16]) / 64 * 1e3
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "llama8b-shape"))
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 2048, 8192])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-resample", dest="resample", action="store_false",
                        help="time the prefill encoders only")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    import jax

    from tokenspeed_jax import LLM

    token_sizes = tuple(sorted(args.tokens))
    with tempfile.TemporaryDirectory(prefix="untuned-plans-") as work:
        model = Path(work) / "model"
        write_shape_checkpoint(model, args.model, TOKENIZER_DIR, num_layers=args.layers,
                               dtype="bfloat16")
        cache = Path(work) / "cache"
        cache.mkdir(mode=0o700)
        llm = LLM(str(model), compile_cache_dir=str(cache), compile_progress=False,
                  background_compile=False, quick_skeleton=False, prefill_autotune=False,
                  prefill_graph_max_tokens=token_sizes[-1],
                  prefill_graph_capture_token_sizes=token_sizes,
                  decode_graph_capture_batch_sizes=(DECODE_ROWS,), max_num_seqs=DECODE_ROWS,
                  max_model_len=token_sizes[-1] + 256)
        runner = llm.runner
        tables = {"untuned-cublas": (prefill_plans(runner), dict(runner.resampler.compiled))}
        compiles = {}
        for name, (options, threads) in VARIANTS.items():
            encoders, resamplers, compiles[name] = compile_variant(
                runner, options, threads, token_sizes, args.resample)
            tables[name] = (encoders, resamplers)
            print(f"{name}: {compiles[name]['compiled']} compiled in "
                  f"{compiles[name]['compile_wall_s']:.1f} s on {compiles[name]['threads']} "
                  f"thread(s)", flush=True)
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in tables}
        for _ in range(args.rounds):
            for name, (encoders, resamplers) in tables.items():
                runner._compiled.update(encoders)
                runner.resampler.compiled.update(resamplers)
                rounds[name].append(measure(llm, token_sizes, args.resample))
        best = {name: {key: min(r[key] for r in runs) for key in runs[0]}
                for name, runs in rounds.items()}
        for name, figures in best.items():
            print(f"{name:<15} " + ", ".join(f"{key} {value:.3f}"
                                            for key, value in figures.items()), flush=True)
        runtime_compiles = llm.stats()["runtime_compiles"]
    if args.out:
        meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                "model": args.model, "layers": args.layers, "runtime_compiles": runtime_compiles}
        Path(args.out).write_text(json.dumps(
            {"meta": meta, "compiles": compiles, "best": best, "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
