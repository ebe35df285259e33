"""Continuous-batching policy: which requests run each step, and how many of their tokens.

Pure Python (no JAX). Each step has a token budget (the chunked-prefill size) and a sequence
budget (``max_num_seqs``). Policy, in order:

1. Running requests, oldest first: one token each when decoding, the next chunk of the prompt
   while prefilling. When a request needs a page and none is free, the newest running request is
   preempted by recompute (its pages freed, itself put back at the head of the waiting queue);
   when the newest is the request itself, it is the one preempted.
2. Waiting requests, first come first served, only when nothing was preempted this step: a
   request first takes whatever full pages the prefix cache holds for its tokens, then as many
   new tokens as the budget allows (chunked prefill).

Hybrid models (``state_slots``, recurrent KDA state): a request also needs a live state row to be
admitted (it waits when none is free) and holds it until it finishes, is aborted or preempted. A
prefix hit is kept only up to the longest boundary with a published state checkpoint (the rest of
the hit pages go back); the request's first step copies that checkpoint into its own row. Each
prefill step that starts on a KDA chunk and crosses a checkpoint boundary stores the state there
when a checkpoint row is free or evictable.

Running ahead (``schedule_ahead``): the decode step after a decode step, built before that
step's tokens reach the host. Each request gets a page for one more position, its input token
comes from the previous step's output on the device (``StepRequest.token_row``), and it is built
only when every row fits in the free pages (never preempts). A request that finishes meanwhile
(a stop token, a stop string, an abort) keeps its row in the step, and ``after_step`` skips it.

Invariants: no accepted request is ever dropped (preemption only delays it); at most
``max_num_seqs`` requests hold pages; a step never schedules more than the token budget; a
request is in exactly one of ``waiting``, ``running`` or neither (finished).
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np

from tokenspeed_jax.engine.batch import StepBatch, StepRequest
from tokenspeed_jax.engine.block_manager import BlockManager
from tokenspeed_jax.engine.request import Request, RequestStatus
from tokenspeed_jax.engine.state_slots import StateSlots


@dataclasses.dataclass
class ScheduledStep:
    """A batch for the runner and the engine-side requests behind it, in the same order."""

    batch: StepBatch
    requests: list[Request]

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        state_slots: StateSlots | None = None,
    ):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.state_slots = state_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def can_admit(self) -> bool:
        """Whether the next waiting request could start now: a sequence slot, a free page and,
        for hybrid models, a free state row."""
        return (bool(self.waiting) and len(self.running) < self.max_num_seqs
                and self.block_manager.num_free_pages > 0
                and (self.state_slots is None or self.state_slots.num_free > 0))

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def finish(self, request: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Take a request out of the queues for good and give back its pages."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        else:
            return
        self._release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason

    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preemptions_before = self.num_preemptions
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._grow(
                request, min(request.num_tokens - request.num_computed_tokens, budget)
            )
            if num_new == 0:
                break  # the request preempted itself: it was the last one running
            scheduled.append((request, num_new))
            budget -= num_new
            i += 1
        if self.num_preemptions == preemptions_before:
            self._admit(scheduled, budget)
        return self._build(scheduled)

    def schedule_ahead(self, requests: list[Request], token_rows: list[int]
                       ) -> ScheduledStep | None:
        """The decode step of ``requests`` right after the decode step whose rows ``token_rows``
        sampled their next tokens; None when their new pages do not all fit (module docstring)."""
        manager = self.block_manager
        need = [manager.pages_for(r.num_computed_tokens + 1) - len(r.page_ids) for r in requests]
        if sum(need) > manager.num_free_pages:
            return None
        step_requests = []
        for request, pages, row in zip(requests, need, token_rows):
            request.page_ids += manager.allocate(pages)
            step_requests.append(StepRequest(
                request_id=request.request_id, token_ids=np.zeros(1, np.int32),
                start_pos=request.num_computed_tokens,
                page_table=np.asarray(request.page_ids, dtype=np.int32), sample=True,
                params=request.params, output_token_ids=[*request.output_token_ids, 0],
                state_slot=request.state_slot, token_row=row, grammar=request.grammar))
        return ScheduledStep(StepBatch(step_requests), list(requests))

    def after_step(self, step: ScheduledStep) -> None:
        """Advance every scheduled request past the tokens the step wrote; cache full pages.
        Requests that finished while the step ran (it ran ahead of them) are skipped."""
        for request, step_request in zip(step.requests, step.batch.requests):
            if request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens = step_request.end_pos
            self.block_manager.commit(
                request.page_ids, request.token_ids, request.num_computed_tokens
            )
        if self.state_slots is not None:
            self.state_slots.publish()

    def _grow(self, request: Request, num_new: int) -> int:
        """Give a running request pages for up to ``num_new`` more tokens; return how many fit.

        A prefill chunk shrinks to the free pages; only when not even one token fits is the
        newest running request preempted, repeatedly. Returns 0 when the request itself was.
        """
        while True:
            fits = self._tokens_that_fit(request.num_computed_tokens, len(request.page_ids))
            if fits >= 1:
                break
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return 0
        num_new = min(num_new, fits)
        manager = self.block_manager
        need = manager.pages_for(request.num_computed_tokens + num_new) - len(request.page_ids)
        request.page_ids += manager.allocate(max(need, 0))
        return num_new

    def _tokens_that_fit(self, num_computed: int, num_pages_held: int) -> int:
        manager = self.block_manager
        return (num_pages_held + manager.num_free_pages) * manager.page_size - num_computed

    def _release(self, request: Request) -> None:
        """Give back a request's pages and state row."""
        self.block_manager.free(request.page_ids)
        request.page_ids = []
        if request.state_slot >= 0:
            self.state_slots.release(request.state_slot)
        request.state_slot = request.restore_slot = -1

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit(self, scheduled: list[tuple[Request, int]], budget: int) -> None:
        manager = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self.state_slots is not None and not self.state_slots.num_free:
                break
            cached, restore = self._prefix_hit(request)
            num_cached = len(cached) * manager.page_size
            num_new = min(
                request.num_tokens - num_cached, budget, self._tokens_that_fit(num_cached, len(cached))
            )
            if num_new < 1:
                manager.free(cached)
                break
            need = manager.pages_for(num_cached + num_new) - len(cached)
            self.waiting.popleft()
            request.page_ids = cached + manager.allocate(need)
            request.num_computed_tokens = num_cached
            if self.state_slots is not None:
                request.state_slot = self.state_slots.acquire()
                request.restore_slot = restore
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
                self.prefix_query_tokens += request.num_tokens
                self.prefix_hit_tokens += num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append((request, num_new))
            budget -= num_new

    def _prefix_hit(self, request: Request) -> tuple[list[int], int]:
        """The cached pages a request starts from, and the checkpoint row to restore (or -1)."""
        manager = self.block_manager
        cached = manager.acquire_prefix(request.token_ids)
        if self.state_slots is None or not cached:
            return cached, -1
        keep, row = self.state_slots.find([manager.pages[p].hash for p in cached])
        manager.free(cached[keep:])
        return cached[:keep], row

    def _build(self, scheduled: list[tuple[Request, int]]) -> ScheduledStep:
        step_requests = []
        for request, num_new in scheduled:
            start = request.num_computed_tokens
            end = start + num_new
            checkpoint = -1
            if self.state_slots is not None and self.block_manager.enable_prefix_caching:
                checkpoint = self.state_slots.reserve(request.token_ids, start, end)
            step_requests.append(
                StepRequest(
                    request_id=request.request_id,
                    token_ids=np.asarray(request.token_ids[start:end], dtype=np.int32),
                    start_pos=start,
                    page_table=np.asarray(request.page_ids, dtype=np.int32),
                    sample=end == request.num_tokens,
                    params=request.params,
                    output_token_ids=request.output_token_ids,
                    state_slot=request.state_slot,
                    restore_slot=request.restore_slot,
                    checkpoint_slot=checkpoint,
                    grammar=request.grammar,
                )
            )
            request.restore_slot = -1
        return ScheduledStep(StepBatch(step_requests), [r for r, _ in scheduled])
