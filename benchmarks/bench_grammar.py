"""Grammar compile time per schema and token-mask time per step, for one tokenizer.

For each constraint: ``compile`` is a cold ``GrammarCompiler.compile`` (llguidance grammar build,
matcher and first mask; a fresh compiler each time, so nothing is cached), ``cached`` a second
``matcher`` call for the same spec, and ``mask`` the median time of one ``allowed_mask`` along an
output drawn at random under the mask. Prints one JSON line per constraint.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from tokenspeed_jax.models.gguf_file import GGUFFile
from tokenspeed_jax.models.loader import default_model_path
from tokenspeed_jax.structured import GrammarCompiler, full_bitmask, spec_from_request
from tokenspeed_jax.structured.tools import tool_call_spec
from tokenspeed_jax.tokenizer import Tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 32},
        "age": {"type": "integer", "minimum": 0},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "customer": {"type": "object", "properties": {
            "email": {"type": "string", "format": "email"},
            "address": {"type": "object", "properties": {
                "street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"]}},
            "required": ["email", "address"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 20, "items": {
            "type": "object", "properties": {
                "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
                "price": {"type": "number"}},
            "required": ["sku", "quantity", "price"], "additionalProperties": False}},
        "status": {"enum": ["pending", "paid", "shipped"]},
        "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["id", "customer", "items", "status"],
}
TOOLS = [
    {"type": "function", "function": {"name": "lookup_person", "parameters": PERSON}},
    {"type": "function", "function": {"name": "place_order", "parameters": ORDER}},
]
CONSTRAINTS = {
    "json_object": {"response_format": {"type": "json_object"}},
    "json_schema person": {"response_format": {
        "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}},
    "json_schema order": {"guided_json": ORDER},
    "regex": {"guided_regex": r"[A-Z][a-z]{1,8}, [0-9]{1,3} (years|months)"},
    "choice": {"guided_choice": ["positive", "negative", "neutral"]},
    "grammar": {"guided_grammar": 'start: expr\nexpr: NUMBER | "(" expr ("+" | "*") expr ")"\n'
                                  "NUMBER: /[0-9]+/"},
}


def load_tokenizer(path: str | None) -> Tokenizer:
    root = default_model_path() if path is None else Path(path)
    if root.suffix == ".gguf":
        return Tokenizer.from_gguf(GGUFFile(root))
    return Tokenizer.from_hf_dir(root)


def mask_times(compiler: GrammarCompiler, spec, steps: int, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    matcher = compiler.matcher(spec)
    row = full_bitmask(1, compiler.vocab_size)[0]
    times = []
    while len(times) < steps and not matcher.is_finished:
        start = time.perf_counter()
        matcher.allowed_mask(row)
        times.append(time.perf_counter() - start)
        bits = np.unpackbits(row.view(np.uint8), bitorder="little")[: compiler.vocab_size]
        matcher.advance(int(rng.choice(np.flatnonzero(bits))))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", metavar="PATH", default=None,
                        help="a .gguf file or an HF directory (default: the embedded SmolLM2)")
    parser.add_argument("--steps", type=int, default=200, help="mask steps timed per constraint")
    args = parser.parse_args()

    tokenizer = load_tokenizer(args.tokenizer)
    start = time.perf_counter()
    GrammarCompiler(tokenizer)
    print(json.dumps({"tokenizer_build_ms": round(1e3 * (time.perf_counter() - start), 1),
                      "vocab_size": tokenizer.vocab_size}))
    specs = {name: spec_from_request(fields) for name, fields in CONSTRAINTS.items()}
    specs["tool_call 2 tools"] = tool_call_spec(TOOLS)
    for name, spec in specs.items():
        compiler = GrammarCompiler(tokenizer)
        start = time.perf_counter()
        compiler.compile(spec)
        compiled = time.perf_counter() - start
        start = time.perf_counter()
        compiler.matcher(spec)
        cached = time.perf_counter() - start
        times = mask_times(compiler, spec, args.steps, seed=0)
        print(json.dumps({
            "constraint": name,
            "compile_ms": round(1e3 * compiled, 2),
            "cached_ms": round(1e3 * cached, 3),
            "mask_median_us": round(1e6 * statistics.median(times), 1),
            "mask_max_us": round(1e6 * max(times), 1),
            "mask_steps": len(times),
        }))


if __name__ == "__main__":
    main()
