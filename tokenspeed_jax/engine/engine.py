"""The serving loop: continuous batching of requests over a model runner.

``Engine`` is synchronous: ``add_request`` / ``abort`` / ``step``, and ``generate`` for offline
use. One ``step`` schedules a batch, runs it, then turns each sampled token into a
``RequestOutput`` (stop tokens, max_tokens, the context length, stop strings across token
boundaries through the incremental detokenizer, a grammar that completed). Start-up (loading,
KV sizing, compiling) is ``engine/startup.py``; the asyncio front is ``engine/async_engine.py``.

Overlap (``overlap_schedule``): when a step is a decode step the runner left running with its
tokens on the device (``PendingStep.on_board``) and no waiting request could be admitted now,
the engine may launch the next decode step before it fetches this one's tokens, so the host's
work for step N+1 (metadata, the executable launch) runs while the device computes step N. The
next step holds every running request of this step that cannot finish by length at this step's
token; a request that stops on a token or string meanwhile wastes its row in that step, whose
token is dropped, and the step is the next ``step()``'s to finish. "on" always runs ahead,
"off" never; "auto" runs ahead while the device is the bottleneck: a synchronous decode step
(launched, then waited for, nothing ahead) whose wait for its tokens is at least
``DEVICE_BOUND_WAIT`` of its launch's host time says the device is still busy after the launch,
so running ahead can hide the launch. One decode step in ``PROBE_EVERY`` is synchronous, and
measures again. The choice never changes a token (tested), only when steps are launched.

Invariants:

* Only one thread touches an ``Engine`` (``AsyncEngine``'s loop, or the caller's).
* A request is validated before it is accepted (prompt within the context length and the
  vocabulary, sampling settings within the vocabulary, unique id); once accepted it always ends
  with exactly one output that has ``finished`` set, whether it stopped, ran out of length, was
  aborted or the engine failed.
* ``max_model_len`` never exceeds what the KV pages can hold, so one request alone always fits
  and preemption can always make progress.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from tokenspeed_jax.config import OVERLAP_SCHEDULES
from tokenspeed_jax.detokenizer import IncrementalDetokenizer
from tokenspeed_jax.engine.batch import PendingStep, StepBatch, StepOutput
from tokenspeed_jax.engine.block_manager import BlockManager
from tokenspeed_jax.engine.request import Request, RequestOutput
from tokenspeed_jax.engine.scheduler import ScheduledStep, Scheduler
from tokenspeed_jax.engine.state_slots import StateSlots
from tokenspeed_jax.outputs import Completion, TokenLogprob
from tokenspeed_jax.sampling_params import SamplingParams, SamplingParamsError
from tokenspeed_jax.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tokenspeed_jax.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


# "auto" overlap: the device is the bottleneck when a synchronous step waits for its tokens at
# least this share of its launch's host time; one decode step in PROBE_EVERY measures again.
DEVICE_BOUND_WAIT = 0.25
PROBE_EVERY = 32


class StepRunner(Protocol):
    model_config: Any  # its model's config (``vocab_size``: the logits' width)

    def step(self, batch: StepBatch) -> StepOutput: ...

    def launch(self, batch: StepBatch) -> PendingStep: ...


@dataclasses.dataclass
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of the ``index``-th of ``n`` samples: n=1, and its own seed when seeded (the
    sampler reads seeds modulo 2**64, so the largest seeds wrap around)."""
    seed = None if params.seed is None else (params.seed + index) % 2**64
    return dataclasses.replace(params, n=1, seed=seed)


class Engine:
    def __init__(
        self,
        runner: StepRunner,
        tokenizer: Tokenizer,
        *,
        num_pages: int,
        page_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        state_slots: StateSlots | None = None,
        overlap_schedule: str = "auto",
    ):
        if overlap_schedule not in OVERLAP_SCHEDULES:
            raise ValueError(f"overlap_schedule must be one of {OVERLAP_SCHEDULES}, got "
                             f"{overlap_schedule!r}")
        self.runner = runner
        self.overlap_schedule = overlap_schedule
        self._ahead: tuple[ScheduledStep, PendingStep] | None = None
        self.device_bound = False  # "auto": what the last synchronous decode step measured
        self._steps_since_probe = 0
        self.tokenizer = tokenizer
        self._grammars: GrammarCompiler | None = None  # made at the first grammar
        self.block_manager = BlockManager(num_pages, page_size, enable_prefix_caching)
        self.state_slots = state_slots
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            state_slots=state_slots,
        )
        self.max_model_len = min(max_model_len, num_pages * page_size)
        self._tracked: dict[str, _Tracked] = {}
        self.num_steps = 0
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_overlapped_steps = 0

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self._ahead is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def check_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        """Raise ValueError unless the prompt leaves room for at least one generated token."""
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context length is "
                f"{self.max_model_len}, which must also hold at least one generated token"
            )
        vocab = self.tokenizer.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary of {vocab}")

    def check_params(self, params: SamplingParams) -> None:
        """Raise ``SamplingParamsError`` unless ``params``' token-valued settings lie within the
        vocabulary (``SamplingParams`` checked everything else when it was made)."""
        vocab = self.tokenizer.vocab_size
        if params.top_k > vocab:
            raise SamplingParamsError("top_k", f"top_k must be at most the vocabulary size "
                                               f"{vocab} (0 or -1 = off), got {params.top_k}")
        for param, ids in (("stop_token_ids", params.stop_token_ids),
                           ("logit_bias", [t for t, _ in params.logit_bias])):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise SamplingParamsError(param, f"{param} token ids {bad[:5]} are outside the "
                                                 f"vocabulary of {vocab}")
        if params.grammar is not None:
            self.grammars.compile(params.grammar)  # GrammarSpecError names the request field

    @property
    def grammars(self) -> GrammarCompiler:
        """The compiler of requests' grammars over this engine's tokenizer and logits width."""
        if self._grammars is None:  # imported here: llguidance loads only for grammars
            from tokenspeed_jax.structured.compiler import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.runner.model_config.vocab_size)
        return self._grammars

    def add_request(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> None:
        if params.n != 1:
            raise ValueError(f"Engine.add_request takes n=1 (fan out with child_params); "
                             f"got n={params.n}")
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_prompt(prompt_token_ids)
        self.check_params(params)
        request = Request(request_id, list(prompt_token_ids), params.with_random_seed())
        if params.grammar is not None:
            request.grammar = self.grammars.matcher(params.grammar)
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids,
                                             stop=params.stop)
        self._tracked[request_id] = _Tracked(request, detokenizer)
        self.scheduler.add(request)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request now; returns its last output, or None when it is not in flight."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.finish(tracked.request, "abort")
        tracked.request.finish_time = time.monotonic()
        return self._output(tracked.request, [], "", None)

    def step(self) -> list[RequestOutput]:
        launch_seconds = None  # host time of this step's launch, when it was launched here
        if self._ahead is not None:
            step, pending = self._ahead
            self._ahead = None
        else:
            step = self.scheduler.schedule()
            if step.is_empty:
                if self.scheduler.has_work:
                    raise RuntimeError(
                        f"scheduler stalled: {self.num_waiting} waiting, {self.num_running} "
                        f"running, {self.block_manager.num_free_pages} free pages"
                    )
                return []
            launched = time.perf_counter()
            pending = self.runner.launch(step.batch)
            launch_seconds = time.perf_counter() - launched
        self.scheduler.after_step(step)
        self.num_steps += 1
        if pending.on_board and self._runs_ahead(launched_here=launch_seconds is not None):
            self._ahead = self._launch_ahead(step)
        measured = pending.on_board and self._ahead is None and launch_seconds is not None
        waited = time.perf_counter()
        result = pending.result()
        if measured:  # a synchronous decode step: did the device outlast its launch?
            wait_seconds = time.perf_counter() - waited
            device_bound = wait_seconds >= DEVICE_BOUND_WAIT * launch_seconds
            if device_bound != self.device_bound and self.overlap_schedule == "auto":
                logger.info("decode steps %s ahead: a synchronous step waited %.2f ms for its "
                            "tokens after a %.2f ms launch",
                            "run" if device_bound else "stop running", 1e3 * wait_seconds,
                            1e3 * launch_seconds)
            self.device_bound = device_bound
        return self._process(step, result)

    def _runs_ahead(self, *, launched_here: bool) -> bool:
        """Whether to run ahead of this decode step (module docstring). In "auto", a step that
        does not is measured when this call launched it; a due probe waits for such a step."""
        if self.overlap_schedule != "auto":
            return self.overlap_schedule == "on"
        if not self.device_bound:
            return False
        self._steps_since_probe += 1
        if self._steps_since_probe < PROBE_EVERY:
            return True
        if launched_here:
            self._steps_since_probe = 0
        return False

    def _launch_ahead(self, step: ScheduledStep) -> tuple[ScheduledStep, PendingStep] | None:
        """Launch the decode step after ``step`` (module docstring); None when there is none."""
        if self.scheduler.can_admit:
            return None  # admit the waiting request first: the next step is scheduled as usual
        rows = [(row, request) for row, request in enumerate(step.requests)
                if not request.finished and not self._ends_by_length(request, pending=1)]
        if not rows:
            return None
        ahead = self.scheduler.schedule_ahead([r for _, r in rows], [row for row, _ in rows])
        if ahead is None:
            return None
        self.num_overlapped_steps += 1
        return ahead, self.runner.launch(ahead.batch)

    def generate(
        self, prompts: Sequence[tuple[Sequence[int], SamplingParams]]
    ) -> list[list[Completion]]:
        """Run every prompt to completion; for each, its ``n`` samples in order.

        Every prompt is checked before any is admitted, so a bad one leaves nothing in flight.
        """
        for prompt_ids, params in prompts:
            self.check_prompt(prompt_ids)
            self.check_params(params)
        ids = []
        for i, (prompt_ids, params) in enumerate(prompts):
            children = [f"generate-{id(self)}-{i}-{j}" for j in range(params.n)]
            for j, child in enumerate(children):
                self.add_request(child, prompt_ids, child_params(params, j))
            ids.append(children)
        collected: dict[str, list[RequestOutput]] = {c: [] for group in ids for c in group}
        while self.has_unfinished:
            for output in self.step():
                collected[output.request_id].append(output)
        return [[_join(list(prompt_ids), collected[c]) for c in group]
                for (prompt_ids, _), group in zip(prompts, ids)]

    def stats(self) -> dict[str, float]:
        manager = self.block_manager
        scheduler = self.scheduler
        slots = self.state_slots
        live = 0 if slots is None else slots.num_live
        return {  # the same keys for every model family: state slots count 0 without them
            "state_slots_total": live,
            "state_slots_used": 0 if slots is None else live - slots.num_free,
            "kda_checkpoints_written": 0 if slots is None else slots.checkpoints_written,
            "kda_checkpoint_hits": 0 if slots is None else slots.checkpoint_hits,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "kv_pages_total": manager.num_pages,
            "kv_pages_used": manager.num_used_pages,
            "num_preemptions": scheduler.num_preemptions,
            "prefix_query_tokens": scheduler.prefix_query_tokens,
            "prefix_hit_tokens": scheduler.prefix_hit_tokens,
            "num_steps": self.num_steps,
            "num_overlapped_steps": self.num_overlapped_steps,
            "decode_device_bound": float(self.device_bound),
        }

    def _process(self, step: ScheduledStep, result: StepOutput) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        sampled = 0
        for request, step_request in zip(step.requests, step.batch.requests):
            self.num_prompt_tokens += max(
                0, min(step_request.end_pos, request.num_prompt_tokens) - step_request.start_pos
            )
            if not step_request.sample:
                continue
            index = sampled
            sampled += 1
            if request.finished:
                continue  # it ended while this step ran ahead of it: the token is dropped
            token = int(result.token_ids[index])
            request.token_ids.append(token)
            self.num_generation_tokens += 1
            if request.first_token_time is None:
                request.first_token_time = now
            logprobs = None
            if request.params.logprobs is not None:
                logprobs = [_token_logprob(result, index, token, request.params.logprobs)]
            outputs.append(self._advance(request, token, logprobs))
        return outputs

    def _advance(
        self, request: Request, token: int, logprobs: list[TokenLogprob] | None
    ) -> RequestOutput:
        """Feed one sampled token through the stop checks and the detokenizer."""
        params = request.params
        detokenizer = self._tracked[request.request_id].detokenizer
        reason, stop_reason = None, None
        if request.grammar is not None:  # the token was sampled under its mask
            request.grammar.advance(token)
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.tokenizer.eos_token_ids
        ):
            reason, stop_reason = "stop", token
            text = detokenizer.finish()
        else:
            text = detokenizer.add(token)
            if detokenizer.stopped:
                reason, stop_reason = "stop", detokenizer.stop_reason
            elif request.grammar is not None and request.grammar.is_finished:
                reason = "stop"  # the output is complete for its grammar
            elif self._ends_by_length(request):
                reason = "length"
            if reason is not None:
                text += detokenizer.finish()
        if reason is not None:
            self.scheduler.finish(request, reason, stop_reason)
            request.finish_time = time.monotonic()
            del self._tracked[request.request_id]
        return self._output(request, [token], text, logprobs)

    def _ends_by_length(self, request: Request, pending: int = 0) -> bool:
        """Whether ``request`` is done by max_tokens or the context length once ``pending``
        more tokens (sampled, not yet on the host) are added."""
        return (request.num_output_tokens + pending >= request.params.max_tokens
                or request.num_tokens + pending >= self.max_model_len)

    @staticmethod
    def _output(
        request: Request, tokens: list[int], text: str, logprobs: list[TokenLogprob] | None
    ) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=tokens,
            new_text=text,
            logprobs=logprobs,
            finished=request.finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
        )


def _token_logprob(result: StepOutput, index: int, token: int, num_top: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if num_top and result.top_token_ids is not None and result.top_logprobs is not None:
        top = [
            (int(t), float(lp))
            for t, lp in zip(result.top_token_ids[index][:num_top],
                             result.top_logprobs[index][:num_top])
        ]
    return TokenLogprob(token, float(result.logprobs[index]), top)


def _join(prompt_ids: list[int], outputs: list[RequestOutput]) -> Completion:
    last = outputs[-1]
    logprobs = None
    if any(o.logprobs is not None for o in outputs):
        logprobs = [lp for o in outputs for lp in (o.logprobs or [])]
    return Completion(
        prompt_token_ids=prompt_ids,
        token_ids=[t for o in outputs for t in o.new_token_ids],
        text="".join(o.new_text for o in outputs),
        finish_reason=last.finish_reason or "abort",
        logprobs=logprobs,
    )
