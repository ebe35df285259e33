"""What every model runner shares: the ready buckets, page-table checks, ``launch`` and ``step``
around the token board, and one counter vocabulary (``runner_stats``).

A family's runner subclasses ``StepRunner`` and supplies the routes:

* ``_on_decode_graph(batch)``: whether the step runs on a compiled decode executable;
* ``_launch_decode(requests)``: enqueue such a step, its tokens left on the token board, and
  return its ``PendingStep``;
* ``_run(requests)``: the packed sampled rows of any step, on the route its shape takes (with
  mixed steps already split by ``run_step``);
* ``_add_plans(ladders)``: register every bucket plan with the ``LadderCompiler``, rung by rung
  (deferred plans compile in that order), and ``cache_fingerprint()``: what its stage functions
  read besides their arguments, for the executable cache key.

and sets, in its constructor, the attributes read here: ``config``, ``model_config``,
``buckets``, ``mesh``, ``page_size`` and ``pages_per_request``, then calls
``_init_step_state()``, which sets the rest the same way for every family: the compile guard,
the token board, the resampler, the counters, ``ladders`` (None until ``compile_all``) and
``compiled``.

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
import logging
import math
from collections.abc import Sequence

import numpy as np

from tokenspeed_jax.engine.batch import PendingStep, StepBatch, StepOutput, StepRequest
from tokenspeed_jax.engine.buckets import Buckets
from tokenspeed_jax.engine.compilers import ladder_compiler
from tokenspeed_jax.engine.ladders import LadderCompiler
from tokenspeed_jax.engine.runner_stats import new_counters, runner_stats
from tokenspeed_jax.engine.sampling_plans import Resampler, run_step
from tokenspeed_jax.engine.token_board import (
    board_rows,
    can_stay_on_board,
    check_no_token_rows,
    new_board,
)
from tokenspeed_jax.graph import CompileGuard, CompileSummary

logger = logging.getLogger(__name__)


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

    # ----------------------------------------------------------------- the family's routes

    @abc.abstractmethod
    def cache_fingerprint(self) -> str: ...

    @abc.abstractmethod
    def _add_plans(self, ladders: LadderCompiler) -> None: ...

    @abc.abstractmethod
    def _on_decode_graph(self, batch: StepBatch) -> bool: ...

    @abc.abstractmethod
    def _launch_decode(self, requests: list[StepRequest]) -> PendingStep: ...

    @abc.abstractmethod
    def _run(self, requests: Sequence[StepRequest]) -> list[np.ndarray]: ...
