"""The contract between the scheduler and the model runner: what one engine step asks for.

The scheduler (pure Python, host side) decides which requests run in a step and how many of their
tokens; the model runner turns that into device work and returns one sampled token per request that
asked for one. Invariants:

* ``StepRequest.token_ids`` are the tokens whose K/V this step writes, at positions
  ``start_pos .. start_pos + len(token_ids) - 1``; everything before ``start_pos`` is already in
  the KV pages listed by ``page_table`` (prefix-cache hits and earlier chunks included).
* ``page_table`` covers at least ``start_pos + len(token_ids)`` positions: page ``i`` holds
  positions ``i * page_size .. (i + 1) * page_size - 1``. Page ids are indices into the runner's
  paged KV cache; the scheduler owns their allocation, the runner only reads and writes them.
* ``sample`` is true when the step ends on the request's last known token (a decode step, or the
  last chunk of a prompt): the runner samples exactly one token for it, in the order of ``requests``.
* ``output_token_ids`` are the tokens generated so far (for penalties); the runner never mutates
  any field.
* Hybrid models only (recurrent KDA state, ``state_slots``): ``state_slot`` is the request's live
  state row; ``restore_slot >= 0`` asks the runner to copy that checkpoint row into
  ``state_slot`` before the step (a prefix-cache hit that ends at ``start_pos``);
  ``checkpoint_slot >= 0`` asks it to store the state at the step's last ``prefix_granularity``
  boundary in that row. All three are -1 for models without recurrent state.
* ``token_row >= 0`` (a decode step launched before the previous step's tokens reached the
  host): the request's input token is the one the runner's previous decode step sampled in that
  row, still on the device; ``token_ids`` and the last of ``output_token_ids`` then hold a
  placeholder (such a request samples without penalties, so only the count matters).
* A runner may run a *mixed* step (some requests decode, others prefill) as two, its decode rows
  on the decode graph and the rest on the prefill route (``split_decode_rows``), and joins the
  sampled rows back in the order of the batch, so the split never shows outside the runner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from tokenspeed_jax.sampling_params import SamplingParams


@dataclasses.dataclass
class StepRequest:
    """One request's share of a step."""

    request_id: str
    token_ids: np.ndarray  # int32 [n], n >= 1
    start_pos: int
    page_table: np.ndarray  # int32 [num_pages]
    sample: bool
    params: SamplingParams
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    state_slot: int = -1
    restore_slot: int = -1
    checkpoint_slot: int = -1
    token_row: int = -1
    grammar: Any = None  # the request's ``structured.GrammarMatcher``, if it has a grammar

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_tokens


@dataclasses.dataclass
class StepBatch:
    """The requests of one step, in scheduler order."""

    requests: list[StepRequest]

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    @property
    def is_decode(self) -> bool:
        return all(r.num_tokens == 1 and r.sample for r in self.requests)


@dataclasses.dataclass
class PendingStep:
    """A launched step: ``result()`` waits for its sampled tokens. ``on_board``: they are also on
    the device for the runner's next decode step to read (``StepRequest.token_row``)."""

    result: Callable[[], StepOutput]
    on_board: bool = False

    @classmethod
    def done(cls, output: StepOutput) -> PendingStep:
        return cls(lambda: output)


@dataclasses.dataclass
class StepOutput:
    """One entry per request with ``sample`` set, in the order of the batch."""

    token_ids: np.ndarray  # int32 [num_sampled]
    logprobs: np.ndarray  # float32 [num_sampled]: log-probability of the sampled token
    top_token_ids: np.ndarray | None = None  # int32 [num_sampled, k] when top_logprobs asked
    top_logprobs: np.ndarray | None = None  # float32 [num_sampled, k]


def is_decode_row(request: StepRequest) -> bool:
    """One sampled token past a known prefix: what a decode graph runs."""
    return request.num_tokens == 1 and request.sample and request.start_pos > 0


def split_decode_rows(
    requests: list[StepRequest],
) -> tuple[list[StepRequest], list[StepRequest], np.ndarray] | None:
    """A mixed step as (decode rows, the rest, order), each part in batch order; None unless the
    step has both. The batch's i-th sampled row is row ``order[i]`` of the decode rows' outputs
    followed by the rest's sampled outputs."""
    decode = [r for r in requests if is_decode_row(r)]
    if not decode or len(decode) == len(requests):
        return None
    rest = [r for r in requests if not is_decode_row(r)]
    joined = {id(r): row for row, r in enumerate([*decode, *(r for r in rest if r.sample)])}
    return decode, rest, np.asarray([joined[id(r)] for r in requests if r.sample], np.int64)
