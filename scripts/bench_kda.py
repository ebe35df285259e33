"""Check the KDA Pallas kernels against the pure-JAX reference on the GPU, then time them beside
fla's Triton kernels (`chunk_kda`, `fused_recurrent_kda`) at H=32, K=V=128, bf16.

    python3 scripts/bench_kda.py [--out DIR] [--skip-fla]

Checks (fp32 and bf16): ragged packed prefill with GVA, states from a pool, a padded request and
a checkpoint; the recurrent kernel; decode with the fused gate and L2 norm. Each reports
||out - ref|| / ||ref|| against the fp32 reference on the same (upcast) inputs.
Timings: prefill at T = 2048, 8192, 32768 (one sequence) and 16 x 1024 packed; decode at batch
1, 64, 256. Our decode runs many steps inside one compiled program (as in the engine), so it pays
no per-call dispatch; fla's numbers are `triton.testing.do_bench` medians of its Python call.
Every result is printed as a JSON line and appended to DIR/bench_kda.jsonl as it comes.
"""

from __future__ import annotations

import argparse
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
DECODE_BATCHES = (1, 64, 256)


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


def random_inputs(key, num_tokens, heads, value_heads, dtype):
    kq, kk, kv, kg, kb = jax.random.split(key, 5)
    q = jax.random.normal(kq, (num_tokens, heads, K), jnp.float32)
    k = kda_ref.l2_normalize(jax.random.normal(kk, (num_tokens, heads, K), jnp.float32))
    v = jax.random.normal(kv, (num_tokens, value_heads, V), jnp.float32)
    g = -jax.nn.softplus(jax.random.normal(kg, (num_tokens, value_heads, K)) - 1.0)
    g = jnp.where(jax.random.uniform(kg, g.shape) < 0.02, -100.0, g)  # strong decay, must not overflow
    beta = jax.nn.sigmoid(jax.random.normal(kb, (num_tokens, value_heads)))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta.astype(dtype)


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(x)):
        return float("nan")
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def check(log: Log):
    lengths = [1, 63, 64, 65, 1000, 300]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    slots = np.array([5, 0, 3, 1, 2, -1], np.int32)
    heads, value_heads = 4, 8
    for dtype, tol in ((jnp.float32, 2e-3), (jnp.bfloat16, 3e-2)):
        name = jnp.dtype(dtype).name
        inputs = random_inputs(jax.random.key(0), int(cu[-1]) + 17, heads, value_heads, dtype)
        f32_inputs = [x.astype(jnp.float32) for x in inputs]
        pool = jax.random.normal(jax.random.key(1), (8, value_heads, K, V), jnp.float32)
        init = jnp.where((slots >= 0)[:, None, None, None], pool[np.maximum(slots, 0)], 0.0)
        o_ref, s_ref = kda_ref.chunk_kda_reference(
            *[x[None] for x in f32_inputs], initial_state=init, output_final_state=True,
            cu_seqlens=cu)
        o_ref = o_ref[0]
        real = slots >= 0
        ckpt_req = 4  # the 1000-token request checkpoints after 512 tokens into slot 7
        lo = int(cu[ckpt_req])
        _, s_ckpt = kda_ref.chunk_kda_reference(
            *[x[None, lo:lo + 512] for x in f32_inputs], initial_state=init[ckpt_req][None],
            output_final_state=True)
        offsets = np.where(np.arange(len(lengths)) == ckpt_req, 512, 0).astype(np.int32)
        ckpt_slots = np.where(np.arange(len(lengths)) == ckpt_req, 7, -1).astype(np.int32)
        for kernel in ("chunk", "recurrent"):
            try:
                if kernel == "chunk":
                    o, new_pool = kda.chunk_kda_prefill(
                        *inputs, jnp.array(pool), jnp.asarray(slots), jnp.asarray(cu),
                        jnp.asarray(offsets), jnp.asarray(ckpt_slots))
                else:
                    o, new_pool = kda.fused_recurrent_kda_pool(
                        *inputs, jnp.array(pool), jnp.asarray(slots), jnp.asarray(cu))
                new_pool = np.asarray(new_pool)
                row = dict(
                    check=f"prefill_{kernel}", dtype=name,
                    o=rel_err(o[: cu[-1]], o_ref[: cu[-1]]),
                    state=rel_err(new_pool[slots[real]], s_ref[real]),
                    padded_untouched=bool(np.array_equal(new_pool[[4, 6]], np.asarray(pool)[[4, 6]])),
                )
                if kernel == "chunk":
                    row["checkpoint"] = rel_err(new_pool[7], s_ckpt[0])
                errs = [row["o"], row["state"], row.get("checkpoint", 0.0)]
                row["ok"] = bool(all(e < tol for e in errs) and row["padded_untouched"])
                log(**row)
            except Exception:  # one failing kernel must not hide the others' results
                log(check=f"prefill_{kernel}", dtype=name, error=traceback.format_exc()[-2000:])
        try:
            n = 64
            q, k, v, g_raw, beta = random_inputs(jax.random.key(2), n, heads, value_heads, dtype)
            a_log = jax.random.normal(jax.random.key(3), (value_heads,)) * 0.5
            dt_bias = jax.random.normal(jax.random.key(4), (value_heads * K,))
            dec_slots = jnp.arange(n, dtype=jnp.int32).at[3].set(-1)
            dec_pool = jax.random.normal(jax.random.key(5), (n, value_heads, K, V), jnp.float32)
            init = jnp.where((dec_slots >= 0)[:, None, None, None], dec_pool, 0.0)
            o_ref, s_ref = kda_ref.recurrent_kda_reference(
                *[x.astype(jnp.float32)[:, None] for x in (q * 3, k * 3, v, g_raw, beta)],
                initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
                use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias)
            o, new_pool = kda_decode.kda_decode(
                q * 3, k * 3, v, g_raw, beta, jnp.array(dec_pool), dec_slots, a_log, dt_bias,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True)
            keep = np.asarray(dec_slots) >= 0
            row = dict(check="decode_gate_l2norm", dtype=name, o=rel_err(o, o_ref[:, 0]),
                       state=rel_err(np.asarray(new_pool)[keep], s_ref[keep]),
                       padded_untouched=bool(np.array_equal(new_pool[3], dec_pool[3])))
            row["ok"] = bool(row["o"] < tol and row["state"] < tol and row["padded_untouched"])
            log(**row)
        except Exception:
            log(check="decode_gate_l2norm", dtype=name, error=traceback.format_exc()[-2000:])


def wall_ms(fn, repeats=5):
    """Median over `repeats` of fn()'s wall time in ms; fn blocks on its own result."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def bench_ours(log: Log):
    for case, lengths in PREFILL_CASES.items():
        try:
            cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
            inputs = random_inputs(jax.random.key(6), int(cu[-1]), H, H, jnp.bfloat16)
            n = len(lengths)
            state = {"pool": jnp.zeros((n, H, K, V), jnp.float32)}
            slots = jnp.arange(n, dtype=jnp.int32)
            calls = 10

            def run():
                for _ in range(calls):
                    o, state["pool"] = kda.chunk_kda_prefill(
                        *inputs, state["pool"], slots, cu, use_qk_l2norm_in_kernel=True)
                o.block_until_ready()

            ms = wall_ms(run) / calls
            log(bench="prefill", case=case, impl="pallas", ms=ms)
        except Exception:
            log(bench="prefill", case=case, impl="pallas", error=traceback.format_exc()[-2000:])
    for batch in DECODE_BATCHES:
        try:
            q, k, v, g, beta = random_inputs(jax.random.key(7), batch, H, H, jnp.bfloat16)
            slots = jnp.arange(batch, dtype=jnp.int32)
            steps = 200

            @jax.jit
            def many_steps(pool):
                def step(_, pool):
                    return kda_decode.kda_decode(q, k, v, g, beta, pool, slots,
                                                 use_qk_l2norm_in_kernel=True)[1]

                return jax.lax.fori_loop(0, steps, step, pool)

            pool = jnp.zeros((batch, H, K, V), jnp.float32)
            us = wall_ms(lambda: many_steps(pool).block_until_ready()) / steps * 1e3
            log(bench="decode", case=f"batch={batch}", impl="pallas", us=us)
        except Exception:
            log(bench="decode", case=f"batch={batch}", impl="pallas",
                error=traceback.format_exc()[-2000:])


def bench_fla(log: Log):
    import torch
    import triton
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    dev = "cuda"
    for case, lengths in PREFILL_CASES.items():
        try:
            n, total = len(lengths), sum(lengths)
            cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.long, device=dev)
            q = torch.randn(1, total, H, K, device=dev, dtype=torch.bfloat16)
            k = torch.randn(1, total, H, K, device=dev, dtype=torch.bfloat16)
            v = torch.randn(1, total, H, V, device=dev, dtype=torch.bfloat16)
            g = -torch.nn.functional.softplus(torch.randn(1, total, H, K, device=dev) - 1.0)
            beta = torch.rand(1, total, H, device=dev, dtype=torch.bfloat16)
            h0 = torch.zeros(n, H, K, V, device=dev)
            ms = triton.testing.do_bench(
                lambda: chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, cu_seqlens=cu),
                return_mode="median")
            log(bench="prefill", case=case, impl="fla", ms=float(ms))
        except Exception:
            log(bench="prefill", case=case, impl="fla", error=traceback.format_exc()[-2000:])
    for batch in DECODE_BATCHES:
        try:
            q = torch.randn(batch, 1, H, K, device=dev, dtype=torch.bfloat16)
            k = torch.randn(batch, 1, H, K, device=dev, dtype=torch.bfloat16)
            v = torch.randn(batch, 1, H, V, device=dev, dtype=torch.bfloat16)
            g = -torch.nn.functional.softplus(torch.randn(batch, 1, H, K, device=dev))
            beta = torch.rand(batch, 1, H, device=dev, dtype=torch.bfloat16)
            h0 = torch.zeros(batch, H, K, V, device=dev)
            ms = triton.testing.do_bench(
                lambda: fused_recurrent_kda(q, k, v, g, beta, initial_state=h0,
                                            output_final_state=True,
                                            use_qk_l2norm_in_kernel=True),
                return_mode="median")
            log(bench="decode", case=f"batch={batch}", impl="fla", us=float(ms) * 1e3)
        except Exception:
            log(bench="decode", case=f"batch={batch}", impl="fla",
                error=traceback.format_exc()[-2000:])


def summary(log: Log) -> str:
    lines = ["| kind | case | ours | fla | fla / ours |", "|---|---|---|---|---|"]
    for kind, unit in (("prefill", "ms"), ("decode", "us")):
        cases = dict.fromkeys(r["case"] for r in log.rows if r.get("bench") == kind)
        for case in cases:
            got = {r["impl"]: r.get(unit) for r in log.rows
                   if r.get("bench") == kind and r["case"] == case}
            ours, fla = got.get("pallas"), got.get("fla")
            ratio = f"{fla / ours:.2f}x" if ours and fla else "-"
            fmt = (lambda x: "-" if x is None else f"{x:.3g} {unit}")  # noqa: E731
            lines.append(f"| {kind} | {case} | {fmt(ours)} | {fmt(fla)} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench_out"))
    parser.add_argument("--skip-fla", action="store_true")
    args = parser.parse_args()
    log = Log(args.out)
    log(device=str(jax.devices()[0]), jax=jax.__version__)
    check(log)
    bench_ours(log)
    if not args.skip_fla:
        bench_fla(log)
    table = summary(log)
    (args.out / "bench_kda.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
