"""Rows of a hybrid model's recurrent-state pool (KDA states): live rows and prefix checkpoints.

The runner owns the pool on the device; this module only decides which row holds what. Pure
Python (no JAX). Rows ``0 .. num_live - 1`` are *live*: a running request holds exactly one from
admission until it finishes, is aborted or is preempted (preemption recomputes, so the row goes
back and a new one is taken on re-admission). Rows ``num_live ..`` are *checkpoints*: the state
after a prefix whose length is a multiple of ``granularity``, keyed by the page hash
(``block_manager.chain_hash``) of that prefix's last page.

Invariants:

* A live row has at most one holder; ``acquire`` never hands out a held row.
* A checkpoint is *pending* from the step that writes it (``reserve``) until that step has run
  (``publish``); only published checkpoints are found, so a hit never reads a row still being
  written. Published checkpoints are evicted least recently used first.
* A checkpoint key is the chain hash of every page before the boundary, the same hash the block
  manager gives the boundary's last page; a hit is only taken where the block manager also hit
  (token-verified) pages up to that boundary.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from tokenspeed_jax.engine.block_manager import chain_hash


def prefix_page_hash(token_ids: Sequence[int], page_size: int, num_pages: int) -> int | None:
    """The block manager's hash of page ``num_pages - 1`` of a sequence (None for 0 pages)."""
    prev_hash = None
    for i in range(num_pages):
        prev_hash = chain_hash(prev_hash, token_ids[i * page_size:(i + 1) * page_size])
    return prev_hash


class StateSlots:
    """Live rows for running requests and an LRU cache of prefix checkpoint rows."""

    def __init__(self, num_live: int, num_checkpoints: int, *, granularity: int, chunk: int,
                 page_size: int) -> None:
        if num_live < 1 or num_checkpoints < 0:
            raise ValueError(f"num_live={num_live} must be >= 1 and "
                             f"num_checkpoints={num_checkpoints} >= 0")
        if granularity % chunk or granularity % page_size:
            raise ValueError(f"granularity={granularity} must be a multiple of chunk={chunk} "
                             f"and page_size={page_size}")
        self.num_live = num_live
        self.num_checkpoints = num_checkpoints
        self.granularity = granularity
        self.chunk = chunk
        self.page_size = page_size
        self._free = collections.deque(range(num_live))
        self._free_checkpoints = collections.deque(range(num_live, num_live + num_checkpoints))
        self._published: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._pending: dict[int, int] = {}  # key -> row written by the step in flight
        self.checkpoint_hits = 0
        self.checkpoints_written = 0

    @property
    def num_slots(self) -> int:
        return self.num_live + self.num_checkpoints

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.num_live} live state rows are held")
        return self._free.popleft()

    def release(self, row: int) -> None:
        if not 0 <= row < self.num_live or row in self._free:
            raise RuntimeError(f"state row {row} released but not held")
        self._free.append(row)

    def find(self, page_hashes: Sequence[int]) -> tuple[int, int]:
        """(pages, row): the longest cached prefix of ``page_hashes`` (hashes of hit pages) that
        ends at a granularity boundary with a published checkpoint; (0, -1) when none does."""
        pages_per_boundary = self.granularity // self.page_size
        for pages in range(len(page_hashes) // pages_per_boundary * pages_per_boundary, 0,
                           -pages_per_boundary):
            row = self._published.get(page_hashes[pages - 1])
            if row is not None:
                self._published.move_to_end(page_hashes[pages - 1])
                self.checkpoint_hits += 1
                return pages, row
        return 0, -1

    def reserve(self, token_ids: Sequence[int], start: int, end: int) -> int:
        """The row a step over positions ``start .. end - 1`` should checkpoint into, or -1.

        A step checkpoints at its last boundary when it starts on a KDA chunk, crosses a
        boundary, and that prefix is neither stored nor being written.
        """
        boundary = end // self.granularity * self.granularity
        if not self.num_checkpoints or start % self.chunk or boundary <= start:
            return -1
        key = prefix_page_hash(token_ids, self.page_size, boundary // self.page_size)
        if key in self._published or key in self._pending:
            return -1
        if self._free_checkpoints:
            row = self._free_checkpoints.popleft()
        elif self._published:
            _, row = self._published.popitem(last=False)
        else:
            return -1
        self._pending[key] = row
        return row

    def publish(self) -> None:
        """The step in flight has run: its checkpoints become findable."""
        self._published.update(self._pending)
        self.checkpoints_written += len(self._pending)
        self._pending.clear()
