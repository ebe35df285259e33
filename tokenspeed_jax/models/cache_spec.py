"""A model's cache as its family declares it: named pools of KV pages or of state rows.

A ``CachePool`` is one device array a runner allocates once and donates at every step: either
per page of the paged cache (``per = PAGE``: K/V pages, latent pages) or per state row
(``per = SLOT``: one row a running request, e.g. KDA's recurrent state and conv window). A
family lists its pools once (``Family.cache_pools``); from that list come the bytes of one page
and of one state row, with which start-up sizes the cache from free memory, and the arrays the
runner allocates, so the sizing and the allocation cannot disagree.

Invariants:

* A pool's shape is its ``unit_shape`` with the count (pages or rows) inserted at
  ``count_axis``; one unit's bytes are the product of ``unit_shape`` times the itemsize.
* ``spec`` is the pool's tensor-parallel split (``PartitionSpec`` of the full shape, empty =
  replicated): a pool split over N devices holds 1/N of each unit on every device, and the
  per-device bytes of a unit round up.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

REPLICATED = PartitionSpec()
PAGE = "page"  # one unit per page of the paged cache
SLOT = "slot"  # one unit per state row (one per running request)


@dataclasses.dataclass(frozen=True)
class CachePool:
    """One named cache array (module docstring)."""

    name: str
    per: str
    unit_shape: tuple[int, ...]
    dtype: Any
    count_axis: int = 0
    spec: PartitionSpec = REPLICATED

    def __post_init__(self) -> None:
        if self.per not in (PAGE, SLOT):
            raise ValueError(f"pool {self.name}: per must be {PAGE!r} or {SLOT!r}, got "
                             f"{self.per!r}")
        if not 0 <= self.count_axis <= len(self.unit_shape):
            raise ValueError(f"pool {self.name}: count_axis={self.count_axis} does not fit "
                             f"unit_shape={self.unit_shape}")

    def shape(self, count: int) -> tuple[int, ...]:
        """The pool's shape holding ``count`` pages or rows."""
        axis = self.count_axis
        return (*self.unit_shape[:axis], count, *self.unit_shape[axis:])

    def unit_bytes(self, devices: int = 1) -> int:
        """Bytes of one page or row of this pool on one of ``devices`` devices."""
        total = math.prod(self.unit_shape) * np.dtype(self.dtype).itemsize
        split = devices if any(axis is not None for axis in self.spec) else 1
        return -(-total // split)


def unit_bytes(pools: Iterable[CachePool], per: str, devices: int = 1) -> int:
    """Bytes of one page (``per = PAGE``) or one state row (``SLOT``) over every pool of that
    kind, on one of ``devices`` devices."""
    return sum(pool.unit_bytes(devices) for pool in pools if pool.per == per)


def pool_specs(pools: Iterable[CachePool], counts: Mapping[str, int],
               mesh: Mesh | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    """Name -> the ``ShapeDtypeStruct`` of each pool holding ``counts[pool.per]`` units, on
    ``mesh`` with the pool's split (None: one device)."""
    return {pool.name: jax.ShapeDtypeStruct(
        pool.shape(counts[pool.per]), pool.dtype,
        sharding=None if mesh is None else NamedSharding(mesh, pool.spec)) for pool in pools}
