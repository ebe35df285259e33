"""Scheduling policy against a fake model that reads its context back from the KV pages.

The fake runner writes each step's tokens into a paged store through the page table and picks
the next token from the whole context it reads back through the same table. The expectation is
computed from the plain token list, so any wrong page table, prefix hit, preemption or chunk
boundary changes the outputs.
"""

import numpy as np
import pytest

from tokenspeed_jax.engine.batch import StepBatch
from tokenspeed_jax.engine.block_manager import BlockManager
from tokenspeed_jax.engine.request import Request
from tokenspeed_jax.engine.scheduler import Scheduler
from tokenspeed_jax.sampling_params import SamplingParams

VOCAB = 97


def next_token(context: list[int]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(context)) + len(context)) % VOCAB


def reference_outputs(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class PagedFakeRunner:
    def __init__(self, num_pages: int, page_size: int):
        self.page_size = page_size
        self.kv = np.full((num_pages, page_size), -1, dtype=np.int64)

    def step(self, batch: StepBatch) -> list[int]:
        sampled = []
        for r in batch.requests:
            for j, token in enumerate(r.token_ids):
                pos = r.start_pos + j
                self.kv[r.page_table[pos // self.page_size], pos % self.page_size] = token
            if r.sample:
                context = [
                    int(self.kv[r.page_table[p // self.page_size], p % self.page_size])
                    for p in range(r.end_pos)
                ]
                sampled.append(next_token(context))
        return sampled


def run_to_completion(scheduler: Scheduler, runner, requests, max_steps=10_000, check=None):
    """Drive ``scheduler`` with ``runner`` until every request has its max_tokens; the batches.
    ``check(scheduler)``, if given, runs after each schedule()."""
    for request in requests:
        scheduler.add(request)
    batches = []
    for _ in range(max_steps):
        if not scheduler.has_work:
            return batches
        step = scheduler.schedule()
        assert not step.is_empty, "scheduler stalled with work left"
        if check is not None:
            check(scheduler)
        batches.append(step.batch)
        sampled = iter(runner.step(step.batch))
        scheduler.after_step(step)
        for request, step_request in zip(step.requests, step.batch.requests):
            if step_request.sample:
                request.token_ids.append(next(sampled))
                if request.num_output_tokens == request.params.max_tokens:
                    scheduler.finish(request, "length")
    raise AssertionError("requests did not finish")


def make_requests(rng, count, shared_prefix=()):
    requests = []
    for i in range(count):
        prompt = list(shared_prefix) + rng.integers(0, VOCAB, rng.integers(1, 20)).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(1, 20)), temperature=0.0)
        requests.append(Request(f"r{i}", prompt, params))
    return requests


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_outputs_match_reference_under_preemption(prefix_caching):
    rng = np.random.default_rng(0)
    manager = BlockManager(num_pages=12, page_size=4, enable_prefix_caching=prefix_caching)
    scheduler = Scheduler(manager, max_num_seqs=6, max_num_batched_tokens=16)
    runner = PagedFakeRunner(12, 4)
    requests = make_requests(rng, 24, shared_prefix=[5, 6, 7, 8, 9, 10, 11, 12, 13])
    run_to_completion(scheduler, runner, requests)
    assert scheduler.num_preemptions > 0
    for request in requests:
        assert request.finish_reason == "length"
        assert request.output_token_ids == reference_outputs(
            request.prompt_token_ids, request.params.max_tokens
        )
    assert manager.num_free_pages == manager.num_pages
    if prefix_caching:
        assert scheduler.prefix_hit_tokens > 0
    else:
        assert scheduler.prefix_hit_tokens == 0


def test_chunked_prefill_respects_token_budget_and_samples_on_last_chunk():
    manager = BlockManager(num_pages=32, page_size=4)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=8)
    long = Request("long", list(range(1, 21)), SamplingParams(max_tokens=2, temperature=0.0))
    batches = run_to_completion(scheduler, PagedFakeRunner(32, 4), [long])
    chunks = [(b.requests[0].start_pos, b.requests[0].num_tokens, b.requests[0].sample)
              for b in batches]
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True), (20, 1, True)]
    assert long.output_token_ids == reference_outputs(long.prompt_token_ids, 2)


def test_decodes_go_first_and_share_the_budget_with_a_prefill():
    manager = BlockManager(num_pages=32, page_size=4)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=6)
    short = Request("short", [1, 2], SamplingParams(max_tokens=5, temperature=0.0))
    scheduler.add(short)
    step = scheduler.schedule()
    scheduler.after_step(step)
    short.token_ids.append(3)
    scheduler.add(Request("long", list(range(30)), SamplingParams(max_tokens=1)))
    step = scheduler.schedule()
    assert [(r.request_id, r.num_tokens) for r in step.batch.requests] == [("short", 1), ("long", 5)]


def test_max_num_seqs_caps_running_requests():
    rng = np.random.default_rng(1)
    manager = BlockManager(num_pages=64, page_size=4)
    scheduler = Scheduler(manager, max_num_seqs=3, max_num_batched_tokens=64)
    batches = run_to_completion(scheduler, PagedFakeRunner(64, 4), make_requests(rng, 10))
    assert max(len(b.requests) for b in batches) == 3


def test_prefix_hit_starts_after_cached_pages():
    manager = BlockManager(num_pages=16, page_size=4)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=64)
    runner = PagedFakeRunner(16, 4)
    prompt = list(range(1, 11))
    first = Request("a", prompt, SamplingParams(max_tokens=3, temperature=0.0))
    run_to_completion(scheduler, runner, [first])
    second = Request("b", prompt + [40], SamplingParams(max_tokens=3, temperature=0.0))
    batches = run_to_completion(scheduler, runner, [second])
    assert batches[0].requests[0].start_pos == 8
    assert second.num_cached_tokens == 8
    assert second.output_token_ids == reference_outputs(second.prompt_token_ids, 3)


def test_abort_frees_pages_of_running_and_waiting_requests():
    manager = BlockManager(num_pages=8, page_size=4)
    scheduler = Scheduler(manager, max_num_seqs=1, max_num_batched_tokens=64)
    running = Request("run", list(range(9)), SamplingParams())
    waiting = Request("wait", list(range(5)), SamplingParams())
    scheduler.add(running)
    scheduler.add(waiting)
    scheduler.schedule()
    assert manager.num_free_pages == 8 - 3
    scheduler.finish(running, "abort")
    scheduler.finish(waiting, "abort")
    assert not scheduler.has_work
    assert manager.num_free_pages == 8
    assert (running.finish_reason, waiting.finish_reason) == ("abort", "abort")
