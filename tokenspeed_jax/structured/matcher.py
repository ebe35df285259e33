"""A request's grammar state: the tokens it may sample next, advanced by the tokens it sampled.

How the engine is meant to use it, per decode step:

1. Build the batch's ``[rows, words]`` int32 bitmask with ``full_bitmask`` (all ones), then fill
   the constrained rows: ``GrammarMatcher.allowed_mask(bitmask[row])`` one by one, or
   ``BitmaskFiller.fill`` for all of them on llguidance's threads.
2. Pass the mask into the compiled sampler, which applies ``apply_token_bitmask`` to its logits.
3. Advance each constrained row's matcher with the token sampled for it (``advance``). When
   ``is_finished`` turns true the output is complete: finish the request (reason ``stop``)
   without sampling the end-of-sequence token the mask would force.

Policy for decode steps that run ahead of the host: a constrained row cannot run ahead, because
the next step's mask needs this step's token. A step that would include a constrained row waits
until that row's previous token is read back and advanced; unconstrained rows keep running
ahead. (A speculative path can instead advance on draft tokens and ``rollback`` the rejected ones.)

Invariants:

* Before the first ``advance`` the mask is the grammar's start; after ``advance(t)`` it is the
  grammar's state after ``t``. ``rollback(n)`` undoes the last ``n`` advances exactly; rolling
  back more than were advanced is a ``ValueError`` that leaves the matcher as it was.
* Once the grammar is complete, the mask allows exactly the end-of-sequence ids; advancing one of
  them is accepted. Tokens past the tokenizer's vocabulary are never allowed.
* A token the mask did not allow is never silently accepted: ``advance`` raises ``GrammarError``
  naming it, and the matcher stays unusable (the request should end with an error).
* Methods release the GIL while llguidance works, and a matcher is used by one thread at a time.
"""

from __future__ import annotations

from collections.abc import Mapping

import llguidance
import numpy as np

from tokenspeed_jax.structured.bitmask import bitmask_words


class GrammarError(RuntimeError):
    """A matcher was advanced with a token its grammar forbids (or is otherwise broken)."""


class GrammarMatcher:
    """One request's position in its grammar (module docstring)."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self.num_advanced = 0  # tokens consumed and not rolled back
        self._check()

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())

    def allowed_mask(self, row: np.ndarray) -> None:
        """Write the next token's bitmask into ``row`` (int32, ``[words]``, contiguous)."""
        _check_bitmask(row, (self.words,))
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        self._check()

    def advance(self, token_id: int) -> None:
        """Consume the token sampled for this request."""
        if not self._matcher.consume_token(int(token_id)):
            raise GrammarError(f"token {token_id} is not allowed here: {self._matcher.get_error()}")
        self.num_advanced += 1

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` advances (at most ``num_advanced``)."""
        if not 0 <= num_tokens <= self.num_advanced:
            raise ValueError(f"cannot roll back {num_tokens=}: {self.num_advanced} advanced")
        if not self._matcher.rollback(num_tokens):
            raise GrammarError(f"cannot roll back {num_tokens} tokens: {self._matcher.get_error()}")
        self.num_advanced -= num_tokens

    @property
    def is_finished(self) -> bool:
        """True once the grammar is complete (only an end-of-sequence token may follow)."""
        return self._matcher.is_stopped()


class BitmaskFiller:
    """Fills the constrained rows of a batch's bitmask in parallel on llguidance's threads."""

    def __init__(self, num_threads: int | None = None) -> None:
        self._executor = llguidance.LLExecutor(num_threads)

    def fill(self, bitmask: np.ndarray, matchers: Mapping[int, GrammarMatcher]) -> None:
        """Set every row of ``bitmask`` [rows, words] to all ones, then each row in ``matchers``
        (row index -> matcher) to its matcher's mask."""
        if bitmask.ndim != 2:
            raise ValueError(f"bitmask must be [rows, words], got shape {bitmask.shape}")
        rows, words = bitmask.shape
        _check_bitmask(bitmask, (rows, words))
        wrong = {row: m.words for row, m in matchers.items() if m.words != words}
        if wrong:
            raise ValueError(f"bitmask has {words} words per row; matchers of rows {wrong} differ")
        outside = [row for row in matchers if not 0 <= row < rows]
        if outside:
            raise ValueError(f"rows {outside} are outside a bitmask of {rows} rows")
        bitmask.fill(-1)
        self._executor.unsafe_compute_mask_ptr(
            [(m._matcher, row) for row, m in matchers.items()],
            bitmask.ctypes.data,
            words * bitmask.itemsize,
            rows,
        )
        for matcher in matchers.values():
            matcher._check()


def _check_bitmask(array: np.ndarray, shape: tuple[int, ...]) -> None:
    if array.dtype != np.int32 or array.shape != shape or not array.flags.c_contiguous:
        raise ValueError(
            f"bitmask must be a contiguous int32 array of shape {shape}, "
            f"got {array.dtype} {array.shape}"
        )
