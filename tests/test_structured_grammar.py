"""Grammars compiled through llguidance for the engine's own tokenizers (tiny_llama's byte-level
BPE and SmolLM2's GGUF vocabulary): outputs sampled under the mask match their constraint, checked
by independent parsers (``json``, ``jsonschema``, ``re``); the matcher's mask, advance, rollback
and end-of-sequence behaviour; and the clear error for a schema llguidance cannot compile."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from tokenspeed_jax.models.gguf_file import GGUFFile
from tokenspeed_jax.models.loader import default_model_path
from tokenspeed_jax.structured import (
    BitmaskFiller,
    GrammarCompiler,
    GrammarError,
    GrammarSpecError,
    full_bitmask,
    spec_from_request,
    tool_call_spec,
)
from tokenspeed_jax.tokenizer import Tokenizer

GOLDEN = Path(__file__).parent / "golden"
SEEDS = range(20)
MAX_STEPS = 400
# Tokens made only of these characters are drawn most of the time, so that sampled strings and
# numbers end in a few steps; the rest of the time any allowed token is drawn.
STRUCTURAL = set('{}[]",:0123456789 \n')

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "dark blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
PRICE = r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6}){0,2}: (0|[1-9][0-9]{0,3})\.[0-9]{2} (EUR|USD)"
CHOICES = ["yes", "yes, sir", "no", 'naïve "quoted" \\ choice']


@pytest.fixture(scope="module", params=["tiny_llama", "smollm2"])
def tokenizer(request) -> Tokenizer:
    if request.param == "tiny_llama":
        return Tokenizer.from_hf_dir(GOLDEN / "tiny_llama")
    return Tokenizer.from_gguf(GGUFFile(default_model_path()))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer)


@pytest.fixture(scope="module")
def structural(tokenizer) -> np.ndarray:
    """Per token id: whether its text is made only of STRUCTURAL characters."""
    texts = [tokenizer.decode([i], skip_special_tokens=False) for i in range(tokenizer.vocab_size)]
    return np.array([bool(t) and set(t) <= STRUCTURAL for t in texts])


def allowed_ids(row: np.ndarray, vocab_size: int) -> np.ndarray:
    """Token ids whose bit is set, read from the little-endian bytes of the packed words."""
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab_size])


def sample_under_mask(compiler, tokenizer, spec, structural, seed: int) -> str:
    """Draw allowed tokens with a seeded RNG until the grammar is complete; the decoded text."""
    rng = np.random.default_rng(seed)
    matcher = compiler.matcher(spec)
    row = full_bitmask(1, compiler.vocab_size)[0]
    eos = set(tokenizer.eos_token_ids)
    out: list[int] = []
    for _ in range(MAX_STEPS):
        matcher.allowed_mask(row)
        allowed = allowed_ids(row, compiler.vocab_size)
        preferred = allowed[structural[allowed]]
        pool = preferred if len(preferred) and rng.random() < 0.9 else allowed
        token = int(rng.choice(pool))
        matcher.advance(token)
        if token in eos:
            break
        out.append(token)
        if matcher.is_finished:
            matcher.allowed_mask(row)
            assert set(allowed_ids(row, compiler.vocab_size)) == eos
            break
    else:
        pytest.fail(f"seed {seed}: no end after {MAX_STEPS} tokens: {tokenizer.decode(out)!r}")
    return tokenizer.decode(out)


@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema_samples_validate(compiler, tokenizer, structural, seed):
    spec = spec_from_request({"response_format": {
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}})
    text = sample_under_mask(compiler, tokenizer, spec, structural, seed)
    value = json.loads(text)
    jsonschema.validate(value, PERSON)
    assert list(value) == list(PERSON["properties"])  # the schema's property order


@pytest.mark.parametrize("seed", SEEDS)
def test_json_object_samples_parse_as_objects(compiler, tokenizer, structural, seed):
    spec = spec_from_request({"response_format": {"type": "json_object"}})
    text = sample_under_mask(compiler, tokenizer, spec, structural, seed)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("seed", SEEDS)
def test_regex_samples_fullmatch(compiler, tokenizer, structural, seed):
    spec = spec_from_request({"guided_regex": PRICE})
    text = sample_under_mask(compiler, tokenizer, spec, structural, seed)
    assert re.fullmatch(PRICE, text), text


@pytest.mark.parametrize("seed", SEEDS)
def test_choice_samples_are_one_of_the_choices(compiler, tokenizer, structural, seed):
    spec = spec_from_request({"structured_outputs": {"choice": CHOICES}})
    assert sample_under_mask(compiler, tokenizer, spec, structural, seed) in CHOICES


@pytest.mark.parametrize("seed", range(5))
def test_tool_call_samples_validate(compiler, tokenizer, structural, seed):
    tools = [
        {"type": "function", "function": {"name": "lookup", "parameters": PERSON}},
        {"type": "function", "function": {"name": "now"}},
    ]
    text = sample_under_mask(compiler, tokenizer, tool_call_spec(tools), structural, seed)
    call = json.loads(text)
    jsonschema.validate(call, json.loads(tool_call_spec(tools).source))
    assert call["name"] in ("lookup", "now")


def test_compact_json_has_no_whitespace(compiler, tokenizer, structural):
    spec = spec_from_request({"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}})
    for seed in range(5):
        text = sample_under_mask(compiler, tokenizer, spec, structural, seed)
        value = json.loads(text)
        assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def test_a_forbidden_token_is_refused(compiler, tokenizer):
    matcher = compiler.matcher(spec_from_request({"guided_regex": "[0-9]+"}))
    row = full_bitmask(1, compiler.vocab_size)[0]
    matcher.allowed_mask(row)
    letter = tokenizer.encode("x")[0]
    assert letter not in allowed_ids(row, compiler.vocab_size)
    with pytest.raises(GrammarError, match=f"token {letter} is not allowed"):
        matcher.advance(letter)


def test_end_of_sequence_only_where_the_grammar_may_end(compiler, tokenizer):
    matcher = compiler.matcher(spec_from_request({"guided_regex": "ab+"}))
    row = full_bitmask(1, compiler.vocab_size)[0]
    eos = tokenizer.eos_token_ids[0]
    matcher.allowed_mask(row)
    assert eos not in allowed_ids(row, compiler.vocab_size)
    for token in tokenizer.encode("ab"):
        matcher.advance(token)
    matcher.allowed_mask(row)
    assert eos in allowed_ids(row, compiler.vocab_size) and not matcher.is_finished
    matcher.advance(eos)
    assert matcher.is_finished


def test_rollback_restores_the_earlier_mask(compiler, tokenizer):
    matcher = compiler.matcher(spec_from_request({"guided_json": PERSON}))
    tokens = tokenizer.encode('{"name": "Ann", "age": 4')
    before = full_bitmask(1, compiler.vocab_size)[0]
    after = before.copy()
    for token in tokens[:3]:
        matcher.advance(token)
    matcher.allowed_mask(before)
    for token in tokens[3:]:
        matcher.advance(token)
    matcher.allowed_mask(after)
    assert not np.array_equal(before, after)
    with pytest.raises(ValueError, match=f"num_tokens={len(tokens) + 1}: {len(tokens)} advanced"):
        matcher.rollback(len(tokens) + 1)
    matcher.rollback(len(tokens) - 3)
    assert matcher.num_advanced == 3
    again = full_bitmask(1, compiler.vocab_size)[0]
    matcher.allowed_mask(again)
    np.testing.assert_array_equal(again, before)


def test_padded_vocabulary_ids_are_never_allowed(tokenizer):
    padded = GrammarCompiler(tokenizer, tokenizer.vocab_size + 45)
    row = full_bitmask(1, padded.vocab_size)[0]
    assert row.shape == (-(-(tokenizer.vocab_size + 45) // 32),)
    padded.matcher(spec_from_request({"response_format": {"type": "json_object"}})).allowed_mask(row)
    ids = allowed_ids(row, padded.vocab_size)
    assert len(ids) and ids.max() < tokenizer.vocab_size
    with pytest.raises(ValueError, match="smaller than the tokenizer's vocabulary"):
        GrammarCompiler(tokenizer, tokenizer.vocab_size - 1)


def test_batch_fill_matches_one_row_at_a_time(compiler):
    specs = [spec_from_request({"guided_json": PERSON}), spec_from_request({"guided_regex": PRICE})]
    matchers = {0: compiler.matcher(specs[0]), 2: compiler.matcher(specs[1])}
    batch = np.zeros((3, full_bitmask(1, compiler.vocab_size).shape[1]), np.int32)
    BitmaskFiller(num_threads=2).fill(batch, matchers)
    for row, matcher in matchers.items():
        single = full_bitmask(1, compiler.vocab_size)[0]
        matcher.allowed_mask(single)
        np.testing.assert_array_equal(batch[row], single)
    assert (batch[1] == -1).all()
    with pytest.raises(ValueError, match=r"rows \[3\] are outside a bitmask of 3 rows"):
        BitmaskFiller(num_threads=1).fill(batch, {3: matchers[0]})


def test_one_schema_compiles_once(tokenizer):
    compiler = GrammarCompiler(tokenizer, cache_size=4)
    compiler.matcher(spec_from_request({"guided_json": PERSON}))
    compiler.matcher(spec_from_request({"structured_outputs": {"json": json.dumps(PERSON)}}))
    info = compiler.cache_info()
    assert (info.misses, info.hits, info.currsize) == (1, 1, 1)


@pytest.mark.parametrize(
    "fields, field, message",
    [
        ({"guided_json": {"type": "foo"}}, "guided_json", "Invalid type: foo"),
        ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 3}}, "guided_json",
         "minimum"),
        ({"guided_json": {"$ref": "#/definitions/missing"}}, "guided_json", "does not exist"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "strict": True, "schema": {"type": "object", "propertyNames": {}}}}},
         "response_format.json_schema.schema", "propertyNames"),
        ({"guided_regex": "(a|b"}, "guided_regex", "unclosed group"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}},
         "structured_outputs.grammar", "undefined_rule"),
    ],
)
def test_schemas_llguidance_rejects_name_their_field(compiler, fields, field, message):
    spec = spec_from_request(fields)
    for _ in range(2):  # errors are not cached
        with pytest.raises(GrammarSpecError, match=message) as raised:
            compiler.compile(spec)
        assert raised.value.field == field


def test_without_strict_unsupported_keywords_are_ignored(compiler, tokenizer, structural):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "propertyNames": {"pattern": "^n$"}, "additionalProperties": False}
    spec = spec_from_request({"response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    assert not spec.strict
    text = sample_under_mask(compiler, tokenizer, spec, structural, 0)
    jsonschema.validate(json.loads(text), schema)


def test_every_end_of_sequence_id_ends_the_grammar():
    tiny = Tokenizer.from_hf_dir(GOLDEN / "tiny_llama")
    im_end = tiny.token_to_id("<|im_end|>")
    two_ends = Tokenizer(tiny.backend, eos_token="<|eos|>", eos_token_ids=[im_end])
    compiler = GrammarCompiler(two_ends)
    row = full_bitmask(1, compiler.vocab_size)[0]
    for end in two_ends.eos_token_ids:
        matcher = compiler.matcher(spec_from_request({"guided_regex": "ab"}))
        for token in two_ends.encode("ab"):
            matcher.advance(token)
        assert matcher.is_finished
        matcher.allowed_mask(row)
        assert list(allowed_ids(row, compiler.vocab_size)) == sorted(two_ends.eos_token_ids)
        matcher.advance(end)
    with pytest.raises(ValueError, match="no end-of-sequence token"):
        GrammarCompiler(Tokenizer(tiny.backend))


def test_json_whitespace_runs_are_bounded(compiler, tokenizer):
    spec = spec_from_request({"guided_json": PERSON})
    matcher = compiler.matcher(spec)
    for token in tokenizer.encode("{" + " \n" * 8 + '"name"'):
        matcher.advance(token)
    matcher = compiler.matcher(spec)
    with pytest.raises(GrammarError, match="not allowed"):
        for token in tokenizer.encode("{" + " \n" * 8 + ' "name"'):
            matcher.advance(token)
