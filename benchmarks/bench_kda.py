"""Check the KDA Pallas kernels against the pure-JAX reference on the GPU, then time them beside
fla's Triton kernels (`chunk_kda`, `fused_recurrent_kda`) at H=32, K=V=128, bf16.

    python3 benchmarks/bench_kda.py [--out DIR] [--skip-fla] [--budget-s SECONDS]

Checks (fp32 and bf16): ragged packed prefill with GVA, states from a pool, a padded request and
a checkpoint; the recurrent kernel; decode with the fused gate and L2 norm; the prefill and decode
again with a bf16 state pool. Each reports ||out - ref|| / ||ref|| against the fp32 reference on
the same (upcast) inputs and states.
Timings: prefill at T = 2048, 8192, 32768 (one sequence) and 16 x 1024 packed; decode at batch
1, 64, 256. Our decode runs many steps inside one compiled program (as in the engine), so it pays
no per-call dispatch; fla's numbers are `triton.testing.do_bench` medians of its Python call.
Timings use fla's benchmark gates (-softplus(x - 1), x normal); the checks and one timed variant
add 2% of gates at -100, where every 16-row block takes the exact in-block pairs. Variants of our
prefill (that one, and other ChunkConfig settings) are timed at T=8192 and T=32768 right after
the default, and the time of each stage alone (inputs to chunks, per-chunk kernel, state scan)
at T=8192; 32 x 1024 packed beside T=32768 shows what the serial state scan costs. Variants of
our decode (a bf16 state pool, a narrower block) are timed at every batch.
Items run most important first; once --budget-s has passed, the rest are logged as skipped, so a
run under a hard time limit still ends with its table. Every result is printed as a JSON line and
appended to DIR/bench_kda.jsonl as it comes.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from tokenspeed_jax.kernels import kda, kda_decode, kda_ref

H, K, V = 32, 128, 128
PREFILL_CASES = {"T=2048": [2048], "T=8192": [8192], "T=32768": [32768], "16x1024": [1024] * 16}
SCAN_CASE = {"32x1024": [1024] * 32}  # T=32768's tokens with 32 scans in parallel
DECODE_BATCHES = (1, 64, 256)
VARIANTS = {  # our prefill under other settings or inputs, timed at T=8192 and T=32768
    "pallas-strong_gates": {"strong_gates": True},
    "pallas-diagonal_rows1": {"config": kda.ChunkConfig(diagonal_rows=1)},
    "pallas-diagonal_rows16": {"config": kda.ChunkConfig(diagonal_rows=16)},
    "pallas-inverses_tf32x3_fp32": {
        "config": kda.ChunkConfig(inverse_dots="tf32x3", block_inverse_dots="fp32")},
}
VARIANT_CASES = ("T=8192", "T=32768")
DECODE_VARIANTS = {  # our decode under other settings, timed at every batch of DECODE_BATCHES
    "pallas-bf16_state": {"state_dtype": jnp.bfloat16},
    "pallas-decode_block_v16": {"config": kda_decode.RecurrentConfig(block_v=16)},
}


class Log:
    def __init__(self, out_dir: pathlib.Path):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / "bench_kda.jsonl"
        self.rows: list[dict] = []

    def __call__(self, **row):
        self.rows.append(row)
        line = json.dumps(row)
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")


def random_inputs(key, num_tokens, heads, value_heads, dtype, strong_gates=True):
    """q, k (L2-normalised), v, g, beta. The gates are fla's benchmark's, -softplus(x - 1) for
    normal x, and with ``strong_gates`` 2% of them -100 (which must not overflow)."""
    kq, kk, kv, kg, kb = jax.random.split(key, 5)
    q = jax.random.normal(kq, (num_tokens, heads, K), jnp.float32)
    k = kda_ref.l2_normalize(jax.random.normal(kk, (num_tokens, heads, K), jnp.float32))
    v = jax.random.normal(kv, (num_tokens, value_heads, V), jnp.float32)
    g = -jax.nn.softplus(jax.random.normal(kg, (num_tokens, value_heads, K)) - 1.0)
    if strong_gates:
        g = jnp.where(jax.random.uniform(kg, g.shape) < 0.02, -100.0, g)
    beta = jax.nn.sigmoid(jax.random.normal(kb, (num_tokens, value_heads)))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta.astype(dtype)


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(x)):
        return float("nan")
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


CHECK_LENGTHS = (1, 63, 64, 65, 1000, 300)
CHECK_SLOTS = np.array([5, 0, 3, 1, 2, -1], np.int32)  # the last request is padding
CHECK_HEADS, CHECK_VALUE_HEADS = 4, 8
TOLERANCE = {"float32": 2e-3, "bfloat16": 3e-2}


def check_prefill(kernel: str, dtype, config: kda.ChunkConfig | None = None,
                  state_dtype=jnp.float32) -> dict:
    """Ragged GVA prefill from a pool (of ``state_dtype``), with a padded request and (chunk
    kernel) a checkpoint."""
    slots, real = CHECK_SLOTS, CHECK_SLOTS >= 0
    cu = np.concatenate([[0], np.cumsum(CHECK_LENGTHS)]).astype(np.int32)
    inputs = random_inputs(jax.random.key(0), int(cu[-1]) + 17, CHECK_HEADS, CHECK_VALUE_HEADS,
                           dtype)
    f32_inputs = [x.astype(jnp.float32) for x in inputs]
    pool = jax.random.normal(jax.random.key(1), (8, CHECK_VALUE_HEADS, V, K), state_dtype)
    init = jnp.where(real[:, None, None, None], pool[np.maximum(slots, 0)], 0.0)
    init = kda_ref.pool_layout(init.astype(jnp.float32))
    o_ref, s_ref = kda_ref.chunk_kda_reference(
        *[x[None] for x in f32_inputs], initial_state=init, output_final_state=True,
        cu_seqlens=cu)
    requests = np.arange(len(CHECK_LENGTHS))
    ckpt_req = 4  # the 1000-token request checkpoints after 512 tokens into slot 7
    offsets = np.where(requests == ckpt_req, 512, 0).astype(np.int32)
    ckpt_slots = np.where(requests == ckpt_req, 7, -1).astype(np.int32)
    if kernel == "chunk":
        o, new_pool = kda.chunk_kda_prefill(
            *inputs, jnp.array(pool), jnp.asarray(slots), jnp.asarray(cu), jnp.asarray(offsets),
            jnp.asarray(ckpt_slots), config=config or kda.ChunkConfig())
    else:
        o, new_pool = kda.fused_recurrent_kda_pool(
            *inputs, jnp.array(pool), jnp.asarray(slots), jnp.asarray(cu))
    new_pool = np.asarray(new_pool)
    row = {
        "o": rel_err(o[: cu[-1]], o_ref[0, : cu[-1]]),
        "state": rel_err(new_pool[slots[real]], kda_ref.pool_layout(s_ref[real])),
        "padded_untouched": bool(np.array_equal(new_pool[[4, 6]], np.asarray(pool)[[4, 6]])),
    }
    if kernel == "chunk":
        lo = int(cu[ckpt_req])
        _, s_ckpt = kda_ref.chunk_kda_reference(
            *[x[None, lo:lo + 512] for x in f32_inputs], initial_state=init[ckpt_req][None],
            output_final_state=True)
        row["checkpoint"] = rel_err(new_pool[7], kda_ref.pool_layout(s_ckpt[0]))
    errors = [row["o"], row["state"], row.get("checkpoint", 0.0)]
    row["ok"] = bool(all(e < TOLERANCE[jnp.dtype(dtype).name] for e in errors)
                     and row["padded_untouched"])
    return row


def check_decode(dtype, state_dtype=jnp.float32) -> dict:
    """Decode with the fused gate and L2 norm, 64 requests, one of them padding, from a pool of
    ``state_dtype``."""
    n, value_heads = 64, CHECK_VALUE_HEADS
    q, k, v, g_raw, beta = random_inputs(jax.random.key(2), n, CHECK_HEADS, value_heads, dtype)
    q, k = q * 3, k * 3
    a_log = jax.random.normal(jax.random.key(3), (value_heads,)) * 0.5
    dt_bias = jax.random.normal(jax.random.key(4), (value_heads * K,))
    slots = jnp.arange(n, dtype=jnp.int32).at[3].set(-1)
    pool = jax.random.normal(jax.random.key(5), (n, value_heads, V, K), state_dtype)
    init = jnp.where((slots >= 0)[:, None, None, None], pool, 0.0).astype(jnp.float32)
    init = kda_ref.pool_layout(init)
    o_ref, s_ref = kda_ref.recurrent_kda_reference(
        *[x.astype(jnp.float32)[:, None] for x in (q, k, v, g_raw, beta)],
        initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias)
    o, new_pool = kda_decode.kda_decode(
        q, k, v, g_raw, beta, jnp.array(pool), slots, a_log, dt_bias,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
    keep = np.asarray(slots) >= 0
    row = {"o": rel_err(o, o_ref[:, 0]),
           "state": rel_err(np.asarray(new_pool)[keep], kda_ref.pool_layout(s_ref[keep])),
           "padded_untouched": bool(np.array_equal(new_pool[3], pool[3]))}
    tol = TOLERANCE[jnp.dtype(dtype).name]
    row["ok"] = bool(row["o"] < tol and row["state"] < tol and row["padded_untouched"])
    return row


def checks(kernels, dtypes, state_dtype=jnp.float32):
    """(labels, measure) items checking `kernels` in each of `dtypes`, states in a pool of
    ``state_dtype``."""
    items = []
    suffix = "" if state_dtype == jnp.float32 else f" {jnp.dtype(state_dtype).name}_state"
    for dtype in dtypes:
        name = jnp.dtype(dtype).name
        for kernel in kernels:
            if kernel == "decode":
                items.append(({"check": "decode_gate_l2norm" + suffix, "dtype": name},
                              functools.partial(check_decode, dtype, state_dtype)))
            else:
                items.append(({"check": f"prefill_{kernel}" + suffix, "dtype": name},
                              functools.partial(check_prefill, kernel, dtype,
                                                state_dtype=state_dtype)))
    return items


def wall_ms(fn, repeats=5):
    """Median over `repeats` of fn()'s wall time in ms; fn blocks on its own result."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def guarded(log: Log, measure, **labels):
    """Logs measure()'s fields, or its traceback: one failing case must not hide the others."""
    try:
        log(**labels, **measure())
    except Exception:  # noqa: BLE001
        log(**labels, error=traceback.format_exc()[-2000:])


def prefill_ours(lengths, config: kda.ChunkConfig | None = None, strong_gates=False, calls=5):
    """ms per call, on fla's benchmark gates unless ``strong_gates``."""
    config = config or kda.ChunkConfig()
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    inputs = random_inputs(jax.random.key(6), int(cu[-1]), H, H, jnp.bfloat16, strong_gates)
    slots = jnp.arange(len(lengths), dtype=jnp.int32)
    state = {"pool": jnp.zeros((len(lengths), H, V, K), jnp.float32)}

    def run():
        for _ in range(calls):
            o, state["pool"] = kda.chunk_kda_prefill(
                *inputs, state["pool"], slots, cu, use_qk_l2norm_in_kernel=True, config=config)
        o.block_until_ready()

    return {"ms": wall_ms(run, repeats=3) / calls}


def prefill_stages(lengths, calls=10):
    """ms of each stage of our prefill alone: inputs to chunks, per-chunk kernel, state scan."""
    config = kda.ChunkConfig()
    num_tokens, num_requests = sum(lengths), len(lengths)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    q, k, v, g, beta = random_inputs(jax.random.key(6), num_tokens, H, H, jnp.bfloat16,
                                     strong_gates=False)
    num_chunks = -(-num_tokens // kda_ref.CHUNK_SIZE) + num_requests

    @jax.jit
    def to_chunks(q, k, v, g, beta):
        token_of_row, first_chunk = kda._chunk_layout(cu, num_tokens, num_chunks)
        return [q, k, v, g, kda._to_chunks(beta, token_of_row), token_of_row], first_chunk

    intra = jax.jit(functools.partial(kda.intra_stage, group=1, scale=K**-0.5, normalize_qk=True,
                                      config=config, interpret=False))
    scan = jax.jit(functools.partial(kda.scan_stage, num_tokens=num_tokens,
                                     out_dtype=jnp.bfloat16, config=config,
                                     interpret=False))
    chunks, first_chunk = to_chunks(q, k, v, g, beta)
    intra_out = intra(*chunks, first_chunk[-1])
    slots = jnp.arange(num_requests, dtype=jnp.int32)
    table = kda._request_table(cu, first_chunk, slots, None, None)
    pool = jnp.zeros((num_requests, H, V, K), jnp.float32)
    stages = {"chunks": lambda: to_chunks(q, k, v, g, beta),
              "intra": lambda: intra(*chunks, first_chunk[-1]),
              "scan": lambda: scan(table, *intra_out, pool)}

    def repeated(stage):
        def run():
            for _ in range(calls):
                out = stage()
            jax.block_until_ready(out)
        return run

    return {f"{name}_ms": wall_ms(repeated(stage), repeats=3) / calls
            for name, stage in stages.items()}


def decode_ours(batch, config: kda_decode.RecurrentConfig | None = None,
                state_dtype=jnp.float32, steps=100):
    config = config or kda_decode.RecurrentConfig()
    q, k, v, g, beta = random_inputs(jax.random.key(7), batch, H, H, jnp.bfloat16,
                                     strong_gates=False)
    slots = jnp.arange(batch, dtype=jnp.int32)

    @jax.jit
    def many_steps(pool):
        def step(_, pool):
            return kda_decode.kda_decode(q, k, v, g, beta, pool, slots,
                                         use_qk_l2norm_in_kernel=True, config=config)[1]

        return jax.lax.fori_loop(0, steps, step, pool)

    pool = jnp.zeros((batch, H, V, K), state_dtype)
    return {"us": wall_ms(lambda: many_steps(pool).block_until_ready(), repeats=3) / steps * 1e3}


def prefill_fla(lengths):
    import torch
    import triton
    from fla.ops.kda import chunk_kda

    n, total = len(lengths), sum(lengths)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.long, device="cuda")
    q, k, v = (torch.randn(1, total, H, K, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    g = -torch.nn.functional.softplus(torch.randn(1, total, H, K, device="cuda") - 1.0)
    beta = torch.rand(1, total, H, device="cuda", dtype=torch.bfloat16)
    h0 = torch.zeros(n, H, K, V, device="cuda")
    ms = triton.testing.do_bench(
        lambda: chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu),
        return_mode="median")
    return {"ms": float(ms)}


def decode_fla(batch):
    import torch
    import triton
    from fla.ops.kda import fused_recurrent_kda

    q, k, v = (torch.randn(batch, 1, H, K, device="cuda", dtype=torch.bfloat16) for _ in "qkv")
    g = -torch.nn.functional.softplus(torch.randn(batch, 1, H, K, device="cuda"))
    beta = torch.rand(batch, 1, H, device="cuda", dtype=torch.bfloat16)
    h0 = torch.zeros(batch, H, K, V, device="cuda")
    ms = triton.testing.do_bench(
        lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True),
        return_mode="median")
    return {"us": float(ms) * 1e3}


def timings(impl: str, prefill, decode, prefill_cases, decode_batches):
    """(labels, measure) items timing one implementation."""
    items = [({"bench": "prefill", "case": case, "impl": impl},
              functools.partial(prefill, {**PREFILL_CASES, **SCAN_CASE}[case]))
             for case in prefill_cases]
    items += [({"bench": "decode", "case": f"batch={batch}", "impl": impl},
               functools.partial(decode, batch)) for batch in decode_batches]
    return items


def plan(with_fla: bool):
    """Every item, most important first. Compiles dominate a run (minutes for the fp32 prefill),
    so the fp32 checks come after the bf16 timings."""
    items = checks(["chunk"], [jnp.bfloat16])
    items += timings("pallas", prefill_ours, decode_ours, PREFILL_CASES, ())
    for impl, settings in VARIANTS.items():
        if "config" in settings:
            items.append(({"check": f"prefill_chunk {impl}", "dtype": "bfloat16"},
                          functools.partial(check_prefill, "chunk", jnp.bfloat16,
                                            settings["config"])))
        items += timings(impl, functools.partial(prefill_ours, **settings), None,
                         VARIANT_CASES, ())
    if with_fla:
        items += timings("fla", prefill_fla, decode_fla, PREFILL_CASES, DECODE_BATCHES)
    items += timings("pallas", prefill_ours, decode_ours, (), DECODE_BATCHES)
    items.append(({"bench": "stages", "case": "T=8192", "impl": "pallas"},
                  functools.partial(prefill_stages, PREFILL_CASES["T=8192"])))
    items += checks(["chunk", "decode"], [jnp.bfloat16], state_dtype=jnp.bfloat16)
    for impl, settings in DECODE_VARIANTS.items():
        items += timings(impl, None, functools.partial(decode_ours, **settings), (),
                         DECODE_BATCHES)
    items += timings("pallas", prefill_ours, None, SCAN_CASE, ())
    items += checks(["chunk"], [jnp.float32])
    items += checks(["recurrent", "decode"], [jnp.bfloat16, jnp.float32])
    return items


def run_plan(log: Log, items, budget_s: float):
    start = time.perf_counter()
    for labels, measure in items:
        if time.perf_counter() - start > budget_s:
            log(**labels, skipped=f"past the {budget_s:.0f} s budget")
        else:
            guarded(log, measure, **labels)


def summary(log: Log) -> str:
    checked = [r for r in log.rows if "check" in r]
    lines = ["| check | dtype | errors | ok |", "|---|---|---|---|"]
    for r in checked:
        errors = " / ".join(f"{key} {r[key]:.2g}" for key in ("o", "state", "checkpoint")
                            if isinstance(r.get(key), float))
        lines.append(f"| {r['check']} | {r['dtype']} | {errors or '-'} | "
                     f"{r.get('ok', 'error' if 'error' in r else 'skipped')} |")
    impls = list(dict.fromkeys(r["impl"] for r in log.rows if "impl" in r))
    lines += ["", "| kind | case | " + " | ".join(impls) + " | fla / pallas |",
              "|---|---|" + "---|" * (len(impls) + 1)]
    for kind, unit in (("prefill", "ms"), ("decode", "us")):
        cases = dict.fromkeys(r["case"] for r in log.rows if r.get("bench") == kind)
        for case in cases:
            got = {r["impl"]: r.get(unit) for r in log.rows
                   if r.get("bench") == kind and r["case"] == case}
            ours, fla = got.get("pallas"), got.get("fla")
            ratio = f"{fla / ours:.2f}x" if ours and fla else "-"
            shown = ["-" if got.get(i) is None else f"{got[i]:.3g} {unit}" for i in impls]
            lines.append(f"| {kind} | {case} | " + " | ".join(shown) + f" | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out"))
    parser.add_argument("--skip-fla", action="store_true")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no item after this many seconds")
    args = parser.parse_args()
    log = Log(args.out)
    log(device=str(jax.devices()[0]), jax=jax.__version__)
    run_plan(log, plan(with_fla=not args.skip_fla), args.budget_s)
    table = summary(log)
    (args.out / "bench_kda.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
