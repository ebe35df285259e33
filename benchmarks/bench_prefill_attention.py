"""Check the ragged paged prefill attention kernel against its plain-JAX reference on the GPU,
then time both at the Llama-3-8B attention shape (32 query heads, 8 KV heads, Dh 128, page 16).

    python3 benchmarks/bench_prefill_attention.py [--out DIR] [--budget-s SECONDS]

Checks (fp32 and bf16): a ragged batch of requests with cached prefixes of several lengths
(mid-page ends, a one-token request, padding tokens and unused page-table rows); each reports
the max |kernel - reference| and ||kernel - reference|| / ||reference||.
Timings (bf16): one request of T = 512, 2048, 8192 new tokens after 0 and 4096 cached tokens,
and 16 requests x 512 tokens after 4096 cached tokens each; the compile seconds of the kernel's
executable, milliseconds per call (median of wall times around ``block_until_ready``) of the
kernel and of the reference, and the kernel's causal TFLOP/s. Then other ``PrefillBlocks`` at
T = 8192. Items run in that order; once --budget-s has passed the rest are skipped, so the table
always prints. Every result is a JSON line, appended to DIR/bench_prefill_attention.jsonl.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from tokenspeed_jax.kernels.paged_prefill_attention import (
    PrefillBlocks,
    prefill_work,
    ragged_paged_prefill_attention,
    ragged_paged_prefill_attention_reference,
)

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
SCALE = HEAD_DIM ** -0.5
TIMED = {  # label: [(cached, new tokens) per request]
    "T=512 ctx=0": [(0, 512)],
    "T=2048 ctx=0": [(0, 2048)],
    "T=8192 ctx=0": [(0, 8192)],
    "T=512 ctx=4096": [(4096, 512)],
    "T=2048 ctx=4096": [(4096, 2048)],
    "T=8192 ctx=4096": [(4096, 8192)],
    "16x512 ctx=4096": [(4096, 512)] * 16,
}
VARIANT_CASES = ("T=8192 ctx=0", "T=8192 ctx=4096")
CHECKED = [(0, 300), (37, 200), (4096, 1), (1000, 333), (16, 16)]  # ragged, mid-page ends
VARIANTS = [PrefillBlocks(128, 4, 8, 2), PrefillBlocks(128, 8, 8, 2), PrefillBlocks(64, 8, 4, 3),
            PrefillBlocks(32, 4, 4, 2)]


def make_case(requests, dtype, *, pad_tokens=0, spare_rows=0, seed=0):
    """Arguments of both functions for ``requests`` (cached, new) with random pages and
    queries; the step's K/V count as already written (they are random slots of the pages)."""
    rng = np.random.default_rng(seed)
    lengths = [cached + new for cached, new in requests]
    width = max(-(-n // PAGE) for n in lengths)
    num_pages = sum(-(-n // PAGE) for n in lengths) + 1
    order = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    tables = np.zeros((len(requests) + spare_rows, width), np.int32)
    token_request, positions = [], []
    for row, (cached, new) in enumerate(requests):
        count = -(-(cached + new) // PAGE)
        tables[row, :count], order = order[:count], order[count:]
        token_request += [row] * new
        positions += range(cached, cached + new)
    token_request = np.array(token_request + [-1] * pad_tokens, np.int32)
    positions = np.array(positions + [-1] * pad_tokens, np.int32)
    key = jax.random.PRNGKey(seed)
    kq, kk, kv = jax.random.split(key, 3)
    shape = (KV_HEADS, num_pages, PAGE, HEAD_DIM)
    q = jax.random.normal(kq, (len(positions), Q_HEADS, HEAD_DIM), jnp.float32).astype(dtype)
    k_pages = jax.random.normal(kk, shape, jnp.float32).astype(dtype)
    v_pages = jax.random.normal(kv, shape, jnp.float32).astype(dtype)
    return q, k_pages, v_pages, tables, token_request, positions


def kernel_fn(q, k_pages, v_pages, tables, token_request, positions, blocks):
    work = jnp.asarray(prefill_work(token_request, positions, num_rows=tables.shape[0],
                                    block_q=blocks.block_q))
    args = (q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(positions), work)
    compiled = jax.jit(lambda *a: ragged_paged_prefill_attention(
        *a, scale=SCALE, blocks=blocks, interpret=False)).lower(*args).compile()
    return lambda: compiled(*args)


def reference_fn(q, k_pages, v_pages, tables, token_request, positions):
    args = (q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(token_request),
            jnp.asarray(positions))
    return lambda: ragged_paged_prefill_attention_reference(*args, scale=SCALE)


def wall_ms(fn, repeats=7) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def errors(out, ref) -> dict:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return {"max_abs": float(np.abs(out - ref).max()),
            "rel": float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))}


def run_and_record(measure, label: dict, out: pathlib.Path | None, log_name: str) -> dict:
    """One measurement's row: an exception becomes an error row (so the table still prints).
    The row is printed and, with ``out``, appended to ``out / log_name`` as a JSON line."""
    try:
        row = measure()
    except Exception as error:  # noqa: BLE001 - report and go on: the table must print
        row = {"item": "error", **label, "error": f"{type(error).__name__}: {error}"[:400]}
    print(json.dumps(row), flush=True)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        with (out / log_name).open("a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def run_within_budget(items, budget_s: float, out: pathlib.Path | None,
                      log_name: str) -> list[dict]:
    """The rows of ``items`` (measurements, run in order through ``run_and_record``); once
    ``budget_s`` seconds have passed, each one left is a skipped row."""
    rows, start = [], time.perf_counter()
    for item in items:
        if time.perf_counter() - start > budget_s:
            rows.append({"item": "skipped (budget)"})
            continue
        rows.append(run_and_record(item, {}, out, log_name))
    return rows


def causal_flops(requests) -> float:
    """2 dots of 2 * Dh flops per (query head, query, visible key)."""
    pairs = sum(new * cached + new * (new + 1) // 2 for cached, new in requests)
    return 4.0 * Q_HEADS * HEAD_DIM * pairs


def check(dtype) -> dict:
    case = make_case(CHECKED, dtype, pad_tokens=13, spare_rows=3, seed=1)
    out = kernel_fn(*case, PrefillBlocks())()
    row = {"item": "check", "dtype": jnp.dtype(dtype).name,
           **errors(out, reference_fn(*case)())}
    padding = case[4] < 0
    row["padding_zero"] = bool(not np.any(np.asarray(out, np.float32)[padding]))
    return row


def timing(label, requests, blocks, with_reference) -> dict:
    case = make_case(requests, jnp.bfloat16)
    start = time.perf_counter()
    kernel = kernel_fn(*case, blocks)
    row = {"item": "time", "case": label, "blocks": f"{blocks.block_q}/{blocks.pages_per_block}"
           f"/w{blocks.num_warps}/s{blocks.num_stages}",
           "compile_s": round(time.perf_counter() - start, 2)}
    row["kernel_ms"] = wall_ms(kernel)
    row["tflops"] = causal_flops(requests) / row["kernel_ms"] / 1e9
    if with_reference:
        reference = reference_fn(*case)
        row["reference_ms"] = wall_ms(reference)
        row.update(errors(kernel(), reference()))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--budget-s", type=float, default=150.0)
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    items = [lambda: check(jnp.float32), lambda: check(jnp.bfloat16)]
    items += [lambda c=c: timing(c, TIMED[c], PrefillBlocks(), True) for c in TIMED]
    items += [lambda b=b, c=c: timing(c, TIMED[c], b, False)
              for b in VARIANTS for c in VARIANT_CASES]
    rows = run_within_budget(items, args.budget_s, args.out, "bench_prefill_attention.jsonl")
    nan = float("nan")
    print(f"\n{'case':<18} {'blocks':<14} {'compile s':>9} {'kernel ms':>10} {'TFLOP/s':>8} "
          f"{'ref ms':>9} {'rel err':>9}")
    for row in rows:
        if row["item"] == "time":
            print(f"{row['case']:<18} {row['blocks']:<14} {row['compile_s']:>9.2f} "
                  f"{row['kernel_ms']:>10.3f} {row['tflops']:>8.1f} "
                  f"{row.get('reference_ms', nan):>9.3f} {row.get('rel', nan):>9.2e}")
        elif row["item"] == "check":
            print(f"check {row['dtype']}: max_abs {row['max_abs']:.2e} rel {row['rel']:.2e} "
                  f"padding zero: {row['padding_zero']}")
        else:
            print(row)


if __name__ == "__main__":
    main()
