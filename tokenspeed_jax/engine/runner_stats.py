"""The statistics every runner exposes, one vocabulary for every model family.

Invariants: a runner's ``stats()`` is ``runner_stats`` of its counters, so every runner has the
same keys whatever family it serves (the server's metric names never change with the model):
the counts of ``COUNTERS`` (a route or a split a family does not have stays at zero), the
resampler's runs, the compiles the guard saw, the padding waste and, once ``compile_all`` has
run, the buckets ready. Every count starts at zero with the runner and never decreases.
``server/metrics.py`` classifies each key as a counter or a gauge.
"""

from __future__ import annotations

from typing import Any

COUNTERS = (
    "prefill_runs",  # compiled prefill and extend steps, on any prefill route
    "ordinary_runs",  # of those, steps with each recurrent layer's kernel at a break
    "decode_runs",  # compiled decode steps
    "eager_runs",  # forwards run op by op at their exact size
    "chunked_prefill_splits",  # extra prefill runs from cutting tokens at the largest bucket
    "request_splits",  # extra prefill runs from cutting requests at the largest bucket
    "decode_splits",  # extra decode runs from cutting requests at the largest decode bucket
    "mixed_splits",  # mixed steps run as their decode rows and the rest
    "real_tokens",  # request tokens run
    "padded_tokens",  # padding tokens run to fill a bucket
    "kda_state_restores",  # recurrent states copied from a prefix checkpoint
)


def new_counters() -> dict[str, int]:
    """Every count of ``COUNTERS`` at zero."""
    return dict.fromkeys(COUNTERS, 0)


def runner_stats(counters: dict[str, int], *, resampler: Any, guard: Any, ladders: Any
                 ) -> dict[str, float]:
    """A runner's statistics (module docstring): ``counters``, then ``resampler.runs``, the
    compile guard's counts, the padding waste since start-up and ``ladders.stats()`` (when the
    runner has compiled)."""
    total = counters["real_tokens"] + counters["padded_tokens"]
    return {
        **counters,
        "resample_runs": resampler.runs,
        "runtime_compiles": guard.runtime_compiles,
        "eager_compiles": guard.allowed_compiles,
        "padding_waste": counters["padded_tokens"] / total if total else 0.0,
        **(ladders.stats() if ladders is not None else {}),
    }
