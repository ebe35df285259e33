"""Cold vs warm start-up to ready, with the on-disk executable cache, in fresh processes.

For each case a child process is started twice on one empty cache directory: the first start
compiles and fills the cache (cold), the second loads from it (warm). The parent times each from
spawning the process to the child's "ready" line (imports, weights, KV cache, every executable),
then the child runs a short greedy generation (or the kernels) and reports a digest of the
outputs, which must be identical between the two starts. Compiles are counted through jax's
monitoring events during the compile phase.

Cases:
* ``smollm2``: ``build_engine`` exactly as the server calls it (embedded SmolLM2 GGUF), or random
  weights of its shape with --random-weights (e.g. where the gguf package is missing);
* ``llama8b-shape``: random bf16 weights of Llama-3-8B's shape, ModelRunner + compile_all;
* ``kda``: a plan of the Pallas KDA kernels (chunked prefill and recurrent decode over a state
  pool): Triton custom calls inside the executables, loaded in a fresh process.

    python scripts/bench_startup.py --out startup.json            # GPU: all three cases
    python scripts/bench_startup.py --tiny                        # CPU smoke test, tiny shapes
    python scripts/bench_startup.py --cases smollm2 --random-weights --server-ladder 2048
                                        # the server's default ladders up to 2048 tokens a step
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = ("smollm2", "llama8b-shape", "kda")
PAGE_SIZE = 16


def _digest(arrays) -> str:
    import numpy as np

    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.asarray(array).tobytes())
    return digest.hexdigest()[:16]


def _engine_config(args: argparse.Namespace, cache_dir: str):
    from tokenspeed_jax.config import EngineConfig

    if args.server_ladder:
        # The server's default ladders (EngineConfig's), up to --server-ladder tokens per step.
        return EngineConfig(
            prefill_graph_max_tokens=args.server_ladder, chunked_prefill_size=args.server_ladder,
            max_model_len=4096, num_pages=1024, page_size=PAGE_SIZE, compile_progress=False,
            compile_cache_dir=cache_dir, dtype="float32" if args.tiny else "bfloat16")
    if args.tiny:
        sizes = {"tokens": (16,), "prefill_bs": (1, 2), "decode": (1, 2), "max_len": 64,
                 "pages": 8}
    else:
        sizes = {"tokens": (128, 512, 2048), "prefill_bs": (1, 4), "decode": (1, 8, 32),
                 "max_len": 4096, "pages": 1024}
    return EngineConfig(
        prefill_graph_capture_token_sizes=sizes["tokens"],
        prefill_graph_max_tokens=max(sizes["tokens"]), chunked_prefill_size=max(sizes["tokens"]),
        prefill_graph_capture_batch_sizes=sizes["prefill_bs"],
        prefill_graph_max_bs=max(sizes["prefill_bs"]),
        decode_graph_capture_batch_sizes=sizes["decode"], decode_graph_max_bs=max(sizes["decode"]),
        max_num_seqs=max(sizes["decode"]), max_model_len=sizes["max_len"],
        num_pages=sizes["pages"], page_size=PAGE_SIZE, compile_progress=False,
        compile_cache_dir=cache_dir, dtype="float32" if args.tiny else "bfloat16")


def _runner(args: argparse.Namespace, config):
    """(ModelRunner with every executable ready, its compile summary)."""
    if args.case == "smollm2" and not args.random_weights and not args.tiny:
        from tokenspeed_jax.engine.engine import build_engine

        bundle = build_engine(config)
        return bundle.runner, bundle.compile_summary
    import jax.numpy as jnp
    from flax import nnx

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_graph import SHAPES

    from tokenspeed_jax.engine.model_runner import ModelRunner
    from tokenspeed_jax.models.llama import LlamaForCausalLM

    dtype = jnp.dtype(config.dtype)
    shape = SHAPES["tiny" if args.tiny else args.case]
    model = LlamaForCausalLM(shape, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    runner = ModelRunner(model, config, config.num_pages, config.page_size)
    return runner, runner.compile_all()


def _generate(runner) -> str:
    """Greedy tokens of one prompt: a prefill step then three decode steps; their digest."""
    import numpy as np

    from tokenspeed_jax.engine.batch import StepBatch, StepRequest
    from tokenspeed_jax.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    prompt = (np.arange(12, dtype=np.int32) * 7919 + 13) % 200
    pages = np.array([1, 2], np.int32)
    request = StepRequest("r", prompt, 0, pages, True, greedy)
    tokens, logprobs = [], []
    for _ in range(4):
        out = runner.step(StepBatch([request]))
        tokens.append(int(out.token_ids[0]))
        logprobs.append(out.logprobs)
        request = StepRequest("r", np.array(tokens[-1:], np.int32), request.end_pos, pages,
                              True, greedy, list(tokens))
    return _digest([np.array(tokens), *logprobs])


# ------------------------------------------------------------------- the KDA (Pallas) case


def kda_prefill(params, meta, q, k, v, g, beta, pool):
    from tokenspeed_jax.kernels.kda import chunk_kda_prefill

    return chunk_kda_prefill(q, k, v, g, beta, pool, meta["slots"], meta["cu_seqlens"])


def kda_step(params, meta, q, k, v, g, beta, pool):
    from tokenspeed_jax.kernels.kda_decode import kda_decode

    return kda_decode(q, k, v, g, beta, pool, meta["slots"])


def _kda(args: argparse.Namespace, cache_dir: str):
    """(run the compiled plans -> output digest, compile summary) for the KDA kernel plans."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tokenspeed_jax.graph import Break, Call, Plan, PlanCompiler
    from tokenspeed_jax.graph.cache import ExecutableCache

    tokens, heads, dim, requests = (128, 2, 32, 2) if args.tiny else (2048, 32, 128, 8)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    names = ("q", "k", "v", "g", "beta", "pool")
    plans = {}
    for name, fn, rows in (("kda prefill", kda_prefill, tokens), ("kda decode", kda_step,
                                                                   requests)):
        stage = Break(name.replace(" ", "_"), fn, names, ("o", "pool"), donate=("pool",))
        plans[name] = (Plan([Call(stage)], names, ("o", "pool")), stage.name, rows)
    compiler = PlanCompiler(progress=False, cache=ExecutableCache(cache_dir))

    def specs(rows: int) -> dict:
        return {"q": jax.ShapeDtypeStruct((rows, heads, dim), dtype),
                "k": jax.ShapeDtypeStruct((rows, heads, dim), dtype),
                "v": jax.ShapeDtypeStruct((rows, heads, dim), dtype),
                "g": jax.ShapeDtypeStruct((rows, heads, dim), jnp.float32),
                "beta": jax.ShapeDtypeStruct((rows, heads), dtype),
                "pool": jax.ShapeDtypeStruct((requests, heads, dim, dim), jnp.float32)}

    slots = np.arange(requests, dtype=np.int32)
    cu_seqlens = np.linspace(0, tokens, requests + 1).astype(np.int32)
    metas = {"kda prefill": {"slots": slots, "cu_seqlens": cu_seqlens},
             "kda decode": {"slots": slots}}
    for label, (plan, stage, rows) in plans.items():
        compiler.add(label, plan, specs(rows), {stage: metas[label]})
    compiled, summary = compiler.compile_all()

    def run() -> str:
        rng = np.random.default_rng(0)
        outputs = []
        pool = jnp.zeros((requests, heads, dim, dim), jnp.float32)
        for label, (_, stage, rows) in plans.items():
            inputs = {n: jnp.asarray(rng.normal(size=s.shape) * 0.1, s.dtype)
                      for n, s in specs(rows).items() if n != "pool"}
            inputs["g"] = -jnp.abs(inputs["g"])
            out = compiled[label].run({**inputs, "pool": pool}, {stage: metas[label]})
            pool = out["pool"]
            outputs.append(out["o"].astype(jnp.float32))
        return _digest([*outputs, pool])

    return run, summary


# ------------------------------------------------------------------- child and parent


def child(args: argparse.Namespace) -> None:
    """One start-up: print READY with phase timings when serving could begin, then DONE."""
    start = time.perf_counter()
    from jax import monitoring

    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(duration)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    import jax  # noqa: F401 - time the import on its own

    imported = time.perf_counter()
    cache_dir = args.cache_dir
    if args.case == "kda":
        run, summary = _kda(args, cache_dir)
    else:
        runner, summary = _runner(args, _engine_config(args, cache_dir))
        def run() -> str:
            return _generate(runner)
    ready = time.perf_counter()
    print("READY " + json.dumps({
        "import_s": imported - start, "in_process_s": ready - start,
        "loaded": summary.num_loaded, "compiled": summary.num_compiled,
        "load_s": summary.load_seconds, "compile_s": summary.compile_seconds,
        "backend_compiles": len(compiles), "backend_compile_s": sum(compiles)}), flush=True)
    print("DONE " + json.dumps({"outputs": run()}), flush=True)


def start_once(args: argparse.Namespace, case: str, cache_dir: str) -> dict:
    command = [sys.executable, __file__, "--child", "--case", case, "--cache-dir", cache_dir]
    command += ["--tiny"] * args.tiny + ["--random-weights"] * args.random_weights
    command += ["--server-ladder", str(args.server_ladder)] * bool(args.server_ladder)
    began = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    result: dict = {}
    for line in process.stdout:
        if line.startswith("READY "):
            result["ready_s"] = time.perf_counter() - began
            result.update(json.loads(line[6:]))
        elif line.startswith("DONE "):
            result.update(json.loads(line[5:]))
    if process.wait() != 0 or "outputs" not in result:
        raise SystemExit(f"{case}: start-up failed (exit {process.returncode})")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and buckets (CPU)")
    parser.add_argument("--random-weights", action="store_true",
                        help="smollm2 with random weights instead of the embedded GGUF")
    parser.add_argument("--server-ladder", type=int, metavar="TOKENS",
                        help="the server's default bucket ladders up to TOKENS per prefill step "
                             "(instead of 3 token buckets), for a start-up like the server's")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    for case in args.cases:
        with tempfile.TemporaryDirectory(prefix=f"startup-{case}-") as cache_dir:
            cold = start_once(args, case, cache_dir)
            warm = start_once(args, case, cache_dir)
            size = sum(f.stat().st_size for f in Path(cache_dir).iterdir())
        rows.append({"case": case, "cold": cold, "warm": warm,
                     "warm_over_cold": warm["ready_s"] / cold["ready_s"],
                     "identical_outputs": cold["outputs"] == warm["outputs"],
                     "cache_bytes": size})
    # compiles: every XLA compile of the process (weights init and KV allocation included)
    print(f"{'case':<15} {'cold s':>8} {'warm s':>8} {'warm/cold':>9} {'compiled':>9} "
          f"{'loaded':>7} {'compiles cold/warm':>18} {'load s':>7} {'same out':>8}")
    for row in rows:
        cold, warm = row["cold"], row["warm"]
        print(f"{row['case']:<15} {cold['ready_s']:8.1f} {warm['ready_s']:8.1f} "
              f"{row['warm_over_cold']:9.1%} {cold['compiled']:9d} {warm['loaded']:7d} "
              f"{cold['backend_compiles']:>11d}/{warm['backend_compiles']:<6d} "
              f"{warm['load_s']:7.2f} {row['identical_outputs']!s:>8}")
    if args.out:
        import jax

        device = jax.devices()[0]
        meta = {"device": device.device_kind, "platform": device.platform,
                "jax": jax.__version__, "tiny": args.tiny, "server_ladder": args.server_ladder,
                "xla_flags": os.environ.get("XLA_FLAGS")}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
