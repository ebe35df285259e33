"""What every model runner shares: the ready buckets, page-table checks, the host arrays of a
packed group of tokens (``pack_tokens``), the decode graph, ``launch`` and ``step`` around the
token board, and one counter vocabulary (``runner_stats``).

A family's runner subclasses ``StepRunner`` and supplies the routes:

* ``_on_decode_graph(batch)``: whether the step runs on a compiled decode executable;
* ``_run(requests)``: the packed sampled rows of any step, on the route its shape takes (with
  mixed steps already split by ``run_step``; its decode steps through ``_run_decode_groups``);
* ``_add_plans(ladders)``: register every bucket plan with the ``LadderCompiler``, rung by rung
  (deferred plans compile in that order; the decode plans through ``_add_decode_plans``), and
  ``cache_fingerprint()``: what its stage functions read besides their arguments, for the
  executable cache key;
* the decode graph's family parts: ``_decode_field_defaults(rows)`` and
  ``_write_decode_fields(fields, requests)``, its own fields of the packed decode metadata
  (``_decode_meta`` writes the common ones), and ``decode_caches()`` /
  ``adopt_decode_caches(arrays)``, the cache arrays a decode step carries (donated) and takes
  back, in the decode plan's order; ``_prepare_decode(requests)`` runs before a decode step
  (nothing by default).

and sets, in its constructor, the attributes read here: ``config``, ``model_config``,
``buckets``, ``mesh``, ``page_size``, ``pages_per_request``, ``alternate_decode`` and
``_model_classes`` (the classes of the model's modules), then calls
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
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax
import jax
import numpy as np

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.batch import PendingStep, StepBatch, StepOutput, StepRequest
from tokenspeed_jax.engine.buckets import Buckets
from tokenspeed_jax.engine.compilers import ladder_compiler
from tokenspeed_jax.engine.decode_turns import DecodeSlot, DecodeTurns, sampled_buffer_spec
from tokenspeed_jax.engine.ladders import LadderCompiler
from tokenspeed_jax.engine.packed import Packed, PackedBuilder
from tokenspeed_jax.engine.runner_stats import new_counters, runner_stats
from tokenspeed_jax.engine.sampling_plans import (
    Resampler,
    run_step,
    sampling_arrays,
    sampling_fields,
    write_sampling_fields,
)
from tokenspeed_jax.engine.token_board import (
    board_rows,
    can_stay_on_board,
    check_no_token_rows,
    new_board,
    pending_decode,
    token_rows,
)
from tokenspeed_jax.graph import CompiledPlan, CompileGuard, CompileSummary, Plan, abstract
from tokenspeed_jax.graph.cache import classes_fingerprint
from tokenspeed_jax.kernels.paged_prefill_attention import prefill_work
from tokenspeed_jax.models.registry import family_of

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PackedTokens:
    """The host arrays of one group of requests packed token after token (``pack_tokens``):
    ``[T]`` token ids, positions, slots (page * page_size + row) and each token's request, the
    requests' page tables (one row each, zero-padded), each request's first token, and the last
    token of each request that samples, in order. Padding tokens have position, slot and
    request -1."""

    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    token_request: np.ndarray
    page_tables: np.ndarray
    starts: np.ndarray
    last_rows: np.ndarray
    sampled: list[StepRequest]

    def attention(self, block_q: int | None) -> dict[str, np.ndarray]:
        """The paged attention's metadata: the slots, each token's request, the page tables and,
        given a Pallas prefill kernel's ``block_q``, its work items (``prefill_work``)."""
        fields = {"slot_mapping": self.slot_mapping, "token_request": self.token_request,
                  "page_tables": self.page_tables}
        if block_q is not None:
            fields["work"] = prefill_work(self.token_request, self.positions,
                                          num_rows=len(self.page_tables), block_q=block_q)
        return fields

    def sampled_rows(self, rows: int) -> np.ndarray:
        """``last_rows`` padded with zeros to ``rows``."""
        padded = np.zeros(rows, np.int32)
        padded[:len(self.last_rows)] = self.last_rows
        return padded


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
        self._decode_builders: dict[int, PackedBuilder] = {}
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

    def slots(self, table: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The cache slots of ``positions`` in page table ``table``."""
        return table[positions // self.page_size] * self.page_size + positions % self.page_size

    def pack_tokens(self, requests: Sequence[StepRequest], num_tokens: int,
                    num_rows: int) -> PackedTokens:
        """``requests`` packed token after token into ``num_tokens`` tokens, with ``num_rows``
        page-table rows (``PackedTokens``); each page table checked (``page_table``)."""
        if len(requests) > num_rows:
            raise ValueError(f"{len(requests)} requests exceed num_table_rows={num_rows}")
        token_ids = np.zeros(num_tokens, np.int32)
        positions = np.full(num_tokens, -1, np.int32)
        slots = np.full(num_tokens, -1, np.int32)
        token_request = np.full(num_tokens, -1, np.int32)
        page_tables = np.zeros((num_rows, self.pages_per_request), np.int32)
        starts = np.zeros(len(requests), np.int32)
        last_rows, sampled = [], []
        offset = 0
        for index, request in enumerate(requests):
            span = slice(offset, offset + request.num_tokens)
            pos = np.arange(request.start_pos, request.end_pos, dtype=np.int32)
            table = self.page_table(request)
            token_ids[span] = request.token_ids
            positions[span] = pos
            slots[span] = self.slots(table, pos)
            token_request[span] = index
            page_tables[index, :len(table)] = table
            starts[index] = offset
            offset += request.num_tokens
            if request.sample:
                last_rows.append(offset - 1)
                sampled.append(request)
        return PackedTokens(token_ids, positions, slots, token_request, page_tables, starts,
                            np.array(last_rows, np.int32), sampled)

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

    def _value_shardings(self, cache_names: Sequence[str]) -> Mapping[str, Any]:
        """The plans' value shardings over the mesh, as the family declares them for its hand-off
        values and the caches ``cache_names`` (none without a mesh)."""
        if self.mesh is None:
            return {}
        return family_of(self.model_config).plan_value_shardings(self.model_config, self.mesh,
                                                                 cache_names)

    def _fingerprint(self, *parts: str) -> str:
        """The executable cache key's fingerprint of a runner: ``parts`` (what the family's stage
        functions read besides their arguments), the flax version, and the bytecode of the
        runner's and the model's classes (``_model_classes``)."""
        classes = [type(self), *self._model_classes]
        return "\n".join([*parts, f"flax={flax.__version__}",
                          classes_fingerprint(classes, skip_modules=("flax",))])

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

    def _run_decode_groups(self, requests: list[StepRequest]) -> list[np.ndarray]:
        """The packed sampled rows of a decode step on the decode executables, cut into groups
        of the largest decode bucket (the extra groups counted as ``decode_splits``)."""
        largest = self.buckets.decode_requests[-1]
        groups = [requests[i:i + largest] for i in range(0, len(requests), largest)]
        self.counters["decode_splits"] += len(groups) - 1
        return [self._run_decode(group) for group in groups]

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

    def _decode_meta(self, requests: Sequence[StepRequest], rows: int) -> Packed:
        """The packed metadata of one decode group padded to ``rows``: one transfer per step,
        written into the padding defaults of ``rows``'s builder. Every family's decode step
        reads the token ids, the token rows, the positions, the page tables and the in-step
        sampler's settings; ``_write_decode_fields`` adds the family's own fields."""
        builder = self._decode_builders.get(rows) or self._new_decode_builder(rows)
        fields = builder.reset()
        if requests:
            count = len(requests)
            page_tables = fields["page_tables"]
            for row, request in enumerate(requests):
                table = self.page_table(request)
                page_tables[row, :len(table)] = table
            fields["token_ids"][:count] = [r.token_ids[0] for r in requests]
            fields["token_rows"][:count] = [r.token_row for r in requests]
            fields["positions"][:count] = [r.start_pos for r in requests]
            write_sampling_fields(fields, requests)
            self._write_decode_fields(fields, requests)
        return builder.take()

    def _new_decode_builder(self, rows: int) -> PackedBuilder:
        """The builder of ``rows``-row decode metadata, every row a padding row by default."""
        builder = self._decode_builders[rows] = PackedBuilder(Packed.of({
            "token_ids": np.zeros(rows, np.int32),
            "token_rows": token_rows([], rows),
            "positions": np.full(rows, -1, np.int32),
            **self._decode_field_defaults(rows),
            "page_tables": np.zeros((rows, self.pages_per_request), np.int32),
            **sampling_fields(sampling_arrays([], rows))}))
        return builder

    # ----------------------------------------------------------------- the family's routes

    @abc.abstractmethod
    def _decode_field_defaults(self, rows: int) -> dict[str, np.ndarray]:
        """The family's own decode metadata fields of ``rows`` padding rows."""

    @abc.abstractmethod
    def _write_decode_fields(self, fields: dict[str, np.ndarray],
                             requests: Sequence[StepRequest]) -> None:
        """Write the family's own decode fields of ``requests`` (the common ones written)."""

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
