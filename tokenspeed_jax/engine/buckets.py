"""The bucket ladders a runner compiles: token buckets, prefill and decode request-count buckets.

Invariants: a ``Buckets`` is frozen; ``from_config`` builds its ladders ascending from the
``EngineConfig`` (an empty ladder: that route is off); a decode executable has at least
``MIN_DECODE_ROWS`` rows (``decode_rows``), whichever bucket it serves.
"""

from __future__ import annotations

import dataclasses

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.graph import (
    batch_ladder,
    choose_bucket,
    explicit_ladder,
    skeleton,
    token_ladder,
)

# XLA on GPUs rewrites a one-row matrix product as a multiply and a reduce that it does not fuse,
# writing each weight out whole: a one-request decode step runs on two rows instead, which is
# faster.
MIN_DECODE_ROWS = 2


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The bucket ladders a runner compiles; empty tuples mean that route is off."""

    tokens: tuple[int, ...]
    prefill_requests: tuple[int, ...]
    decode_requests: tuple[int, ...]

    @classmethod
    def from_config(cls, config: EngineConfig, *, prefill: bool, decode: bool) -> Buckets:
        tokens: tuple[int, ...] = ()
        requests: tuple[int, ...] = ()
        if prefill and config.prefill_graph_enabled:
            top = config.prefill_token_limit
            tokens = (token_ladder(top) if config.prefill_graph_capture_token_sizes is None
                      else explicit_ladder(config.prefill_graph_capture_token_sizes, top))
            max_bs = min(config.prefill_graph_max_bs, top)
            requests = (batch_ladder(max_bs) if config.prefill_graph_capture_batch_sizes is None
                        else explicit_ladder(config.prefill_graph_capture_batch_sizes, max_bs))
        decode_requests: tuple[int, ...] = ()
        if decode and not config.enforce_eager:
            max_bs = config.decode_graph_max_bs
            decode_requests = (
                batch_ladder(max_bs) if config.decode_graph_capture_batch_sizes is None
                else explicit_ladder(config.decode_graph_capture_batch_sizes, max_bs))
        return cls(tokens, requests, decode_requests)

    def decode_rows(self, count: int) -> int:
        """Rows of the decode executable that runs ``count`` requests: their bucket, but at least
        ``MIN_DECODE_ROWS`` (extra rows are padding requests)."""
        return max(choose_bucket(self.decode_requests, count), MIN_DECODE_ROWS)

    @property
    def decode_executables(self) -> tuple[int, ...]:
        """The row counts of the decode executables: one per bucket, small buckets merged."""
        return tuple(sorted({max(rows, MIN_DECODE_ROWS) for rows in self.decode_requests}))

    def skeleton(self) -> Buckets:
        """The rungs compiled before serving when the rest compile in the background: token
        buckets about 4x apart from the smallest to the largest (``graph.skeleton``), and the
        smallest and largest request-count buckets of prefill and decode. Empty ladders (routes
        that are off) stay empty."""
        def ends(ladder: tuple[int, ...]) -> tuple[int, ...]:
            return skeleton(ladder, None) if ladder else ()

        return Buckets(skeleton(self.tokens) if self.tokens else (), ends(self.prefill_requests),
                       ends(self.decode_requests))
