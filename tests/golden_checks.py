"""The engine's own per-step log-probabilities against transformers' golden logits.

A completion generated with ``SamplingParams(logprobs=k)`` carries, for every generated token, the
log-probability of the sampled token and the ``k`` most likely tokens with theirs, computed by the
engine from the logits of its compiled forward. At greedy step ``i`` these must equal
``log_softmax`` of the logits transformers picked its ``i``-th greedy token from (the goldens'
``greedy_logits``, written by ``scripts/make_golden.py``).

numpy only, on plain lists: the tensor-parallel workers return ``step_logprobs`` as JSON and the
test process checks them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

# The fp32 engine and fp32 transformers differ only in the order of float sums (and, sharded, in
# partial sums added across devices): about 1e-5 on the tiny models' log-probabilities (-2 to -5).
LOGPROB_ATOL = 1e-4


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log-probabilities over the last axis."""
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def step_logprobs(completion: Any) -> dict[str, list]:
    """A completion's tokens and per-step log-probabilities as JSON-friendly lists."""
    return {"token_ids": list(completion.token_ids),
            "logprobs": [entry.logprob for entry in completion.logprobs],
            "top": [[[token, value] for token, value in entry.top]
                    for entry in completion.logprobs]}


def assert_steps_match_golden(steps: Mapping[str, list], golden_logits: np.ndarray, *,
                              atol: float = LOGPROB_ATOL, label: str = "") -> None:
    """At every step: the sampled token's log-probability, and each of the top ``k`` (distinct,
    best first, and the ``k`` best up to ``atol``), equal the golden log-probabilities."""
    expected = log_softmax(golden_logits)
    assert len(steps["token_ids"]) == len(steps["logprobs"]) == len(expected), label
    for i, (token, logprob, top, row) in enumerate(zip(
            steps["token_ids"], steps["logprobs"], steps["top"], expected, strict=True)):
        where = f"{label} step {i}"
        np.testing.assert_allclose(logprob, row[token], atol=atol, rtol=0, err_msg=where)
        if not top:
            continue
        ids = [int(token_id) for token_id, _ in top]
        values = np.array([value for _, value in top])
        assert len(set(ids)) == len(ids), where
        assert np.all(np.diff(values) <= 0), where
        np.testing.assert_allclose(values, row[ids], atol=atol, rtol=0, err_msg=where)
        assert values[-1] >= np.sort(row)[-len(ids)] - atol, f"{where}: not the {len(ids)} best"
