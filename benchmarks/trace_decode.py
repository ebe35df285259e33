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
The MLA shapes of ``bench_kimi.py`` (``kimi-linear``, ``deepseek-v3``, --layers of them) run with
random bf16 weights made on the device.

Each GPU stream is also summarised as a timeline: its kernels per step, the time they keep the
stream busy against the span from the first kernel's start to the last one's end, and the
largest idle gaps with the kernels on either side (a step whose stream is busy nearly all of
its span is the sum of its kernels: only fewer or shorter kernels make it faster). With --out,
the summary JSON holds every kernel of one traced step in order (name, microseconds, gap
before it), when the stream's kernels divide evenly into the steps.

    python benchmarks/trace_decode.py --model llama8b-shape --decode-batches 1,32 --out traces/
    python benchmarks/trace_decode.py --model smollm2 --decode-batches 1 --run-ahead --out traces/
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.97 python benchmarks/trace_decode.py --model kimi-linear \
        --layers 27 --decode-batches 1 --decode-context 1024 --run-ahead --out traces/
    python benchmarks/trace_decode.py --model tiny --decode-batches 1 --dtype float32   # CPU check

Event times overlap (a parent event contains its children), so the rows of one thread do not add
up to the step; compare rows across variants instead. A trace slows the host side down.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import shutil
import tempfile
from pathlib import Path

import bench_graph
import bench_kimi
import jax
import jax.numpy as jnp

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.batch import StepBatch
from tokenspeed_jax.engine.runner import ModelRunner
from tokenspeed_jax.models.loader import random_model

GAPS_SHOWN = 12  # largest idle gaps listed per GPU stream


def read_trace(trace_file: Path) -> tuple[list[dict], dict]:
    """The trace's events and the name of each (process, thread) id pair."""
    with gzip.open(trace_file) as compressed:
        data = json.loads(compressed.read())
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name")}
    return events, names


def summarise(trace_file: Path, steps: int, top: int) -> list[dict]:
    """Per thread of the trace: microseconds per step in total and for its ``top`` events."""
    events, names = read_trace(trace_file)
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


def gpu_timelines(trace_file: Path, steps: int) -> list[dict]:
    """Per GPU stream of the trace: kernels a step, busy and span microseconds, the idle gaps
    (total, count over 2 us, the largest with their neighbours) and, when the kernels divide
    evenly into ``steps``, the middle step's kernels in order."""
    events, names = read_trace(trace_file)
    streams: dict[str, list[dict]] = collections.defaultdict(list)
    for event in events:
        process = str(names.get((event.get("pid"), None), ""))
        if event.get("ph") == "X" and process.startswith("/device:"):
            streams[f"{process} | {names.get((event['pid'], event['tid']), event['tid'])}"
                    ].append(event)
    rows = []
    for stream, kernels in streams.items():
        kernels.sort(key=lambda e: e["ts"])
        busy, end, gaps, sequence = 0.0, None, [], []
        for before, kernel in zip([None, *kernels[:-1]], kernels):
            start, stop = kernel["ts"], kernel["ts"] + kernel.get("dur", 0.0)
            gap = None if end is None else start - end
            if gap is not None and gap > 0:
                gaps.append((gap, before["name"], kernel["name"]))
            busy += max(0.0, stop - (start if end is None else max(start, end)))  # not yet counted
            end = stop if end is None else max(end, stop)
            sequence.append({"name": kernel["name"], "us": kernel.get("dur", 0.0), "gap_us": gap})
        per_step, whole = divmod(len(kernels), steps)
        gaps.sort(reverse=True)
        rows.append({
            "stream": stream, "kernels_per_step": len(kernels) / steps, "busy_us": busy,
            "span_us": end - kernels[0]["ts"], "gap_us": sum(gap for gap, _, _ in gaps),
            "gaps_over_2us": sum(gap > 2 for gap, _, _ in gaps),
            "largest_gaps": [{"us": gap, "after": after, "before": following}
                             for gap, after, following in gaps[:GAPS_SHOWN]],
            "one_step": (sequence[per_step * (steps // 2):per_step * (steps // 2 + 1)]
                         if per_step and not whole else None)})
    return rows


def mla_runner(shape: str, layers: int, batches: list[int], context: int) -> ModelRunner:
    """A runner with only the decode graph of ``bench_kimi.py``'s ``shape`` with ``layers``
    layers of random bf16 weights, compiled for ``batches`` at ``context`` tokens."""
    model = random_model(bench_kimi.SHAPES[shape](layers), dtype=jnp.bfloat16, seed=0)
    top, pages = max(batches), bench_graph.context_pages(context)
    config = EngineConfig(
        prefill_graph_max_tokens=0, decode_graph_capture_batch_sizes=tuple(batches),
        decode_graph_max_bs=top, max_model_len=pages * bench_graph.PAGE_SIZE,
        background_compile=False, compile_cache=False)
    runner = ModelRunner(model, config, num_pages=top * pages + 1, num_state_slots=top,
                         page_size=bench_graph.PAGE_SIZE)
    print(runner.compile_all().table())
    return runner


def synchronous_steps(runner, requests: list, steps: int) -> None:
    for _ in range(steps):
        runner.step(StepBatch(requests))


def trace_steps(runner, requests: list, steps: int, out: Path | None,
                run_ahead: bool) -> tuple[list[dict], list[dict]]:
    """(``summarise``'s rows, ``gpu_timelines``' rows) of ``steps`` traced decode steps of
    ``requests``."""
    batch = len(requests)
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
        return summarise(trace_file, steps, top=12), gpu_timelines(trace_file, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted({*bench_graph.SHAPES, *bench_kimi.SHAPES}),
                        default="smollm2")
    parser.add_argument("--layers", type=int, default=27,
                        help="layers of an MLA shape (kimi-linear, deepseek-v3)")
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
    if args.model in bench_kimi.SHAPES:
        runner = mla_runner(args.model, args.layers, batches, args.decode_context)
    else:
        model = bench_graph.load_model(args.model, args.dtype, random_weights=True)
        runner = bench_graph.decode_runner(model, batches, args.decode_context,
                                           None if args.op_route else bench_graph.DEFAULT_FUSED)
    report = {}
    for batch in batches:
        requests = bench_graph.decode_requests(batch, args.decode_context)
        if args.model in bench_kimi.SHAPES:  # a state row per request (KDA layers)
            requests = [dataclasses.replace(r, state_slot=row) for row, r in enumerate(requests)]
        rows, timelines = trace_steps(runner, requests, args.steps, args.out, args.run_ahead)
        report[batch] = {"threads": rows, "gpu_streams": timelines}
        print(f"\n{args.model} decode batch {batch}, context {args.decode_context}"
              f"{', run ahead' if args.run_ahead else ''} "
              f"({jax.devices()[0].device_kind}, jax {jax.__version__}): us per step")
        for row in sorted(rows, key=lambda r: -r["us_per_step"]):
            print(f"-- {row['thread']}: {row['us_per_step']:.0f} us, "
                  f"{row['events_per_step']:.0f} events")
            for event in row["top"]:
                print(f"   {event['us_per_step']:9.1f} us {event['calls_per_step']:6.1f}x  "
                      f"{event['name'][:90]}")
        for stream in timelines:
            print(f"-- timeline of {stream['stream']}: {stream['kernels_per_step']:.0f} kernels "
                  f"a step, busy {stream['busy_us']:.0f} of {stream['span_us']:.0f} us, "
                  f"{stream['gaps_over_2us']} gaps over 2 us; largest: " + ", ".join(
                      f"{gap['us']:.1f} us after {gap['after'][:40]}"
                      for gap in stream["largest_gaps"][:4]))
    if runner.stats()["runtime_compiles"]:
        raise RuntimeError(f"the decode step compiled while serving: {runner.stats()}")
    if args.out:
        (args.out / "decode_trace_summary.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
