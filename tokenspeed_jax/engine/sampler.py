"""Token sampling as a pure JAX function, compiled inside the engine's executables.

``SamplingArrays`` carries every request's sampling settings as arrays (one row per request,
built on the host with numpy); ``sample`` turns a batch of logits into one token per row.
Invariants:

* Static shapes, no host sync and no Python branching on values: every knob is a per-row array.
* Rows are independent: a row's token depends only on its logits, its settings and its key, so a
  greedy row is the exact argmax whatever the other rows do, and a seeded request samples the same
  tokens in any batch and at any row position.
* A request's random key for its i-th output token is ``fold_in(key(seed), i)``: a function of
  (seed, i) alone.
* Reported log-probabilities are those of the *unmodified* logits (``log_softmax(logits)``), as
  OpenAI reports them, whatever penalties, temperature or truncation chose the token.

Order of operations on a sampled row: penalties, logit bias, temperature, top-k, top-p (over the
distribution left by top-k), min-p, then a categorical draw. Greedy rows (temperature 0) take the
argmax after penalties and logit bias. A bias is added to the logit as given (no clamping): where
a row's logits span less than 100 (a model's do), +100 makes a token the argmax and -100 takes it
out of the running, and a sampled row then draws it (or, under +100, any other token) with a
probability of at most V * exp(-(100 - span) / temperature). Truncation keeps every token whose
score reaches a per-row threshold, so tokens tied exactly at the threshold are all kept.

Top-k and top-p look at the ``top_k_cap`` best tokens of each row (``lax.top_k`` with a static
size, not a full sort). Consequences of a cap smaller than the vocabulary: ``top_k`` above the
cap acts as the cap, and a nucleus that needs more tokens than the cap is cut to the cap's tokens.
``top_k_cap=None`` sorts the whole row and is exact. Rows with top-k and top-p off sample from the
whole vocabulary either way. ``top_k_cap=0`` leaves the top-k/top-p stage out of the program
(``lax.top_k`` dominates the sampler's cost on a GPU): use it only for batches whose
``SamplingArrays.uses_top_k_or_top_p()`` is false, which the host knows before it picks the
executable; top-k and top-p settings would be ignored there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tokenspeed_jax.sampling_params import SamplingParams

DEFAULT_TOP_K_CAP = 1024  # beyond any common top_k; a nucleus this wide holds nearly all the mass
KEY_IMPL = "threefry2x32"  # JAX's default PRNG; its key data is two uint32 words


def settings_columns(rows: Sequence[tuple[SamplingParams, int]]) -> dict[str, list]:
    """The settings of ``rows`` of (params, output token index), checked, as one list per
    ``SamplingArrays`` field (``key``: [high, low] words of the seed) for its first rows."""
    for row, (params, index) in enumerate(rows):
        if params.seed is None and not params.greedy:
            raise ValueError(
                f"row {row} samples with seed=None; call params.with_random_seed() once per "
                "request"
            )
        if index < 0:
            raise ValueError(f"row {row} has output token index {index} < 0")
    if not rows:
        return {}
    params = [p for p, _ in rows]
    seeds = [(p.seed or 0) % 2**64 for p in params]
    return {
        "temperature": [p.temperature for p in params],
        "top_p": [p.top_p for p in params],
        "top_k": [p.top_k for p in params],
        "min_p": [p.min_p for p in params],
        "presence_penalty": [p.presence_penalty for p in params],
        "frequency_penalty": [p.frequency_penalty for p in params],
        "repetition_penalty": [p.repetition_penalty for p in params],
        "key": [(seed >> 32, seed & 0xFFFFFFFF) for seed in seeds],
        "step": [index for _, index in rows],
    }


class SamplingArrays(NamedTuple):
    """Per-row sampling settings for a batch of B rows (a pytree of arrays)."""

    temperature: jax.Array  # f32[B], 0 = greedy
    top_p: jax.Array  # f32[B], 1 = off
    top_k: jax.Array  # i32[B], 0 = off
    min_p: jax.Array  # f32[B], 0 = off
    presence_penalty: jax.Array  # f32[B]
    frequency_penalty: jax.Array  # f32[B]
    repetition_penalty: jax.Array  # f32[B], 1 = off
    key: jax.Array  # u32[B, 2], threefry key data of the request's seed
    step: jax.Array  # i32[B], index of the token being sampled in the request's output

    @classmethod
    def from_params(
        cls, rows: Sequence[tuple[SamplingParams, int]], pad_to: int | None = None
    ) -> SamplingArrays:
        """Arrays for ``rows`` of (params, output token index), padded with greedy rows.

        Every sampled (non-greedy) row needs a seed: give an unseeded request one once, when it is
        admitted (``SamplingParams.with_random_seed``), so its tokens do not depend on the batch.
        """
        size = len(rows) if pad_to is None else pad_to
        if size < len(rows):
            raise ValueError(f"pad_to={pad_to} is smaller than the {len(rows)} rows given")
        # Padding rows are greedy, with top_p and repetition_penalty off.
        floats = np.zeros((6, size), np.float32)
        floats[(1, 5), :] = 1.0
        arrays = dict(zip(("temperature", "top_p", "min_p", "presence_penalty",
                           "frequency_penalty", "repetition_penalty"), floats))
        arrays.update(top_k=np.zeros(size, np.int32), key=np.zeros((size, 2), np.uint32),
                      step=np.zeros(size, np.int32))
        for name, column in settings_columns(rows).items():
            arrays[name][:len(rows)] = column
        return cls(**arrays)

    def uses_top_k_or_top_p(self) -> bool:
        """Host-side: whether any row truncates by top-k or top-p (needs ``top_k_cap != 0``)."""
        sampled = np.asarray(self.temperature) > 0.0
        truncates = (np.asarray(self.top_k) > 0) | (np.asarray(self.top_p) < 1.0)
        return bool(np.any(sampled & truncates))


def seed_key_data(seed: int) -> np.ndarray:
    """Threefry key data u32[2] for ``seed`` (taken modulo 2**64): ``[high word, low word]``.

    For 0 <= seed < 2**32 this equals ``jax.random.key_data(jax.random.key(seed))``.
    """
    seed %= 2**64
    return np.array([seed >> 32, seed & 0xFFFFFFFF], np.uint32)


def apply_penalties(logits: jax.Array, counts: jax.Array, arrays: SamplingArrays) -> jax.Array:
    """Penalize tokens already generated; ``counts`` i32[B, V] is how often each was.

    Repetition penalty as HF applies it (positive logits divided, negative ones multiplied), then
    OpenAI's frequency (times the count) and presence (once) penalties subtracted.
    """
    seen = counts > 0
    repetition = arrays.repetition_penalty[:, None]
    penalized = jnp.where(logits > 0, logits / repetition, logits * repetition)
    logits = jnp.where(seen, penalized, logits)
    return (
        logits
        - arrays.frequency_penalty[:, None] * counts.astype(logits.dtype)
        - arrays.presence_penalty[:, None] * seen.astype(logits.dtype)
    )


def dense_logit_bias(ids: jax.Array, values: jax.Array, vocab_size: int) -> jax.Array:
    """f32[B, V] from a sparse per-row bias: ``values`` f32[B, E] added at token ``ids`` i32[B, E].
    Unused entries carry value 0 (any id), so they change nothing."""
    rows = jnp.arange(ids.shape[0])[:, None]
    return jnp.zeros((ids.shape[0], vocab_size), jnp.float32).at[rows, ids].add(values)


def truncation_threshold(
    scores: jax.Array, arrays: SamplingArrays, top_k_cap: int | None
) -> jax.Array:
    """f32[B]: the lowest score a token may have to survive top-k, top-p and min-p."""
    no_limit = jnp.full(scores.shape[:1], -jnp.inf, scores.dtype)
    # Min-p: p >= min_p * p_max  <=>  score >= max score + log(min_p).
    min_p_threshold = jnp.where(
        arrays.min_p > 0.0,
        jnp.max(scores, axis=-1)
        + jnp.log(jnp.maximum(arrays.min_p, jnp.finfo(scores.dtype).tiny)),
        no_limit,
    )
    if top_k_cap == 0:
        return min_p_threshold
    vocab = scores.shape[-1]
    cap = vocab if top_k_cap is None else min(top_k_cap, vocab)
    best, _ = jax.lax.top_k(scores, cap)  # [B, cap], descending

    use_top_k = arrays.top_k > 0
    kept_by_k = jnp.where(use_top_k, jnp.clip(arrays.top_k, 1, cap), cap)  # [B]
    top_k_threshold = jnp.where(use_top_k, _score_at(best, kept_by_k - 1), no_limit)

    # Top-p over the distribution top-k leaves: without top-k, normalise over the whole row.
    in_top_k = jnp.arange(cap)[None, :] < kept_by_k[:, None]
    log_norm = jnp.where(
        use_top_k,
        jax.nn.logsumexp(jnp.where(in_top_k, best, -jnp.inf), axis=-1),
        jax.nn.logsumexp(scores, axis=-1),
    )
    probs = jnp.where(in_top_k, jnp.exp(best - log_norm[:, None]), 0.0)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    kept_by_p = jnp.sum((mass_before < arrays.top_p[:, None]) & in_top_k, axis=-1)
    top_p_threshold = jnp.where(
        arrays.top_p < 1.0, _score_at(best, jnp.maximum(kept_by_p, 1) - 1), no_limit
    )
    return jnp.maximum(jnp.maximum(top_k_threshold, top_p_threshold), min_p_threshold)


def _score_at(sorted_scores: jax.Array, index: jax.Array) -> jax.Array:
    return jnp.take_along_axis(sorted_scores, index[:, None], axis=-1)[:, 0]


def row_keys(arrays: SamplingArrays) -> jax.Array:
    """Typed PRNG keys [B]: each row's seed key folded with its output token index."""
    seed_keys = jax.random.wrap_key_data(arrays.key, impl=KEY_IMPL)
    return jax.vmap(jax.random.fold_in)(seed_keys, arrays.step)


def sample(
    logits: jax.Array,
    arrays: SamplingArrays,
    counts: jax.Array | None = None,
    bias: jax.Array | None = None,
    *,
    top_k_cap: int | None = DEFAULT_TOP_K_CAP,
) -> tuple[jax.Array, jax.Array]:
    """One token per row of ``logits`` f32[B, V]: (token ids i32[B], their log-probs f32[B]).

    ``counts`` i32[B, V] (how often each token was already generated) enables the penalties;
    ``bias`` f32[B, V] is added to the logits after them.
    """
    if top_k_cap is not None and top_k_cap < 0:
        raise ValueError(f"{top_k_cap=} must be >= 0 or None")
    logits = logits.astype(jnp.float32)
    scores = logits if counts is None else apply_penalties(logits, counts, arrays)
    scores = scores if bias is None else scores + bias
    greedy = arrays.temperature <= 0.0
    scores = scores / jnp.where(greedy, 1.0, arrays.temperature)[:, None]
    threshold = truncation_threshold(scores, arrays, top_k_cap)
    truncated = jnp.where(scores >= threshold[:, None], scores, -jnp.inf)
    drawn = jax.vmap(jax.random.categorical)(row_keys(arrays), truncated)
    token_ids = jnp.where(greedy, jnp.argmax(scores, axis=-1), drawn).astype(jnp.int32)
    logprobs = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), token_ids[:, None], -1)
    return token_ids, logprobs[:, 0]


def top_logprobs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The ``k`` likeliest tokens of each row: (log-probs f32[B, k], ids i32[B, k]), best first."""
    values, ids = jax.lax.top_k(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), k)
    return values, ids.astype(jnp.int32)
