"""Prometheus metrics of the server, kept in one private ``prometheus_client`` registry per app.

Invariants:

* Each ``ServerMetrics`` owns its ``CollectorRegistry``, never the process-wide default one, so
  several apps in one process (the tests start many) never share or clash on a series.
* Request-level metrics (finished requests by finish reason, prompt and generated tokens, the
  TTFT, TPOT and end-to-end latency histograms) are updated on the event loop as requests finish.
* Everything else is read from the engine and the runner at scrape time (``EngineCollector``),
  so a scrape shows the state at that moment.
* ``tokenspeed_ready`` is 1 exactly while the engine is attached and its loop is alive.
* Every runner exposes the same statistics whatever the model family (``engine/runner_stats.py``),
  so the metric names do not change with the model.
* A statistic of ``Engine.stats()`` or a runner's ``stats()`` is a counter only when
  ``COUNTERS`` lists it: it starts at zero with the engine and never decreases, which is what
  ``rate()`` relies on. ``GAUGES`` lists the levels. A numeric statistic in neither table (one
  added without being classified) is exposed as a gauge named after its key: a gauge promises
  nothing, so a level is never misread as a counter. Statistics that are not numbers are skipped.
* Every metric name starts with ``tokenspeed_``; every counter's ends with ``_total``.
  prometheus_client adds a ``_created`` gauge (creation time) beside each request-level counter
  and histogram.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# statistic -> (metric name, help): counts since start-up, first the engine's, then the runners'.
COUNTERS: dict[str, tuple[str, str]] = {
    "num_steps": ("tokenspeed_engine_steps_total", "Engine steps run."),
    "num_overlapped_steps": (
        "tokenspeed_engine_overlapped_steps_total",
        "Decode steps launched before the previous step's tokens reached the host."),
    "num_preemptions": ("tokenspeed_num_preemptions_total", "Requests preempted by recompute."),
    "prefix_query_tokens": (
        "tokenspeed_prefix_cache_query_tokens_total",
        "Prompt tokens looked up in the prefix cache (at each request's first admission)."),
    "prefix_hit_tokens": (
        "tokenspeed_prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache."),
    "kda_checkpoints_written": (
        "tokenspeed_kda_checkpoints_written_total", "KDA state checkpoints written."),
    "kda_checkpoint_hits": (
        "tokenspeed_kda_checkpoint_hits_total", "Prefix lookups that found a KDA checkpoint."),
    "prefill_runs": (
        "tokenspeed_prefill_runs_total", "Compiled prefill and extend steps, on any route."),
    "ordinary_runs": (
        "tokenspeed_ordinary_runs_total",
        "Compiled prefill steps with each recurrent layer's kernel at a break (0 without one)."),
    "decode_runs": ("tokenspeed_decode_runs_total", "Compiled decode steps."),
    "eager_runs": (
        "tokenspeed_eager_runs_total", "Forwards run op by op, at their exact size."),
    "chunked_prefill_splits": (
        "tokenspeed_chunked_prefill_splits_total",
        "Extra prefill runs from splitting a step's tokens over the largest token bucket."),
    "request_splits": (
        "tokenspeed_request_splits_total",
        "Extra prefill runs from splitting a step's requests over the largest request bucket."),
    "decode_splits": (
        "tokenspeed_decode_splits_total",
        "Extra decode runs from splitting a step's requests over the largest decode bucket."),
    "mixed_splits": (
        "tokenspeed_mixed_splits_total",
        "Mixed steps run as their decode rows and the rest, separately."),
    "real_tokens": ("tokenspeed_real_tokens_total", "Request tokens run."),
    "padded_tokens": ("tokenspeed_padded_tokens_total", "Padding tokens run to fill a bucket."),
    "kda_state_restores": (
        "tokenspeed_kda_state_restores_total", "KDA states restored from a checkpoint."),
    "resample_runs": (
        "tokenspeed_resample_runs_total",
        "Runs of the full sampler (penalties, top-k or top-p, log-probabilities)."),
    "runtime_compiles": (
        "tokenspeed_runtime_compiles_total",
        "XLA compiles while serving, outside declared eager fallbacks."),
    "eager_compiles": (
        "tokenspeed_eager_compiles_total", "XLA compiles inside declared eager fallbacks."),
}

# statistic -> (metric name, help): levels, which go up and down.
GAUGES: dict[str, tuple[str, str]] = {
    "num_running": ("tokenspeed_num_requests_running", "Requests holding KV pages."),
    "num_waiting": ("tokenspeed_num_requests_waiting", "Requests queued."),
    "kv_pages_used": ("tokenspeed_kv_pages_used", "KV pages in use."),
    "kv_pages_total": ("tokenspeed_kv_pages_capacity", "KV pages in the cache."),
    "state_slots_used": ("tokenspeed_state_slots_used", "Live KDA state slots in use."),
    "state_slots_total": ("tokenspeed_state_slots_capacity", "Live KDA state slots."),
    "decode_device_bound": (
        "tokenspeed_engine_decode_device_bound",
        "1 while the last synchronous decode step found the device busy after its launch."),
    "padding_waste": (
        "tokenspeed_padding_waste", "Padding tokens / all tokens run, since start-up."),
    "buckets_ready": (
        "tokenspeed_buckets_ready",
        "Buckets (token, prefill request and decode ladder rungs) whose executables are ready."),
    "buckets_total": (
        "tokenspeed_buckets_capacity",
        "Buckets of every ladder, ready or still compiling in the background."),
    "plans_untuned": (
        "tokenspeed_plans_untuned",
        "Quick skeleton plans (not autotuned) serving until their autotuned ones land."),
}


@dataclasses.dataclass(frozen=True)
class EngineReading:
    """What one scrape reads from the engine: whether its loop is alive, and the statistics of
    ``Engine.stats()`` and the runner's ``stats()`` in one mapping."""

    alive: bool
    stats: Mapping[str, object]


class EngineCollector(Collector):
    """The engine's metrics, read through ``read`` (None until an engine is attached) at every
    scrape."""

    def __init__(self, read: Callable[[], EngineReading | None]):
        self._read = read

    def collect(self) -> Iterator[Metric]:
        reading = self._read()
        yield GaugeMetricFamily("tokenspeed_ready", "1 while the engine serves requests.",
                                value=float(reading is not None and reading.alive))
        if reading is None:
            return
        stats = reading.stats
        for key, value in stats.items():
            if not isinstance(value, (int, float)):
                continue
            if key in COUNTERS:
                yield CounterMetricFamily(*COUNTERS[key], value=value)
            else:
                name, help_text = GAUGES.get(key, (f"tokenspeed_{key}", f"Statistic {key}."))
                yield GaugeMetricFamily(name, help_text, value=value)
        yield GaugeMetricFamily("tokenspeed_kv_cache_usage_ratio", "Fraction of KV pages in use.",
                                value=stats["kv_pages_used"] / stats["kv_pages_total"])
        queried = stats["prefix_query_tokens"]
        yield GaugeMetricFamily(
            "tokenspeed_prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens looked up, since start-up.",
            value=stats["prefix_hit_tokens"] / queried if queried else 0.0)


class ServerMetrics:
    """The app's registry: request-level counters and latency histograms, and the engine's
    metrics read at scrape time through ``read_engine``."""

    def __init__(self, read_engine: Callable[[], EngineReading | None]):
        self.registry = CollectorRegistry()
        self.requests = Counter("tokenspeed_requests_total", "Finished requests by finish reason.",
                                ["finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("tokenspeed_prompt_tokens_total", "Prompt tokens accepted.",
                                     registry=self.registry)
        self.generation_tokens = Counter("tokenspeed_generation_tokens_total",
                                         "Tokens generated.", registry=self.registry)
        self.ttft = Histogram("tokenspeed_time_to_first_token_seconds", "Arrival to first token.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("tokenspeed_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, per request.",
                              buckets=TOKEN_LATENCY_BUCKETS, registry=self.registry)
        self.latency = Histogram("tokenspeed_e2e_request_latency_seconds",
                                 "Arrival to last token.", buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        self.registry.register(EngineCollector(read_engine))

    def observe_request(
        self,
        *,
        finish_reason: str,
        num_prompt_tokens: int,
        num_output_tokens: int,
        arrival: float,
        first_token: float | None,
        end: float,
    ) -> None:
        self.requests.labels(finish_reason=finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        self.latency.observe(end - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if num_output_tokens > 1:
                self.tpot.observe((end - first_token) / (num_output_tokens - 1))
