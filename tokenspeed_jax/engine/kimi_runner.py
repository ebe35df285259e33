"""Kimi-Linear model runner: KDA layers inline in the segments, MLA attention at the breaks.

A forward is written as a list of *pieces* (embed, one KDA layer, the halves of an MLA layer, the
KDA core) and cut into a ``graph.Plan``: consecutive non-break pieces fuse into one segment, so
the KDA layers between two MLA layers share one segment (``out(MLA j) + KDA ... + in(MLA j+1)``);
segments with the same pieces and wiring are one executable. Routes per step:

* **inline** (prefill and extend steps, the default): KDA layers (projections, short conv, the
  chunked Pallas KDA kernel, gated norm, output projection, MoE) run inside the segments; each
  MLA layer's latent paged attention is a break (``mla_attention.mla_prefill_step``: the Pallas
  kernel on a GPU, the plain-JAX reference elsewhere; ``choose_mla_kernel`` decides once). One
  plan per (token bucket, request bucket).
* **ordinary**: the same, with each KDA layer's core (the kernel) at a break. Taken for steps
  with a one-token continuation chunk and when ``disable_kda_prefill_graph`` is set; a step with
  more requests or tokens than the largest bucket runs this route eagerly at its exact size.
* **decode**: one token per request, one whole-step executable per decode batch bucket
  (``StepRunner``'s decode graph): the embedding, every layer (the recurrent KDA kernel; MLA
  attention with ``mla_decode_step``, which also writes the step's latent rows), the head and
  the in-step sampler, which writes the sampled ids to the token board (``token_board``): a row
  whose ``StepRequest.token_row`` is set takes its input token from the previous decode step's
  board, so ``launch`` can leave a decode step running and the engine can launch the next one
  before the tokens reach the host. Its metadata is one packed buffer; the pools, the board and
  the turn's sampled-rows buffer are donated. A decode step of more requests than the largest
  decode bucket runs as bucket-sized groups (counted as ``decode_splits``).
* **eager**: any plan op by op (``run_eager``), the reference the compiled routes match.

A mixed step (some requests decode, others prefill) runs as two, its decode rows on the decode
route and the rest on the route they take, joined back in batch order (``mixed_splits``).
Counts use every runner's vocabulary (``runner_stats``): inline and ordinary steps are
``prefill_runs``, the ordinary ones also ``ordinary_runs``.

State: per KDA layer a recurrent pool ``state.i [P, H, V, K]`` (each state transposed; fp32, or
bf16 with ``EngineConfig.kda_state_dtype``) and a conv pool
``conv.i [P, W - 1, 3 H K]``; per MLA layer a paged latent cache ``latent.j``. Requests name
their rows (``StepRequest.state_slot``); every pool is donated and updated in place. A
request at position 0 starts from zero states (its rows are reset inside the plan); a later chunk
or decode step continues from what its rows hold (its previous chunk, or a restored checkpoint).

MLA layers take the token positions (``layer.mla_inputs(hidden, positions)``), so a family
whose latent attention rotates its rope part (DeepSeek-V3) runs here too; a model without KDA
layers has no state pools or restore executable, and its requests need no state rows (the runner
is then built like ``ModelRunner``: ``(model, config, num_pages, page_size)``).

Tensor parallelism (``tensor_parallel_size`` > 1): the weights are placed with the family's
``place_model``, the pools as the family's ``cache_pools`` declare them (state and conv rows
split by head, latent pages replicated); every executable is compiled over the mesh with the
hand-off values' shardings the family declares (``Family.plan_value_shardings``), and the pieces
run the KDA kernels and the routed experts per shard (``shard_map``).

Invariants:

* Padding tokens have slot -1, request -1 and position -1; padding requests have state slot -1
  and no checkpoint: they never write a pool row or a page (tested on the whole pool).
* Prefix checkpoints: a request with ``checkpoint_slot >= 0`` stores its KDA and conv states at
  the last multiple of ``prefix_granularity`` its step crosses (``checkpoint_split``). Every
  prefill plan carries per-request checkpoint offsets and slots, so a step with zero, one or more
  checkpointing requests reuses the same executable; the kernel scans such a request in two
  loops (main up to the checkpoint, tail after it) within one call.
* Restores: a request with ``restore_slot >= 0`` has that row's KDA and conv states copied into
  its ``state_slot`` (one compiled ``restore`` executable, pools donated) before its step runs.
* Per-request KDA metadata (``cu_seqlens``, slots, checkpoint offsets and slots) travels as plan
  inputs of the prefill routes (segments read it), their attention's (page tables, slot
  mappings, kernel work items) as break metadata; a decode step's all travels in its one packed
  buffer.
* Sampling is two-tier as in ``ModelRunner`` (``sampling_plans``): the head ends with the in-step
  sampler, and the ``Resampler`` samples again the rows of a step whose requests need penalties,
  truncation or top log-probabilities.
* Every executable goes through the on-disk executable cache, keyed with ``cache_fingerprint``.
* With background compile, the skeleton's plans are compiled before serving and the others in
  the background (``engine/ladders.py``); a prefill plan is per (token bucket, request bucket),
  so a token rung is ready with its shapes for the skeleton's request rungs, and any other
  request rung with its shapes for every token rung: a ready token bucket and a ready request
  bucket always have their plans. A step's token bucket holds at least its request bucket.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tokenspeed_jax import parallel
from tokenspeed_jax.config import EngineConfig, warn_inapplicable
from tokenspeed_jax.engine.batch import StepBatch, StepOutput, StepRequest
from tokenspeed_jax.engine.buckets import Buckets
from tokenspeed_jax.engine.compilers import engine_compiler
from tokenspeed_jax.engine.decode_turns import sampled_buffer_spec
from tokenspeed_jax.engine.ladders import LadderCompiler
from tokenspeed_jax.engine.packed import Packed
from tokenspeed_jax.engine.sampling_plans import (
    fast_sample,
    sampling_arrays,
    step_output,
    unpack_sampling,
)
from tokenspeed_jax.engine.step_runner import StepRunner, alternates_decode_executables
from tokenspeed_jax.engine.token_board import read_tokens, write_board
from tokenspeed_jax.graph import (
    Break,
    Call,
    CompiledPlan,
    Piece,
    Plan,
    PlanBuilder,
    Segment,
    abstract,
    choose_bucket,
    run_eager,
)
from tokenspeed_jax.graph import arrays as device_arrays
from tokenspeed_jax.kernels.kda_ref import CHUNK_SIZE
from tokenspeed_jax.kernels.mla_attention import (
    MLAKernel,
    choose_mla_kernel,
    mla_decode_step,
    mla_prefill_step,
)
from tokenspeed_jax.kernels.paged_attention_backend import PALLAS
from tokenspeed_jax.models.cache_spec import PAGE, SLOT, pool_specs
from tokenspeed_jax.models.kimi_linear import KDA, KimiLinearForCausalLM
from tokenspeed_jax.models.kimi_linear.layers import KdaImpl, KdaMeta, kda_core
from tokenspeed_jax.models.mla import write_latent
from tokenspeed_jax.models.registry import family_of

KDA_META = ("cu_seqlens", "kda_slots", "checkpoint_offsets", "checkpoint_slots")
FRESH = "fresh_slots"  # [N]: the state slot of each request starting at position 0, else -1
HEAD_OUTPUTS = ("sampled", "logits")

logger = logging.getLogger(__name__)


def reset_rows(pool: jax.Array, rows: jax.Array) -> jax.Array:
    """``pool`` with rows ``rows`` zeroed (rows < 0 are skipped)."""
    target = jnp.where(rows >= 0, rows, pool.shape[0])
    return pool.at[target].set(0, mode="drop")


def checkpoint_split(start_pos: int, num_tokens: int, granularity: int) -> int:
    """Tokens of this step before its last ``granularity`` boundary (0 if it crosses none).

    The request then scans ``split`` tokens (main) and ``num_tokens - split`` (tail).
    """
    boundary = (start_pos + num_tokens) // granularity * granularity
    return max(boundary - start_pos, 0)


class KimiRunner(StepRunner):
    """Runs engine steps of a Kimi-Linear model (or of any model of MLA layers, as DeepSeek-V3)
    over its state pools and latent pages."""

    COMPILE_DESCRIPTION = "compiling Kimi executables"

    @staticmethod
    def extra_device_bytes(config: EngineConfig, model: Any) -> int:
        """Device bytes besides the caches and state pools (``ModelRunner.extra_device_bytes``):
        none, the weights are used in place."""
        return 0

    def __init__(self, model: KimiLinearForCausalLM, config: EngineConfig, num_pages: int,
                 page_size: int = 16, *, num_state_slots: int = 0,
                 mla_kernel: MLAKernel | None = None) -> None:
        """``mla_kernel``: how MLA attention runs (the tests give the Pallas kernels,
        interpreted); None = ``choose_mla_kernel`` for JAX's default backend."""
        has_kda = any(layer.kind == KDA for layer in model.layers)
        if num_pages < 1 or page_size < 1 or (has_kda and num_state_slots < 1):
            raise ValueError(f"num_pages={num_pages}, page_size={page_size} and (with KDA "
                             f"layers) num_state_slots={num_state_slots} must be >= 1")
        self.config = config
        self.model_config = cfg = model.config
        self.page_size = page_size
        self.num_state_slots = num_state_slots
        warn_inapplicable(config, ("inline_prefill_attention", "fused_decode_attention",
                                   "stack_decode_weights"),
                          "Kimi Linear (MLA attention, its own routes)", logger)
        self.pages_per_request = math.ceil(config.max_model_len / page_size)
        self.scale = float(model.attention_scale)
        self.buckets = Buckets.from_config(config, prefill=True, decode=True)
        self.dtype = model.dtype
        self.mesh = parallel.make_mesh(config.tensor_parallel_size)
        if self.mesh is not None:
            family_of(model.config).place_model(model, self.mesh)
        self.alternate_decode = alternates_decode_executables(config, jax.default_backend())
        self.mla_kernel = mla_kernel or choose_mla_kernel(
            kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim, page_size=page_size,
            dtype=self.dtype, mesh=self.mesh)
        layers = list(model.layers)
        self.kinds = [layer.kind for layer in layers]
        graphdefs: list[Any] = []
        self._layer_defs, self.layer_states = [], []
        for layer in layers:
            graphdef, state = nnx.split(layer)
            if graphdef not in graphdefs:
                graphdefs.append(graphdef)
            self._layer_defs.append(graphdefs.index(graphdef))
            self.layer_states.append(state)
        self._graphdefs = graphdefs
        self._model_classes = {type(m) for _, m in nnx.iter_modules(model)}
        self.model_def, layers_state, self.outer_state = nnx.split(
            model, nnx.PathContains("layers"), ...)
        self._layers_placeholder = abstract(layers_state)
        pools = family_of(cfg).cache_pools(cfg, page_size, self.dtype, config.kda_state_dtype,
                                           parallel.mesh_size(self.mesh))
        self.pools: dict[str, jax.Array] = device_arrays.zeros(
            engine_compiler(config, description="allocating the state pools and latent pages",
                            fingerprint=None, mesh=self.mesh),
            pool_specs(pools, {PAGE: num_pages, SLOT: num_state_slots}, self.mesh))
        self._init_step_state()
        self._builder = PlanBuilder()
        self._fns: dict[tuple, Callable] = {}
        self.plans = {route: self._forward_plan(route) for route in ("inline", "ordinary")}
        self.plans["reference"] = self._forward_plan("ordinary", impl="reference")
        self.state_pools = tuple(n for n in self.pools if not n.startswith("latent"))
        self.restore_plan = None  # a model without KDA layers has no states to restore
        if self.state_pools:
            restore = Segment("restore", _copy_rows,
                              ("restore_src", "restore_dst", *self.state_pools),
                              self.state_pools, self.state_pools)
            self.restore_plan = Plan([Call(restore)], restore.inputs, restore.outputs)
        self.restore_rows = self.buckets.prefill_requests[-1]
        head = Break("sample", self._head, ("hidden",), HEAD_OUTPUTS)
        self.head_plan = Plan([Call(head, self.outer_state)], ("hidden",), HEAD_OUTPUTS)
        carried = (*self.pools, "board", "sampled")
        decoded = (*HEAD_OUTPUTS, "board", *self.pools)
        decode = Break("decode", self._decode_step, carried, decoded, donate=carried)
        self.decode_plan = Plan([Call(decode, (self.outer_state, tuple(self.layer_states)))],
                                carried, decoded)
        self.plans["decode"] = self.decode_plan  # one call: the whole step
        self._compiled: dict[tuple, CompiledPlan] = {}

    # ----------------------------------------------------------------- pieces

    def _layer(self, graph: int, state: Any) -> Any:
        """The layer module of structure ``graph`` (an index into the distinct graphdefs)."""
        return nnx.merge(self._graphdefs[graph], state)

    def _fn(self, kind: tuple, make: Callable[[], Callable]) -> Callable:
        if kind not in self._fns:
            self._fns[kind] = make()
        return self._fns[kind]

    def _pieces(self, route: str, impl: KdaImpl) -> list[Piece]:
        """The prefill forward of ``route`` ("inline" or "ordinary") as pieces."""
        outer = self.model_def
        placeholder = self._layers_placeholder

        def embed(params, token_ids):
            return (nnx.merge(outer, placeholder, params).embed(token_ids),)

        pieces = [Piece(("embed",), embed, ("token_ids",), ("hidden",), self.outer_state)]
        for i, kind in enumerate(self.kinds):
            graph = self._layer_defs[i]
            state = self.layer_states[i]
            conv, pool = f"conv.{i}", f"state.{i}"
            if kind == KDA and route == "inline":
                def block(params, hidden, conv_pool, state_pool, fresh, *meta, _g=graph):
                    return self._layer(_g, params).kda_block(
                        hidden, reset_rows(conv_pool, fresh), reset_rows(state_pool, fresh),
                        KdaMeta(*meta), impl=impl, mesh=self.mesh)

                pieces.append(Piece(("kda", graph, impl),
                                    self._fn(("kda", graph, impl), lambda b=block: b),
                                    ("hidden", conv, pool, FRESH, *KDA_META),
                                    ("hidden", conv, pool), state))
            elif kind == KDA:
                def kda_in(params, hidden, conv_pool, fresh, *meta, _g=graph):
                    return self._layer(_g, params).kda_inputs(
                        hidden, reset_rows(conv_pool, fresh), KdaMeta(*meta))

                def core(params, meta, q, k, v, g, beta, state_pool, fresh, *kda_meta):
                    return kda_core(q, k, v, g, beta, reset_rows(state_pool, fresh),
                                    KdaMeta(*kda_meta), impl=impl, decode=False, mesh=self.mesh)

                def kda_out(params, hidden, o, gate, _g=graph):
                    return (self._layer(_g, params).kda_outputs(hidden, o, gate, mesh=self.mesh),)

                qkv = ("q", "k", "v", "g", "beta")
                pieces += [
                    Piece(("kda_in", graph), self._fn(("kda_in", graph), lambda f=kda_in: f),
                          ("hidden", conv, FRESH, *KDA_META), (*qkv, "gate", conv), state),
                    Piece(("kda_core", impl), self._fn(("kda_core", impl), lambda f=core: f),
                          (*qkv, pool, FRESH, *KDA_META), ("o", pool), meta="kda",
                          donate=(pool,)),
                    Piece(("kda_out", graph), self._fn(("kda_out", graph), lambda f=kda_out: f),
                          ("hidden", "o", "gate"), ("hidden",), state),
                ]
            else:
                latent = f"latent.{i}"

                def mla_in(params, hidden, positions, _g=graph):
                    return self._layer(_g, params).mla_inputs(hidden, positions)

                def mla_out(params, hidden, attn, _g=graph):
                    return (self._layer(_g, params).mla_outputs(hidden, attn, mesh=self.mesh),)

                pieces += [
                    Piece(("mla_in", graph), self._fn(("mla_in", graph), lambda f=mla_in: f),
                          ("hidden", "positions"), ("q_lat", "kv"), state),
                    Piece(("mla",), self._mla_prefill, ("q_lat", "kv", "positions", latent),
                          ("attn", latent), meta="attention", donate=(latent,)),
                    Piece(("mla_out", graph), self._fn(("mla_out", graph), lambda f=mla_out: f),
                          ("hidden", "attn"), ("hidden",), state),
                ]
        return pieces

    def _mla_prefill(self, params, meta, q, kv, positions, pages) -> tuple:
        pages = write_latent(pages, kv, meta["slot_mapping"])
        attn = mla_prefill_step(q, pages, meta["page_tables"], meta["token_request"], positions,
                                meta.get("work"), scale=self.scale,
                                kv_lora_rank=self.model_config.kv_lora_rank,
                                kernel=self.mla_kernel)
        return attn, pages

    def _decode_step(self, params: Any, packed: Packed, *values: jax.Array) -> tuple:
        """One decode step with every layer inside: the in-step sampler's rows, the logits
        (for ``resample``), the token board, the pools. KDA layers run the recurrent kernel,
        MLA layers ``mla_decode_step`` (which writes the step's latent rows). A row with
        ``token_rows >= 0`` reads its input token from the board the previous decode step
        wrote; decode rows continue their states (position > 0), so no row is reset. The last
        value (the turn's sampled-rows buffer) is not read: it is donated so that the sampled
        rows are written into it."""
        outer_state, layer_states = params
        meta = packed.unpack()
        *pool_values, board, _ = values
        pools = dict(zip(self.pools, pool_values))
        positions = meta["positions"]
        kda_meta = KdaMeta(*(meta[n] for n in KDA_META))
        outer = nnx.merge(self.model_def, self._layers_placeholder, outer_state)
        hidden = outer.embed(read_tokens(meta["token_ids"], meta["token_rows"], board))
        for i, (kind, state) in enumerate(zip(self.kinds, layer_states)):
            layer = self._layer(self._layer_defs[i], state)
            if kind == KDA:
                conv, pool = f"conv.{i}", f"state.{i}"
                hidden, pools[conv], pools[pool] = layer.kda_block(
                    hidden, pools[conv], pools[pool], kda_meta, impl="pallas", decode=True,
                    mesh=self.mesh)
            else:
                latent = f"latent.{i}"
                q, rows = layer.mla_inputs(hidden, positions)
                attn, pools[latent] = mla_decode_step(
                    q, rows, pools[latent], meta["page_tables"], positions, scale=self.scale,
                    kv_lora_rank=self.model_config.kv_lora_rank, kernel=self.mla_kernel)
                hidden = layer.mla_outputs(hidden, attn, mesh=self.mesh)
        logits = outer.head(hidden).astype(jnp.float32)
        sampled = fast_sample(unpack_sampling(meta), logits)
        return (sampled, logits, write_board(board, sampled), *pools.values())

    def _head(self, params, meta, hidden) -> tuple:
        """The sampled rows' head and the in-step sampler: (sampled rows, fp32 logits)."""
        rows = jnp.take(hidden, meta["rows"], axis=0)
        logits = nnx.merge(self.model_def, self._layers_placeholder, params).head(rows)
        logits = logits.astype(jnp.float32)
        return fast_sample(meta["sampling"], logits), logits

    def _forward_plan(self, route: str, impl: KdaImpl = "pallas") -> Plan:
        pools = tuple(self.pools)
        inputs = ("token_ids", "positions", FRESH, *KDA_META, *pools)
        return self._builder.plan(self._pieces(route, impl), inputs, ("hidden", *pools))

    # ----------------------------------------------------------------- host arrays

    def step_arrays(self, requests: Sequence[StepRequest], num_tokens: int,
                    num_requests: int) -> tuple[dict, dict, dict]:
        """Host-built (numpy) arrays of one padded prefill group: plan inputs, break metadata
        (with the work items of the Pallas MLA prefill kernel when that runs), head."""
        packed = self.pack_tokens(requests, num_tokens, num_requests)
        cu = np.full(num_requests + 1, sum(r.num_tokens for r in requests), np.int32)
        cu[:len(requests)] = packed.starts
        kda_slots = np.full(num_requests, -1, np.int32)
        ckpt_offsets = np.zeros(num_requests, np.int32)
        ckpt_slots = np.full(num_requests, -1, np.int32)
        fresh = np.full(num_requests, -1, np.int32)
        for n, request in enumerate(requests):
            self._check_slots(request)
            kda_slots[n] = request.state_slot
            if request.start_pos == 0:
                fresh[n] = request.state_slot
            ckpt_offsets[n], ckpt_slots[n] = self._checkpoint(request)
        inputs = {"token_ids": packed.token_ids, "positions": packed.positions, "cu_seqlens": cu,
                  FRESH: fresh, "kda_slots": kda_slots, "checkpoint_offsets": ckpt_offsets,
                  "checkpoint_slots": ckpt_slots}
        pallas = self.mla_kernel.backend == PALLAS
        attention = packed.attention(self.mla_kernel.prefill.block_q if pallas else None)
        return inputs, attention, {"rows": packed.sampled_rows(num_requests),
                                   "sampling": sampling_arrays(packed.sampled, num_requests)}

    def _checkpoint(self, request: StepRequest) -> tuple[int, int]:
        """(tokens scanned before the checkpoint, checkpoint row) of ``request``'s step; (0, -1)
        when the step stores none (see the invariants)."""
        if request.checkpoint_slot < 0:
            return 0, -1
        split = checkpoint_split(request.start_pos, request.num_tokens,
                                 self.config.prefix_granularity)
        if split % CHUNK_SIZE:
            raise ValueError(
                f"request {request.request_id}: a checkpoint needs start_pos="
                f"{request.start_pos} to be a multiple of the {CHUNK_SIZE}-token chunk")
        return (split, request.checkpoint_slot) if split else (0, -1)

    def _decode_field_defaults(self, rows: int) -> dict[str, np.ndarray]:
        return {"cu_seqlens": np.zeros(rows + 1, np.int32),
                "kda_slots": np.full(rows, -1, np.int32),
                "checkpoint_offsets": np.zeros(rows, np.int32),
                "checkpoint_slots": np.full(rows, -1, np.int32)}

    def _write_decode_fields(self, fields: dict[str, np.ndarray],
                             requests: Sequence[StepRequest]) -> None:
        """The KDA metadata of one token per request: request ``n`` is token ``n``."""
        count = len(requests)
        fields["cu_seqlens"][:] = np.minimum(np.arange(len(fields["cu_seqlens"])), count)
        for n, request in enumerate(requests):
            self._check_slots(request)
            fields["kda_slots"][n] = request.state_slot
            fields["checkpoint_offsets"][n], fields["checkpoint_slots"][n] = self._checkpoint(
                request)

    def decode_caches(self) -> list[jax.Array]:
        """The pools a decode step carries, in ``pools`` order."""
        return list(self.pools.values())

    def adopt_decode_caches(self, caches: Sequence[jax.Array]) -> None:
        self.pools = dict(zip(self.pools, caches))

    def _check_slots(self, request: StepRequest) -> None:
        if not self.state_pools:  # no KDA layers: a request's state rows are never read
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

    # ----------------------------------------------------------------- compile

    def cache_fingerprint(self) -> str:
        """What the stage functions read besides their arguments, for the executable cache key:
        the model's static structure (config, dtypes), each layer kind's structure, the scale,
        the MLA kernels, the flax version, and the bytecode of the runner's and the model's
        classes."""
        return self._fingerprint(repr(self.model_def), *map(repr, self._graphdefs),
                                 f"scale={self.scale!r}", f"mla_kernel={self.mla_kernel!r}")

    def _add_plans(self, ladders: LadderCompiler) -> None:
        """Every bucket plan: per decode executable the decode step and its resamplers; the
        restore; per prefill shape its routes' plans, head and resamplers."""
        shardings = self._value_shardings(list(self.pools))
        pools = abstract(self.pools)
        hidden_size = self.model_config.hidden_size
        # Added rung by rung, each rung's plans together: deferred plans compile in this order.
        self._add_decode_plans(ladders, lambda rows: self.decode_plan, pools, shardings)
        if self.restore_plan is not None:
            rows = abstract({"restore_src": np.zeros(self.restore_rows, np.int32),
                             "restore_dst": np.zeros(self.restore_rows, np.int32)})
            ladders.add([("prefill_requests", self.restore_rows)],
                        f"restore T={self.restore_rows} N={self.restore_rows}",
                        self._store(("restore", self.restore_rows, self.restore_rows)),
                        self.restore_plan, {**rows, **{n: pools[n] for n in self.state_pools}},
                        shardings=shardings)
        routes = ["ordinary"] if self.config.disable_kda_prefill_graph else ["inline", "ordinary"]
        for tokens, requests in self._prefill_shapes(ladders.skeleton):
            needed_by = self._rungs_needing(tokens, requests, ladders.skeleton)
            inputs, attention, head = (abstract(m) for m in self.step_arrays([], tokens, requests))
            for route in routes:
                ladders.add(needed_by, f"{route} T={tokens} N={requests}",
                            self._store((route, tokens, requests)), self.plans[route],
                            {**inputs, **pools}, {"attention": attention, "kda": {}},
                            shardings=shardings, autotune=False)
            hidden = jax.ShapeDtypeStruct((tokens, hidden_size), self.dtype)
            ladders.add(needed_by, f"head T={tokens} N={requests}",
                        self._store(("head", tokens, requests)), self.head_plan,
                        {"hidden": hidden}, {"sample": head})
            ladders.add_resampler(self.resampler, requests)

    def _store(self, key: tuple[str, int, int]) -> Callable[[CompiledPlan], None]:
        return functools.partial(self._compiled.__setitem__, key)

    def _prefill_shapes(self, skeleton: Buckets) -> list[tuple[int, int]]:
        """The (tokens, requests) shapes of the prefill plans, in compile order: each token
        rung with the skeleton's request rungs, then each other request rung with every token
        rung."""
        shapes = [(t, n) for t in self.buckets.tokens for n in self.buckets.prefill_requests
                  if n <= t]
        first = [(t, n) for t, n in shapes if n in skeleton.prefill_requests]
        rest = sorted(set(shapes) - set(first), key=lambda shape: shape[::-1])
        return first + rest

    @staticmethod
    def _rungs_needing(tokens: int, requests: int, skeleton: Buckets) -> list[tuple[str, int]]:
        """The rungs that need the plans of one prefill shape: a token rung its shapes with
        the skeleton's request rungs; a request rung its shapes with the skeleton's token
        rungs, or with every token rung when it is not in the skeleton itself. So any ready
        token rung and ready request rung have their shape's plans."""
        needed_by = []
        if requests in skeleton.prefill_requests:
            needed_by.append(("tokens", tokens))
        if requests not in skeleton.prefill_requests or tokens in skeleton.tokens:
            needed_by.append(("prefill_requests", requests))
        return needed_by

    # ----------------------------------------------------------------- serving

    def route(self, requests: Sequence[StepRequest]) -> str:
        """The route a step takes (see the module docstring)."""
        decode = all(r.num_tokens == 1 and r.sample and r.start_pos > 0 for r in requests)
        if decode and self.buckets.decode_requests:
            return "decode"
        total = sum(r.num_tokens for r in requests)
        fits = (choose_bucket(self.buckets.tokens, total) is not None
                and choose_bucket(self.buckets.prefill_requests, len(requests)) is not None)
        if not fits:
            return "eager"
        mixed = any(r.num_tokens == 1 and r.start_pos > 0 for r in requests)
        if mixed or self.config.disable_kda_prefill_graph:
            return "ordinary"
        return "inline"

    def _on_decode_graph(self, batch: StepBatch) -> bool:
        return (self.route(batch.requests) == "decode"
                and len(batch.requests) <= self.buckets.decode_requests[-1])

    def _run(self, requests: Sequence[StepRequest]) -> list[np.ndarray]:
        """The packed sampled rows of ``requests`` on the route they take."""
        route = self.route(requests)
        if route == "eager":
            return [self._eager_rows(requests, "ordinary")]
        return self._compiled_route_rows(route, requests)

    def _prepare_decode(self, requests: Sequence[StepRequest]) -> None:
        self.restore(requests)

    def bucket(self, route: str, requests: Sequence[StepRequest]) -> tuple[int, int]:
        """(tokens, requests): the ready bucket of the executable a compiled step on prefill
        route ``route`` runs. A prefill shape holds at most as many requests as tokens."""
        ready = self.ready
        rows = choose_bucket(ready.prefill_requests, len(requests))
        return choose_bucket(ready.tokens, max(sum(r.num_tokens for r in requests), rows)), rows

    def run_compiled(self, route: str, requests: Sequence[StepRequest]) -> StepOutput:
        """A step on the compiled plan of ``route`` ("inline", "ordinary" or "decode")."""
        return step_output(self._compiled_route_rows(route, requests))

    def _compiled_route_rows(self, route: str, requests: Sequence[StepRequest]
                             ) -> list[np.ndarray]:
        """The packed sampled rows of a step on the compiled plans of ``route``: the decode
        executables in bucket groups, or a prefill route's plan."""
        if route == "decode":
            return self._run_decode_groups(list(requests))
        return [self._compiled_rows(route, requests)]

    def _compiled_rows(self, route: str, requests: Sequence[StepRequest]) -> np.ndarray:
        """The packed sampled rows of a step on a prefill route's compiled plan and its head
        (keeping the pools)."""
        total = sum(r.num_tokens for r in requests)
        tokens, rows = self.bucket(route, requests)
        inputs, attention, head = self.step_arrays(requests, tokens, rows)
        self.restore(requests)
        self.counters["prefill_runs"] += 1
        if route == "ordinary":
            self.counters["ordinary_runs"] += 1
        self.counters["real_tokens"] += total
        self.counters["padded_tokens"] += tokens - total
        out = self._compiled[route, tokens, rows].run(
            {**jax.device_put(inputs), **self.pools}, {"attention": attention, "kda": {}})
        self._adopt(out)
        sampled = self._compiled["head", tokens, rows].run({"hidden": out["hidden"]},
                                                           {"sample": head})
        return self.resampler.finish([r for r in requests if r.sample], rows,
                                     sampled["sampled"], sampled["logits"])

    def run_eager(self, requests: Sequence[StepRequest], *, plan: str = "ordinary") -> StepOutput:
        """A step op by op at its exact size (``plan``: "inline", "ordinary", "decode", or
        "reference" for the ordinary plan with the pure-JAX KDA reference)."""
        return step_output([self._eager_rows(requests, plan)])

    def _eager_rows(self, requests: Sequence[StepRequest], plan: str) -> np.ndarray:
        self.counters["eager_runs"] += 1
        total = sum(r.num_tokens for r in requests)
        self.counters["real_tokens"] += total
        if plan == "decode":
            return self._eager_decode_rows(requests)
        inputs, attention, head = self.step_arrays(requests, total, len(requests))
        self.restore(requests)
        num_sampled = sum(r.sample for r in requests)
        with self.guard.allowed("Kimi eager forward"):
            out = run_eager(self.plans[plan], {**jax.device_put(inputs), **self.pools},
                            {"attention": attention, "kda": {}})
            self._adopt(out)
            rows = {"rows": head["rows"][:num_sampled],
                    "sampling": jax.tree_util.tree_map(lambda a: a[:num_sampled],
                                                       head["sampling"])}
            sampled = run_eager(self.head_plan, {"hidden": out["hidden"]}, {"sample": rows})
            return self.resampler.finish([r for r in requests if r.sample], num_sampled,
                                         sampled["sampled"], sampled["logits"], eager=True)

    def _eager_decode_rows(self, requests: Sequence[StepRequest]) -> np.ndarray:
        """The decode plan op by op at the step's exact size."""
        rows = len(requests)
        meta = {"decode": self._decode_meta(requests, rows)}
        self.restore(requests)
        spec = sampled_buffer_spec(rows)
        with self.guard.allowed("Kimi eager forward"):
            out = run_eager(self.decode_plan, {**self.pools, "board": self.board,
                                               "sampled": jnp.zeros(spec.shape, spec.dtype)}, meta)
            self._adopt(out)
            self.board = out["board"]
            return self.resampler.finish(list(requests), rows, out["sampled"], out["logits"],
                                         eager=True)

    def restore(self, requests: Sequence[StepRequest]) -> None:
        """Copy each ``restore_slot`` row into its request's ``state_slot`` (see the invariants)."""
        if self.restore_plan is None:
            return
        pairs = [(r.restore_slot, r.state_slot) for r in requests if r.restore_slot >= 0]
        for start in range(0, len(pairs), self.restore_rows):
            src = np.full(self.restore_rows, -1, np.int32)
            dst = np.full(self.restore_rows, -1, np.int32)
            chunk = pairs[start:start + self.restore_rows]
            src[:len(chunk)], dst[:len(chunk)] = zip(*chunk)
            self.counters["kda_state_restores"] += len(chunk)
            states = {n: self.pools[n] for n in self.state_pools}
            out = self._compiled["restore", self.restore_rows, self.restore_rows].run(
                {"restore_src": jax.device_put(src), "restore_dst": jax.device_put(dst), **states})
            self.pools.update(out)

    def _adopt(self, values: dict[str, jax.Array]) -> None:
        """Take the pools a plan returned (the donated inputs are gone)."""
        self.pools = {name: values[name] for name in self.pools}



def _copy_rows(params: Any, src: jax.Array, dst: jax.Array, *pools: jax.Array) -> tuple:
    """Each pool with row ``dst[i]`` set to row ``src[i]`` (pairs with ``dst < 0`` skipped)."""
    del params
    return tuple(pool.at[jnp.where(dst >= 0, dst, pool.shape[0])].set(
        pool[jnp.maximum(src, 0)], mode="drop") for pool in pools)
