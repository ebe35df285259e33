"""Benchmark tensor parallelism in one process: tp=1 against tp=N for a Llama and a Kimi shape.

For each model shape and each --tp size, with random weights of one seed built fresh on the
device per tp (so every tp starts from the same weights; the family's ``place_model`` then moves
them onto their shardings in place), measures the following; prints one table per shape, and
with --out writes everything as JSON after every tp (a run cut short keeps what it measured):

* correctness against tp=1: the --check-prompts prompts (random ids), each prefilled alone (its
  first token), then decoded together up to --check-steps greedy tokens each; the tokens must equal
  tp=1's, and the log-probs of the sampled tokens are compared (max abs difference over the
  tokens before a prompt's first mismatch, where both runs saw the same context);
* prefill throughput (tokens/s) of one prompt at each --prefill-tokens size: a whole
  ``runner.step(StepBatch(...))``, median of --iters;
* decode step time (ms, median of --iters) of a whole ``runner.step`` at each --decode-batches
  size, every request at --decode-context tokens;
* scaling efficiency t(tp=1) / (tp * t(tp)) of both (1.0 = linear scaling), and the start-up
  compile seconds.

Shapes: ``llama8b-shape`` (``bench_graph.SHAPES``, --llama-layers layers) on a ``ModelRunner``,
and a Kimi-Linear-48B-A3B shape (``bench_kimi.kimi_linear``, --kimi-layers layers) on a
``ModelRunner``. Each (shape, tp) builds two runners over its model, each compiling only its
explicit buckets: a prefill runner (the --prefill-tokens buckets, one request per step, one
decode bucket for the check) and a decode runner whose page tables span --decode-context
(as ``bench_graph.decode_runner``'s), so decode attention reads the pages of that context only.
``--tiny``: tiny shapes of both families and small sizes, a check that runs on the CPU.

    python benchmarks/bench_tp.py --tp 1,2 --out bench_tp.json            # 2 GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
        python benchmarks/bench_tp.py --tiny                               # CPU check
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import math
import sys
from collections.abc import Callable
from typing import Any

import bench_graph
import bench_kimi
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.batch import StepBatch, StepRequest
from tokenspeed_jax.engine.runner import ModelRunner
from tokenspeed_jax.models.kimi_linear import KimiLinearForCausalLM
from tokenspeed_jax.models.llama import LlamaForCausalLM

PAGE_SIZE = bench_graph.PAGE_SIZE
SEED = 0
DEFAULTS = {  # per mode (full, --tiny), the defaults of the dtype and size options
    "full": {"dtype": "bfloat16", "prefill_tokens": "2048,8192", "decode_batches": "1,32,128",
             "decode_context": 512, "check_prompts": "300,1000", "check_steps": 16, "iters": 5},
    "tiny": {"dtype": "float32", "prefill_tokens": "64", "decode_batches": "1,4",
             "decode_context": 48, "check_prompts": "11,29", "check_steps": 8, "iters": 2},
}


@dataclasses.dataclass(frozen=True)
class Family:
    """How to build a model of one shape and a runner for it."""

    name: str
    build: Callable[[], Any]  # a fresh random-weight model (seed SEED) on the default device
    runner: Callable[[Any, EngineConfig, int, int], Any]  # (model, config, pages, state slots)
    decode_runner_prefill: dict[str, Any]  # the decode runner's prefill settings


def prefill_buckets(tokens: tuple[int, ...]) -> dict[str, Any]:
    """EngineConfig settings compiling exactly these prefill token buckets, one request each."""
    top = max(tokens)
    return {"prefill_graph_capture_token_sizes": tokens, "prefill_graph_max_tokens": top,
            "chunked_prefill_size": top, "prefill_graph_capture_batch_sizes": (1,),
            "prefill_graph_max_bs": 1}


def llama_family(tiny: bool, layers: int | None, dtype: str) -> Family:
    name = "tiny" if tiny else "llama8b-shape"
    shape = bench_graph.SHAPES[name]
    shape = dataclasses.replace(shape, num_hidden_layers=layers or shape.num_hidden_layers)
    jdtype = jnp.dtype(dtype)
    return Family(
        name=f"llama-{name}" if tiny else name,
        build=lambda: LlamaForCausalLM(shape, dtype=jdtype, param_dtype=jdtype,
                                       rngs=nnx.Rngs(SEED)),
        runner=lambda model, config, pages, slots: ModelRunner(model, config, num_pages=pages,
                                                               page_size=PAGE_SIZE),
        decode_runner_prefill={"prefill_graph_max_tokens": 0})


def kimi_family(tiny: bool, layers: int, dtype: str) -> Family:
    shape = bench_kimi.kimi_linear(layers)
    if tiny:
        shape = dataclasses.replace(
            shape, vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_attention_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=8, linear_num_heads=4, linear_head_dim=16, num_experts=8,
            num_experts_per_token=2)
    jdtype = jnp.dtype(dtype)
    return Family(
        name="kimi-tiny" if tiny else "kimi-linear-48b-a3b-shape",
        build=lambda: KimiLinearForCausalLM(shape, dtype=jdtype, param_dtype=jdtype,
                                            rngs=nnx.Rngs(SEED)),
        runner=lambda model, config, pages, slots: ModelRunner(
            model, config, num_pages=pages, num_state_slots=slots, page_size=PAGE_SIZE),
        # ModelRunner always compiles a prefill bucket (its state-restore executable is sized by
        # the prefill request buckets): one small one, on the ordinary route only
        decode_runner_prefill={**prefill_buckets((64,)), "disable_kda_prefill_graph": True})


def compiled_runner(family: Family, model: Any, tp: int, *, prefill: dict[str, Any],
                    decode_batches: tuple[int, ...], max_len: int, pages: int,
                    slots: int) -> tuple[Any, float]:
    """A runner compiled for exactly these decode buckets and ``prefill`` settings, and its
    start-up compile seconds."""
    config = EngineConfig(
        tensor_parallel_size=tp, decode_graph_capture_batch_sizes=decode_batches,
        decode_graph_max_bs=max(decode_batches), max_model_len=max_len, compile_progress=False,
        compile_cache=False, background_compile=False, **prefill)
    runner = family.runner(model, config, pages, slots)
    summary = runner.compile_all()
    print(f"  {summary.describe()}", file=sys.stderr, flush=True)
    return runner, summary.total_seconds


def greedy_check(runner: Any, lengths: list[int], steps: int, vocab: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Greedy tokens and their log-probs [prompt, step]: each prompt prefilled alone, then
    ``steps - 1`` decode steps of all prompts together."""
    rng = np.random.default_rng(SEED)
    pages_each = math.ceil((max(lengths) + steps) / PAGE_SIZE)
    prompts = [StepRequest(f"check{i}", rng.integers(0, vocab, n).astype(np.int32), 0,
                           np.arange(1 + i * pages_each, 1 + (i + 1) * pages_each,
                                     dtype=np.int32),
                           True, bench_graph.GREEDY, state_slot=i)
               for i, n in enumerate(lengths)]
    firsts = [runner.step(StepBatch([p])) for p in prompts]
    tokens = [[int(out.token_ids[0])] for out in firsts]
    logprobs = [[float(out.logprobs[0])] for out in firsts]
    for _ in range(steps - 1):
        batch = [dataclasses.replace(p, token_ids=np.array(t[-1:], np.int32),
                                     start_pos=p.num_tokens + len(t) - 1, output_token_ids=list(t))
                 for p, t in zip(prompts, tokens)]
        out = runner.step(StepBatch(batch))
        for i in range(len(prompts)):
            tokens[i].append(int(out.token_ids[i]))
            logprobs[i].append(float(out.logprobs[i]))
    return np.array(tokens), np.array(logprobs)


def compare(tokens: np.ndarray, logprobs: np.ndarray, ref_tokens: np.ndarray,
            ref_logprobs: np.ndarray) -> dict:
    """Whether the greedy tokens match the reference's; the max abs log-prob difference over
    each prompt's tokens before its first mismatch; the first mismatching step and, there, the
    difference between the two picks' log-probs (both runs saw the same context: as small as
    the differences before it means a near tie that rounding decided, not a wrong model)."""
    mismatch = tokens != ref_tokens
    agreed = [int(np.argmax(row)) if row.any() else row.size for row in mismatch]
    diffs = [np.abs(lp[:n] - ref[:n]).max() for lp, ref, n in
             zip(logprobs, ref_logprobs, agreed) if n]
    result = {"tokens_match": not mismatch.any(),
              "max_abs_logprob_diff": float(max(diffs)) if diffs else None,
              "first_mismatch_step": None, "first_mismatch_logprob_diff": None}
    if mismatch.any():
        prompt = int(np.argmin(agreed))
        step = agreed[prompt]
        result["first_mismatch_step"] = step
        result["first_mismatch_logprob_diff"] = float(
            abs(logprobs[prompt, step] - ref_logprobs[prompt, step]))
    return result


def measure(family: Family, tp: int, args: argparse.Namespace) -> dict:
    """Everything measured for one (shape, tp) on a freshly built model (module docstring)."""
    print(f"{family.name} tp={tp}: building the model", file=sys.stderr, flush=True)
    model = family.build()
    vocab = model.config.vocab_size
    steps, lengths = args.check_steps, args.check_prompts
    check_pages = len(lengths) * math.ceil((max(lengths) + steps) / PAGE_SIZE)
    runner, prefill_compile = compiled_runner(
        family, model, tp, prefill=prefill_buckets(tuple(args.prefill_tokens)),
        decode_batches=(len(lengths),), max_len=max(*args.prefill_tokens, max(lengths) + steps),
        pages=1 + max(check_pages, math.ceil(max(args.prefill_tokens) / PAGE_SIZE)),
        slots=len(lengths))
    tokens, logprobs = greedy_check(runner, lengths, steps, vocab)
    prefill = []
    for size in args.prefill_tokens:
        prompt = bench_graph.prompt_request("p", size, 0, 1)
        request = dataclasses.replace(prompt, token_ids=prompt.token_ids % vocab, state_slot=0)
        seconds = bench_graph.timed(lambda r=request: runner.step(StepBatch([r])), args.iters)
        prefill.append({"tokens": size, "tok_s": size / seconds})
    compiles = runner.stats()["runtime_compiles"]
    del runner
    context_pages = math.ceil((args.decode_context + 1) / PAGE_SIZE)
    top = max(args.decode_batches)
    runner, decode_compile = compiled_runner(
        family, model, tp, prefill=family.decode_runner_prefill,
        decode_batches=tuple(args.decode_batches), max_len=context_pages * PAGE_SIZE,
        pages=1 + top * context_pages, slots=top)
    decode = []
    for batch in args.decode_batches:
        step = StepBatch([dataclasses.replace(r, state_slot=i) for i, r in
                          enumerate(bench_graph.decode_requests(batch, args.decode_context))])
        seconds = bench_graph.timed(lambda s=step: runner.step(s), args.iters, warmup=2)
        decode.append({"batch": batch, "step_ms": seconds * 1e3})
    compiles += runner.stats()["runtime_compiles"]
    return {"tokens": tokens.tolist(), "logprobs": logprobs.tolist(), "prefill": prefill,
            "decode": decode, "compile_s": prefill_compile + decode_compile,
            "runtime_compiles": compiles}


def scaling(result: dict, reference: dict, tp: int) -> dict:
    """Efficiency t(tp=1) / (tp * t(tp)) of each prefill size and decode batch, and the greedy
    check against tp=1."""
    return {
        "prefill": [r["tok_s"] / (tp * ref["tok_s"])
                    for r, ref in zip(result["prefill"], reference["prefill"])],
        "decode": [ref["step_ms"] / (tp * r["step_ms"])
                   for r, ref in zip(result["decode"], reference["decode"])],
        "check": compare(*(np.array(result[k]) for k in ("tokens", "logprobs")),
                         *(np.array(reference[k]) for k in ("tokens", "logprobs")))}


def print_table(name: str, results: dict[int, dict], scalings: dict[int, dict],
                args: argparse.Namespace) -> None:
    tps = sorted(results)
    print(f"\n{name}: tp {', '.join(map(str, tps))}; efficiency = t(tp=1) / (tp * t(tp))")
    print(f"{'':>24}" + "".join(f"{f'tp={tp}':>12}" for tp in tps)
          + "".join(f"{f'eff tp={tp}':>12}" for tp in tps[1:]))
    rows = [(f"prefill {r['tokens']} tok/s", [results[tp]["prefill"][i]["tok_s"] for tp in tps],
             "{:12.0f}", [scalings[tp]["prefill"][i] for tp in tps[1:]])
            for i, r in enumerate(results[1]["prefill"])]
    rows += [(f"decode b={r['batch']} ms", [results[tp]["decode"][i]["step_ms"] for tp in tps],
              "{:12.3f}", [scalings[tp]["decode"][i] for tp in tps[1:]])
             for i, r in enumerate(results[1]["decode"])]
    rows.append(("start-up compile s", [results[tp]["compile_s"] for tp in tps], "{:12.1f}", []))
    rows.append(("runtime compiles", [results[tp]["runtime_compiles"] for tp in tps], "{:12d}",
                 []))
    for label, values, fmt, effs in rows:
        print(f"{label:>24}" + "".join(fmt.format(v) for v in values)
              + "".join(f"{e:12.2f}" for e in effs))
    for tp in tps[1:]:
        check = scalings[tp]["check"]
        diff = check["max_abs_logprob_diff"]
        print(f"greedy check tp={tp} vs tp=1 ({len(args.check_prompts)} prompts x "
              f"{args.check_steps} tokens): tokens "
              + ("match" if check["tokens_match"]
                 else f"DIFFER from step {check['first_mismatch_step']} (the picks' logprobs "
                      f"there {check['first_mismatch_logprob_diff']:.3g} apart)")
              + f", max |logprob diff| {'n/a' if diff is None else f'{diff:.3g}'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true",
                        help="tiny shapes and sizes (a check on the CPU)")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes; 1 is the reference")
    parser.add_argument("--models", default="llama,kimi", help="families: llama, kimi")
    parser.add_argument("--llama-layers", type=int,
                        help="layers of the Llama shape (default: the shape's own, 32 for 8B)")
    parser.add_argument("--kimi-layers", type=int, default=4,
                        help="layers of the Kimi shape, in its 3 KDA : 1 MLA pattern")
    parser.add_argument("--dtype", help="weights and compute (default: bfloat16; float32 with "
                        "--tiny, where bf16 rounding can flip near-tied greedy picks)")
    parser.add_argument("--prefill-tokens")
    parser.add_argument("--decode-batches")
    parser.add_argument("--decode-context", type=int,
                        help="tokens already in each decoding request's KV pages")
    parser.add_argument("--check-prompts", help="prompt lengths of the greedy check")
    parser.add_argument("--check-steps", type=int, help="greedy tokens per check prompt")
    parser.add_argument("--iters", type=int)
    parser.add_argument("--out", help="write the results as JSON here")
    tiny = parser.parse_known_args()[0].tiny
    parser.set_defaults(**DEFAULTS["tiny" if tiny else "full"])
    args = parser.parse_args()
    for name in ("prefill_tokens", "decode_batches", "check_prompts"):
        setattr(args, name, [int(v) for v in getattr(args, name).split(",")])
    tps = sorted({int(t) for t in args.tp.split(",")} | {1})
    if len(jax.devices()) < tps[-1]:
        raise SystemExit(
            f"--tp {args.tp} needs {tps[-1]} devices; jax sees {len(jax.devices())} "
            f"{jax.devices()[0].platform} device(s) (on the CPU, set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={tps[-1]})")
    builders = {"llama": lambda: llama_family(tiny, args.llama_layers, args.dtype),
                "kimi": lambda: kimi_family(tiny, args.kimi_layers, args.dtype)}
    names = args.models.split(",")
    if not set(names) <= set(builders):
        parser.error(f"--models {args.models}: the families are {', '.join(builders)}")
    families = [builders[name]() for name in names]

    device = jax.devices()[0].device_kind
    header = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "device": device, "devices": len(jax.devices()), "jax": jax.__version__,
              "dtype": args.dtype}
    report = {**header, "args": vars(args), "models": {}}
    print(f"bench_tp {header['date']}: {header['devices']} x {device}, jax {jax.__version__}, "
          f"{args.dtype}, random weights; decode context {args.decode_context}, "
          f"median of {args.iters}", flush=True)
    for family in families:
        results: dict[int, dict] = {}
        for tp in tps:  # tp=1 first: the reference
            results[tp] = measure(family, tp, args)
            gc.collect()  # free this tp's model, caches and executables before the next
            scalings = {n: scaling(results[n], results[1], n) for n in results if n != 1}
            report["models"][family.name] = {
                "results": {str(n): r for n, r in results.items()},
                "scaling": {str(n): s for n, s in scalings.items()}}
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=2)
        print_table(family.name, results, scalings, args)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
