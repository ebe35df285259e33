"""What ``LLM.generate`` returns: one finished completion per prompt (per sample when n > 1).

Invariants: ``token_ids`` are the generated tokens only (the prompt is in ``prompt_token_ids``);
a stop token that ended the output is the last entry of ``token_ids`` but never part of ``text``;
a stop string is never part of ``text``; ``finish_reason`` is ``"stop"`` or ``"length"``. This
module imports nothing from the package: the engine and the server build these types, never the
other way round.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class TokenLogprob:
    """One generated token's log-probability, and the ``top`` most likely tokens' (best first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None  # one per generated token when asked for
