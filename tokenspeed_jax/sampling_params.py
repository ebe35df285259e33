"""SamplingParams: how one request picks its tokens.

Invariants: a params object is validated once, at construction, for type, finiteness and range;
an error is a ``SamplingParamsError`` (a ValueError) whose ``param`` names the field and whose
message names the value, so nothing a request carries can fail later inside
the engine loop (every number here becomes an int32 / float32 / uint64 array element on the
device); ``temperature == 0`` means greedy: the argmax after the penalties (as HF and vLLM do),
ignoring top_p, top_k, min_p and seed; ``top_k`` -1 or 0 means off and is stored as 0; a given
``seed`` makes the sampled tokens reproducible for the same prompt and model, whatever batch they
share.

Ranges are those of OpenAI's API where it defines one (penalties in [-2, 2], ``logprobs`` at most
20, ``n`` at most 128) and otherwise what float32 arithmetic on the logits keeps meaningful: a
temperature or repetition penalty is 0 / at least ``MIN_SCALE`` and at most ``MAX_SCALE``, so
dividing or scaling a logit by it never overflows or divides by a value that rounds to zero.
Limits that depend on the model (``top_k`` and stop token ids within the vocabulary) are checked
by the engine when the request is added.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets

MAX_N = 128  # OpenAI's limit on samples per prompt
MAX_LOGPROBS = 20  # OpenAI's limit on top log-probabilities per token
INT32_MAX = 2**31 - 1  # top_k and max_tokens travel as int32
UINT64_MAX = 2**64 - 1  # seeds become two uint32 key words
MIN_SCALE = 1e-5  # smallest non-zero temperature / repetition penalty (below it logits overflow)
MAX_SCALE = 1e5  # largest temperature / repetition penalty


class SamplingParamsError(ValueError):
    """A sampling setting of the wrong type or out of range; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _integer(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplingParamsError(name, f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise SamplingParamsError(name, f"{name} must be in [{low}, {high}], got {value}")
    return int(value)


def _number(name: str, value: object, low: float, high: float, *,
            low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingParamsError(name, f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise SamplingParamsError(name, f"{name} must be finite, got {value}")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise SamplingParamsError(name, f"{name} must be in {bracket}{low}, {high}], got {value}")
    return value


def _scale(name: str, value: object, *, zero_allowed: bool) -> float:
    """A temperature or repetition penalty: finite, in [MIN_SCALE, MAX_SCALE] (or exactly 0)."""
    value = _number(name, value, 0.0, MAX_SCALE)
    if value == 0.0 and zero_allowed:
        return value
    if value < MIN_SCALE:
        raise SamplingParamsError(name, f"{name} must be {'0 or ' if zero_allowed else ''}in "
                                        f"[{MIN_SCALE}, {MAX_SCALE}], got {value}")
    return value


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = off
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
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise SamplingParamsError("stop", f"stop strings must be non-empty strings, got "
                                              f"{stop!r}")
        top_k = _integer("top_k", self.top_k, -1, INT32_MAX)
        values = {
            "stop": stop,
            "stop_token_ids": tuple(_integer("stop_token_ids", t, 0, INT32_MAX)
                                    for t in self.stop_token_ids),
            "max_tokens": _integer("max_tokens", self.max_tokens, 1, INT32_MAX),
            "temperature": _scale("temperature", self.temperature, zero_allowed=True),
            "top_p": _number("top_p", self.top_p, 0.0, 1.0, low_open=True),
            "top_k": max(top_k, 0),
            "min_p": _number("min_p", self.min_p, 0.0, 1.0),
            "seed": None if self.seed is None else _integer("seed", self.seed, 0, UINT64_MAX),
            "presence_penalty": _number("presence_penalty", self.presence_penalty, -2.0, 2.0),
            "frequency_penalty": _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0),
            "repetition_penalty": _scale("repetition_penalty", self.repetition_penalty,
                                         zero_allowed=False),
            "n": _integer("n", self.n, 1, MAX_N),
            "logprobs": None if self.logprobs is None
            else _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS),
        }
        if not isinstance(self.ignore_eos, bool):
            raise SamplingParamsError("ignore_eos",
                                      f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        for name, value in values.items():
            object.__setattr__(self, name, value)

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
