"""SamplingParams: how one request picks its tokens.

Invariants: a params object is validated once, at construction, with errors that name the field
and the value; ``temperature == 0`` means greedy: the argmax after the penalties (as HF and vLLM
do), ignoring top_p, top_k, min_p and seed; a given ``seed`` makes the sampled tokens reproducible
for the same prompt and model, whatever batch they share.
"""

from __future__ import annotations

import dataclasses
import secrets


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    logprobs: int | None = None  # number of top log-probabilities to return per token

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0.0,
             f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs must be in [0, 20], got {self.logprobs}"),
            (all(self.stop), f"stop strings must be non-empty, got {self.stop!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def has_penalties(self) -> bool:
        """Whether any presence, frequency or repetition penalty is asked for."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_random_seed(self) -> SamplingParams:
        """These params with a seed: their own, or a random one drawn now (once per request)."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=secrets.randbits(63))
