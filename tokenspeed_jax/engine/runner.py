"""The model runner: one engine step (``StepBatch``) -> sampled tokens, on compiled plans, for
every model family.

The family says how its forward splits into pieces (``models/forward.py``: its ``Forward``,
named by ``Family.forward``); the runner owns the rest, the same way for every family: the cache
pools (the family's ``cache_pools``, allocated here), buckets, page tables, host metadata, the
compile loop (plans keyed by hashable keys), the head and the in-step sampler, the token board,
state-row restores, routes and one counter vocabulary (``runner_stats``).

Routes, chosen per step from static configuration and the step's sizes (``route``):

* **decode**: every request decodes one token past a known prefix. One whole-step executable
  per decode batch bucket (the family's ``decode_layers``, then the head and the in-step
  sampler), at least ``MIN_DECODE_ROWS`` rows (``Buckets``), which writes its sampled ids to the
  *token board* (one device array, a row per sequence) and reads a row's input token from the
  previous step's board when ``StepRequest.token_row`` asks: so ``launch`` can leave a decode
  step running and the engine can launch the next one before the tokens reach the host. The
  pools, the board and the turn's sampled-rows buffer are donated; its metadata is one packed
  buffer. Successive steps of a bucket take its two *turns* (``decode_turns``); with
  ``alternate_decode`` each turn runs its own loaded copy of the executable, so each copy's
  command buffer sees the same addresses at every call. A step with more requests than the
  largest bucket runs in bucket-sized groups (``decode_splits``). When the family stacks decode
  weights (``Forward.stacks_decode_weights``) the buckets of at most ``STACKED_DECODE_MAX_ROWS``
  rows take each layer weight stacked over the layers (a start-up copy).
* **prefill** routes (the family's ``prefill_routes``; ``Forward.prefill_route`` picks one per
  step): the family's prefill plan, which ends by gathering each sampled request's last hidden
  row, then a *head* plan per request bucket: the head and the in-step sampler on its first
  rows. Prefill plans are per token bucket (``table_rows`` page-table rows, ``narrow_rows``
  gathered rows: shapes do not depend on how much context is cached) or, for a family whose
  pieces read per-request metadata (``plans_per_request_bucket``), per (token bucket, request
  bucket). On a GPU they compile without XLA's autotuning (``engine/ladders.py``). A step with
  more tokens or requests than the largest buckets runs in groups that fit them: cut at the
  token boundary (chunked prefill) or, for a family whose requests must stay whole in a step
  (``splits_prefill`` off), of whole requests; a request that cannot fit runs eagerly.
* **Mixed steps** (some requests decode, others prefill) run as two: the decode rows on the
  decode route and the rest on theirs, joined back in batch order (``mixed_splits``).
* **Sampling in two tiers** (``sampling_plans``): heads and decode steps end with the in-step
  sampler and also return their logits; the ``Resampler`` samples again the rows whose requests
  need penalties, truncation or top log-probabilities.
* **eager**: the same plans op by op at the step's exact size (``enforce_eager``, a family
  without a prefill graph, or a step too large for the buckets); counted, its compiles declared
  to the guard.

Invariants:

* Padding tokens have slot -1, request -1 and position -1; padding requests own no token, have
  state slot -1 and sample nothing that is returned: they never write a page or a state row.
* Every pool is donated and updated in place, never copied per step.
* State rows (pools counted in ``SLOT``s, a family's recurrent state): a request names its row
  (``state_slot``), and one with ``restore_slot >= 0`` has that row copied into its own (one
  compiled ``restore`` executable, pools donated) before its step runs.
* ``launch`` leaves a step running only on the decode route and only when every request can stay
  on the board (``token_board.can_stay_on_board``); any other step runs to its end, and one whose
  requests read tokens from the board is refused (``check_no_token_rows``). ``step(batch)`` is
  ``launch(batch).result()``.
* After ``compile_all`` nothing on the compiled routes compiles; the guard counts (strict:
  raises on) any compile. Steps before ``compile_all`` are refused; a background-compile failure
  is raised at the next step (``LadderCompiler.check``).
* ``ready`` is what steps choose buckets from: every bucket before ``compile_all``, then the
  ladders' ready ones, whose largest are the full ladders' largest, so only the padding changes.
  A prefill plan per (tokens, requests) is ready with its shapes for the skeleton's request rungs
  once its token rung is, and for every token rung once a request rung outside the skeleton is.
* Every executable goes through the on-disk executable cache, keyed with ``cache_fingerprint``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from tokenspeed_jax import parallel
from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.batch import (
    PendingStep,
    StepBatch,
    StepOutput,
    StepRequest,
    is_decode_row,
)
from tokenspeed_jax.engine.buckets import Buckets
from tokenspeed_jax.engine.compilers import engine_compiler, ladder_compiler
from tokenspeed_jax.engine.decode_turns import DecodeSlot, DecodeTurns, sampled_buffer_spec
from tokenspeed_jax.engine.ladders import LadderCompiler, Rung
from tokenspeed_jax.engine.runner_stats import new_counters, runner_stats
from tokenspeed_jax.engine.sampling_plans import (
    Resampler,
    fast_sample,
    run_step,
    sampling_arrays,
    sampling_fields,
    step_output,
    unpack_sampling,
    write_sampling_fields,
)
from tokenspeed_jax.engine.token_board import (
    board_rows,
    can_stay_on_board,
    check_no_token_rows,
    new_board,
    pending_decode,
    read_tokens,
    token_rows,
    write_board,
)
from tokenspeed_jax.graph import (
    Break,
    Call,
    CompiledPlan,
    CompileGuard,
    CompileSummary,
    Plan,
    Segment,
    abstract,
    choose_bucket,
    run_eager,
)
from tokenspeed_jax.graph import arrays as device_arrays
from tokenspeed_jax.graph.cache import classes_fingerprint
from tokenspeed_jax.graph.packed import Packed, PackedBuilder
from tokenspeed_jax.kernels.paged_prefill_attention import prefill_work
from tokenspeed_jax.models.cache_spec import PAGE, SLOT, pool_specs
from tokenspeed_jax.models.registry import family_of

logger = logging.getLogger(__name__)

STACKED_DECODE_MAX_ROWS = 8  # decode buckets up to this many rows take stacked weights
HEAD_OUTPUTS = ("sampled", "logits")


def split_requests(
    requests: Sequence[StepRequest], max_tokens: int, max_requests: int
) -> list[list[StepRequest]]:
    """Pack ``requests`` in order into groups of <= max_tokens tokens and <= max_requests requests.

    A request that does not fit is cut at the token boundary: its pieces keep their positions
    (``start_pos`` advances) and only the piece holding its last token samples.
    """
    groups: list[list[StepRequest]] = []
    current: list[StepRequest] = []
    tokens = 0
    for request in requests:
        offset = 0
        while offset < request.num_tokens:
            if len(current) == max_requests or tokens == max_tokens:
                groups.append(current)
                current, tokens = [], 0
            take = min(request.num_tokens - offset, max_tokens - tokens)
            last = offset + take == request.num_tokens
            current.append(dataclasses.replace(
                request,
                token_ids=request.token_ids[offset:offset + take],
                start_pos=request.start_pos + offset,
                sample=request.sample and last,
            ))
            tokens += take
            offset += take
    if current:
        groups.append(current)
    return groups


def group_whole_requests(requests: Sequence[StepRequest], max_tokens: int, max_requests: int
                         ) -> list[list[StepRequest]]:
    """``requests`` in order in groups of <= max_tokens tokens and <= max_requests requests,
    none cut (each request holds at most ``max_tokens`` tokens)."""
    groups: list[list[StepRequest]] = []
    current: list[StepRequest] = []
    tokens = 0
    for request in requests:
        if current and (len(current) == max_requests
                        or tokens + request.num_tokens > max_tokens):
            groups.append(current)
            current, tokens = [], 0
        current.append(request)
        tokens += request.num_tokens
    if current:
        groups.append(current)
    return groups


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


def _copy_rows(params: Any, src: jax.Array, dst: jax.Array, *pools: jax.Array) -> tuple:
    """Each pool with row ``dst[i]`` set to row ``src[i]`` (pairs with ``dst < 0`` skipped)."""
    del params
    return tuple(pool.at[jnp.where(dst >= 0, dst, pool.shape[0])].set(
        pool[jnp.maximum(src, 0)], mode="drop") for pool in pools)


class ModelRunner:
    """Runs engine steps of any registered family's model over the cache pools it owns (module
    docstring)."""

    COMPILE_DESCRIPTION = "compiling executables"  # the start-up compile's progress bar

    @staticmethod
    def extra_device_bytes(config: EngineConfig, model: Any) -> int:
        """Device bytes a runner of ``model`` adds besides its caches, which start-up reserves
        before sizing them (the family's ``Forward.extra_device_bytes``)."""
        return family_of(model.config).forward_class().extra_device_bytes(config, model)

    def __init__(self, model: Any, config: EngineConfig, num_pages: int, page_size: int = 16,
                 *, num_state_slots: int = 0, settings: Any = None) -> None:
        """``num_state_slots``: rows of the state pools (a family with recurrent state needs at
        least one); ``settings``: the family forward's resolved settings (the tests give a
        GPU's); None = resolved for JAX's default backend."""
        family = family_of(model.config)
        self.mesh = parallel.make_mesh(config.tensor_parallel_size)
        pools = family.cache_pools(model.config, page_size, getattr(model, "dtype", jnp.float32),
                                   config.kda_state_dtype, parallel.mesh_size(self.mesh))
        has_state = any(pool.per == SLOT for pool in pools)
        if num_pages < 1 or page_size < 1 or (has_state and num_state_slots < 1):
            raise ValueError(f"num_pages={num_pages}, page_size={page_size} and (with state "
                             f"pools) num_state_slots={num_state_slots} must be >= 1")
        self.config = config
        self.model_config = model.config
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_state_slots = num_state_slots
        self.pages_per_request = math.ceil(config.max_model_len / page_size)
        if self.mesh is not None:
            family.place_model(model, self.mesh)
        self.forward = family.forward_class()(model, config, page_size=page_size, mesh=self.mesh,
                                              settings=settings)
        self.buckets = Buckets.from_config(config, prefill=self.forward.supports_prefill_graph,
                                           decode=self.forward.supports_decode_graph)
        self.alternate_decode = self.forward.alternate_decode
        self.pools: dict[str, jax.Array] = device_arrays.zeros(
            engine_compiler(config, description="allocating the cache pools", fingerprint=None,
                            mesh=self.mesh),
            pool_specs(pools, {PAGE: num_pages, SLOT: num_state_slots}, self.mesh))
        self.state_pools = tuple(pool.name for pool in pools if pool.per == SLOT)
        self.stacked_layers = None
        if self.forward.stacks_decode_weights():
            self.stacked_layers = device_arrays.stack(engine_compiler(
                config, description="stacking decode weights", fingerprint=None, mesh=self.mesh),
                self.forward.layer_states)
        self.guard = CompileGuard(strict=config.strict_no_compile)
        self.board = new_board(board_rows(config.max_num_seqs, self.buckets.decode_executables))
        self.resampler = Resampler(self.model_config.vocab_size)
        self.counters = new_counters()
        self._decode_turns: dict[int, DecodeTurns] = {}
        self._decode_builders: dict[int, PackedBuilder] = {}
        self._compiled: dict[tuple, CompiledPlan] = {}
        self.ladders: LadderCompiler | None = None  # set by compile_all
        self.compiled = False
        self._build_plans()

    # ----------------------------------------------------------------- plans

    def _build_plans(self) -> None:
        forward = self.forward
        pools = tuple(self.pools)
        self.plans = {route: forward.prefill_plan(route, pools)
                      for route in dict.fromkeys((*forward.prefill_routes, forward.eager_route))}
        head = Break("head", self._head, ("rows_hidden",), HEAD_OUTPUTS)
        self.head_plan = Plan([Call(head, forward.outer_state)], ("rows_hidden",), HEAD_OUTPUTS)
        carried = (*pools, "board", "sampled")
        decoded = (*HEAD_OUTPUTS, "board", *pools)
        decode = Break("decode", self._decode_step, carried, decoded, donate=carried)
        # Also the quick skeleton's decode (engine/ladders.py): stacked weights make every
        # layer's products a different fused computation, each compiled (and autotuned) alone.
        self.per_layer_decode_plan = Plan(
            [Call(decode, (forward.outer_state, tuple(forward.layer_states)))], carried, decoded)
        self.stacked_decode_plan = None if self.stacked_layers is None else Plan(
            [Call(decode, (forward.outer_state, self.stacked_layers))], carried, decoded)
        self.restore_plan = None
        if self.state_pools:
            restore = Segment("restore", _copy_rows,
                              ("restore_src", "restore_dst", *self.state_pools),
                              self.state_pools, self.state_pools)
            self.restore_plan = Plan([Call(restore)], restore.inputs, restore.outputs)

    def decode_plan(self, rows: int) -> Plan:
        """The decode plan of a bucket of ``rows`` rows: stacked weights for small buckets when
        the runner stacks them (module docstring), one argument per layer weight otherwise."""
        if self.stacked_decode_plan is not None and rows <= STACKED_DECODE_MAX_ROWS:
            return self.stacked_decode_plan
        return self.per_layer_decode_plan

    def prefill_plan(self, name: str) -> Plan:
        """The prefill plan ``name`` (a route of the family, or an eager-only plan it knows)."""
        if name not in self.plans:
            self.plans[name] = self.forward.prefill_plan(name, tuple(self.pools))
        return self.plans[name]

    def _head(self, params: Any, packed: Packed, hidden: jax.Array) -> tuple:
        """The head and the in-step sampler on the first rows of ``hidden``, one per sampling
        row: (sampled rows, fp32 logits)."""
        sampling = unpack_sampling(packed.unpack())
        hidden = hidden[:sampling.temperature.shape[0]]
        logits = self.forward.outer(params).head(hidden).astype(jnp.float32)
        return fast_sample(sampling, logits), logits

    def _decode_step(self, params: Any, packed: Packed, *values: jax.Array) -> tuple:
        """One decode step: the in-step sampler's rows, the logits (for ``resample``), the token
        board, the pools. A row with ``token_rows >= 0`` reads its input token from the board the
        previous decode step wrote. The last value (the turn's sampled-rows buffer) is not read:
        it is donated so that the sampled rows are written into it."""
        meta = packed.unpack()
        *pool_values, board, _ = values
        token_ids = read_tokens(meta["token_ids"], meta["token_rows"], board)
        hidden, pools = self.forward.decode_layers(params, meta, token_ids,
                                                   dict(zip(self.pools, pool_values)))
        logits = self.forward.outer(params[0]).head(hidden).astype(jnp.float32)
        sampled = fast_sample(unpack_sampling(meta), logits)
        return (sampled, logits, write_board(board, sampled), *pools.values())

    # ----------------------------------------------------------------- buckets and host arrays

    @property
    def ready(self) -> Buckets:
        """The buckets steps choose from: those whose plans are compiled (all of ``buckets``
        once the background compile is done); before ``compile_all``, ``buckets``."""
        return self.buckets if self.ladders is None else self.ladders.ready

    @property
    def narrow_rows(self) -> int:
        """Rows a prefill plan per token bucket gathers for the head (the largest request
        bucket): one plan serves every request bucket, whose head reads its first rows."""
        return self.buckets.prefill_requests[-1]

    def _plan_rows(self, tokens: int, requests: int) -> tuple[int | None, int, int]:
        """(the request rows in a prefill plan's key, its page-table rows, its gathered rows)
        for a step of ``requests`` request rows in token bucket ``tokens``."""
        if self.forward.plans_per_request_bucket:
            return requests, requests, requests
        return None, min(tokens, self.narrow_rows), self.narrow_rows

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

    def _check_state_rows(self, request: StepRequest) -> None:
        """A request's state rows, with state pools: its own in range, its checkpoint and restore
        rows in range and not its own (without state pools they are never read)."""
        if not self.state_pools:
            return
        slot, checkpoint = request.state_slot, request.checkpoint_slot
        if not 0 <= slot < self.num_state_slots:
            raise ValueError(f"request {request.request_id}: state_slot={slot} must be in "
                             f"[0, {self.num_state_slots})")
        if checkpoint >= self.num_state_slots or checkpoint == slot:
            raise ValueError(f"request {request.request_id}: checkpoint_slot={checkpoint} must "
                             f"be < {self.num_state_slots} and differ from state_slot={slot}")
        if request.restore_slot >= self.num_state_slots or request.restore_slot == slot:
            raise ValueError(f"request {request.request_id}: restore_slot={request.restore_slot} "
                             f"must be < {self.num_state_slots} and differ from state_slot={slot}")

    def pack_tokens(self, requests: Sequence[StepRequest], num_tokens: int,
                    num_rows: int) -> PackedTokens:
        """``requests`` packed token after token into ``num_tokens`` tokens, with ``num_rows``
        page-table rows (``PackedTokens``); each page table and state row checked."""
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
            self._check_state_rows(request)
            token_ids[span] = request.token_ids
            positions[span] = pos
            slots[span] = (table[pos // self.page_size] * self.page_size
                           + pos % self.page_size)
            token_request[span] = index
            page_tables[index, :len(table)] = table
            starts[index] = offset
            offset += request.num_tokens
            if request.sample:
                last_rows.append(offset - 1)
                sampled.append(request)
        return PackedTokens(token_ids, positions, slots, token_request, page_tables, starts,
                            np.array(last_rows, np.int32), sampled)

    def prefill_arrays(self, requests: Sequence[StepRequest], num_tokens: int,
                       num_table_rows: int, num_rows: int) -> tuple[dict, dict]:
        """Host-built (numpy) arrays of one padded prefill group: the plan inputs (``rows``:
        each sampled request's last token, padded to ``num_rows``; the family's own) and the
        plan's metadata (the family's: page tables padded to ``num_table_rows`` rows)."""
        packed = self.pack_tokens(requests, num_tokens, num_table_rows)
        inputs, meta = self.forward.prefill_arrays(requests, packed, num_table_rows)
        return {"token_ids": packed.token_ids, "positions": packed.positions,
                "rows": packed.sampled_rows(num_rows), **inputs}, meta

    def _head_meta(self, sampled: Sequence[StepRequest], rows: int) -> dict:
        """The packed metadata of the head plan: the in-step sampler's settings."""
        return {"head": Packed.of(sampling_fields(sampling_arrays(sampled, rows)))}

    # ----------------------------------------------------------------- start-up compile

    def cache_fingerprint(self) -> str:
        """What the stage functions read besides their arguments, for the executable cache key:
        the family forward's parts (the model's static structure and attributes, its kernels),
        the flax version, and the bytecode of the runner's, the forward's and the model's
        classes."""
        classes = [type(self), type(self.forward), *self.forward.model_classes]
        return "\n".join([*self.forward.fingerprint_parts(), f"flax={flax.__version__}",
                          classes_fingerprint(classes, skip_modules=("flax",))])

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

    def _add_plans(self, ladders: LadderCompiler) -> None:
        """Every bucket plan, rung by rung (deferred plans compile in this order): per decode
        executable the decode step and its resamplers; the restore; per request bucket the head
        and its resamplers; per prefill shape its routes' plans."""
        pools = abstract(self.pools)
        shardings = {} if self.mesh is None else family_of(self.model_config).plan_value_shardings(
            self.model_config, self.mesh, list(self.pools))
        self._add_decode_plans(ladders, pools, shardings)
        rows = self.restore_rows
        if self.restore_plan is not None and rows is not None:
            index = jax.ShapeDtypeStruct((rows,), jnp.int32)
            ladders.add([("prefill_requests", rows)], f"restore N={rows}",
                        self._store(("restore", rows)), self.restore_plan,
                        {"restore_src": index, "restore_dst": index,
                         **{n: pools[n] for n in self.state_pools}}, shardings=shardings)
        hidden = self.model_config.hidden_size
        for rows in self.buckets.prefill_requests:
            gathered = self._plan_rows(rows, rows)[2]
            ladders.add([("prefill_requests", rows)], f"head B={rows}",
                        self._store(("head", rows)), self.head_plan,
                        {"rows_hidden": jax.ShapeDtypeStruct((gathered, hidden),
                                                             self.forward.dtype)},
                        abstract(self._head_meta([], rows)))
            ladders.add_resampler(self.resampler, rows)
        for tokens, requests in self._prefill_shapes(ladders.skeleton):
            key_rows = self._plan_rows(tokens, requests)[0]
            shape = f"T={tokens}" if key_rows is None else f"T={tokens} N={key_rows}"
            for route in self.forward.prefill_routes:
                ladders.add(self._rungs_needing(tokens, key_rows, ladders.skeleton),
                            f"{route} {shape}", self._store((route, tokens, key_rows)),
                            self.plans[route], *self.prefill_specs(tokens, requests),
                            shardings=shardings, autotune=False)

    def prefill_specs(self, tokens: int, requests: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """The abstract (inputs, metadata) of the prefill plans of token bucket ``tokens`` and
        request bucket ``requests``, for a ``PlanCompiler``."""
        _, table_rows, gathered = self._plan_rows(tokens, requests)
        inputs, meta = abstract(self.prefill_arrays([], tokens, table_rows, gathered))
        return {**inputs, **abstract(self.pools)}, meta

    def _store(self, key: tuple) -> Callable[[CompiledPlan], None]:
        return functools.partial(self._compiled.__setitem__, key)

    def compiled_plan(self, key: tuple) -> CompiledPlan:
        """The compiled plan of ``key``: ``(route, tokens, request rows or None)`` for a prefill
        plan, ``("head", rows)``, ``("restore", rows)``."""
        return self._compiled[key]

    def _prefill_shapes(self, skeleton: Buckets) -> list[tuple[int, int]]:
        """The (tokens, requests) shapes of the prefill plans, in compile order: each token
        rung with the skeleton's request rungs, then each other request rung with every token
        rung (a plan per token bucket serves every request bucket: one shape per token rung)."""
        if not self.forward.plans_per_request_bucket:
            return [(t, self.narrow_rows) for t in self.buckets.tokens]
        shapes = [(t, n) for t in self.buckets.tokens for n in self.buckets.prefill_requests
                  if n <= t]
        first = [(t, n) for t, n in shapes if n in skeleton.prefill_requests]
        rest = sorted(set(shapes) - set(first), key=lambda shape: shape[::-1])
        return first + rest

    @staticmethod
    def _rungs_needing(tokens: int, requests: int | None, skeleton: Buckets) -> list[Rung]:
        """The rungs that need the plans of one prefill shape: a plan per token bucket its token
        rung. A plan per (tokens, requests): a token rung its shapes with the skeleton's request
        rungs; a request rung its shapes with the skeleton's token rungs, or with every token
        rung when it is not in the skeleton itself. So any ready token rung and ready request
        rung have their shape's plans."""
        if requests is None:
            return [("tokens", tokens)]
        needed_by = []
        if requests in skeleton.prefill_requests:
            needed_by.append(("tokens", tokens))
        if requests not in skeleton.prefill_requests or tokens in skeleton.tokens:
            needed_by.append(("prefill_requests", requests))
        return needed_by

    def stats(self) -> dict[str, float]:
        """Runtime compiles, route counts and padding waste since start-up; buckets ready
        (``runner_stats``)."""
        return runner_stats(self.counters, resampler=self.resampler, guard=self.guard,
                            ladders=self.ladders)

    # ----------------------------------------------------------------- serving

    def step(self, batch: StepBatch) -> StepOutput:
        """Run one engine step; one sampled token per request with ``sample`` set, in order."""
        return self.launch(batch).result()

    def launch(self, batch: StepBatch) -> PendingStep:
        """Start one engine step. A decode step whose requests need only the in-step sampler is
        left running: its tokens are fetched by ``result()``, and stay on the token board for
        the next decode step (``StepRequest.token_row``). Any other step runs to its end here."""
        requests = batch.requests
        if not requests:
            raise ValueError("a step needs at least one request")
        if (self.buckets.tokens or self.buckets.decode_requests) and not self.compiled:
            raise RuntimeError("call compile_all() before step()")
        if self.ladders is not None:
            self.ladders.check()
        if (self.route(requests) == "decode" and len(requests) <= self.buckets.decode_requests[-1]
                and can_stay_on_board(requests)):
            return self._launch_decode(requests)
        check_no_token_rows(requests)
        return PendingStep.done(run_step(requests, self._run, counters=self.counters,
                                         split_mixed=bool(self.buckets.decode_requests)))

    def route(self, requests: Sequence[StepRequest]) -> str:
        """The route a step takes (module docstring): "decode", one of the family's prefill
        routes, or "eager"."""
        if self.buckets.decode_requests and all(map(is_decode_row, requests)):
            return "decode"
        if not self.buckets.tokens:
            return "eager"
        max_tokens = self.buckets.tokens[-1]
        total = sum(r.num_tokens for r in requests)
        if self.forward.splits_prefill:
            eager = total > max_tokens and not self.config.chunked_prefill_size
        else:
            eager = any(r.num_tokens > max_tokens for r in requests)
        if eager:
            logger.info("a step of %d requests, %d tokens, does not fit the largest prefill "
                        "bucket of %d tokens in pieces: running eagerly", len(requests), total,
                        max_tokens)
            return "eager"
        return self.forward.prefill_route(requests)

    def _run(self, requests: list[StepRequest]) -> list[np.ndarray]:
        """The packed sampled rows of ``requests`` on the route they take."""
        route = self.route(requests)
        if route == "eager":
            return [self._eager_rows(requests, self.forward.eager_route)]
        if route == "decode":
            return self._run_decode_groups(requests)
        max_tokens = self.buckets.tokens[-1]
        max_requests = self.buckets.prefill_requests[-1]
        if self.forward.splits_prefill:
            total = sum(r.num_tokens for r in requests)
            by_requests = split_requests(requests, total, max_requests)
            groups = split_requests(requests, max_tokens, max_requests)
        else:
            by_requests = groups = group_whole_requests(requests, max_tokens, max_requests)
        self.counters["request_splits"] += len(by_requests) - 1
        self.counters["chunked_prefill_splits"] += len(groups) - len(by_requests)
        return [self._run_prefill(self.forward.prefill_route(group), group) for group in groups]

    def run_compiled(self, route: str, requests: Sequence[StepRequest]) -> StepOutput:
        """A step on the compiled plans of ``route`` ("decode" or a prefill route)."""
        if route == "decode":
            return step_output(self._run_decode_groups(list(requests)))
        return step_output([self._run_prefill(route, requests)])

    def prefill_bucket(self, requests: Sequence[StepRequest]) -> tuple[int, int]:
        """(tokens, requests): the ready buckets of a prefill group. A plan per (tokens,
        requests) holds at most as many requests as tokens."""
        ready = self.ready
        rows = choose_bucket(ready.prefill_requests, len(requests))
        total = sum(r.num_tokens for r in requests)
        if self.forward.plans_per_request_bucket:
            total = max(total, rows)
        return choose_bucket(ready.tokens, total), rows

    def _run_prefill(self, route: str, requests: Sequence[StepRequest]) -> np.ndarray:
        """The packed sampled rows of a prefill group on the compiled plan of ``route`` and the
        head of its request bucket (keeping the pools)."""
        total = sum(r.num_tokens for r in requests)
        tokens, rows = self.prefill_bucket(requests)
        key_rows, table_rows, gathered = self._plan_rows(tokens, rows)
        inputs, meta = self.prefill_arrays(requests, tokens, table_rows, gathered)
        self.restore(requests)
        self.counters["prefill_runs"] += 1
        self.counters["ordinary_runs"] += route == "ordinary"
        self.counters["real_tokens"] += total
        self.counters["padded_tokens"] += tokens - total
        out = self._compiled[route, tokens, key_rows].run(
            {**jax.device_put(inputs), **self.pools}, meta)
        self._adopt(out)
        sampled = [r for r in requests if r.sample]
        head = self._compiled["head", rows].run({"rows_hidden": out["rows_hidden"]},
                                                self._head_meta(sampled, rows))
        return self.resampler.finish(sampled, rows, head["sampled"], head["logits"])

    def run_eager(self, requests: Sequence[StepRequest], *, plan: str | None = None
                  ) -> StepOutput:
        """A step op by op at its exact size on the prefill plan ``plan`` (default the family's
        eager route; any plan the family knows, e.g. Kimi's "reference") or "decode"."""
        return step_output([self._eager_rows(requests, plan or self.forward.eager_route)])

    def _eager_rows(self, requests: Sequence[StepRequest], plan: str) -> np.ndarray:
        self.counters["eager_runs"] += 1
        total = sum(r.num_tokens for r in requests)
        self.counters["real_tokens"] += total
        if plan == "decode":
            return self._eager_decode_rows(requests)
        sampled = [r for r in requests if r.sample]
        inputs, meta = self.prefill_arrays(requests, total, len(requests), len(sampled))
        self.restore(requests)
        with self.guard.allowed("eager forward"):
            out = run_eager(self.prefill_plan(plan), {**jax.device_put(inputs), **self.pools},
                            meta)
            self._adopt(out)
            head = run_eager(self.head_plan, {"rows_hidden": out["rows_hidden"]},
                             self._head_meta(sampled, len(sampled)))
            return self.resampler.finish(sampled, len(sampled), head["sampled"], head["logits"],
                                         eager=True)

    def _eager_decode_rows(self, requests: Sequence[StepRequest]) -> np.ndarray:
        """The decode plan op by op at the step's exact size."""
        rows = len(requests)
        meta = {"decode": self._decode_meta(requests, rows)}
        self.restore(requests)
        spec = sampled_buffer_spec(rows)
        with self.guard.allowed("eager forward"):
            out = run_eager(self.per_layer_decode_plan,
                            {**self.pools, "board": self.board,
                             "sampled": jnp.zeros(spec.shape, spec.dtype)}, meta)
            self._adopt(out)
            self.board = out["board"]
            return self.resampler.finish(list(requests), rows, out["sampled"], out["logits"],
                                         eager=True)

    @property
    def restore_rows(self) -> int | None:
        """Row pairs one compiled restore executable copies (the largest prefill request bucket);
        None without prefill request buckets (the prefill graph off, or eager): none is compiled."""
        return max(self.buckets.prefill_requests, default=None)

    def restore(self, requests: Sequence[StepRequest]) -> None:
        """Copy each ``restore_slot`` row into its request's ``state_slot`` (see the invariants):
        through the compiled restore executable, ``restore_rows`` pairs a call, or where none is
        compiled op by op, all pairs at once."""
        if self.restore_plan is None:
            return
        pairs = [(r.restore_slot, r.state_slot) for r in requests if r.restore_slot >= 0]
        rows = self.restore_rows
        if rows is None:
            if pairs:
                self._restore_rows(pairs, len(pairs), compiled=False)
            return
        for start in range(0, len(pairs), rows):
            self._restore_rows(pairs[start:start + rows], rows, compiled=True)

    def _restore_rows(self, pairs: list[tuple[int, int]], rows: int, *, compiled: bool) -> None:
        """One restore call of ``rows`` rows copying ``pairs`` (source, destination slots)."""
        src = np.full(rows, -1, np.int32)
        dst = np.full(rows, -1, np.int32)
        src[:len(pairs)], dst[:len(pairs)] = zip(*pairs)
        self.counters["kda_state_restores"] += len(pairs)
        inputs = {"restore_src": jax.device_put(src), "restore_dst": jax.device_put(dst),
                  **{n: self.pools[n] for n in self.state_pools}}
        if compiled:
            out = self._compiled["restore", rows].run(inputs)
        else:
            with self.guard.allowed("eager restore"):
                out = run_eager(self.restore_plan, inputs, {})
        self.pools.update(out)

    def _adopt(self, values: dict[str, jax.Array]) -> None:
        """Take the pools a plan returned (the donated inputs are gone)."""
        self.pools = {name: values[name] for name in self.pools}

    # ----------------------------------------------------------------- the decode route

    def _add_decode_plans(self, ladders: LadderCompiler, pools: dict[str, Any],
                          shardings: dict[str, Any]) -> None:
        """Per decode executable, rung by rung: its decode plan (over ``pools`` in carried
        order) and its resamplers."""
        for rows in self.buckets.decode_executables:
            specs = {**pools, "board": abstract(self.board),
                     "sampled": sampled_buffer_spec(rows)}
            ladders.add(ladders.decode_rungs(rows), f"decode B={rows}",
                        functools.partial(self._store_decode, rows), self.decode_plan(rows),
                        specs, {"decode": abstract(self._decode_meta([], rows))},
                        shardings=shardings, copies=2 if self.alternate_decode else 1,
                        quick_plan=self.per_layer_decode_plan)
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
        """Enqueue one decode executable (keeping its pools, token board and sampled-rows
        buffer): its outputs, on the device, its rows and the turn it ran in."""
        rows = self.ready.decode_rows(len(requests))
        slot, meta = self.decode_inputs(requests, rows)
        self.restore(requests)
        self.counters["decode_runs"] += 1
        self.counters["real_tokens"] += len(requests)
        self.counters["padded_tokens"] += rows - len(requests)
        slot.sampled, logits, self.board, *pools = slot.plan.run_positional(
            [*self.pools.values(), self.board, slot.sampled], meta)
        self.pools = dict(zip(self.pools, pools))
        return {"sampled": slot.sampled, "logits": logits}, rows, slot

    def _decode_meta(self, requests: Sequence[StepRequest], rows: int) -> Packed:
        """The packed metadata of one decode group padded to ``rows``: one transfer per step,
        written into the padding defaults of ``rows``'s builder: the token ids, the token rows,
        the positions, the page tables, the in-step sampler's settings and the family's own
        fields (``Forward.write_decode_fields``)."""
        builder = self._decode_builders.get(rows) or self._new_decode_builder(rows)
        fields = builder.reset()
        if requests:
            count = len(requests)
            page_tables = fields["page_tables"]
            for row, request in enumerate(requests):
                table = self.page_table(request)
                self._check_state_rows(request)
                page_tables[row, :len(table)] = table
            fields["token_ids"][:count] = [r.token_ids[0] for r in requests]
            fields["token_rows"][:count] = [r.token_row for r in requests]
            fields["positions"][:count] = [r.start_pos for r in requests]
            write_sampling_fields(fields, requests)
            self.forward.write_decode_fields(fields, requests)
        return builder.take()

    def _new_decode_builder(self, rows: int) -> PackedBuilder:
        """The builder of ``rows``-row decode metadata, every row a padding row by default."""
        builder = self._decode_builders[rows] = PackedBuilder(Packed.of({
            "token_ids": np.zeros(rows, np.int32),
            "token_rows": token_rows([], rows),
            "positions": np.full(rows, -1, np.int32),
            **self.forward.decode_field_defaults(rows),
            "page_tables": np.zeros((rows, self.pages_per_request), np.int32),
            **sampling_fields(sampling_arrays([], rows))}))
        return builder
