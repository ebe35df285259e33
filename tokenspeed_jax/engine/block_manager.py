"""KV page bookkeeping: allocation, reference counts and a hash-based prefix cache of full pages.

The runner owns the paged KV cache on the device; this module only decides which page ids hold
what. Pure Python (no JAX), so the policy is unit-testable on its own. Invariants:

* A page is either free (``ref_count == 0``, in the free queue) or in use (``ref_count >= 1``,
  not in the queue). A page in use is never handed out by ``allocate``.
* Pages are shared only through the prefix cache; every holder took one reference and gives it
  back with ``free``.
* A page gets a hash only once it is full and every one of its positions has its K/V written
  (``commit``). The hash chains over all earlier pages of the sequence, and a hit also compares
  the page's token ids, so a hit always means "same tokens at the same positions"; a hash
  collision can only cost a miss.
* A freed page keeps its hash and contents until ``allocate`` reuses it, so a later request can
  revive it. The free queue is least-recently-freed first, and sequences are freed tail first, so
  the deepest pages of a prefix are evicted before its shared head.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass
class Page:
    page_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


def chain_hash(prev_hash: int | None, token_ids: Sequence[int]) -> int:
    """Hash of one full page given the hash of the page before it (None for the first page)."""
    return hash((prev_hash, tuple(token_ids)))


class BlockManager:
    """Counts pages and caches full-page prefixes; sequences are lists of page ids."""

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pages = [Page(i) for i in range(num_pages)]
        self._free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(
            range(num_pages)
        )
        self._cached: dict[int, int] = {}  # page hash -> page id

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """How many pages hold ``num_tokens`` positions."""
        return -(-num_tokens // self.page_size)

    def acquire_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Take a reference on the longest run of cached full pages that starts ``token_ids``.

        At least one token is always left uncached, so the caller still computes the logits of
        the last position.
        """
        if not self.enable_prefix_caching:
            return []
        max_pages = (len(token_ids) - 1) // self.page_size
        hit: list[int] = []
        prev_hash = None
        for i in range(max_pages):
            chunk = tuple(token_ids[i * self.page_size : (i + 1) * self.page_size])
            prev_hash = chain_hash(prev_hash, chunk)
            page_id = self._cached.get(prev_hash)
            if page_id is None or self.pages[page_id].token_ids != chunk:
                break
            hit.append(page_id)
        for page_id in hit:
            self._ref(page_id)
        return hit

    def allocate(self, num_pages: int) -> list[int]:
        """Hand out ``num_pages`` free pages, evicting whatever prefix they cached."""
        if num_pages > len(self._free):
            raise RuntimeError(f"asked for {num_pages} pages, only {len(self._free)} free")
        page_ids = []
        for _ in range(num_pages):
            page_id, _ = self._free.popitem(last=False)
            page = self.pages[page_id]
            if page.hash is not None and self._cached.get(page.hash) == page_id:
                del self._cached[page.hash]
            page.hash, page.token_ids, page.ref_count = None, (), 1
            page_ids.append(page_id)
        return page_ids

    def free(self, page_ids: Sequence[int]) -> None:
        """Drop one reference on each page, tail first; pages nobody holds become free."""
        for page_id in reversed(page_ids):
            page = self.pages[page_id]
            if page.ref_count < 1:
                raise RuntimeError(f"page {page_id} freed more often than it was taken")
            page.ref_count -= 1
            if page.ref_count == 0:
                self._free[page_id] = None

    def commit(self, page_ids: Sequence[int], token_ids: Sequence[int], num_computed: int) -> None:
        """Register in the cache every page of a sequence that is full of written K/V.

        ``token_ids`` are the sequence's tokens and ``num_computed`` how many of them have K/V in
        ``page_ids``. Hashed pages always form a prefix of ``page_ids``, so only the new ones are
        hashed.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed // self.page_size, len(page_ids))
        first = num_full
        while first > 0 and self.pages[page_ids[first - 1]].hash is None:
            first -= 1
        prev_hash = self.pages[page_ids[first - 1]].hash if first > 0 else None
        for i in range(first, num_full):
            page = self.pages[page_ids[i]]
            page.token_ids = tuple(token_ids[i * self.page_size : (i + 1) * self.page_size])
            page.hash = prev_hash = chain_hash(prev_hash, page.token_ids)
            self._cached.setdefault(page.hash, page.page_id)

    def _ref(self, page_id: int) -> None:
        page = self.pages[page_id]
        if page.ref_count == 0:
            del self._free[page_id]
        page.ref_count += 1
