"""Prometheus metrics of the server, in the text exposition format (version 0.0.4).

Counters and histograms are updated on the event loop as requests finish; gauges are read from
the engine and the runner at scrape time, so a scrape always shows the current state. Every
metric name starts with ``tokenspeed_``. Histogram buckets are cumulative and end at ``+Inf``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


def _number(value: float) -> str:
    return repr(float(value)) if value != float("inf") else "+Inf"


class Counter:
    def __init__(self, name: str, help_text: str):
        self.name, self.help = name, help_text
        self.values: dict[tuple[tuple[str, str], ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        values = self.values or {(): 0.0}
        lines += [f"{self.name}{_labels(dict(k))} {_number(v)}" for k, v in values.items()]
        return lines


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help = name, help_text
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        lines += [f"{self.name}_sum {_number(self.sum)}", f"{self.name}_count {cumulative}"]
        return lines


class ServerMetrics:
    """Request-level counters and latency histograms, plus gauges read at scrape time."""

    def __init__(self, read_gauges: Callable[[], Mapping[str, tuple[str, float]]]):
        self.requests = Counter("tokenspeed_requests_total", "Finished requests by finish reason.")
        self.prompt_tokens = Counter("tokenspeed_prompt_tokens_total", "Prompt tokens accepted.")
        self.generation_tokens = Counter(
            "tokenspeed_generation_tokens_total", "Tokens generated."
        )
        self.ttft = Histogram(
            "tokenspeed_time_to_first_token_seconds", "Arrival to first token.", LATENCY_BUCKETS
        )
        self.tpot = Histogram(
            "tokenspeed_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.latency = Histogram(
            "tokenspeed_e2e_request_latency_seconds", "Arrival to last token.", LATENCY_BUCKETS
        )
        self._read_gauges = read_gauges

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
        self.requests.inc(finish_reason=finish_reason)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        self.latency.observe(end - arrival)
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if num_output_tokens > 1:
                self.tpot.observe((end - first_token) / (num_output_tokens - 1))

    def render(self) -> str:
        lines: list[str] = []
        for metric in (self.requests, self.prompt_tokens, self.generation_tokens,
                       self.ttft, self.tpot, self.latency):
            lines += metric.render()
        for name, (help_text, value) in self._read_gauges().items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge",
                      f"{name} {_number(value)}"]
        return "\n".join(lines) + "\n"
