"""Benchmark a random-weight Kimi-Linear-48B-A3B-shaped model on the KimiRunner routes.

Measures prefill throughput of the inline-KDA segmented route, the ordinary route (KDA at a
break) and eager execution, and the decode step time per batch size, one step at a time and run
ahead as the engine's overlap schedule runs them (``bench_graph.run_ahead_steps``); prints a
markdown table for docs/benchmarks.md. The shape is Kimi-Linear-48B-A3B's (hidden 2304, 32 KDA heads of 128, MLA with
kv_lora_rank 512, 256 experts of 1024, 8 per token, 1 shared) with ``--layers`` layers in its
3 KDA : 1 MLA pattern (the full 27 layers need about 100 GB of bf16 weights).

    python benchmarks/bench_kimi.py --layers 8 --prefill-tokens 2048 --decode-batches 1 32 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_graph import run_ahead_steps
from flax import nnx

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.batch import StepRequest
from tokenspeed_jax.engine.kimi_runner import KimiRunner
from tokenspeed_jax.models.kimi_linear import KDA, MLA, KimiLinearConfig, KimiLinearForCausalLM
from tokenspeed_jax.sampling_params import SamplingParams

PAGE_SIZE = 16


def model_config(layers: int) -> KimiLinearConfig:
    types = tuple(MLA if (i + 1) % 4 == 0 or i == layers - 1 else KDA for i in range(layers))
    return KimiLinearConfig(
        vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
        num_hidden_layers=layers, num_attention_heads=32, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, layer_types=types,
        linear_num_heads=32, linear_head_dim=128, conv_kernel_size=4, first_k_dense_replace=1,
        num_experts=256, num_experts_per_token=8, num_shared_experts=1, num_expert_group=1,
        topk_group=1, routed_scaling_factor=2.446)


def requests(count: int, length: int, start: int, pages_each: int) -> list[StepRequest]:
    rng = np.random.default_rng(0)
    return [
        StepRequest(f"r{i}", rng.integers(0, 163840, length).astype(np.int32), start,
                        np.arange(i * pages_each, (i + 1) * pages_each, dtype=np.int32), True,
                        SamplingParams(temperature=0.0), state_slot=i)
        for i in range(count)
    ]


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` (each call returns host numpy, so it is synchronised)."""
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--prefill-requests", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--context", type=int, default=1024, help="decode context length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-eager", action="store_true")
    args = parser.parse_args()

    config = model_config(args.layers)
    t0 = time.perf_counter()
    model = KimiLinearForCausalLM(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                  rngs=nnx.Rngs(0))
    jax.block_until_ready(nnx.state(model))
    print(f"init {time.perf_counter() - t0:.1f}s on {jax.devices()[0].device_kind}")
    max_len = max(args.prefill_tokens, args.context + 8)
    pages_each = -(-max_len // PAGE_SIZE)
    max_requests = max(max(args.prefill_requests), max(args.decode_batches))
    engine = EngineConfig(
        prefill_graph_capture_token_sizes=(args.prefill_tokens,),
        prefill_graph_max_tokens=args.prefill_tokens,
        prefill_graph_capture_batch_sizes=tuple(args.prefill_requests),
        prefill_graph_max_bs=max(args.prefill_requests),
        decode_graph_capture_batch_sizes=tuple(args.decode_batches),
        decode_graph_max_bs=max(args.decode_batches), max_model_len=max_len,
        compile_progress=True, compile_cache=False, background_compile=False)
    runner = KimiRunner(model, engine, num_pages=pages_each * max_requests,
                        num_state_slots=max_requests, page_size=PAGE_SIZE)
    summary = runner.compile_all()
    print(summary.table())

    rows = ["| what | requests | tokens | time (ms) | tokens/s |", "|---|---|---|---|---|"]
    for count in args.prefill_requests:
        batch = requests(count, args.prefill_tokens // count, 0, pages_each)
        routes = [("inline", lambda b=batch: runner.run_compiled("inline", b)),
                  ("ordinary", lambda b=batch: runner.run_compiled("ordinary", b))]
        if not args.skip_eager:
            routes.append(("eager", lambda b=batch: runner.run_eager(b, plan="ordinary")))
        for name, fn in routes:
            seconds = timed(fn, args.repeats if name != "eager" else 1)
            rows.append(f"| prefill {name} | {count} | {args.prefill_tokens} | "
                        f"{seconds * 1e3:.2f} | {args.prefill_tokens / seconds:,.0f} |")
    ahead_steps = 5 * args.repeats
    for batch_size in args.decode_batches:
        batch = requests(batch_size, 1, args.context, pages_each)
        seconds = timed(lambda b=batch: runner.run_compiled("decode", b), args.repeats)
        ahead = timed(lambda b=batch: run_ahead_steps(runner, b, ahead_steps), 1) / ahead_steps
        for name, step in (("decode step", seconds), ("decode step, run ahead", ahead)):
            rows.append(f"| {name} | {batch_size} | {batch_size} | {step * 1e3:.2f} | "
                        f"{batch_size / step:,.0f} |")
    print(f"\nKimi-Linear-48B-A3B shape, {args.layers} layers "
          f"({config.layer_types.count(KDA)} KDA, {config.layer_types.count(MLA)} MLA), bf16, "
          f"random weights; decode context {args.context}")
    print("\n".join(rows))
    print(f"runtime compiles: {runner.stats()['runtime_compiles']}")


if __name__ == "__main__":
    main()
