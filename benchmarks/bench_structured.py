"""Decode step time with 0%, 50% and 100% of a batch's rows under a JSON-schema grammar, beside
the unconstrained step, and the grammar's compile time.

A constrained row samples through the full sampler with its token bitmask (filled on the host
from its llguidance matcher each step) and cannot run ahead, so a step that holds one waits for
its tokens; this measures what that costs at batch 1 / 32 / 64. The schema keeps every
constrained row inside one long string (``minLength`` above the tokens generated), so no row
finishes early and every step has the full batch.

Per (batch, share): the best of ``--repeats`` ``LLM.generate`` runs of ``--tokens`` and of 16
greedy tokens; their difference over the extra steps is the decode step time, so prefill and the
fetches at either end cancel. The engine's ladders are complete before timing (no background
compile shares the machine).

    python benchmarks/bench_structured.py --random-weights --out results.json   # GPU
    python benchmarks/bench_structured.py --tiny                                # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tokenspeed_jax import LLM, SamplingParams
from tokenspeed_jax.structured import GrammarCompiler
from tokenspeed_jax.structured.specs import json_schema_spec

TINY_MODEL = Path(__file__).resolve().parent.parent / "tests" / "golden" / "tiny_llama"
SHORT = 16  # tokens of the shorter run, whose time is subtracted


def long_string_schema(min_chars: int) -> dict:
    """One object holding one string of at least ``min_chars`` characters."""
    return {"type": "object", "properties": {"text": {"type": "string", "minLength": min_chars}},
            "required": ["text"], "additionalProperties": False}


def decode_ms(llm: LLM, batch: int, share: float, spec, tokens: int, repeats: int) -> float:
    """Milliseconds per decode step of ``batch`` greedy rows, ``share`` of them constrained."""
    constrained = round(batch * share)
    prompts = [[(i * 31 + j) % 300 + 5 for j in range(40)] for i in range(batch)]
    best = {}
    for length in (SHORT, tokens):
        free = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=length)
        bound = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=length, grammar=spec)
        params = [bound] * constrained + [free] * (batch - constrained)
        runs = []
        for _ in range(repeats):
            began = time.perf_counter()
            outputs = llm.generate(prompts, params)
            runs.append(time.perf_counter() - began)
            if any(len(o.token_ids) != length for o in outputs):
                raise SystemExit("a row finished early: the timing would not be per full batch")
        best[length] = min(runs)
    return (best[tokens] - best[SHORT]) / (tokens - SHORT) * 1e3


def model_path(args: argparse.Namespace, work: Path) -> str | None:
    """The model to run: the tiny test checkpoint, a random SmolLM2-shaped one, or the embedded
    GGUF (None)."""
    if args.tiny:
        return str(TINY_MODEL)
    if not args.random_weights:
        return None
    from random_checkpoint import shape_config, write_random_checkpoint

    write_random_checkpoint(work / "model", shape_config("smollm2"), TINY_MODEL,
                            dtype="bfloat16")
    return str(work / "model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny test model (CPU)")
    parser.add_argument("--random-weights", action="store_true",
                        help="a random SmolLM2-shaped checkpoint instead of the embedded GGUF")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    parser.add_argument("--tokens", type=int, default=144, help="tokens of the longer run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.tiny:
        args.batches, args.tokens, args.repeats = [1, 4], 48, 1
    with tempfile.TemporaryDirectory(prefix="bench-structured-") as work:
        llm = LLM(model_path(args, Path(work)), max_num_seqs=max(args.batches),
                  compile_progress=False)
        llm.runner.ladders.wait()
        schema = long_string_schema(8 * args.tokens)
        spec = json_schema_spec(schema, "response_format")
        began = time.perf_counter()
        GrammarCompiler(llm.tokenizer, llm.runner.model_config.vocab_size).compile(spec)
        results = {"grammar_compile_ms": (time.perf_counter() - began) * 1e3, "rows": []}
        print(f"grammar compile (tokenizer included): {results['grammar_compile_ms']:.1f} ms")
        print(f"{'batch':>5} {'constrained':>11} {'decode ms':>9}")
        for batch in args.batches:
            for share in args.shares:
                ms = decode_ms(llm, batch, share, spec, args.tokens, args.repeats)
                results["rows"].append({"batch": batch, "share": share, "decode_ms": ms})
                print(f"{batch:5d} {share:11.0%} {ms:9.3f}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
