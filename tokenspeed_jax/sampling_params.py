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
20, ``n`` at most 128, ``logit_bias`` values in [-100, 100] on at most 300 tokens) and otherwise
what float32 arithmetic on the logits keeps meaningful: a temperature or repetition penalty is
0 / at least ``MIN_SCALE`` and at most ``MAX_SCALE``, so dividing or scaling a logit by it never
overflows or divides by a value that rounds to zero.
Limits that depend on the model (``top_k``, stop token ids and ``logit_bias`` token ids within the
vocabulary) are checked by the engine when the request is added. ``logit_bias`` is stored as a
tuple of (token id, bias) pairs sorted by token id, one pair per token, whether it was given as a
mapping or as pairs.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
from collections.abc import Iterable, Mapping

from tokenspeed_jax.structured.specs import GrammarSpec

MAX_N = 128  # OpenAI's limit on samples per prompt
MAX_LOGPROBS = 20  # OpenAI's limit on top log-probabilities per token
INT32_MAX = 2**31 - 1  # top_k and max_tokens travel as int32
UINT64_MAX = 2**64 - 1  # seeds become two uint32 key words
MAX_LOGIT_BIAS = 300  # OpenAI's limit on biased tokens per request
MAX_BIAS = 100.0  # OpenAI's range of one bias: [-100, 100]
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


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """A mapping or pairs of token id -> bias, checked, as pairs sorted by token id."""
    pairs = list(value.items()) if isinstance(value, Mapping) else value
    if isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable):
        raise SamplingParamsError("logit_bias", f"logit_bias must map token ids to biases, got "
                                                f"{value!r}")
    pairs = list(pairs)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise SamplingParamsError("logit_bias", f"logit_bias holds {len(pairs)} tokens; at most "
                                                f"{MAX_LOGIT_BIAS} are allowed")
    checked = {}
    for pair in pairs:
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise SamplingParamsError("logit_bias", f"logit_bias entries must be (token id, "
                                                    f"bias) pairs, got {pair!r}")
        token = _integer("logit_bias", pair[0], 0, INT32_MAX)
        if token in checked:
            raise SamplingParamsError("logit_bias", f"logit_bias names token {token} twice")
        checked[token] = _number("logit_bias", pair[1], -MAX_BIAS, MAX_BIAS)
    return tuple(sorted(checked.items()))


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
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    # The output's constraint (JSON schema, regex, choice, grammar: ``structured.specs``); the
    # engine masks every token the constraint does not allow at each step.
    grammar: GrammarSpec | None = None

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
            "logit_bias": _logit_bias(self.logit_bias),
        }
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise SamplingParamsError("grammar", f"grammar must be a GrammarSpec (see "
                                                 f"tokenspeed_jax.structured), got "
                                                 f"{self.grammar!r}")
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
