"""Structured outputs: constrain what a request may sample with a grammar (JSON schema, regex,
choice, Lark/GBNF), compiled by llguidance and applied as a packed token bitmask.

The pieces, each in its own module:

* ``specs``: the request fields clients send (``response_format``, ``guided_*``,
  ``structured_outputs``) -> one ``GrammarSpec``; ``tools``: specs for tool-call arguments.
* ``compiler``: ``GrammarCompiler`` (one per tokenizer) compiles specs through llguidance, with an
  LRU cache, and hands each request a ``GrammarMatcher``.
* ``matcher``: ``GrammarMatcher`` (per request: ``allowed_mask``, ``advance``, ``is_finished``,
  ``rollback``) and ``BitmaskFiller`` (a batch's masks in parallel).
* ``bitmask``: the packed ``[rows, ceil(V / 32)]`` int32 layout and ``apply_token_bitmask``, the
  pure JAX function the compiled sampler applies to its logits.

Plugging it into the engine: validate the request with ``spec_from_request`` (a
``GrammarSpecError`` is a 400 naming ``error.field``) and get its matcher from the compiler before
the request is queued. Per decode step the engine builds a ``[rows, words]`` int32 bitmask (all
ones for unconstrained rows), fills the constrained rows, passes it into the compiled sampler as
an input array (no recompiles), and advances each matcher with the token sampled for its row.
Constrained rows cannot run ahead: the next step's mask needs this step's token (``matcher``'s
docstring states the policy).
"""

from importlib import import_module
from typing import Any

from tokenspeed_jax.structured.bitmask import apply_token_bitmask, bitmask_words, full_bitmask
from tokenspeed_jax.structured.specs import (
    GRAMMAR_FIELDS,
    GrammarSpec,
    GrammarSpecError,
    spec_from_request,
)
from tokenspeed_jax.structured.tools import tool_arguments_spec, tool_call_spec

# Names whose modules load llguidance, imported on first use: a ``SamplingParams`` (which imports
# ``specs``) never loads it, only a grammar does.
_LAZY = {"GrammarCompiler": "compiler", "BitmaskFiller": "matcher", "GrammarError": "matcher",
         "GrammarMatcher": "matcher"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GRAMMAR_FIELDS",
    "BitmaskFiller",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "GrammarSpec",
    "GrammarSpecError",
    "apply_token_bitmask",
    "bitmask_words",
    "full_bitmask",
    "spec_from_request",
    "tool_arguments_spec",
    "tool_call_spec",
]
