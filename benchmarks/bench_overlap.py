"""Decode step time of the serving engine with and without the overlap schedule, side by side.

    python benchmarks/bench_overlap.py [--models smollm2 llama8b-shape] [--batches 1 32]
                                    [--tokens 128] [--repeats 3] [--out FILE]
    python benchmarks/bench_overlap.py --tiny      # CPU smoke test: the tiny shape, float32

For each model shape a random checkpoint (``random_checkpoint.py``, bf16; float32 with --tiny,
the tokenizer of ``tests/golden/tiny_llama``) is written once into a temporary directory and
loaded by ``LLM`` with few buckets: the decode batches asked for, one prefill bucket. Then, per
batch size, ``batch`` prompts of 32 random tokens generate greedily with ``ignore_eos`` through
``LLM.generate`` (the engine loop a server runs), alternating the engine's ``overlap_schedule``
("off", "on", "auto"), ``--repeats`` times each. A decode step's time is
(time for ``--tokens`` tokens - time for 1 token) / (``--tokens`` - 1): the prefill cancels
out. The table gives the median per setting, off / on, and how many steps ran ahead; "auto"
runs ahead only while its synchronous probe steps find the device busy after their launch
(``engine.device_bound``, printed as measured at the end).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from random_checkpoint import write_shape_checkpoint

from tokenspeed_jax import LLM, SamplingParams

TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "tests" / "golden" / "tiny_llama"
PROMPT_TOKENS = 32


def build(shape_name: str, batches: list[int], tokens: int, dtype: str, work: Path) -> LLM:
    model_dir = work / shape_name
    write_shape_checkpoint(model_dir, shape_name, TOKENIZER_DIR, dtype=dtype)
    max_batch = max(batches)
    return LLM(str(model_dir), dtype=dtype, prefill_graph_capture_token_sizes=(256,),
               prefill_graph_max_tokens=256, chunked_prefill_size=256,
               prefill_graph_capture_batch_sizes=(max_batch,), max_num_seqs=max_batch,
               decode_graph_capture_batch_sizes=tuple(batches), max_model_len=512,
               num_pages=max_batch * (PROMPT_TOKENS + tokens) // 16 + 2 * max_batch,
               compile_progress=False, enable_prefix_caching=False,
               background_compile=False)


def generate_seconds(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    assert all(len(o.token_ids) == tokens for o in outs)
    return seconds


SETTINGS = ("off", "on", "auto")


def step_ms(llm: LLM, prompts: list[list[int]], tokens: int, overlap: str) -> float:
    llm.engine.overlap_schedule = overlap
    whole = generate_seconds(llm, prompts, tokens)
    first = generate_seconds(llm, prompts, 1)
    return 1e3 * (whole - first) / (tokens - 1)


def bench_model(name: str, args: argparse.Namespace, work: Path) -> list[dict]:
    dtype = "float32" if args.tiny else "bfloat16"
    llm = build("tiny" if args.tiny else name, args.batches, args.tokens, dtype, work)
    rng = np.random.default_rng(0)
    rows = []
    for batch in args.batches:
        prompts = rng.integers(3, 300, (batch, PROMPT_TOKENS)).tolist()
        step_ms(llm, prompts, args.tokens, "on")  # warm-up: the settings share executables
        times = {setting: [] for setting in SETTINGS}
        ahead = dict.fromkeys(SETTINGS, 0)
        for _ in range(args.repeats):
            for setting in SETTINGS:
                before = llm.engine.stats()["num_overlapped_steps"]
                times[setting].append(step_ms(llm, prompts, args.tokens, setting))
                ahead[setting] += llm.engine.stats()["num_overlapped_steps"] - before
        median = {setting: statistics.median(times[setting]) for setting in SETTINGS}
        rows.append({"model": name, "batch": batch, **{f"{s}_ms": median[s] for s in SETTINGS},
                     "speedup": median["off"] / median["on"],
                     **{f"{s}_steps_ahead": ahead[s] for s in SETTINGS},
                     "auto_device_bound": llm.engine.device_bound,
                     "runtime_compiles": llm.stats()["runtime_compiles"]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", "llama8b-shape"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="the tiny shape in float32 (CPU)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.tokens < 2:
        parser.error("--tokens must be >= 2")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-overlap-") as work:
        for name in (["tiny"] if args.tiny else args.models):
            rows += bench_model(name, args, Path(work))
    print(f"\n{'model':<15} {'batch':>5} {'off ms':>8} {'on ms':>8} {'auto ms':>8} "
          f"{'off / on':>8} {'ahead on/auto':>13} {'auto: device-bound':>18}")
    for row in rows:
        print(f"{row['model']:<15} {row['batch']:>5} {row['off_ms']:>8.3f} {row['on_ms']:>8.3f} "
              f"{row['auto_ms']:>8.3f} {row['speedup']:>8.2f} "
              f"{row['on_steps_ahead']:>6}/{row['auto_steps_ahead']:<6} "
              f"{row['auto_device_bound']!s:>18}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
