"""One sequence's state inside the engine, and what the engine reports back about it per step.

Invariants:

* ``token_ids`` is the prompt followed by every generated token; ``num_computed_tokens`` of them
  have K/V in ``page_ids``. A running request always has at least one token not yet computed
  (the last sampled one), so every step can schedule it.
* Preemption by recompute drops ``page_ids`` and ``num_computed_tokens`` but keeps ``token_ids``:
  the request later recomputes prompt and output alike, and never loses a generated token.
  For a hybrid model it also gives back ``state_slot`` (the KDA state row), taken anew on
  re-admission; ``restore_slot`` is the checkpoint row its first step after admission copies.
* ``finish_reason`` is set exactly once, when the request leaves the engine: ``"stop"`` (EOS, a
  stop token or a stop string), ``"length"`` (max_tokens or the context length) or ``"abort"``.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

from tokenspeed_jax.outputs import TokenLogprob
from tokenspeed_jax.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    page_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    state_slot: int = -1  # live recurrent-state row while running (hybrid models), else -1
    restore_slot: int = -1  # checkpoint row to copy into state_slot at the next step, else -1
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_preemptions: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    grammar: Any = None  # a ``structured.GrammarMatcher`` at the output so far, with a grammar

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt")
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclasses.dataclass
class RequestOutput:
    """What one step added to a request: new tokens and text, and whether it finished."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
