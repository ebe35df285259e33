"""Compile time against speed: XLA compile options and compile threads, one fresh process each.

    python benchmarks/bench_compile_options.py --model smollm2 --variants default threads-4 \\
        --out compile_options.json

Each variant starts ``LLM`` in a process of its own on an empty executable cache of its own (a
random bf16 checkpoint of the shape, written once), with every plan compiled before serving
(no background compile, no quick skeleton), token buckets 512 / 2048 / 8192 and decode buckets
32 / 64; it reports every plan's compile seconds, the wall time of the whole compile, then the
decode step at batch 1 / 64 and one 2048-token prefill (``bench_startup.decode_ms`` /
``prefill_ms``). A variant is ``EngineConfig`` keyword arguments (``VARIANTS``): XLA options are
part of the cache key, and ``compile_threads`` compiles that many executables at once, each
autotuned while the others run, so the speed columns say what the compile picked.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS: dict[str, dict] = {
    "default": {},
    "threads-4": {"compile_threads": 4},
    "cublas-gemm": {"xla_compiler_options": ("xla_gpu_enable_triton_gemm=false",)},
    "no-autotune": {"xla_compiler_options": ("xla_gpu_autotune_level=0",)},
}
TOKEN_BUCKETS = (512, 2048, 8192)
DECODE_BUCKETS = (32, 64)
TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "tests" / "golden" / "tiny_llama"


def child(variant: str, model: str, cache: str) -> dict:
    """Start the engine with ``variant``'s settings; its compile and speed figures."""
    from bench_startup import decode_ms, prefill_ms

    from tokenspeed_jax import LLM
    from tokenspeed_jax.graph.compile import PlanCompiler

    seconds: list[tuple[str, float]] = []
    compile_one = PlanCompiler._compile

    def timed(compiler, job):
        began = time.perf_counter()
        compile_one(compiler, job)
        seconds.append((job.label, time.perf_counter() - began))

    PlanCompiler._compile = timed
    began = time.perf_counter()
    llm = LLM(model, compile_cache_dir=cache, compile_progress=False, background_compile=False,
              quick_skeleton=False, prefill_graph_max_tokens=TOKEN_BUCKETS[-1],
              prefill_graph_capture_token_sizes=TOKEN_BUCKETS,
              decode_graph_capture_batch_sizes=DECODE_BUCKETS, max_num_seqs=DECODE_BUCKETS[-1],
              max_model_len=TOKEN_BUCKETS[-1] + 256, **VARIANTS[variant])
    compile_wall = time.perf_counter() - began
    speed = {f"decode_ms_bs{batch}": decode_ms(llm.engine, batch) for batch in (1, 64)}
    speed["prefill_ms_T2048"] = prefill_ms(llm.engine, 2048)
    return {"variant": variant, "start_s": compile_wall, "compiled": len(seconds),
            "compile_s": sum(s for _, s in seconds),
            "plans": sorted(seconds, key=lambda item: -item[1]), **speed,
            "runtime_compiles": llm.stats()["runtime_compiles"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "llama8b-shape"))
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--child", nargs=3, metavar=("VARIANT", "MODEL", "CACHE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child)), flush=True)
        return
    from random_checkpoint import write_shape_checkpoint

    rows = []
    with tempfile.TemporaryDirectory(prefix="compile-options-") as work:
        model = Path(work) / "model"
        write_shape_checkpoint(model, args.model, TOKENIZER_DIR, num_layers=args.layers,
                               dtype="bfloat16")
        for variant in args.variants:
            cache = Path(work) / f"cache-{variant}"
            cache.mkdir(mode=0o700)
            process = subprocess.run(
                [sys.executable, __file__, "--child", variant, str(model), str(cache)],
                stdout=subprocess.PIPE, text=True, check=True)
            row = json.loads(process.stdout.split("RESULT ", 1)[1])
            rows.append(row)
            print(f"{variant:<12} start {row['start_s']:6.1f} s, {row['compiled']} compiled in "
                  f"{row['compile_s']:6.1f} s; decode ms bs 1 / 64: {row['decode_ms_bs1']:.3f} / "
                  f"{row['decode_ms_bs64']:.3f}; prefill 2048: {row['prefill_ms_T2048']:.2f} ms; "
                  f"slowest: {row['plans'][:3]}", flush=True)
    if args.out:
        import jax

        meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                "model": args.model, "layers": args.layers}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
