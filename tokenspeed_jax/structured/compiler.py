"""Grammar compile through llguidance, cached per (spec, tokenizer), and matchers from it.

One ``GrammarCompiler`` serves one tokenizer (build it once per engine: it reads the whole
vocabulary). ``compile(spec)`` turns a ``GrammarSpec`` into an llguidance grammar, builds a
matcher at the grammar's start and computes its first mask, so a schema llguidance rejects fails
here and the lexer work is done once; ``matcher(spec)`` hands each request its own copy.

Invariants:

* Every kind goes through llguidance's own front ends (JSON schema, regex, Lark/GBNF); nothing
  here translates a schema into an automaton.
* An invalid or unsupported spec raises ``GrammarSpecError`` naming the spec's request field,
  with llguidance's message. Errors are not cached: the same bad spec raises again.
* The LRU cache holds at most ``cache_size`` compiled grammars, keyed by the spec (its canonical
  source and options), so one schema sent by many requests compiles once. A compiler is
  thread-safe; compiling releases the GIL.
* JSON grammars allow JSON whitespace between tokens, at most ``JSON_WHITESPACE``'s bound per
  gap (so a sampled whitespace run cannot go on for ever), or none for a ``compact`` spec.
* Regexes use the Rust ``regex`` crate's syntax (no look-around or back-references); a choice
  matches one of its strings exactly.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance

from tokenspeed_jax.structured.bitmask import full_bitmask
from tokenspeed_jax.structured.llg_tokenizer import llguidance_tokenizer
from tokenspeed_jax.structured.matcher import GrammarMatcher
from tokenspeed_jax.structured.specs import GrammarSpec, GrammarSpecError
from tokenspeed_jax.tokenizer import Tokenizer

# Any JSON whitespace between two tokens, bounded: 16 characters still indent nested objects.
JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
DEFAULT_CACHE_SIZE = 256


def llguidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar text of ``spec``."""
    if spec.kind == "json_schema":
        options = {"lenient": not spec.strict}
        if spec.compact:
            options["whitespace_flexible"] = False
        else:
            options["whitespace_pattern"] = JSON_WHITESPACE
        return llguidance.LLMatcher.grammar_from_json_schema(spec.source, overrides=options)
    if spec.kind == "choice":
        choices = json.loads(spec.source)
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(choice) for choice in choices)
        )
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    try:
        return llguidance.grammar_from("grammar", spec.source)
    except ValueError as e:
        raise GrammarSpecError(spec.field, str(e)) from None


class GrammarCompiler:
    """Compiles specs for one tokenizer and hands out per-request matchers (module docstring)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int | None = None,
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self.llg_tokenizer = llguidance_tokenizer(tokenizer, vocab_size)
        self.vocab_size = self.llg_tokenizer.vocab_size
        self._compile = functools.lru_cache(maxsize=cache_size)(self._compile_uncached)

    def _compile_uncached(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.llg_tokenizer, llguidance_grammar(spec), log_level=0)
        if not matcher.is_error():
            scratch = full_bitmask(1, self.vocab_size)[0]
            matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
        if matcher.is_error():
            raise GrammarSpecError(spec.field, f"invalid {spec.kind}: {matcher.get_error()}")
        return matcher

    def compile(self, spec: GrammarSpec) -> None:
        """Compile ``spec`` into the cache (or find it there); raises ``GrammarSpecError``."""
        self._compile(spec)

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher at the start of ``spec``'s grammar, compiled or from the cache."""
        return GrammarMatcher(self._compile(spec).deep_copy(), self.vocab_size)

    def cache_info(self) -> Any:
        """Hits, misses and size of the compile cache."""
        return self._compile.cache_info()
