"""What every model runner shares: the ready buckets, page-table checks, ``launch`` and ``step``
around the token board, and one counter vocabulary (``runner_stats``).

A family's runner subclasses ``StepRunner`` and supplies the routes:

* ``_on_decode_graph(batch)``: whether the step runs on a compiled decode executable;
* ``_run(requests)``: the packed sampled rows of any step, on the route its shape takes (with
  mixed steps already split by ``run_step``; its decode groups through ``_run_decode``);
* ``_add_plans(ladders)``: register every bucket plan with the ``LadderCompiler``, rung by rung
  (deferred plans compile in that order; the decode plans through ``_add_decode_plans``), and
  ``cache_fingerprint()``: what its stage functions read besides their arguments, for the
  executable cache key;
* the decode graph's family parts: ``_decode_meta(requests, rows)``, the packed metadata of a
  decode group padded to ``rows``, and ``decode_caches()`` / ``adopt_decode_caches(arrays)``,
  the cache arrays a decode step carries (donated) and takes back, in the decode plan's order;
  ``_prepare_decode(requests)`` runs before a decode step (nothing by default).

and sets, in its constructor, the attributes read here: ``config``, ``model_config``,
``buckets``, ``mesh``, ``page_size``, ``pages_per_request`` and ``alternate_decode``, then calls
``_init_step_state()``, which sets the rest the same way for every family: the compile guard,
the token board, the resampler, the counters, the decode turns, ``ladders`` (None until
``compile_all``) and ``compiled``.

The decode graph is the same for every family: one whole-step executable per decode batch
bucket whose plan carries ``(*decode caches, "board", "sampled")`` and returns ``("sampled",
"logits", "board", *decode caches)``, everything carried donated, its metadata one packed
buffer named ``"decode"``. Successive steps of a bucket take its two turns (``decode_turns``),
each with its own loaded copy of the executable with ``alternate_decode``.

Invariants:

* ``launch`` leaves a step running only on the decode graph and only when every request can
  stay on the board (``token_board.can_stay_on_board``); any other step runs to its end, and
  one whose requests read tokens from the board is refused (``check_no_token_rows``).
* ``step(batch)`` is ``launch(batch).result()``: the same tokens either way.
* A runner with compiled routes refuses steps before ``compile_all``; a background-compile
  failure is raised at the next step (``LadderCompiler.check``).
* ``ready`` is what steps choose buckets from: every bucket before ``compile_all`` (the host
  side of a step is computable without plans), then the ladders' ready ones.
"""

from __future__ import annotations

import abc
import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.batch import PendingStep, StepBatch, StepOutput, StepRequest
from tokenspeed_jax.engine.buckets import Buckets
from tokenspeed_jax.engine.compilers import ladder_compiler
from tokenspeed_jax.engine.decode_turns import DecodeSlot, DecodeTurns, sampled_buffer_spec
from tokenspeed_jax.engine.ladders import LadderCompiler
from tokenspeed_jax.engine.packed import Packed
from tokenspeed_jax.engine.runner_stats import new_counters, runner_stats
from tokenspeed_jax.engine.sampling_plans import Resampler, run_step
from tokenspeed_jax.engine.token_board import (
    board_rows,
    can_stay_on_board,
    check_no_token_rows,
    new_board,
    pending_decode,
)
from tokenspeed_jax.graph import CompiledPlan, CompileGuard, CompileSummary, Plan, abstract

logger = logging.getLogger(__name__)


def alternates_decode_executables(config: EngineConfig, platform: str) -> bool:
    """Whether decode steps take turns between two loaded copies of each decode executable: an
    explicit setting, else on one GPU (command buffers are a GPU runtime's)."""
    if config.alternate_decode_executables is not None:
        return config.alternate_decode_executables
    return platform == "gpu" and config.tensor_parallel_size == 1


class StepRunner(abc.ABC):
    """The host side of a model runner that does not depend on the model family (module
    docstring); subclasses supply the routes."""

    COMPILE_DESCRIPTION = "compiling executables"  # the start-up compile's progress bar

    def _init_step_state(self) -> None:
        """The host-side state of every family's runner (module docstring), from ``config``,
        ``model_config`` and ``buckets``: a row of the token board per sequence the decode
        executables can hold."""
        self.guard = CompileGuard(strict=self.config.strict_no_compile)
        self.board = new_board(board_rows(self.config.max_num_seqs,
                                          self.buckets.decode_executables))
        self.resampler = Resampler(self.model_config.vocab_size)
        self.counters = new_counters()
        self._decode_turns: dict[int, DecodeTurns] = {}
        self.ladders: LadderCompiler | None = None  # set by compile_all
        self.compiled = False

    def compile_all(self, *, start_background: bool = True) -> CompileSummary:
        """Compile (or load from the executable cache) every executable a step can reach, fatal
        on failure, then arm the guard. With ``background_compile`` only the skeleton's
        (``Buckets.skeleton``) are compiled here and a thread compiles the others, each bucket
        ready for the next step once its plans are (``engine/ladders.py``); without
        ``start_background``, ``ladders.compile_deferred`` compiles them when called."""
        ladders = self.ladders = ladder_compiler(
            self.config, self.buckets, description=self.COMPILE_DESCRIPTION,
            fingerprint=self.cache_fingerprint(), mesh=self.mesh)
        self._add_plans(ladders)
        summary = ladders.compile_all(background=start_background)
        logger.info("start-up compile:\n%s", summary.table())
        self.compiled = True
        self.guard.arm()
        return summary

    @property
    def ready(self) -> Buckets:
        """The buckets steps choose from: those whose plans are compiled, the skeleton's and
        the ones the background compile has added (all of ``buckets`` once it is done); before
        ``compile_all``, ``buckets``."""
        return self.buckets if self.ladders is None else self.ladders.ready

    def page_table(self, request: StepRequest) -> np.ndarray:
        """``request``'s page table, checked: enough pages for its positions, and no more than
        a sequence of ``max_model_len`` tokens holds."""
        table = np.asarray(request.page_table, np.int32)
        needed = math.ceil(request.end_pos / self.page_size)
        if len(table) < needed or len(table) > self.pages_per_request:
            raise ValueError(
                f"request {request.request_id}: page_table has {len(table)} pages; it needs "
                f">= {needed} and at most {self.pages_per_request} (max_model_len="
                f"{self.config.max_model_len}, page_size={self.page_size})")
        return table

    def step(self, batch: StepBatch) -> StepOutput:
        """Run one engine step; one sampled token per request with ``sample`` set, in order."""
        return self.launch(batch).result()

    def launch(self, batch: StepBatch) -> PendingStep:
        """Start one engine step. A decode-graph step whose requests need only the in-step
        sampler is left running: its tokens are fetched by ``result()``, and stay on the token
        board for the next decode step (``StepRequest.token_row``). Any other step runs to its
        end here."""
        requests = batch.requests
        if not requests:
            raise ValueError("a step needs at least one request")
        if (self.buckets.tokens or self.buckets.decode_requests) and not self.compiled:
            raise RuntimeError("call compile_all() before step()")
        if self.ladders is not None:
            self.ladders.check()
        if self._on_decode_graph(batch) and can_stay_on_board(requests):
            return self._launch_decode(requests)
        check_no_token_rows(requests)
        return PendingStep.done(run_step(requests, self._run, counters=self.counters,
                                         split_mixed=bool(self.buckets.decode_requests)))

    def stats(self) -> dict[str, float]:
        """Runtime compiles, route counts and padding waste since start-up; buckets ready
        (``runner_stats``)."""
        return runner_stats(self.counters, resampler=self.resampler, guard=self.guard,
                            ladders=self.ladders)

    # ----------------------------------------------------------------- the decode graph

    def _add_decode_plans(self, ladders: LadderCompiler, plan_of_rows: Callable[[int], Plan],
                          cache_specs: Mapping[str, Any], shardings: Mapping[str, Any], *,
                          quick_plan: Plan | None = None) -> None:
        """Per decode executable, rung by rung: its decode plan (``plan_of_rows(rows)``, over
        the caches of ``cache_specs`` in carried order) and its resamplers."""
        for rows in self.buckets.decode_executables:
            specs = {**cache_specs, "board": abstract(self.board),
                     "sampled": sampled_buffer_spec(rows)}
            ladders.add(ladders.decode_rungs(rows), f"decode B={rows}",
                        functools.partial(self._store_decode, rows), plan_of_rows(rows), specs,
                        {"decode": abstract(self._decode_meta([], rows))}, shardings=shardings,
                        copies=2 if self.alternate_decode else 1, quick_plan=quick_plan)
            ladders.add_resampler(self.resampler, rows)

    def _store_decode(self, rows: int, plan: CompiledPlan) -> None:
        self._decode_turns[rows] = DecodeTurns((plan, *plan.copies), rows)

    def decode_inputs(self, requests: Sequence[StepRequest], rows: int | None = None
                      ) -> tuple[DecodeSlot, dict]:
        """The decode turn for ``requests`` on the ``rows``-row executable (default: the ready
        one for their count, at most the largest decode bucket; the bucket's two turns
        alternate, one per call) and its host-built metadata (one packed buffer)."""
        if rows is None:
            rows = self.ready.decode_rows(len(requests))
        return self._decode_turns[rows].take(), {"decode": self._decode_meta(requests, rows)}

    def _launch_decode(self, requests: list[StepRequest]) -> PendingStep:
        """Enqueue a decode step whose tokens stay on the token board: its ``PendingStep``."""
        out, _, slot = self._decode(requests)
        slot.pending = pending_decode(out["sampled"], len(requests))
        return slot.pending

    def _run_decode(self, requests: list[StepRequest]) -> np.ndarray:
        """The packed sampled rows of a decode group on its decode executable."""
        out, rows, _ = self._decode(requests)
        return self.resampler.finish(requests, rows, out["sampled"], out["logits"])

    def _decode(self, requests: list[StepRequest]
                ) -> tuple[dict[str, jax.Array], int, DecodeSlot]:
        """Enqueue one decode executable (keeping its caches, token board and sampled-rows
        buffer): its outputs, on the device, its rows and the turn it ran in."""
        rows = self.ready.decode_rows(len(requests))
        slot, meta = self.decode_inputs(requests, rows)
        self._prepare_decode(requests)
        self.counters["decode_runs"] += 1
        self.counters["real_tokens"] += len(requests)
        self.counters["padded_tokens"] += rows - len(requests)
        slot.sampled, logits, self.board, *caches = slot.plan.run_positional(
            [*self.decode_caches(), self.board, slot.sampled], meta)
        self.adopt_decode_caches(caches)
        return {"sampled": slot.sampled, "logits": logits}, rows, slot

    def _prepare_decode(self, requests: Sequence[StepRequest]) -> None:
        """What must run before a decode step of ``requests`` (module docstring)."""

    # ----------------------------------------------------------------- the family's routes

    @abc.abstractmethod
    def _decode_meta(self, requests: Sequence[StepRequest], rows: int) -> Packed: ...

    @abc.abstractmethod
    def decode_caches(self) -> list[jax.Array]: ...

    @abc.abstractmethod
    def adopt_decode_caches(self, caches: Sequence[jax.Array]) -> None: ...

    @abc.abstractmethod
    def cache_fingerprint(self) -> str: ...

    @abc.abstractmethod
    def _add_plans(self, ladders: LadderCompiler) -> None: ...

    @abc.abstractmethod
    def _on_decode_graph(self, batch: StepBatch) -> bool: ...

    @abc.abstractmethod
    def _run(self, requests: Sequence[StepRequest]) -> list[np.ndarray]: ...
