"""Load generator for any OpenAI-compatible server: throughput, TTFT and TPOT percentiles.

Sends streamed /v1/completions (or /v1/chat/completions) requests, either keeping a fixed number
in flight (--concurrency) or arriving as a Poisson process (--request-rate), with prompt and
output lengths drawn uniformly around a mean from a seeded generator, so two runs with the same
flags send the same workload. Prints a table, optionally writes JSON and a plot (matplotlib only
if installed).

    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --num-requests 200 \
        --concurrency 32 --input-len 256 --output-len 128 --json out.json --plot out.png
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import sys
import time

import httpx
import numpy as np

WORDS = ["time", "person", "year", "way", "day", "thing", "man", "world", "life", "hand", "part", "child", "eye", "woman", "place", "work", "week", "case", "point", "number", "group", "problem", "fact", "river", "stone", "light", "water", "music", "paper", "window"]


@dataclasses.dataclass
class Result:
    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def make_workload(args: argparse.Namespace) -> list[tuple[str, int, int]]:
    """(prompt, prompt length in words, max_tokens) per request, from the seeded generator."""
    rng = random.Random(args.seed)

    def draw(mean: int, spread: float) -> int:
        return max(1, round(mean * rng.uniform(1 - spread, 1 + spread)))

    workload = []
    for _ in range(args.num_requests):
        words = draw(args.input_len, args.input_len_range)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        workload.append((prompt, words, draw(args.output_len, args.output_len_range)))
    return workload


def request_body(args: argparse.Namespace, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": args.temperature}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


async def one_request(client: httpx.AsyncClient, args, model: str, prompt: str, words: int,
                      max_tokens: int) -> Result:
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    result = Result(ok=False, prompt_len=words)
    start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with client.stream("POST", path,
                                 json=request_body(args, model, prompt, max_tokens)) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    result.prompt_len = event["usage"]["prompt_tokens"]
                    result.output_tokens = event["usage"]["completion_tokens"]
                choices = event.get("choices") or []
                text = "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                               for c in choices)
                if text:
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
    except httpx.HTTPError as error:
        result.error = repr(error)
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no tokens streamed"
    return result


async def run(args: argparse.Namespace) -> tuple[list[Result], float]:
    timeout = httpx.Timeout(args.timeout)
    limits = httpx.Limits(max_connections=max(args.concurrency, 1) + 8)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=timeout, limits=limits) as client:
        model = args.model
        if model is None:
            response = await client.get("/v1/models")
            response.raise_for_status()
            model = response.json()["data"][0]["id"]
        workload = make_workload(args)
        semaphore = asyncio.Semaphore(args.concurrency or len(workload))
        arrivals = np.random.default_rng(args.seed)

        async def limited(item) -> Result:
            async with semaphore:
                return await one_request(client, args, model, *item)

        start = time.perf_counter()
        tasks = []
        for item in workload:
            tasks.append(asyncio.create_task(limited(item)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(arrivals.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def percentiles(values: list[float], name: str, scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {}
    array = np.asarray(values) * scale
    return {f"mean_{name}": float(array.mean()),
            **{f"p{q}_{name}": float(np.percentile(array, q)) for q in (50, 90, 99)}}


def summarize(results: list[Result], duration: float) -> dict[str, float]:
    done = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_len for r in done)
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration,
    }
    summary |= percentiles([r.ttft for r in done], "ttft_ms")
    summary |= percentiles([t for r in done if (t := r.tpot) is not None], "tpot_ms")
    summary |= percentiles([x for r in done for x in r.itl], "itl_ms")
    summary |= percentiles([r.latency for r in done], "e2e_latency_ms")
    return summary


def print_table(summary: dict[str, float]) -> None:
    width = max(len(k) for k in summary)
    print("-" * (width + 16))
    for key, value in summary.items():
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown:>12}")
    print("-" * (width + 16))


def plot(results: list[Result], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.ok]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].hist([r.ttft * 1000 for r in done], bins=30)
    axes[0].set_xlabel("TTFT (ms)")
    axes[1].hist([r.tpot * 1000 for r in done if r.tpot is not None], bins=30)
    axes[1].set_xlabel("TPOT (ms)")
    for ax in axes:
        ax.set_ylabel("requests")
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name; default: the server's first")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=16,
                        help="requests in flight at most; 0 = unlimited")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Poisson arrival rate in requests/s; inf = all at once")
    parser.add_argument("--input-len", type=int, default=128, help="mean prompt length in words")
    parser.add_argument("--input-len-range", type=float, default=0.5,
                        help="prompt lengths are uniform in mean * (1 +- this)")
    parser.add_argument("--output-len", type=int, default=64, help="mean max_tokens")
    parser.add_argument("--output-len-range", type=float, default=0.5)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="ask the server to ignore EOS (a vLLM-style extra field)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--json", default=None, help="write the summary and per-request data")
    parser.add_argument("--plot", default=None, help="write TTFT/TPOT histograms (PNG)")
    args = parser.parse_args(argv)
    if args.num_requests < 1:
        parser.error(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.concurrency < 0:
        parser.error(f"--concurrency must be >= 0, got {args.concurrency}")
    if args.request_rate <= 0:
        parser.error(f"--request-rate must be > 0, got {args.request_rate}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results, duration = asyncio.run(run(args))
    summary = summarize(results, duration)
    print_table(summary)
    for failure in [r for r in results if not r.ok][:5]:
        print(f"failed: {failure.error}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "request_rate"}
                       | {"request_rate": str(args.request_rate)},
                       "summary": summary,
                       "requests": [dataclasses.asdict(r) for r in results]}, f, indent=1)
    if args.plot:
        plot(results, args.plot)
    return 0 if summary["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
