"""Where a decode step's time goes: a ``jax.profiler`` trace of whole ``ModelRunner.step`` calls.

For each --decode-batches size, runs warm-up steps, then traces --steps steps and prints, per
thread of the trace (the Python thread, XLA's and PJRT's host threads, each GPU stream), the time
per step and its largest events per step: on a GPU the kernels by name (e.g. a scatter fusion or
``paged_attention``), on the host the executable call and, with command buffers, their submission
(``command_buffer::execute``) or re-recording (``command_buffer::update``). The raw trace
(``perfetto_trace.json.gz``) is copied to --out for a closer look in Perfetto. With --run-ahead
the steps run as the engine's overlap schedule runs them: each one is launched (``launch``, its
input tokens read from the previous step's token board) before the previous step's tokens are
fetched. Decode attention is the engine's default (the fused kernel on a GPU) unless --op-route.

    python benchmarks/trace_decode.py --model llama8b-shape --decode-batches 1,32 --out traces/
    python benchmarks/trace_decode.py --model smollm2 --decode-batches 1 --run-ahead --out traces/
    python benchmarks/trace_decode.py --model tiny --decode-batches 1 --dtype float32   # CPU check

Event times overlap (a parent event contains its children), so the rows of one thread do not add
up to the step; compare rows across variants instead. A trace slows the host side down.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import shutil
import tempfile
from pathlib import Path

import bench_graph
import jax

from tokenspeed_jax.engine.batch import StepBatch


def summarise(trace_file: Path, steps: int, top: int) -> list[dict]:
    """Per thread of the trace: microseconds per step in total and for its ``top`` events."""
    with gzip.open(trace_file) as compressed:
        data = json.loads(compressed.read())
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name")}
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for event in events:
        if event.get("ph") != "X":
            continue
        thread = f"{names.get((event['pid'], None), event['pid'])} | " \
                 f"{names.get((event['pid'], event['tid']), event['tid'])}"
        threads[thread][event["name"]] += event.get("dur", 0.0)
        counts[thread][event["name"]] += 1
    rows = []
    for thread, durations in threads.items():
        rows.append({"thread": thread, "us_per_step": sum(durations.values()) / steps,
                     "events_per_step": sum(counts[thread].values()) / steps,
                     "top": [{"name": name, "us_per_step": us / steps,
                              "calls_per_step": counts[thread][name] / steps}
                             for name, us in durations.most_common(top)]})
    return rows


def synchronous_steps(runner, requests: list, steps: int) -> None:
    for _ in range(steps):
        runner.step(StepBatch(requests))


def trace_steps(runner, batch: int, context: int, steps: int, out: Path | None,
                run_ahead: bool) -> list[dict]:
    requests = bench_graph.decode_requests(batch, context)
    run = bench_graph.run_ahead_steps if run_ahead else synchronous_steps
    run(runner, requests, 5)
    with tempfile.TemporaryDirectory(prefix="trace-") as directory:
        jax.profiler.start_trace(directory, create_perfetto_trace=True)
        run(runner, requests, steps)
        jax.profiler.stop_trace()
        (trace_file,) = Path(directory).glob("**/perfetto_trace.json.gz")
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            suffix = "_ahead" if run_ahead else ""
            shutil.copy(trace_file, out / f"decode_b{batch}{suffix}.json.gz")
        return summarise(trace_file, steps, top=12)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(bench_graph.SHAPES), default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--decode-batches", default="1,32")
    parser.add_argument("--decode-context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5, help="traced steps per batch size")
    parser.add_argument("--out", type=Path, help="copy each raw trace and a summary JSON here")
    parser.add_argument("--run-ahead", action="store_true",
                        help="launch each step before fetching the previous one's tokens")
    parser.add_argument("--op-route", action="store_true",
                        help="decode attention on JAX's paged-attention op instead of the fused "
                             "kernel (the default)")
    args = parser.parse_args()
    batches = [int(b) for b in args.decode_batches.split(",")]
    model = bench_graph.load_model(args.model, args.dtype, random_weights=True)
    runner = bench_graph.decode_runner(model, batches, args.decode_context,
                                       None if args.op_route else bench_graph.DEFAULT_FUSED)
    report = {}
    for batch in batches:
        rows = trace_steps(runner, batch, args.decode_context, args.steps, args.out,
                           args.run_ahead)
        report[batch] = rows
        print(f"\n{args.model} decode batch {batch}, context {args.decode_context}"
              f"{', run ahead' if args.run_ahead else ''} "
              f"({jax.devices()[0].device_kind}, jax {jax.__version__}): us per step")
        for row in sorted(rows, key=lambda r: -r["us_per_step"]):
            print(f"-- {row['thread']}: {row['us_per_step']:.0f} us, "
                  f"{row['events_per_step']:.0f} events")
            for event in row["top"]:
                print(f"   {event['us_per_step']:9.1f} us {event['calls_per_step']:6.1f}x  "
                      f"{event['name'][:90]}")
    if runner.stats()["runtime_compiles"]:
        raise RuntimeError(f"the decode step compiled while serving: {runner.stats()}")
    if args.out:
        (args.out / "decode_trace_summary.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
