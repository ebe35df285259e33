"""Cold vs warm start-up to ready, with the on-disk executable cache, in fresh processes.

For each case a child process is started twice on one empty cache directory: the first start
compiles and fills the cache (cold), the second loads from it (warm). The parent times each from
spawning the process to the child's "ready" line and to its "ladder" line, once every bucket
is compiled (later than ready with background compile, ``EngineConfig.background_compile``),
then the child runs a short greedy generation (or the kernels) and reports a digest of the
outputs, which must be identical between the two starts.

Cases:
* ``smollm2``: the embedded SmolLM2 GGUF, or with --random-weights (or --tiny) a random checkpoint
  of its shape (e.g. where the GGUF cannot be shipped);
* ``llama8b-shape``: a random checkpoint of Llama-3-8B's shape;
* ``kda``: a plan of the Pallas KDA kernels (chunked prefill and recurrent decode over a state
  pool): Triton custom calls inside the executables, loaded in a fresh process.

Invariants:

* The model cases start exactly as the server does: ``build_engine`` on an ``EngineConfig`` whose
  ``model`` is the checkpoint (None: the embedded GGUF), so loading, KV sizing and compiling are
  the server's own. Only the checkpoint load is split off to time it: the child calls
  ``load_model`` as ``build_engine`` would and hands the result to it.
* A random checkpoint (``random_checkpoint.py``: bf16, float32 with --tiny, the tokenizer of
  ``tests/golden/tiny_llama``) is written by the parent once per case, before the two starts,
  into the case's temporary directory; its writing time is reported on its own, never as
  start-up. With --tiny both model cases use the ``tiny`` shape.
* The ready line splits the start into imports, checkpoint load and the plan compile (executables
  loaded from the cache vs compiled); the total runs from the child's first line. Compiles are
  jax's backend-compile monitoring events: all of them, and those inside
  ``PlanCompiler.compile_all`` (the plan executables, the only ones the cache can serve); the rest
  (eager ops such as KV-cache allocation) are compiled again by every start.

    python benchmarks/bench_startup.py --out startup.json            # GPU: all three cases
    python benchmarks/bench_startup.py --tiny                        # CPU smoke test, tiny shapes
    python benchmarks/bench_startup.py --cases smollm2 --random-weights --server-ladder 2048
                                        # the server's default ladders up to 2048 tokens a step
    python benchmarks/bench_startup.py --cases smollm2 --inline-prefill-attention
                                        # prefill encoders with attention inside
    python benchmarks/bench_startup.py --cases smollm2 --compile-threads 1
                                        # one executable compiled at a time
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = ("smollm2", "llama8b-shape", "kda")
PAGE_SIZE = 16
PREFILL_TOKENS = 2048  # the prompt `--speed` times, as in the prefill benchmarks
# The random checkpoints' tokenizer: a 320-token byte-level BPE that ships with the tests.
TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "tests" / "golden" / "tiny_llama"


def _digest(arrays) -> str:
    import numpy as np

    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.asarray(array).tobytes())
    return digest.hexdigest()[:16]


def _dtype(args: argparse.Namespace) -> str:
    """Weights and compute: float32 for the CPU smoke test, else bfloat16."""
    return "float32" if args.tiny else "bfloat16"


def _needs_checkpoint(args: argparse.Namespace, case: str) -> bool:
    """Whether the case starts from a random checkpoint the parent writes."""
    return case == "llama8b-shape" or (case == "smollm2" and (args.random_weights or args.tiny))


def _write_checkpoint(args: argparse.Namespace, case: str, model_dir: Path) -> float:
    """Write the case's random checkpoint into ``model_dir``; the seconds it took."""

    from random_checkpoint import write_shape_checkpoint

    began = time.perf_counter()
    write_shape_checkpoint(model_dir, "tiny" if args.tiny else case, TOKENIZER_DIR,
                           dtype=_dtype(args))
    return time.perf_counter() - began


SWITCHES = ("inline_prefill_attention", "background_compile", "quick_skeleton")


def _switches(args: argparse.Namespace) -> dict:
    """The on/off flags given on the command line; the others keep EngineConfig's defaults."""
    return {name: getattr(args, name) for name in SWITCHES if getattr(args, name) is not None}


def _engine_config(args: argparse.Namespace, cache_dir: str):
    from tokenspeed_jax.config import EngineConfig

    if args.server_ladder:
        # The server's default ladders (EngineConfig's), up to --server-ladder tokens per step.
        return EngineConfig(
            model=args.model, prefill_graph_max_tokens=args.server_ladder,
            chunked_prefill_size=args.server_ladder, max_model_len=4096, num_pages=1024,
            page_size=PAGE_SIZE, compile_progress=False, compile_cache_dir=cache_dir,
            dtype=_dtype(args), compile_threads=args.compile_threads, **_switches(args))
    if args.tiny:
        sizes = {"tokens": (16,), "prefill_bs": (1, 2), "decode": (1, 2), "max_len": 64,
                 "pages": 8}
    else:
        sizes = {"tokens": (128, 512, 2048), "prefill_bs": (1, 4), "decode": (1, 8, 32),
                 "max_len": 4096, "pages": 1024}
    return EngineConfig(
        model=args.model, prefill_graph_capture_token_sizes=sizes["tokens"],
        prefill_graph_max_tokens=max(sizes["tokens"]), chunked_prefill_size=max(sizes["tokens"]),
        prefill_graph_capture_batch_sizes=sizes["prefill_bs"],
        prefill_graph_max_bs=max(sizes["prefill_bs"]),
        decode_graph_capture_batch_sizes=sizes["decode"], decode_graph_max_bs=max(sizes["decode"]),
        max_num_seqs=max(sizes["decode"]), max_model_len=sizes["max_len"],
        num_pages=sizes["pages"], page_size=PAGE_SIZE, compile_progress=False,
        compile_cache_dir=cache_dir, dtype=_dtype(args), compile_threads=args.compile_threads,
        **_switches(args))


def _engine(config):
    """``build_engine(config)`` as the server runs it, the checkpoint load timed on its own:
    (runner ready to serve, compile summary, checkpoint load seconds)."""
    from tokenspeed_jax import parallel
    from tokenspeed_jax.engine.startup import build_engine
    from tokenspeed_jax.models.loader import load_model

    began = time.perf_counter()
    loaded = load_model(config.model, dtype=config.dtype,
                        mesh=parallel.make_mesh(config.tensor_parallel_size))
    load_seconds = time.perf_counter() - began
    bundle = build_engine(config, loaded)
    return bundle, load_seconds


def best_seconds(run, repeats: int = 3) -> float:
    """The shortest of ``repeats`` timed calls of ``run()``."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return min(times)


def decode_ms(engine, batch: int) -> float:
    """Milliseconds per decode step of ``batch`` greedy requests through ``engine.generate``:
    the best of three runs of 144 and of 16 tokens, their difference over 128 steps (the
    prefill and the fetches at the ends cancel)."""
    from tokenspeed_jax.sampling_params import SamplingParams

    prompts = [[(i * 31 + j) % 300 + 5 for j in range(40)] for i in range(batch)]
    best = {}
    for tokens in (16, 144):
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens)
        best[tokens] = best_seconds(lambda p=params: engine.generate([(q, p) for q in prompts]))
    return (best[144] - best[16]) / 128 * 1e3


def prefill_ms(engine, tokens: int) -> float:
    """Milliseconds of one ``tokens``-token prompt's prefill through ``engine.generate`` (one
    output token, so nothing decodes): the best of three runs, each of a prompt of its own
    (another first token), so that the prefix cache holds none of it."""
    from tokenspeed_jax.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
    runs = itertools.count()

    def run() -> None:
        shift = next(runs)
        engine.generate([([(j * 7 + shift) % 300 + 5 for j in range(tokens)], params)])

    return best_seconds(run) * 1e3


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
    from tokenspeed_jax.graph.trust import load_mac_key

    tokens, heads, dim, requests = (128, 2, 32, 2) if args.tiny else (2048, 32, 128, 8)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    names = ("q", "k", "v", "g", "beta", "pool")
    plans = {}
    for name, fn, rows in (("kda prefill", kda_prefill, tokens), ("kda decode", kda_step,
                                                                   requests)):
        stage = Break(name.replace(" ", "_"), fn, names, ("o", "pool"), donate=("pool",))
        plans[name] = (Plan([Call(stage)], names, ("o", "pool")), stage.name, rows)
    compiler = PlanCompiler(progress=False, cache=ExecutableCache(cache_dir, load_mac_key()),
                            threads=args.compile_threads)

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


class BackendCompiles:
    """This process's backend compiles (jax monitoring events), counting apart those made while a
    ``PlanCompiler.compile_all`` runs: the plan executables, the ones the cache can serve."""

    def __init__(self):
        from jax import monitoring

        from tokenspeed_jax.graph import PlanCompiler

        self.seconds: list[float] = []
        self.in_plans = 0
        self._inside_plans = False
        monitoring.register_event_duration_secs_listener(self._record)
        compile_all = PlanCompiler.compile_all

        def counted_compile_all(compiler, **options):
            self._inside_plans = True
            try:
                return compile_all(compiler, **options)
            finally:
                self._inside_plans = False

        PlanCompiler.compile_all = counted_compile_all

    def _record(self, event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.seconds.append(duration)
            self.in_plans += self._inside_plans


def child(args: argparse.Namespace) -> None:
    """One start-up: print READY with phase timings when serving could begin, LADDER once
    every bucket is compiled, then DONE."""
    start = time.perf_counter()
    compiles = BackendCompiles()  # imports jax and the plan compiler: part of the import phase
    if args.case != "kda":  # the server's modules, timed as imports
        for module in ("tokenspeed_jax.engine.startup", "tokenspeed_jax.models.loader"):
            importlib.import_module(module)

    imported = time.perf_counter()
    checkpoint_load_s = None
    if args.case == "kda":
        run, summary = _kda(args, args.cache_dir)
    else:
        bundle, checkpoint_load_s = _engine(_engine_config(args, args.cache_dir))
        runner, summary = bundle.runner, bundle.compile_summary

        def run() -> str:
            return _generate(runner)
    ready = time.perf_counter()
    print("READY " + json.dumps({
        "import_s": imported - start, "checkpoint_load_s": checkpoint_load_s,
        "in_process_s": ready - start, "loaded": summary.num_loaded,
        "compiled": summary.num_compiled, "load_s": summary.load_seconds,
        "compile_s": summary.compile_seconds,
        "compile_wall_s": summary.compile_wall_seconds, "threads": summary.threads,
        "backend_compiles": len(compiles.seconds),
        "plan_backend_compiles": compiles.in_plans,
        "backend_compile_s": sum(compiles.seconds)}), flush=True)
    speeds = {}
    if args.case != "kda":
        while runner.stats()["plans_untuned"]:  # a quick skeleton still serving
            time.sleep(0.1)
        print("TUNED", flush=True)
        runner.ladders.wait()
        if args.speed:
            speeds = {f"decode_ms_bs{batch}": decode_ms(bundle.engine, batch)
                      for batch in (1, 64)}
            tokens = min(PREFILL_TOKENS, runner.buckets.tokens[-1])
            speeds[f"prefill_ms_T{tokens}"] = prefill_ms(bundle.engine, tokens)
    print("LADDER", flush=True)
    print("DONE " + json.dumps({"outputs": run(), **speeds}), flush=True)


def start_once(args: argparse.Namespace, case: str, cache_dir: Path,
               model_dir: Path | None) -> dict:
    command = [sys.executable, __file__, "--child", "--case", case, "--cache-dir", str(cache_dir)]
    command += ["--tiny"] * args.tiny + ["--random-weights"] * args.random_weights
    command += ["--server-ladder", str(args.server_ladder)] * bool(args.server_ladder)
    command += ["--model", str(model_dir)] * (model_dir is not None)
    command += ["--compile-threads", str(args.compile_threads)]
    for flag, on in _switches(args).items():
        command.append(f"--{'' if on else 'no-'}{flag.replace('_', '-')}")
    command += ["--speed"] * args.speed
    began = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    result: dict = {}
    for line in process.stdout:
        if line.startswith("READY "):
            result["ready_s"] = time.perf_counter() - began
            result.update(json.loads(line[6:]))
        elif line.startswith("TUNED"):
            result["tuned_s"] = time.perf_counter() - began
        elif line.startswith("LADDER"):
            result["ladder_s"] = time.perf_counter() - began
        elif line.startswith("DONE "):
            result.update(json.loads(line[5:]))
    if process.wait() != 0 or "outputs" not in result:
        raise SystemExit(f"{case}: start-up failed (exit {process.returncode})")
    return result


def bench_case(args: argparse.Namespace, case: str) -> dict:
    """The case's random checkpoint (if any), then a cold and a warm start on one cache."""
    with tempfile.TemporaryDirectory(prefix=f"startup-{case}-") as work:
        cache_dir, model_dir = Path(work) / "cache", None
        cache_dir.mkdir(mode=0o700)  # the cache refuses a directory others may write
        write_s = None
        if _needs_checkpoint(args, case):
            model_dir = Path(work) / "model"
            write_s = _write_checkpoint(args, case, model_dir)
            print(f"{case}: wrote a random checkpoint in {write_s:.1f}s", flush=True)
        cold = start_once(args, case, cache_dir, model_dir)
        print(f"{case} cold: {json.dumps(cold)}", flush=True)
        warm = start_once(args, case, cache_dir, model_dir)
        print(f"{case} warm: {json.dumps(warm)}", flush=True)
        size = sum(f.stat().st_size for f in cache_dir.iterdir())
    return {"case": case, "checkpoint_write_s": write_s, "cold": cold, "warm": warm,
            "warm_over_cold": warm["ready_s"] / cold["ready_s"],
            "identical_outputs": cold["outputs"] == warm["outputs"], "cache_bytes": size}


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_table(rows: list[dict]) -> None:
    """Cold and warm start per case, to ready and the cold start to a complete ladder; the cold
    start's compile threads and the wall time of its start-up plan compiles; the phases
    (import, checkpoint load, executables loaded from the cache) and the compiles outside the
    plans are the warm start's."""
    print(f"{'case':<15} {'write s':>7} {'cold s':>7} {'tuned s':>7} {'ladder s':>8} "
          f"{'warm s':>7} "
          f"{'warm/cold':>9} "
          f"{'compiled':>8} {'threads':>7} {'compile wall s':>14} {'loaded':>6} "
          f"{'compiles cold/warm':>18} {'non-plan warm':>13} "
          f"{'import s':>8} {'ckpt s':>6} {'exe load s':>10} {'same out':>8}")
    for row in rows:
        cold, warm = row["cold"], row["warm"]
        non_plan = warm["backend_compiles"] - warm["plan_backend_compiles"]
        print(f"{row['case']:<15} {seconds(row['checkpoint_write_s']):>7} "
              f"{cold['ready_s']:7.1f} {seconds(cold.get('tuned_s')):>7} "
              f"{cold['ladder_s']:8.1f} {warm['ready_s']:7.1f} "
              f"{row['warm_over_cold']:9.1%} "
              f"{cold['compiled']:8d} {cold['threads']:7d} {cold['compile_wall_s']:14.1f} "
              f"{warm['loaded']:6d} "
              f"{cold['backend_compiles']:>11d}/{warm['backend_compiles']:<6d} {non_plan:13d} "
              f"{warm['import_s']:8.1f} {seconds(warm['checkpoint_load_s']):>6} "
              f"{warm['load_s']:10.2f} {row['identical_outputs']!s:>8}")
        if "decode_ms_bs1" in warm:
            prefill = next(key for key in warm if key.startswith("prefill_ms_T"))
            print(f"{'':<15} after start-up (warm): decode ms, batch 1 / 64: "
                  f"{warm['decode_ms_bs1']:.3f} / {warm['decode_ms_bs64']:.3f}; prefill ms, "
                  f"{prefill.removeprefix('prefill_ms_T')} tokens: {warm[prefill]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and buckets (CPU)")
    parser.add_argument("--random-weights", action="store_true",
                        help="smollm2 from a random checkpoint of its shape instead of the "
                             "embedded GGUF")
    parser.add_argument("--server-ladder", type=int, metavar="TOKENS",
                        help="the server's default bucket ladders up to TOKENS per prefill step "
                             "(instead of 3 token buckets), for a start-up like the server's")
    parser.add_argument("--inline-prefill-attention", action=argparse.BooleanOptionalAction,
                        help="prefill encoders with attention inside, or not (EngineConfig's "
                             "option; unset: its auto rule)")
    parser.add_argument("--compile-threads", type=int, default=1,
                        help="executables compiled at once (EngineConfig's compile_threads)")
    parser.add_argument("--background-compile", action=argparse.BooleanOptionalAction,
                        help="serve after a skeleton of the buckets, the rest compiled in the "
                             "background, or not (EngineConfig's option; unset: its auto rule)")
    parser.add_argument("--quick-skeleton", action=argparse.BooleanOptionalAction,
                        help="compile the skeleton without autotuning and autotune it in the "
                             "background, or not (EngineConfig's option; unset: its auto rule)")
    parser.add_argument("--speed", action="store_true",
                        help="after the ladder is complete, time decode steps at batch 1 and 64 "
                             f"and the prefill of one prompt of {PREFILL_TOKENS} tokens (or the "
                             "largest token bucket)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = [bench_case(args, case) for case in args.cases]
    print_table(rows)
    if args.out:
        import jax

        device = jax.devices()[0]
        meta = {"device": device.device_kind, "platform": device.platform,
                "jax": jax.__version__, "tiny": args.tiny, "server_ladder": args.server_ladder,
                "inline_prefill_attention": args.inline_prefill_attention,
                "compile_threads": args.compile_threads,
                "background_compile": args.background_compile,
                "xla_flags": os.environ.get("XLA_FLAGS")}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
