"""Two-tier sampling on compiled plans, shared by every model runner.

A runner's head (or whole decode step) ends with the *in-step* sampler, ``fast_sample``:
temperature, min-p, seeds and greedy rows, but no top-k/top-p truncation and no top
log-probabilities, so it never sorts over the vocabulary (``lax.top_k``'s sort was one of a
decode step's main device costs). The head also returns its logits as fp32
``[rows, V]``. When a request needs more (``needs_full_sampler``: penalties, logit bias,
truncation of a sampled row, top log-probabilities), ``Resampler`` runs the *full* sampler on
those logits: one compiled plan per row bucket, plus a *penalized* one for batches with a penalty
or a logit bias, which also takes ``counts i32[rows, V]`` of each request's output tokens (built
on the host) and each row's logit bias as ``MAX_LOGIT_BIAS`` (token id, bias) entries. The bias
is an input array like the other settings, so a new bias never compiles anything, and the plain
plan (the common one: top-p, top-k, log-probabilities) carries none of it.

Invariants:

* Both tiers draw from ``sampler.sample`` with the same per-row keys, so a row that needs neither
  truncation nor penalties gets the same token from either tier; rows stay independent.
* A head's output is one ``i32[rows, 2]`` (token id, log-prob bits) and the full sampler's one
  ``i32[rows, 2 + 2k]`` (plus the k top ids and their log-prob bits): fetching a step's tokens
  is one device->host copy; ``step_output`` splits and joins them.
* The resample plans read only their arguments (no model weights), so their executables are
  shared by every model of the same vocabulary size in the executable cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tokenspeed_jax.engine.batch import StepOutput, StepRequest, split_decode_rows
from tokenspeed_jax.engine.sampler import (
    SamplingArrays,
    dense_logit_bias,
    sample,
    settings_columns,
    top_logprobs,
)
from tokenspeed_jax.graph import Break, Call, CompiledPlan, Plan, abstract, run_eager
from tokenspeed_jax.graph.packed import Packed
from tokenspeed_jax.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from tokenspeed_jax.structured.bitmask import apply_token_bitmask, full_bitmask

MAX_TOP_LOGPROBS = 20  # SamplingParams.logprobs is at most 20
FAST_SAMPLE_WIDTH = 2  # columns of the in-step sampler's rows: token id, log-prob bits
SAMPLED = "sampled"
RESAMPLE_LABELS = {False: "resample", True: "penalized-resample"}  # by ``penalized``


def needs_full_sampler(params: SamplingParams) -> bool:
    """Whether a request needs more than the in-step sampler: penalties, a logit bias, top-k or
    top-p truncation of a sampled row, or top log-probabilities."""
    truncates = not params.greedy and (params.top_k > 0 or params.top_p < 1.0)
    return needs_penalized_plan(params) or truncates or bool(params.logprobs)


def needs_penalized_plan(params: SamplingParams) -> bool:
    """Whether a request needs the penalized full sampler: penalties, a logit bias or a
    grammar (its token mask)."""
    return params.has_penalties or bool(params.logit_bias) or params.grammar is not None


def settings_rows(requests: Sequence[StepRequest]) -> list[tuple[SamplingParams, int]]:
    """Each request's sampling parameters and the index of the output token it samples next."""
    return [(r.params, len(r.output_token_ids)) for r in requests]


def sampling_arrays(requests: Sequence[StepRequest], rows: int) -> SamplingArrays:
    """The sampling settings of ``requests`` as arrays padded (greedy) to ``rows``."""
    return SamplingArrays.from_params(settings_rows(requests), pad_to=rows)


def write_sampling_fields(fields: Mapping[str, np.ndarray],
                          requests: Sequence[StepRequest]) -> None:
    """Writes the settings of ``requests`` into the first rows of ``sampling_fields``'s fields
    (``fields``: the writable views of a ``PackedBuilder``, padding rows left as they are)."""
    columns = settings_columns(settings_rows(requests))
    for name, column in columns.items():
        fields[f"sampling.{name}"][:len(requests)] = column


def sampling_fields(sampling: SamplingArrays) -> dict[str, np.ndarray]:
    """The settings as named fields of a ``Packed`` buffer (``unpack_sampling`` reverses it)."""
    return {f"sampling.{name}": value for name, value in sampling._asdict().items()}


def unpack_sampling(meta: Mapping[str, jax.Array]) -> SamplingArrays:
    return SamplingArrays(*(meta[f"sampling.{name}"] for name in SamplingArrays._fields))


def output_counts(requests: Sequence[StepRequest], rows: int, vocab_size: int) -> np.ndarray:
    """i32[rows, V]: how often each request already generated each token (penalties)."""
    counts = np.zeros((rows, vocab_size), np.int32)
    for row, request in enumerate(requests):
        np.add.at(counts[row], np.asarray(request.output_token_ids, np.int64), 1)
    return counts


def logit_bias_fields(requests: Sequence[StepRequest], rows: int) -> dict[str, np.ndarray]:
    """Each request's logit bias as ``MAX_LOGIT_BIAS`` entries per row: token ids i32 and biases
    f32, unused entries (and padding rows) with bias 0."""
    ids = np.zeros((rows, MAX_LOGIT_BIAS), np.int32)
    values = np.zeros((rows, MAX_LOGIT_BIAS), np.float32)
    for row, request in enumerate(requests):
        bias = request.params.logit_bias
        if bias:
            ids[row, :len(bias)], values[row, :len(bias)] = zip(*bias)
    return {"logit_bias.ids": ids, "logit_bias.values": values}


def grammar_bitmask(requests: Sequence[StepRequest], rows: int, vocab_size: int) -> np.ndarray:
    """i32[rows, ceil(V / 32)]: the tokens each request's grammar allows next (bit t % 32 of
    word t // 32), every token for requests without one and for padding rows."""
    bitmask = full_bitmask(rows, vocab_size)
    for row, request in enumerate(requests):
        if request.grammar is not None:
            request.grammar.allowed_mask(bitmask[row])
    return bitmask


def fast_sample(sampling: SamplingArrays, logits: jax.Array) -> jax.Array:
    """The in-step sampler: i32[rows, FAST_SAMPLE_WIDTH] of token id and log-prob bits."""
    token_ids, logprobs = sample(logits, sampling, top_k_cap=0)
    return jnp.stack([token_ids, jax.lax.bitcast_convert_type(logprobs, jnp.int32)], axis=1)


def full_sample(meta: Mapping[str, jax.Array], logits: jax.Array) -> jax.Array:
    """The full sampler: i32[rows, 2 + 2k]; penalties, logit bias and grammar masks apply when
    ``meta`` holds ``counts``, the ``logit_bias_fields`` and the ``grammar_bitmask``. A masked
    token's bias is -inf, so it is never sampled; reported log-probabilities stay those of the
    model's logits."""
    bias = None
    if "logit_bias.ids" in meta:
        bias = dense_logit_bias(meta["logit_bias.ids"], meta["logit_bias.values"],
                                logits.shape[-1])
        bias = apply_token_bitmask(bias, meta["bitmask"])
    token_ids, logprobs = sample(logits, unpack_sampling(meta), meta.get("counts"), bias)
    k = min(MAX_TOP_LOGPROBS, logits.shape[-1])
    top_values, top_ids = top_logprobs(logits, k)
    as_words = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    return jnp.concatenate([token_ids[:, None], as_words(logprobs)[:, None], top_ids,
                            as_words(top_values)], axis=1)


def fetch_sampled(sampled: jax.Array, count: int) -> np.ndarray:
    """A sampler output -> numpy, in one copy: the first ``count`` rows (the rest are padding)."""
    return np.asarray(sampled)[:count]


def run_step(requests: list[StepRequest], run: Callable[[list[StepRequest]], list[np.ndarray]],
             *, split_mixed: bool, counters: dict[str, int]) -> StepOutput:
    """A step's output from ``run`` (requests -> packed sampled rows). With ``split_mixed`` a
    mixed step runs as its decode rows and the rest (``batch.split_decode_rows``), counted in
    ``counters["mixed_splits"]``."""
    split = split_decode_rows(requests) if split_mixed else None
    if split is None:
        return step_output(run(requests))
    decode, rest, order = split
    counters["mixed_splits"] += 1
    return step_output(run(decode) + run(rest), order)


def step_output(results: list[np.ndarray], order: np.ndarray | None = None) -> StepOutput:
    """Split the packed rows: token id, logprob bits, k top ids, k top log-prob bits. Results of
    the in-step sampler (k = 0) are widened with zeros to join full-sampler results; ``order``
    picks and orders the joined rows (``batch.split_decode_rows``)."""
    width = max(r.shape[1] for r in results)
    joined = np.concatenate([_widened(r, width) for r in results])
    if order is not None:
        joined = joined[order]
    k = (joined.shape[1] - 2) // 2
    return StepOutput(
        token_ids=joined[:, 0].copy(),
        logprobs=joined[:, 1].copy().view(np.float32),
        top_token_ids=joined[:, 2:2 + k].copy(),
        top_logprobs=joined[:, 2 + k:].copy().view(np.float32),
    )


def _widened(rows: np.ndarray, width: int) -> np.ndarray:
    """``rows`` with zero columns appended up to ``width`` (``np.pad``'s per-call overhead
    is as large as the rest of a step's output handling)."""
    if rows.shape[1] == width:
        return rows
    wide = np.zeros((rows.shape[0], width), rows.dtype)
    wide[:, :rows.shape[1]] = rows
    return wide


def _resample(params: object, packed: Packed, logits: jax.Array) -> jax.Array:
    del params
    return full_sample(packed.unpack(), logits)


class Resampler:
    """The full-sampler plans of one runner (module docstring), compiled per row bucket."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        # Break names are the metadata keys: "sample" and "penalized-sample".
        self.plans = {penalized: Plan([Call(Break(f"{'penalized-' * penalized}sample",
                                                  _resample, ("logits",), (SAMPLED,)))],
                                      ("logits",), (SAMPLED,))
                      for penalized in (False, True)}
        self.compiled: dict[tuple[bool, int], CompiledPlan] = {}
        self.runs = 0

    def plans_for(self, rows: int) -> Iterator[tuple[str, tuple[bool, int], Plan, dict, dict]]:
        """Both plans of row bucket ``rows``: (label, key in ``compiled``, plan, input specs,
        metadata specs), for a ``PlanCompiler``."""
        logits = jax.ShapeDtypeStruct((rows, self.vocab_size), jnp.float32)
        for penalized, label in RESAMPLE_LABELS.items():
            yield (f"{label} B={rows}", (penalized, rows), self.plans[penalized],
                   {"logits": logits}, abstract(self.meta([], rows, penalized)[1]))

    def store(self, key: tuple[bool, int]) -> Callable[[CompiledPlan], None]:
        """What keeps the compiled plan of ``key`` (as ``plans_for`` names it)."""
        return functools.partial(self.compiled.__setitem__, key)

    def meta(self, requests: Sequence[StepRequest], rows: int,
             penalized: bool | None = None) -> tuple[bool, dict]:
        """(whether the penalized plan runs, its packed metadata). ``penalized`` None: exactly
        when a request has a penalty or a logit bias."""
        if penalized is None:
            penalized = any(needs_penalized_plan(r.params) for r in requests)
        fields = sampling_fields(sampling_arrays(requests, rows))
        if penalized:
            fields["counts"] = output_counts(requests, rows, self.vocab_size)
            fields.update(logit_bias_fields(requests, rows))
            fields["bitmask"] = grammar_bitmask(requests, rows, self.vocab_size)
        return penalized, {"penalized-sample" if penalized else "sample": Packed.of(fields)}

    def finish(self, requests: Sequence[StepRequest], rows: int, sampled: jax.Array,
               logits: jax.Array, *, eager: bool = False) -> np.ndarray:
        """The sampled rows of ``requests``: the in-step sampler's (``sampled``) or, when one
        needs more, the full sampler's on ``logits`` (its compiled plan for ``rows``, or op by
        op with ``eager``)."""
        if not any(needs_full_sampler(r.params) for r in requests):
            return fetch_sampled(sampled, len(requests))
        self.runs += 1
        penalized, meta = self.meta(requests, rows)
        run: Callable[..., dict] = (functools.partial(run_eager, self.plans[penalized]) if eager
                                    else self.compiled[penalized, rows].run)
        return fetch_sampled(run({"logits": logits}, meta)[SAMPLED], len(requests))
