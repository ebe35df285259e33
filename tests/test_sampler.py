"""The on-device sampler against numpy references and hand-computed distributions."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax.engine.batch import StepRequest
from tokenspeed_jax.engine.sampler import (
    SamplingArrays,
    apply_penalties,
    dense_logit_bias,
    sample,
    seed_key_data,
    top_logprobs,
)
from tokenspeed_jax.engine.sampling_plans import Resampler, needs_full_sampler, step_output
from tokenspeed_jax.sampling_params import MAX_LOGIT_BIAS, SamplingParams, SamplingParamsError

sample_jit = jax.jit(sample, static_argnames="top_k_cap")


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def reference_distribution(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The truncated sampling distribution of one row, written out step by step in numpy."""
    probs = np.exp(np_log_softmax(logits.astype(np.float64) / p.temperature))
    order = np.argsort(-probs, kind="stable")
    keep = np.ones_like(probs, dtype=bool)
    if p.top_k:
        keep[order[p.top_k :]] = False
    if p.top_p < 1.0:
        renormalised = np.where(keep, probs, 0.0) / probs[keep].sum()
        mass = 0.0
        for token in order:
            if keep[token] and mass >= p.top_p:
                keep[token] = False
            mass += renormalised[token]
    if p.min_p:
        keep &= probs >= p.min_p * probs.max()
    kept = np.where(keep, probs, 0.0)
    return kept / kept.sum()


def empirical(logits_row: np.ndarray, params: SamplingParams, n: int, **kwargs) -> np.ndarray:
    """Frequencies of n draws from one row: same seed, output indices 0..n-1."""
    arrays = SamplingArrays.from_params([(params, i) for i in range(n)])
    logits = jnp.broadcast_to(jnp.asarray(logits_row, jnp.float32), (n, logits_row.size))
    tokens, _ = sample_jit(logits, arrays, **kwargs)
    return np.bincount(np.asarray(tokens), minlength=logits_row.size) / n


def assert_matches_distribution(freq: np.ndarray, expected: np.ndarray, n: int) -> None:
    assert np.all(freq[expected == 0] == 0), f"sampled excluded tokens: {freq} vs {expected}"
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) <= 5 * sigma + 1e-9), f"{freq} vs {expected}"


NUM_DRAWS = 20000
LOGITS = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.6, seed=2),
        SamplingParams(temperature=1.7, seed=3),
        SamplingParams(temperature=1.0, top_k=3, seed=4),
        SamplingParams(temperature=1.0, top_p=0.7, seed=5),
        SamplingParams(temperature=1.3, min_p=0.3, seed=6),
        SamplingParams(temperature=0.8, top_k=4, top_p=0.75, seed=7),
        SamplingParams(temperature=1.2, top_k=5, top_p=0.9, min_p=0.15, seed=8),
    ],
    ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-minp{p.min_p}",
)
def test_empirical_distribution_matches_truncated_distribution(params: SamplingParams) -> None:
    freq = empirical(LOGITS, params, NUM_DRAWS)
    assert_matches_distribution(freq, reference_distribution(LOGITS, params), NUM_DRAWS)


def test_top_p_keeps_hand_computed_nucleus() -> None:
    # probabilities .5 .2 .15 .1 .05, top_p .8: mass before each token is 0, .5, .7, .85, .95,
    # so the first three survive, renormalised by .85.
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    freq = empirical(logits, SamplingParams(temperature=1.0, top_p=0.8, seed=11), NUM_DRAWS)
    expected = np.array([0.5, 0.2, 0.15, 0.0, 0.0]) / 0.85
    assert_matches_distribution(freq, expected, NUM_DRAWS)


def test_top_p_keeps_at_least_the_best_token() -> None:
    logits = np.log(np.array([0.9, 0.05, 0.05]))
    freq = empirical(logits, SamplingParams(temperature=1.0, top_p=0.01, seed=12), 500)
    np.testing.assert_array_equal(freq, [1.0, 0.0, 0.0])


def test_top_k_cap_bounds_truncation_and_none_is_exact() -> None:
    vocab = 40
    logits = -0.05 * np.arange(vocab, dtype=np.float32)  # nearly flat, strictly decreasing
    top_k = SamplingParams(temperature=1.0, top_k=20, seed=13)
    capped = empirical(logits, top_k, 4000, top_k_cap=8)
    assert set(np.flatnonzero(capped)) == set(range(8))
    exact = empirical(logits, top_k, 4000, top_k_cap=None)
    assert set(np.flatnonzero(exact)) == set(range(20))
    nucleus = empirical(logits, SamplingParams(top_p=0.95, seed=14), 4000, top_k_cap=8)
    assert set(np.flatnonzero(nucleus)) == set(range(8))
    untruncated = empirical(logits, SamplingParams(seed=15), 8000, top_k_cap=8)
    assert np.count_nonzero(untruncated) > 30  # without top-k/top-p the whole vocabulary is open


def test_top_k_cap_zero_keeps_temperature_and_min_p() -> None:
    params = SamplingParams(temperature=1.3, min_p=0.3, seed=16)
    freq = empirical(LOGITS, params, NUM_DRAWS, top_k_cap=0)
    assert_matches_distribution(freq, reference_distribution(LOGITS, params), NUM_DRAWS)
    plain = SamplingArrays.from_params([(params, 0), (SamplingParams(temperature=0, top_k=2), 0)])
    assert not plain.uses_top_k_or_top_p()
    nucleus = SamplingArrays.from_params([(params, 0), (SamplingParams(top_p=0.5, seed=1), 0)])
    assert nucleus.uses_top_k_or_top_p()
    with pytest.raises(ValueError, match="top_k_cap=-1"):
        sample(jnp.zeros((1, 4)), plain, top_k_cap=-1)


def test_greedy_rows_are_numpy_argmax_whatever_the_other_rows() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32) * 3
    rows = [
        (SamplingParams(temperature=0.0), 0),
        (SamplingParams(temperature=1.5, top_k=3, seed=1), 4),
        (SamplingParams(temperature=0.0, top_p=0.1, top_k=2, min_p=0.5), 7),
        (SamplingParams(temperature=2.0, min_p=0.01, seed=2), 1),
        (SamplingParams(temperature=0.0, seed=99), 3),
        (SamplingParams(temperature=0.9, top_p=0.5, seed=3), 2),
    ]
    tokens, logprobs = sample_jit(jnp.asarray(logits), SamplingArrays.from_params(rows))
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    greedy = [0, 2, 4]
    np.testing.assert_array_equal(tokens[greedy], logits[greedy].argmax(axis=-1))
    reference_logprobs = np_log_softmax(logits)[np.arange(6), tokens]
    np.testing.assert_allclose(logprobs, reference_logprobs, rtol=1e-5, atol=1e-5)


def test_logprobs_are_of_the_unmodified_logits() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(4, 30)).astype(np.float32)
    counts = rng.integers(0, 3, size=(4, 30)).astype(np.int32)
    params = SamplingParams(
        temperature=0.3, top_k=5, repetition_penalty=1.5, frequency_penalty=0.5, seed=4
    )
    arrays = SamplingArrays.from_params([(params, i) for i in range(4)])
    tokens, logprobs = sample_jit(jnp.asarray(logits), arrays, jnp.asarray(counts))
    expected = np_log_softmax(logits)[np.arange(4), np.asarray(tokens)]
    np.testing.assert_allclose(np.asarray(logprobs), expected, rtol=1e-5, atol=1e-5)


def np_penalties(logits, counts, presence, frequency, repetition):
    out = logits.astype(np.float64).copy()
    for b in range(out.shape[0]):
        for v in range(out.shape[1]):
            if counts[b, v] > 0:
                if out[b, v] > 0:
                    out[b, v] /= repetition[b]
                else:
                    out[b, v] *= repetition[b]
                out[b, v] -= frequency[b] * counts[b, v] + presence[b]
    return out


def test_penalties_match_numpy_reference() -> None:
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(3, 24)).astype(np.float32) * 2
    counts = rng.integers(0, 4, size=(3, 24)).astype(np.int32) * (rng.random((3, 24)) < 0.4)
    params = [
        SamplingParams(presence_penalty=0.7, seed=1),
        SamplingParams(frequency_penalty=-0.4, repetition_penalty=1.3, seed=2),
        SamplingParams(
            presence_penalty=-1.0, frequency_penalty=1.5, repetition_penalty=0.8, seed=3
        ),
    ]
    arrays = SamplingArrays.from_params([(p, 0) for p in params])
    got = apply_penalties(jnp.asarray(logits), jnp.asarray(counts.astype(np.int32)), arrays)
    expected = np_penalties(
        logits,
        counts,
        [p.presence_penalty for p in params],
        [p.frequency_penalty for p in params],
        [p.repetition_penalty for p in params],
    )
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def test_greedy_takes_argmax_after_penalties() -> None:
    logits = np.array([[3.0, 2.9, 0.0, -1.0]], np.float32)
    counts = np.array([[1, 0, 0, 0]], np.int32)
    rows = [(SamplingParams(temperature=0.0, repetition_penalty=1.2), 0)]
    tokens, _ = sample_jit(jnp.asarray(logits), SamplingArrays.from_params(rows), counts)
    assert int(tokens[0]) == 1  # 3.0 / 1.2 = 2.5 < 2.9


def seeded_sequence(
    position: int, batch: int, seed: int, logits_row: np.ndarray, steps: int = 12
) -> list[int]:
    """Tokens of a seeded request placed at ``position`` among differently-set rows."""
    others = [SamplingParams(temperature=0.5, top_k=2, seed=1000 + i) for i in range(batch)]
    rng = np.random.default_rng(position)
    logits = rng.normal(size=(batch, logits_row.size)).astype(np.float32)
    logits[position] = logits_row
    out = []
    for step in range(steps):
        rows = [(p, step + 3 * i) for i, p in enumerate(others)]
        rows[position] = (SamplingParams(temperature=1.0, seed=seed), step)
        tokens, _ = sample_jit(jnp.asarray(logits), SamplingArrays.from_params(rows))
        out.append(int(tokens[position]))
    return out


def test_same_seed_same_tokens_in_any_batch_position() -> None:
    logits_row = np.zeros(64, np.float32)  # uniform: the key alone picks the token
    first = seeded_sequence(0, 4, 1234, logits_row)
    assert seeded_sequence(3, 4, 1234, logits_row) == first
    assert seeded_sequence(5, 8, 1234, logits_row) == first
    assert seeded_sequence(0, 4, 4321, logits_row) != first
    assert len(set(first)) > 1  # successive tokens use different keys


def test_seed_key_data_is_jax_key_of_the_seed() -> None:
    for seed in (0, 7, 2**32 - 1):
        expected = jax.random.key_data(jax.random.key(seed, impl="threefry2x32"))
        np.testing.assert_array_equal(seed_key_data(seed), np.asarray(expected))
    np.testing.assert_array_equal(seed_key_data(2**40 + 5), [2**8, 5])


def test_from_params_pads_with_greedy_rows_and_validates() -> None:
    arrays = SamplingArrays.from_params([(SamplingParams(top_k=7, seed=3), 5)], pad_to=4)
    assert all(np.asarray(a).shape[0] == 4 for a in arrays)
    np.testing.assert_array_equal(arrays.temperature, [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(arrays.top_k, [7, 0, 0, 0])
    np.testing.assert_array_equal(arrays.step, [5, 0, 0, 0])
    np.testing.assert_array_equal(arrays.repetition_penalty, [1.0] * 4)
    with pytest.raises(ValueError, match="pad_to=1"):
        SamplingArrays.from_params([(SamplingParams(seed=1), 0)] * 2, pad_to=1)
    with pytest.raises(ValueError, match="seed=None"):
        SamplingArrays.from_params([(SamplingParams(temperature=0.5), 0)])
    seeded = SamplingParams(temperature=0.5).with_random_seed()
    assert seeded.seed is not None and seeded.with_random_seed() is seeded


def test_top_logprobs_match_numpy_sort() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(3, 17)).astype(np.float32)
    values, ids = jax.jit(functools.partial(top_logprobs, k=4))(jnp.asarray(logits))
    reference = np_log_softmax(logits)
    expected_ids = np.argsort(-reference, axis=-1)[:, :4]
    np.testing.assert_array_equal(np.asarray(ids), expected_ids)
    expected = np.take_along_axis(reference, expected_ids, -1)
    np.testing.assert_allclose(np.asarray(values), expected, rtol=1e-5, atol=1e-6)


def test_compiled_sampler_moves_no_data_to_the_host() -> None:
    rows = [(SamplingParams(top_p=0.9, seed=1), 0), (SamplingParams(temperature=0.0), 0)]
    arrays = jax.device_put(SamplingArrays.from_params(rows))
    logits = jax.device_put(np.ones((2, 16), np.float32))
    counts = jax.device_put(np.zeros((2, 16), np.int32))
    compiled = jax.jit(sample).lower(logits, arrays, counts).compile()
    with jax.transfer_guard("disallow"):
        tokens, logprobs = compiled(logits, arrays, counts)
    assert tokens.dtype == jnp.int32 and tokens.shape == (2,) and logprobs.shape == (2,)


def test_step_output_joins_in_step_and_full_sampler_rows_in_order() -> None:
    """Two in-step rows (token, logprob bits; no top entries) and one full-sampler row with two
    top entries, joined and put back in request order: the narrow rows get zero top columns."""
    def bits(*values):
        return np.asarray(values, np.float32).view(np.int32)

    in_step = np.stack([np.r_[[7], bits(-0.5)], np.r_[[9], bits(-1.5)]]).astype(np.int32)
    full = np.r_[[3], bits(-0.25), [3, 4], bits(-0.25, -2.0)].astype(np.int32)[None]
    out = step_output([in_step, full], order=np.array([2, 0, 1]))
    np.testing.assert_array_equal(out.token_ids, [3, 7, 9])
    np.testing.assert_array_equal(out.logprobs, np.float32([-0.25, -0.5, -1.5]))
    np.testing.assert_array_equal(out.top_token_ids, [[3, 4], [0, 0], [0, 0]])
    np.testing.assert_array_equal(out.top_logprobs, np.float32([[-0.25, -2.0], [0, 0], [0, 0]]))


def np_dense_bias(pairs_per_row, vocab: int) -> np.ndarray:
    bias = np.zeros((len(pairs_per_row), vocab), np.float32)
    for row, pairs in enumerate(pairs_per_row):
        for token, value in pairs:
            bias[row, token] += value
    return bias


def test_logit_bias_is_added_before_temperature_and_logprobs_stay_unbiased() -> None:
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(3, 40)).astype(np.float32)
    biases = [((3, 4.0), (7, -2.5)), ((0, 1.5),), ()]
    ids = np.zeros((3, 4), np.int32)
    values = np.zeros((3, 4), np.float32)
    for row, pairs in enumerate(biases):
        for entry, (token, value) in enumerate(pairs):
            ids[row, entry], values[row, entry] = token, value
    dense = np.asarray(dense_logit_bias(jnp.asarray(ids), jnp.asarray(values), 40))
    np.testing.assert_array_equal(dense, np_dense_bias(biases, 40))
    rows = [(SamplingParams(temperature=0.0), 0)] * 3
    tokens, logprobs = sample_jit(jnp.asarray(logits), SamplingArrays.from_params(rows),
                                  None, jnp.asarray(dense))
    np.testing.assert_array_equal(np.asarray(tokens), (logits + dense).argmax(axis=-1))
    np.testing.assert_allclose(np.asarray(logprobs),
                               np_log_softmax(logits)[np.arange(3), np.asarray(tokens)],
                               rtol=1e-5, atol=1e-5)
    # sampled: the distribution is that of (logits + bias) / temperature
    params = SamplingParams(temperature=0.7, seed=11)
    bias_row = np_dense_bias([((1, 2.0), (4, -1.0))], LOGITS.size)[0]
    arrays = SamplingArrays.from_params([(params, i) for i in range(NUM_DRAWS)])
    tiled = jnp.broadcast_to(jnp.asarray(LOGITS, jnp.float32), (NUM_DRAWS, LOGITS.size))
    drawn, _ = sample_jit(tiled, arrays, None, jnp.broadcast_to(bias_row, tiled.shape))
    freq = np.bincount(np.asarray(drawn), minlength=LOGITS.size) / NUM_DRAWS
    assert_matches_distribution(freq, reference_distribution(LOGITS + bias_row, params),
                                NUM_DRAWS)


def step_request(params: SamplingParams, output: list[int]) -> StepRequest:
    return StepRequest("r", np.array([1], np.int32), 0, np.zeros(1, np.int32), True, params,
                       output_token_ids=output)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_resampler_bias_of_100_forces_and_minus_100_forbids(temperature: float) -> None:
    """Through the full sampler as the engine runs it (padded rows, packed metadata): +100 on a
    token the logits rank last makes it every row's token, -100 on the argmax removes it."""
    rng = np.random.default_rng(6)
    vocab, rows = 64, 8
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 4
    worst, best = logits.argmin(axis=-1), logits.argmax(axis=-1)
    forced = [SamplingParams(temperature=temperature, seed=i,
                             logit_bias={int(worst[i]): 100}) for i in range(3)]
    banned = [SamplingParams(temperature=temperature, seed=i, logit_bias={int(best[i]): -100})
              for i in range(3, 6)]
    requests = [step_request(p, [2, 2]) for p in forced + banned]
    assert all(needs_full_sampler(p) for p in forced + banned)
    resampler = Resampler(vocab)
    out = resampler.finish(requests, rows, jnp.zeros((rows, 2), jnp.int32), jnp.asarray(logits),
                           eager=True)
    tokens = step_output([out]).token_ids
    np.testing.assert_array_equal(tokens[:3], worst[:3])
    assert not np.any(tokens[3:6] == best[3:6])
    if temperature == 0.0:  # greedy: the next best token
        second = np.argsort(-logits, axis=-1)[:, 1]
        np.testing.assert_array_equal(tokens[3:6], second[3:6])


def test_logit_bias_is_checked_and_normalised() -> None:
    assert SamplingParams(logit_bias={9: 1, 2: -3.5}).logit_bias == ((2, -3.5), (9, 1.0))
    assert SamplingParams(logit_bias=[(4, 100)]).logit_bias == ((4, 100.0),)
    for bad, match in [({1: 100.5}, "100"), ({1: float("nan")}, "finite"), ({-1: 1}, ">= 0|0,"),
                       ({"a": 1}, "integer"), ([(1, 1), (1, 2)], "twice"), ("ab", "map"),
                       ({i: 1 for i in range(MAX_LOGIT_BIAS + 1)}, str(MAX_LOGIT_BIAS))]:
        with pytest.raises(SamplingParamsError, match=match) as error:
            SamplingParams(logit_bias=bad)
        assert error.value.param == "logit_bias"
