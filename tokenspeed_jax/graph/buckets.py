"""Shape buckets: the token ladder, request-count ladders, bucket choice and padding.

Every executable is compiled for a fixed shape, so live sizes are rounded up to a *bucket* and the
rest is padding. Invariants:

* A ladder is sorted, strictly increasing, positive, and always ends at its maximum.
* The token ladder starts at ``TOKEN_FLOOR`` and each rung's step is the largest power of two
  <= rung / ``STEP_DIVISOR``, clamped to [``MIN_STEP``, ``MAX_STEP``]; so above 128 tokens a
  request never pads by more than 1/8 (12.5%) of its bucket.
* ``choose_bucket`` returns the smallest bucket that fits, or None when nothing fits (the caller
  then takes a fallback route; this module never picks a bucket that is too small).
* ``skeleton`` picks a few rungs of a ladder to compile first (the rest can follow in the
  background): always its smallest and its largest, so whatever fits the ladder fits the
  skeleton, at the price of more padding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

TOKEN_FLOOR = 16  # smallest token bucket: below it dispatch, not padding, dominates
STEP_DIVISOR = 8  # step <= size / 8 keeps padding waste under 12.5%
MIN_STEP = 16  # small rungs: finer steps would multiply executables for no measurable gain
MAX_STEP = 512  # large rungs: 512-token steps already waste < 12.5% above 4096
DEFAULT_DECODE_MAX_BS = 160
SMALL_BATCH_BUCKETS = (1, 2, 4, 8)
BATCH_STEP = 16  # above 8 requests, weight reads dominate and 16-row steps cost little
# Skeleton token rungs about 4x apart: a prompt pads to at most about 4x its size until the rest
# of the ladder is compiled, from six rungs for the default ladder to 8192 (16, 32, 128, ...).
SKELETON_RATIO = 4


def _largest_power_of_two_at_most(x: float) -> int:
    power = 1
    while power * 2 <= x:
        power *= 2
    return power


def token_step(size: int) -> int:
    """The distance from rung ``size`` to the next rung of the token ladder."""
    return min(max(_largest_power_of_two_at_most(size / STEP_DIVISOR), MIN_STEP), MAX_STEP)


def token_ladder(max_tokens: int) -> tuple[int, ...]:
    """The default token buckets up to and including ``max_tokens``."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    rungs = []
    size = TOKEN_FLOOR
    while size < max_tokens:
        rungs.append(size)
        size += token_step(size)
    rungs.append(max_tokens)
    return tuple(rungs)


def explicit_ladder(sizes: Iterable[int], max_size: int) -> tuple[int, ...]:
    """A user's bucket list, filtered to (0, max_size], sorted, with ``max_size`` always kept."""
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    kept = {int(s) for s in sizes if 0 < int(s) <= max_size}
    kept.add(max_size)
    return tuple(sorted(kept))


def batch_ladder(max_bs: int) -> tuple[int, ...]:
    """Request-count buckets: 1, 2, 4, 8, then steps of ``BATCH_STEP``, ending at ``max_bs``."""
    if max_bs < 1:
        raise ValueError(f"max_bs must be >= 1, got {max_bs}")
    rungs = [b for b in SMALL_BATCH_BUCKETS if b < max_bs]
    rungs += range(BATCH_STEP, max_bs, BATCH_STEP)
    return tuple(sorted(set(rungs))) + (max_bs,)


def skeleton(ladder: Sequence[int], ratio: float | None = SKELETON_RATIO) -> tuple[int, ...]:
    """The rungs of ``ladder`` to compile first: its smallest and its largest and, with a
    ``ratio``, the rung nearest (on a log scale) to each ``largest / ratio**k`` above the
    smallest. ``ratio=None``: the two ends only."""
    if not ladder:
        raise ValueError("a skeleton needs a non-empty ladder")
    if ratio is not None and ratio <= 1:
        raise ValueError(f"ratio must be > 1 (or None), got {ratio}")
    smallest, largest = ladder[0], ladder[-1]
    chosen = {smallest, largest}
    target = largest / ratio if ratio is not None else 0
    while target > smallest:
        chosen.add(min(ladder, key=lambda rung: abs(math.log(rung / target))))
        target /= ratio
    return tuple(sorted(chosen))


def choose_bucket(buckets: Sequence[int], size: int) -> int | None:
    """The smallest bucket >= size, or None when size exceeds every bucket."""
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")
    for bucket in buckets:
        if bucket >= size:
            return bucket
    return None


def padding_waste(size: int, bucket: int) -> float:
    """The fraction of ``bucket`` that is padding when ``size`` items run in it."""
    if not 0 < size <= bucket:
        raise ValueError(f"size={size} must be in (0, bucket={bucket}]")
    return (bucket - size) / bucket
