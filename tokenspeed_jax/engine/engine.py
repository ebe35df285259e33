"""The serving loop: continuous batching of requests over a model runner, sync and asyncio fronts.

``Engine`` is synchronous: ``add_request`` / ``abort`` / ``step``, and ``generate`` for offline
use. One ``step`` schedules a batch, runs it, then turns each sampled token into a
``RequestOutput`` (stop tokens, max_tokens, the context length, stop strings across token
boundaries through the incremental detokenizer).

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

``AsyncEngine`` runs that loop in one background thread and streams each request's outputs to
an asyncio consumer; request-side host work (HTTP, tokenisation, JSON) runs on the event loop
while the engine thread waits on the device. Faults stay with their cause: anything that goes
wrong while adding one request fails that request alone (a ``ValueError`` is its caller's bad
input) and the loop goes on; a failure of a step, which belongs to no single request, stops the
loop: it logs the traceback once, ends every request in flight with ``EngineDeadError``, reports
itself dead (``alive``) and calls ``on_failure`` so its owner can exit.

Invariants:

* Only the engine thread touches ``Engine``; the asyncio side talks to it through a queue.
* A request is validated before it is accepted (prompt within the context length and the
  vocabulary, sampling settings within the vocabulary, unique id); once accepted it always ends
  with exactly one output that has ``finished`` set, whether it stopped, ran out of length, was
  aborted or the engine failed.
* ``max_model_len`` never exceeds what the KV pages can hold, so one request alone always fits
  and preemption can always make progress.
* The KV page count is a shape of every executable, so it does not follow free memory from one
  start to the next: sized from free memory when ``num_pages`` is not set, it is recorded beside
  the executable cache and later starts of the same setup keep it while it fits in the memory
  free then (``num_kv_pages``, ``sizing_record``); with the cache off each start sizes anew.
* A model runs on the runner its family names (``models/registry.py``). A family with recurrent
  state (Kimi-Linear: KDA state beside a paged latent cache) gets a state pool of
  ``max_num_seqs`` live rows plus, with prefix caching, as many checkpoint rows
  (``state_slots.StateSlots``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from tokenspeed_jax import parallel
from tokenspeed_jax.config import OVERLAP_SCHEDULES, EngineConfig
from tokenspeed_jax.detokenizer import IncrementalDetokenizer
from tokenspeed_jax.engine import sizing_record
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


# The CPU backend's "device memory" is host RAM shared with everything else on the machine, so
# the KV cache there takes only this share of what is free (times mem_fraction).
CPU_MEMORY_SHARE = 0.1
# Free memory moves a little between starts; the page count is a compiled shape, so it is rounded
# down to this many pages to keep it (and the executable cache's keys) the same across restarts.
KV_PAGE_ROUNDING = 256


def hybrid_state_slots(config: EngineConfig) -> StateSlots:
    """The state rows of a hybrid model: ``max_num_seqs`` live rows, plus as many checkpoint rows
    when prefix caching is on (the caller turns it off when checkpoints cannot line up with
    pages)."""
    from tokenspeed_jax.kernels.kda_ref import CHUNK_SIZE

    checkpoints = config.max_num_seqs if config.enable_prefix_caching else 0
    return StateSlots(config.max_num_seqs, checkpoints, granularity=config.prefix_granularity,
                      chunk=CHUNK_SIZE, page_size=config.page_size)


def free_device_bytes() -> tuple[int, str]:
    """Free memory of the first device, and where the figure came from."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)), "device"
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(available * CPU_MEMORY_SHARE), "host"


def total_device_bytes() -> int:
    """Memory of the first device: what its allocator may use, or on the CPU the host's RAM."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def sizing_key(config: EngineConfig, page_bytes: int, reserved_bytes: int, model: str
               ) -> dict[str, Any]:
    """What decides the page count besides free memory: the key of its sizing record."""
    import jax

    return {"model": model, "page_bytes": page_bytes, "reserved_bytes": reserved_bytes,
            "page_size": config.page_size, "max_model_len": config.max_model_len,
            "max_num_seqs": config.max_num_seqs, "mem_fraction": config.mem_fraction,
            "tensor_parallel_size": config.tensor_parallel_size,
            "device_kind": jax.devices()[0].device_kind,
            "device_total_bytes": total_device_bytes()}


def num_kv_pages(config: EngineConfig, page_bytes: int, reserved_bytes: int = 0, *,
                 model: str = "") -> int:
    """KV pages to allocate: the explicit ``num_pages``, else what the free memory allows (less
    ``reserved_bytes`` taken by other per-engine buffers).

    Never more than ``max_num_seqs`` full-length sequences need, never fewer than one sequence of
    ``max_model_len`` needs.

    With the executable cache on, a count sized from free memory is recorded in the cache
    directory (``sizing_record``), keyed by ``sizing_key``: ``model`` (its path), the page and
    reserved bytes, ``page_size``, ``max_model_len``, ``max_num_seqs``, ``mem_fraction``,
    ``tensor_parallel_size`` and the device's kind and total memory. A later call with the same
    key returns the recorded count while it is within the bounds above and fits in the memory
    free now (``mem_fraction`` of it, less ``reserved_bytes``), however much more is free, so
    the executables' shapes stay those of the first start; a count that no longer fits is sized
    again (logged with the numbers) and replaces the record. Delete the record, or set
    ``num_pages``, to choose anew. With the cache off every call sizes from free memory.
    """
    if config.num_pages is not None:
        if config.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {config.num_pages}")
        return config.num_pages
    if not 0.0 < config.mem_fraction <= 1.0:
        raise ValueError(f"mem_fraction must be in (0, 1], got {config.mem_fraction}")
    per_sequence = math.ceil(config.max_model_len / config.page_size)
    most = config.max_num_seqs * per_sequence
    free, _ = free_device_bytes()
    affordable = (int(free * config.mem_fraction) - reserved_bytes) // page_bytes
    directory = config.compile_cache_path
    key = sizing_key(config, page_bytes, reserved_bytes, model) if directory else None
    recorded = None if key is None else sizing_record.read_pages(directory, key)
    if recorded is not None:
        if per_sequence <= recorded <= min(affordable, most):
            logger.info("KV cache: %d pages, as recorded at an earlier start in %s", recorded,
                        sizing_record.record_path(directory, key))
            return recorded
        logger.warning(
            "the KV page count recorded at an earlier start, %d, does not fit now: %.2f GiB "
            "free x mem_fraction=%s holds %d pages of %d bytes (bounds %d..%d); sizing again, "
            "so executables of the new count are compiled", recorded, free / 2**30,
            config.mem_fraction, affordable, page_bytes, per_sequence, most)
    if affordable >= KV_PAGE_ROUNDING:
        affordable = max(affordable // KV_PAGE_ROUNDING * KV_PAGE_ROUNDING, per_sequence)
    if affordable < per_sequence:
        raise ValueError(
            f"{free / 2**30:.2f} GiB free x mem_fraction={config.mem_fraction} holds "
            f"{affordable} KV pages of {page_bytes} bytes, fewer than one sequence of "
            f"max_model_len={config.max_model_len} needs ({per_sequence}); lower max_model_len "
            f"or set num_pages"
        )
    pages = min(affordable, most)
    if key is not None:
        path = sizing_record.write_pages(directory, key, pages)
        if path is not None:
            logger.info("KV cache: %d pages sized from %.2f GiB free; recorded in %s for later "
                        "starts", pages, free / 2**30, path)
    return pages


@dataclasses.dataclass
class EngineBundle:
    """A ready engine and what start-up produced on the way."""

    engine: Engine
    runner: Any  # of the runner class the model's family names
    compile_summary: Any  # graph.CompileSummary
    model_path: str
    seconds: float
    loaded: Any  # models.loader.LoadedModel (with its family)
    config: EngineConfig  # as run: buckets clamped, prefix caching off where it cannot work


def build_engine(config: EngineConfig, loaded: Any = None) -> EngineBundle:
    """Load the model (unless ``loaded`` is given), size the KV cache, compile every executable,
    return a ready engine."""
    from tokenspeed_jax.engine.model_runner import stacked_copy_bytes
    from tokenspeed_jax.models.loader import load_model

    start = time.perf_counter()
    # No step ever holds more than max_num_seqs requests: larger batch buckets would be dead code.
    config = dataclasses.replace(
        config,
        decode_graph_max_bs=min(config.decode_graph_max_bs, config.max_num_seqs),
        prefill_graph_max_bs=min(config.prefill_graph_max_bs, config.max_num_seqs),
    )
    mesh = parallel.make_mesh(config.tensor_parallel_size)
    if loaded is None:
        loaded = load_model(config.model, dtype=config.dtype, mesh=mesh)
    family = loaded.family
    dtype = getattr(loaded.model, "dtype", "float32")
    page_bytes = family.kv_page_bytes(loaded.config, config.page_size, dtype)
    if mesh is not None:  # each device holds its share of every page; free memory is per device
        family.check_split(loaded.config, mesh.size)
        page_bytes = -(-page_bytes // family.kv_cache_shards(loaded.config, mesh.size))
    state_slots = None
    reserved = 0
    if family.has_recurrent_state:
        if config.enable_prefix_caching and config.prefix_granularity % config.page_size:
            logger.warning(
                "prefix caching is off for this hybrid model: prefix_granularity=%d is not a "
                "multiple of page_size=%d, so KDA checkpoints cannot end on a page",
                config.prefix_granularity, config.page_size)
            config = dataclasses.replace(config, enable_prefix_caching=False)
        state_slots = hybrid_state_slots(config)
        # KDA state rows are split by head: each device holds 1/N of every row
        reserved = -(-state_slots.num_slots
                     * family.state_slot_bytes(loaded.config, dtype, config.kda_state_dtype)
                     // parallel.mesh_size(mesh))
    if state_slots is None:
        reserved += stacked_copy_bytes(config, loaded.model)
    num_pages = num_kv_pages(config, page_bytes, reserved, model=str(loaded.path))
    runner_class = family.runner_class()
    if state_slots is None:
        runner = runner_class(loaded.model, config, num_pages, config.page_size)
    else:
        runner = runner_class(loaded.model, config, num_pages=num_pages,
                              num_state_slots=state_slots.num_slots, page_size=config.page_size)
    summary = runner.compile_all()
    budget = config.prefill_token_limit if config.chunked_prefill_size else config.max_model_len
    engine = Engine(
        runner,
        loaded.tokenizer,
        num_pages=num_pages,
        page_size=config.page_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=min(config.max_model_len, loaded.config.max_position_embeddings),
        enable_prefix_caching=config.enable_prefix_caching,
        state_slots=state_slots,
        overlap_schedule=config.overlap_schedule,
    )
    return EngineBundle(engine, runner, summary, str(loaded.path), time.perf_counter() - start,
                        loaded, config)


class EngineDeadError(RuntimeError):
    """The engine loop failed; every request in flight ends with this error."""


class RequestCancelledError(RuntimeError):
    """The engine's owner ended a request before it finished (``AsyncEngine.cancel_all``)."""


class AsyncEngine:
    """Runs ``Engine.step`` in a background thread; ``generate`` streams one request's outputs.

    ``on_failure`` is called once, on the engine thread, with the error that stopped the loop.
    """

    def __init__(self, engine: Engine,
                 on_failure: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.on_failure = on_failure
        self._inbox: queue.SimpleQueue[tuple[str, tuple]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        """Requests being streamed to a consumer."""
        return len(self._streams)

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving early (or cancellation) aborts the request.

        Raises ValueError when the engine refuses the request, ``EngineDeadError`` when the loop
        failed, ``RequestCancelledError`` when ``cancel_all`` ended it."""
        self.engine.check_prompt(prompt_token_ids)
        self.engine.check_params(params)
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        finished = False
        try:
            # Checked once the stream is registered: a loop that fails from here on delivers
            # its error to this stream, one that failed before is seen here.
            if self.error is not None:
                raise EngineDeadError(f"the engine loop failed: {self.error!r}")
            self._send("add", request_id, list(prompt_token_ids), params)
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._send("abort", request_id)
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    def cancel_all(self, reason: str) -> None:
        """End every request in flight now with ``RequestCancelledError(reason)``."""
        for request_id in list(self._streams):
            self._deliver(request_id, RequestCancelledError(reason))

    def _send(self, kind: str, *args) -> None:
        self._inbox.put((kind, args))
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            loop.call_soon_threadsafe(outputs.put_nowait, item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, args = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                request_id = args[0]
                try:
                    self.engine.add_request(*args)
                except ValueError as error:
                    self._deliver(request_id, error)
                except Exception as error:
                    logger.exception("could not add request %s", request_id)
                    self._deliver(request_id, RuntimeError(f"the request failed: {error!r}"))
            else:
                output = self.engine.abort(args[0])
                if output is not None:
                    self._deliver(output.request_id, output)

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._drain_inbox()
                if not engine.has_unfinished:
                    if self._stopping:
                        return
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                for output in engine.step():
                    self._deliver(output.request_id, output)
        except BaseException as error:
            logger.critical("the engine loop failed; ending every request in flight",
                            exc_info=error)
            self.error = error
            dead = EngineDeadError(f"the engine loop failed: {error!r}")
            for request_id in list(self._streams):
                self._deliver(request_id, dead)
            if self.on_failure is not None:
                self.on_failure(error)
