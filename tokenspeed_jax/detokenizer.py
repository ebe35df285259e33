"""Incremental detokenisation for streaming: token ids in, text deltas out, stop strings cut.

Invariants:

* The concatenation of every delta ``IncrementalDetokenizer.add`` (then ``finish``) returns equals
  the one-shot ``tokenizer.decode(output_ids)``, cut before the first stop string when one matches.
* A delta never ends in half a UTF-8 character: while the decoded tail ends in U+FFFD (bytes of a
  character still to come) the text is held back. ``finish`` releases whatever is held.
* Text that could still grow into a stop string is held back until it cannot; the stop string
  itself is never emitted (OpenAI's behaviour).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tokenspeed_jax.tokenizer import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the first output token, so tokenizers whose decoding of a token
# depends on its left neighbour (sentencepiece's leading space) render it as in the full text.
PROMPT_CONTEXT_TOKENS = 5


@dataclasses.dataclass(frozen=True)
class StopCheck:
    """What ``check_stop_strings`` decided for the text so far."""

    emit: str  # text newly safe to emit
    emitted: int  # characters of the text emitted in all, this ``emit`` included
    stop: str | None  # the stop string that matched, if one did

    @property
    def stopped(self) -> bool:
        return self.stop is not None


def check_stop_strings(
    text: str, stop: Sequence[str], emitted: int, *, final: bool = False
) -> StopCheck:
    """Decide how much of ``text`` past its first ``emitted`` characters can be emitted.

    The earliest stop string occurrence ends the text just before it. Without one, a suffix of
    ``text`` that is the start of some stop string is held back, unless ``final`` (no more text
    will come). A stop string cannot begin inside the emitted part: a text that could have
    started one there was held back.
    """
    if not 0 <= emitted <= len(text):
        raise ValueError(f"emitted={emitted} is outside the text of length {len(text)}")
    match_at, match = len(text), None
    for candidate in stop:
        at = text.find(candidate, emitted)
        if at != -1 and at < match_at:
            match_at, match = at, candidate
    if match is not None:
        return StopCheck(text[emitted:match_at], match_at, match)
    end = len(text) if final else len(text) - _held_suffix(text, stop, emitted)
    return StopCheck(text[emitted:end], end, None)


def _held_suffix(text: str, stop: Sequence[str], emitted: int) -> int:
    """Length of the longest suffix of ``text[emitted:]`` that is a proper prefix of a stop."""
    pending = len(text) - emitted
    held = 0
    for candidate in stop:
        for length in range(min(len(candidate) - 1, pending), held, -1):
            if text.endswith(candidate[:length]):
                held = length
                break
    return held


class IncrementalDetokenizer:
    """Turns one request's output tokens, one at a time, into text deltas safe to stream."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        empty = [s for s in stop if not s]
        if empty:
            raise ValueError(f"stop strings must be non-empty, got {list(stop)!r}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        context = list(prompt_ids)[-PROMPT_CONTEXT_TOKENS:]
        self._ids = context  # decoding window: prompt context, then output tokens
        self._num_context = len(context)
        self._prefix_offset = 0  # start of the tokens decoded for context only
        self._read_offset = len(context)  # first token whose text is not yet in ``_text``
        self._text = ""  # decoded output text (before stop strings are applied)
        self._emitted = 0  # characters of ``_text`` already returned
        self.stop_reason: str | None = None
        self.finished = False

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    @property
    def text(self) -> str:
        """The text returned so far."""
        return self._text[: self._emitted]

    @property
    def stopped(self) -> bool:
        """True once a stop string matched: the request should finish."""
        return self.stop_reason is not None

    def add(self, token_id: int) -> str:
        """Append one output token; return the text that became safe to emit."""
        if self.stopped or self.finished:
            raise RuntimeError("add() called after the output finished")
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self._text += new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The output ended: release held text (an incomplete character decodes as U+FFFD)."""
        if not (self.stopped or self.finished):
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset :])
            self._text += new_text[len(prefix_text) :]
            self._read_offset = len(self._ids)
        delta = "" if self.stopped else self._release(final=True)
        self.finished = True
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _release(self, *, final: bool) -> str:
        check = check_stop_strings(self._text, self._stop, self._emitted, final=final)
        self._emitted = check.emitted
        self.stop_reason = check.stop
        return check.emit
