"""The reference generation path: a plain jitted forward over a dense KV cache.

Every faster path (segmented plans, the serving engine) is tested against this one, so it stays
simple: all prompts are prefilled together (right-padded; padding sits at position -1 and writes
nothing), then one decode step runs for the whole batch per new token. Invariants:

* A row's tokens depend only on its own prompt and params: padding and other rows never change
  them (masked attention, per-row sampling keys).
* A finished row keeps its place in the batch at position -1, so it writes no K/V and the batch
  shape, hence the compiled program, does not change mid-generation.
* Shapes are rounded (prompt length to a multiple of ``LENGTH_QUANTUM``, cache length to a multiple
  of ``CACHE_QUANTUM``) so repeated calls reuse compiled programs.
* Stopping (EOS, stop token ids, stop strings, max_tokens, the context length) is decided on the
  host after each step; the stop token is kept in ``token_ids``, never in ``text``.
* Its compiles are declared to the compile guard (``graph.guard.allowed``): running the reference
  beside a serving engine never counts as, or raises for, a runtime compile of the engine.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tokenspeed_jax.detokenizer import IncrementalDetokenizer
from tokenspeed_jax.engine.sampler import SamplingArrays, sample
from tokenspeed_jax.graph.guard import allowed
from tokenspeed_jax.models.llama import DenseKVCache, LlamaForCausalLM
from tokenspeed_jax.outputs import Completion, TokenLogprob
from tokenspeed_jax.sampling_params import SamplingParams
from tokenspeed_jax.tokenizer import Tokenizer

LENGTH_QUANTUM = 16
CACHE_QUANTUM = 64


def _round_up(value: int, quantum: int) -> int:
    return -(-value // quantum) * quantum


@dataclasses.dataclass
class _Row:
    """One completion being generated."""

    prompt: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    stop_ids: frozenset[int]
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None

    @property
    def position(self) -> int:
        """Position of the next token to feed (the last generated one)."""
        return len(self.prompt) + len(self.token_ids) - 1


def _declared(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` with every compile inside declared to the guard as the reference path's."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with allowed("reference generator"):
            return method(*args, **kwargs)

    return call


class ReferenceGenerator:
    """Greedy or sampled generation over ``model`` with a dense KV cache."""

    # the model's dense cache: ``create(config, batch, len, dtype)``; a model that declares its
    # own (``dense_cache_type``) gets that one
    cache_type: Any = DenseKVCache

    def __init__(self, model: LlamaForCausalLM, tokenizer: Tokenizer) -> None:
        self.config = model.config
        self.tokenizer = tokenizer
        self._dtype = model.dtype
        self.cache_type = getattr(model, "dense_cache_type", self.cache_type)
        graphdef, state = nnx.split(model)
        self._state = state

        def forward(state, token_ids, positions, cache):
            return nnx.merge(graphdef, state)(token_ids, positions, cache)

        self._forward = jax.jit(forward, donate_argnums=(3,))
        self._sample = jax.jit(sample)

    def forward(
        self, token_ids: np.ndarray, positions: np.ndarray, cache: DenseKVCache
    ) -> tuple[jax.Array, DenseKVCache]:
        """The model's dense-cache forward, jitted; ``cache`` is donated."""
        return self._forward(self._state, jnp.asarray(token_ids, jnp.int32),
                             jnp.asarray(positions, jnp.int32), cache)

    @_declared
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [len(token_ids), vocab]: the next-token logits after each prefix."""
        n = len(token_ids)
        self._check_length(n)
        length = _round_up(n, LENGTH_QUANTUM)
        tokens = np.zeros((1, length), np.int32)
        tokens[0, :n] = token_ids
        positions = np.full((1, length), -1, np.int32)
        positions[0, :n] = np.arange(n)
        cache = self.cache_type.create(self.config, 1, _round_up(n, CACHE_QUANTUM), self._dtype)
        logits, _ = self.forward(tokens, positions, cache)
        return np.asarray(logits[0, :n], np.float32)

    @_declared
    def generate(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[Completion]:
        """One completion per (prompt, params) pair."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if not prompts:
            return []
        rows = [self._new_row(list(p), sp) for p, sp in zip(prompts, params)]
        batch = len(rows)
        longest = max(len(r.prompt) for r in rows)
        total = max(len(r.prompt) + r.params.max_tokens for r in rows)
        cache_len = _round_up(min(total, self.config.max_position_embeddings), CACHE_QUANTUM)
        cache = self.cache_type.create(self.config, batch, cache_len, self._dtype)
        limit = min(cache_len, self.config.max_position_embeddings)

        length = _round_up(longest, LENGTH_QUANTUM)
        tokens = np.zeros((batch, length), np.int32)
        positions = np.full((batch, length), -1, np.int32)
        for i, row in enumerate(rows):
            tokens[i, : len(row.prompt)] = row.prompt
            positions[i, : len(row.prompt)] = np.arange(len(row.prompt))
        logits, cache = self.forward(tokens, positions, cache)
        last = np.array([len(r.prompt) - 1 for r in rows])
        self._take(rows, logits[jnp.arange(batch), last], limit)

        while not all(r.finish_reason for r in rows):
            tokens = np.array([[r.token_ids[-1]] for r in rows], np.int32)
            positions = np.array([[-1 if r.finish_reason else r.position] for r in rows],
                                 np.int32)
            logits, cache = self.forward(tokens, positions, cache)
            self._take(rows, logits[:, 0], limit)
        return [self._completion(r) for r in rows]

    def _check_length(self, n: int) -> None:
        if n == 0:
            raise ValueError("the prompt is empty")
        limit = self.config.max_position_embeddings
        if n > limit:
            raise ValueError(f"the prompt has {n} tokens, over the context length of {limit}")

    def _new_row(self, prompt: list[int], params: SamplingParams) -> _Row:
        self._check_length(len(prompt))
        vocab = self.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.tokenizer.eos_token_ids)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt, stop=params.stop)
        return _Row(prompt, params.with_random_seed(), detokenizer, frozenset(stop_ids))

    def _take(self, rows: list[_Row], logits: jax.Array, limit: int) -> None:
        """Sample one token for every unfinished row and apply the stop rules.

        ``limit`` is the number of positions a row may fill (cache and context length).
        """
        arrays = SamplingArrays.from_params([(r.params, len(r.token_ids)) for r in rows])
        counts = None
        if any(r.params.has_penalties for r in rows):
            counts = np.zeros((len(rows), self.config.vocab_size), np.int32)
            for i, row in enumerate(rows):
                np.add.at(counts[i], row.token_ids, 1)
        token_ids, logprobs = self._sample(logits, arrays, counts)
        token_ids, logprobs = np.asarray(token_ids), np.asarray(logprobs)
        for row, token, logprob in zip(rows, token_ids.tolist(), logprobs.tolist()):
            if row.finish_reason:
                continue
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            if token in row.stop_ids:
                row.finish_reason = "stop"
                continue
            row.detokenizer.add(token)
            if row.detokenizer.stopped:
                row.finish_reason = "stop"
            elif len(row.token_ids) >= row.params.max_tokens or row.position >= limit:
                row.finish_reason = "length"

    @staticmethod
    def _completion(row: _Row) -> Completion:
        row.detokenizer.finish()
        logprobs = None
        if row.params.logprobs is not None:
            logprobs = [TokenLogprob(t, lp) for t, lp in zip(row.token_ids, row.logprobs)]
        return Completion(row.prompt, row.token_ids, row.detokenizer.text, row.finish_reason,
                          logprobs)
