"""Benchmark a random-weight MLA model (Kimi-Linear-48B-A3B or DeepSeek-V3 shape) on ModelRunner.

Measures prefill throughput of the inline-KDA segmented route and the ordinary route (KDA at a
break; the two are one route for DeepSeek-V3, which has no KDA layers), optionally eager
execution, and the decode step time per batch size and context, one step at a time and run ahead
as the engine's overlap schedule runs them (``bench_graph.run_ahead_steps``). Next to each decode
figure it prints the step's weight-read floor: the bytes the step must read (every weight but
the routed experts and the embedding table, the routed experts a batch of that size touches on
average under uniform routing, the embedding rows, each request's latent rows and KDA states)
over ``--bandwidth``. Before timing, the smallest decode batch's tokens on the decode executable
are checked against the eager ordinary route on the same pools, beside the gap between the eager
route's two best log-probabilities (``check_decode_tokens``).

Shapes (random bf16 weights made on the device by ``loader.random_model``, ``--layers``
layers):

* ``kimi-linear``: hidden 2304, 32 KDA heads of 128, MLA with kv_lora_rank 512, 256 experts of
  1024 (8 per token, 1 shared), in its 3 KDA : 1 MLA pattern; 27 layers is the whole model
  (about 97 GB of weights).
* ``deepseek-v3``: hidden 7168, 128 heads with q_lora_rank 1536 and kv_lora_rank 512, 256 experts
  of 2048 (8 per token in 4 of 8 groups, 1 shared); the first layer dense, the others MoE (each
  about 23 GB).

    python benchmarks/bench_kimi.py --shape kimi-linear --layers 8 --decode-batches 1 32 64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from bench_graph import run_ahead_steps
from flax import nnx

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.batch import StepRequest
from tokenspeed_jax.engine.runner import ModelRunner
from tokenspeed_jax.kernels.expert_rows import NO_EXPERT_ROWS
from tokenspeed_jax.models.deepseek_v3 import DeepseekV3Config
from tokenspeed_jax.models.kimi_linear import KDA, MLA, KimiLinearConfig
from tokenspeed_jax.models.loader import random_model
from tokenspeed_jax.models.moe import KimiMoE
from tokenspeed_jax.parallel import param_name
from tokenspeed_jax.sampling_params import SamplingParams

PAGE_SIZE = 16
ROUTED_EXPERTS = ("w1", "w2", "w3")  # the routed experts' stacked weights (``moe.KimiMoE``)
EMBEDDING = "embed_tokens"


def kimi_linear(layers: int) -> KimiLinearConfig:
    types = tuple(MLA if (i + 1) % 4 == 0 or i == layers - 1 else KDA for i in range(layers))
    return KimiLinearConfig(
        vocab_size=163840, hidden_size=2304, intermediate_size=9216, moe_intermediate_size=1024,
        num_hidden_layers=layers, num_attention_heads=32, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, layer_types=types,
        linear_num_heads=32, linear_head_dim=128, conv_kernel_size=4, first_k_dense_replace=1,
        num_experts=256, num_experts_per_token=8, num_shared_experts=1, num_expert_group=1,
        topk_group=1, routed_scaling_factor=2.446)


def deepseek_v3(layers: int) -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=layers, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
        num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, first_k_dense_replace=min(1, layers),
        max_position_embeddings=163840)


SHAPES = {"kimi-linear": kimi_linear, "deepseek-v3": deepseek_v3}


def requests(count: int, length: int, start: int, pages_each: int, vocab: int
             ) -> list[StepRequest]:
    rng = np.random.default_rng(0)
    return [
        StepRequest(f"r{i}", rng.integers(0, vocab, length).astype(np.int32), start,
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


def weight_bytes(model) -> dict[str, int]:
    """Bytes of the model's weights: the routed experts' (and their count per MoE layer, and
    the number of MoE layers), the embedding table's, and every other weight's."""
    parts = {"routed": 0, "embedding": 0, "other": 0, "moe_layers": 0, "experts": 0}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model)):
        name = param_name(path)
        if name in ROUTED_EXPERTS:
            parts["routed"] += leaf.nbytes
            parts["moe_layers"] += name == "w1"
            parts["experts"] = leaf.shape[0]
        elif name == EMBEDDING:
            parts["embedding"] += leaf.nbytes
        else:
            parts["other"] += leaf.nbytes
    return parts


def decode_floor_bytes(weights: dict[str, int], config, batch: int, context: int,
                       top_k: int, kinds: list[str]) -> float:
    """The bytes a decode step of ``batch`` requests at ``context`` must read (module
    docstring)."""
    experts = max(weights["experts"], 1)
    touched = experts * (1 - (1 - min(top_k / experts, 1)) ** batch)  # distinct, per layer
    routed = weights["routed"] / experts * touched
    embedding_rows = weights["embedding"] / config.vocab_size * batch
    latent = kinds.count(MLA) * context * (config.kv_lora_rank + config.qk_rope_head_dim) * 2
    states = 0
    if KDA in kinds:
        heads, dim = config.linear_num_heads, config.linear_head_dim
        states = kinds.count(KDA) * heads * dim * dim * 4 * 2  # fp32, read and written
    return weights["other"] + routed + embedding_rows + batch * (latent + states)


def check_decode_tokens(runner: ModelRunner, batch: list[StepRequest]) -> dict:
    """The decode executable's tokens against the eager ordinary route on the same pools, and
    the eager route's two best log-probabilities per request: where a token differs, a gap
    between them smaller than the logprob difference is a near-tie, not a wrong step."""
    ranked = [dataclasses.replace(r, params=dataclasses.replace(r.params, logprobs=2))
              for r in batch]
    with runner.guard.allowed("bench check"):
        saved = {name: jnp.copy(pool) for name, pool in runner.pools.items()}
        compiled = runner.run_compiled("decode", batch)
        runner.pools = {name: jnp.copy(pool) for name, pool in saved.items()}
        eager = runner.run_eager(ranked, plan="ordinary")
        runner.pools = saved
    differ = compiled.token_ids != eager.token_ids
    return {"tokens_equal": not bool(differ.any()),
            "max_logprob_diff": float(np.max(np.abs(compiled.logprobs - eager.logprobs))),
            "differing_tokens_in_eager_top2": bool(np.all(
                (compiled.token_ids[:, None] == eager.top_token_ids).any(axis=1)[differ])),
            "eager_top2_gaps": (eager.top_logprobs[:, 0] - eager.top_logprobs[:, 1]).tolist()}


def record(results: list[dict], row: dict) -> None:
    """Keep ``row`` and print it at once, so a run cut short still shows what it measured."""
    results.append(row)
    print(json.dumps(row), flush=True)


def turn_expert_rows_off(model) -> None:
    """Every MoE layer of ``model`` on the sorted grouped path whatever its pair count."""
    for _, module in nnx.iter_modules(model):
        if isinstance(module, KimiMoE):
            module.expert_rows_kernel = NO_EXPERT_ROWS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="kimi-linear")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prefill-tokens", type=int, nargs="*", default=[2048])
    parser.add_argument("--prefill-requests", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024],
                        help="decode context lengths")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--eager", action="store_true", help="also time eager prefill")
    parser.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s of the floor")
    parser.add_argument("--expert-rows", choices=("auto", "off"), default="auto",
                        help="off: every MoE call on the sorted grouped matmuls, as the engine "
                             "ran decode before the expert-rows path (a side-by-side baseline)")
    parser.add_argument("--out", type=Path, help="write the rows as JSON to this file")
    args = parser.parse_args()

    config = SHAPES[args.shape](args.layers)
    t0 = time.perf_counter()
    model = random_model(config, dtype=jnp.bfloat16, seed=0)
    if args.expert_rows == "off":
        turn_expert_rows_off(model)
    jax.block_until_ready(nnx.state(model))
    init_s = time.perf_counter() - t0
    weights = weight_bytes(model)
    kinds = [layer.kind for layer in model.layers]
    print(f"init {init_s:.1f}s on {jax.devices()[0].device_kind}; weights "
          f"{sum(v for k, v in weights.items() if k in ('routed', 'embedding', 'other')) / 1e9:.1f}"
          f" GB")
    prefill_tokens = args.prefill_tokens or [16]  # none timed: the smallest plans
    max_len = max(*prefill_tokens, max(args.contexts) + 8)
    pages_each = -(-max_len // PAGE_SIZE)
    max_requests = max(max(args.prefill_requests), max(args.decode_batches))
    engine = EngineConfig(
        prefill_graph_capture_token_sizes=tuple(prefill_tokens),
        prefill_graph_max_tokens=max(prefill_tokens),
        prefill_graph_capture_batch_sizes=tuple(args.prefill_requests),
        prefill_graph_max_bs=max(args.prefill_requests),
        decode_graph_capture_batch_sizes=tuple(args.decode_batches),
        decode_graph_max_bs=max(args.decode_batches), max_model_len=max_len,
        compile_progress=True, compile_cache=False, background_compile=False)
    runner = ModelRunner(model, engine, num_pages=pages_each * max_requests,
                        num_state_slots=max_requests, page_size=PAGE_SIZE)
    t0 = time.perf_counter()
    summary = runner.compile_all()
    compile_s = time.perf_counter() - t0
    print(summary.table())
    vocab = config.vocab_size
    check = check_decode_tokens(runner, requests(min(args.decode_batches), 1, 64, pages_each,
                                                 vocab))
    print(f"decode executable vs eager ordinary route: {check}")

    results = []
    routes = ["inline", "ordinary"] if KDA in kinds else ["ordinary"]
    for tokens in args.prefill_tokens:
        for count in args.prefill_requests:
            batch = requests(count, tokens // count, 0, pages_each, vocab)
            timings = [(r, lambda b=batch, r=r: runner.run_compiled(r, b)) for r in routes]
            if args.eager:
                timings.append(("eager", lambda b=batch: runner.run_eager(b, plan="ordinary")))
            for name, fn in timings:
                seconds = timed(fn, args.repeats if name != "eager" else 1)
                record(results, {"what": f"prefill {name}", "requests": count,
                                 "tokens": tokens, "ms": seconds * 1e3,
                                 "tokens_per_s": tokens / seconds})
    ahead_steps = 5 * args.repeats
    top_k = getattr(config, "num_experts_per_tok", None) or config.num_experts_per_token
    for context in args.contexts:
        for batch_size in args.decode_batches:
            batch = requests(batch_size, 1, context, pages_each, vocab)
            step = timed(lambda b=batch: runner.run_compiled("decode", b), args.repeats)
            ahead = timed(lambda b=batch: run_ahead_steps(runner, b, ahead_steps),
                          1) / ahead_steps
            floor = decode_floor_bytes(weights, config, batch_size, context, top_k, kinds)
            record(results, {"what": "decode", "requests": batch_size, "context": context,
                             "step_ms": step * 1e3, "run_ahead_ms": ahead * 1e3,
                             "floor_ms": floor / args.bandwidth * 1e3, "floor_gb": floor / 1e9})
    print(f"\n{args.shape} shape, {args.layers} layers ({kinds.count(KDA)} KDA, "
          f"{kinds.count(MLA)} MLA), bf16, random weights")
    print("| what | requests | tokens / context | ms | run ahead ms | floor ms | x floor |")
    print("|---|---|---|---|---|---|---|")
    for row in results:
        if row["what"] == "decode":
            print(f"| decode | {row['requests']} | {row['context']} | {row['step_ms']:.2f} | "
                  f"{row['run_ahead_ms']:.2f} | {row['floor_ms']:.2f} | "
                  f"{row['run_ahead_ms'] / row['floor_ms']:.2f} |")
        else:
            print(f"| {row['what']} | {row['requests']} | {row['tokens']} | {row['ms']:.2f} | "
                  f"| | |")
    runtime_compiles = runner.stats()["runtime_compiles"]
    print(f"runtime compiles: {runtime_compiles}")
    if args.out:
        args.out.write_text(json.dumps({
            "shape": args.shape, "layers": args.layers, "expert_rows": args.expert_rows,
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
            "init_s": init_s, "compile_s": compile_s, "weights": weights, "check": check,
            "runtime_compiles": runtime_compiles, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
