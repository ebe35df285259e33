"""The forward in segments of models built of MLA and KDA layers (Kimi-Linear; DeepSeek-V3, whose
layers are all MLA): KDA layers inline in the segments, MLA attention at the breaks.

The prefill forward is a list of *pieces* (embed, one KDA layer, the halves of an MLA layer, the
KDA core), cut into a ``graph.Plan``: consecutive non-break pieces fuse into one segment, so the
KDA layers between two MLA layers share one segment (``out(MLA j) + KDA ... + in(MLA j+1)``);
segments with the same pieces and wiring are one executable. Prefill routes:

* ``"inline"`` (the default): KDA layers (projections, short conv, the chunked Pallas KDA kernel,
  gated norm, output projection, MoE) run inside the segments; each MLA layer's latent paged
  attention is a break (``mla_attention.mla_prefill_step``: the Pallas kernel on a GPU, the
  plain-JAX reference elsewhere; ``choose_mla_kernel`` decides once).
* ``"ordinary"``: the same, with each KDA layer's core (the kernel) at a break. Taken by steps
  with a one-token continuation chunk and when ``disable_kda_prefill_graph`` is set; it is also
  the route a request too large for the buckets runs eagerly at its exact size.
* ``"reference"`` (eager only): the ordinary route with the pure-JAX KDA reference.

Decode runs every layer inside one step: KDA through the fused decode-step kernel on GPUs (the
recurrent kernel between plain-JAX pieces elsewhere; ``KimiDeltaAttention.fuses_decode``), and
MLA attention with ``mla_decode_step``, which also writes the step's latent rows.

Plans are per (token bucket, request bucket): the KDA metadata (``cu_seqlens``, slots,
checkpoint offsets and slots, the rows ``fresh_slots`` to reset) is sized by the request count,
and the chunked kernel's work grows with it.

Invariants:

* State: per KDA layer a recurrent pool ``state.i [P, H, V, K]`` and a conv pool ``conv.i [P,
  W - 1, 3 H K]``; per MLA layer a paged latent cache ``latent.j``. A request at position 0
  starts from zero states (its rows are reset inside the plan, ``fresh_slots``); a later chunk or
  decode step continues from what its rows hold. Decode rows continue (position > 0), so decode
  resets no row.
* Padding tokens have slot -1, request -1 and position -1; padding requests have state slot -1
  and no checkpoint: they never write a pool row or a page. Every layer's experts see the
  position: a padding token (prefill or decode) routes to no expert (``moe.KimiMoE``'s
  ``live``), so a bucket's padding reads and multiplies no expert weights.
* Prefix checkpoints: a request with ``checkpoint_slot >= 0`` stores its KDA and conv states at
  the last multiple of ``prefix_granularity`` its step crosses (``checkpoint_split``). Every plan
  carries per-request checkpoint offsets and slots, so a step with zero, one or more
  checkpointing requests reuses the same executable.
* MLA layers take the token positions (``layer.mla_inputs(hidden, positions)``), so a family
  whose latent attention rotates its rope part (DeepSeek-V3) runs here too.
* Under tensor parallelism the pieces run the KDA kernels and the routed experts per shard
  (``shard_map``) over ``mesh``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tokenspeed_jax.config import EngineConfig, warn_inapplicable
from tokenspeed_jax.graph import Piece, Plan, PlanBuilder
from tokenspeed_jax.kernels.kda_ref import CHUNK_SIZE
from tokenspeed_jax.kernels.mla_attention import (
    MLAKernel,
    choose_mla_kernel,
    mla_decode_step,
    mla_prefill_step,
)
from tokenspeed_jax.kernels.paged_attention_backend import PALLAS
from tokenspeed_jax.models.forward import (
    ROWS_PIECE,
    Forward,
    alternates_decode_executables,
    structure_key,
)
from tokenspeed_jax.models.kimi_linear.layers import KdaImpl, KdaMeta, kda_core
from tokenspeed_jax.models.kimi_linear.model import KDA
from tokenspeed_jax.models.mla import write_latent

KDA_META = ("cu_seqlens", "kda_slots", "checkpoint_offsets", "checkpoint_slots")
FRESH = "fresh_slots"  # [N]: the state slot of each request starting at position 0, else -1

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


class LatentForward(Forward):
    """The forward of a model of MLA and KDA layers over its state pools and latent pages
    (module docstring)."""

    plans_per_request_bucket = True
    splits_prefill = False
    eager_route = "ordinary"

    def __init__(self, model: Any, config: EngineConfig, *, page_size: int, mesh: Any,
                 settings: MLAKernel | None = None) -> None:
        """``settings``: how MLA attention runs (the tests give the Pallas kernels,
        interpreted); None = ``choose_mla_kernel`` for JAX's default backend."""
        self._split(model, config, mesh)
        cfg = model.config
        warn_inapplicable(config, ("inline_prefill_attention", "fused_decode_attention",
                                   "stack_decode_weights"),
                          "Kimi Linear (MLA attention, its own routes)", logger)
        self.scale = float(model.attention_scale)
        self.alternate_decode = alternates_decode_executables(config, jax.default_backend())
        self.mla_kernel = settings or choose_mla_kernel(
            kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim, page_size=page_size,
            dtype=self.dtype, mesh=mesh)
        self.kinds = [layer.kind for layer in model.layers]
        self.prefill_routes = (("ordinary",) if config.disable_kda_prefill_graph
                               else ("inline", "ordinary"))
        graphdefs: list[Any] = []
        self._layer_defs = []
        for layer in model.layers:
            graphdef = nnx.graphdef(layer)
            if graphdef not in graphdefs:
                graphdefs.append(graphdef)
            self._layer_defs.append(graphdefs.index(graphdef))
        self._graphdefs = graphdefs
        self._builder = PlanBuilder()
        self._fns: dict[tuple, Callable] = {}

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
        pieces = [self.embed_piece()]
        for i, kind in enumerate(self.kinds):
            graph = self._layer_defs[i]
            state = self.layer_states[i]
            conv, pool = f"conv.{i}", f"state.{i}"
            if kind == KDA and route == "inline":
                def block(params, hidden, positions, conv_pool, state_pool, fresh, *meta,
                          _g=graph):
                    return self._layer(_g, params).kda_block(
                        hidden, reset_rows(conv_pool, fresh), reset_rows(state_pool, fresh),
                        KdaMeta(*meta), impl=impl, mesh=self.mesh, live=positions >= 0)

                pieces.append(Piece(("kda", graph, impl),
                                    self._fn(("kda", graph, impl), lambda b=block: b),
                                    ("hidden", "positions", conv, pool, FRESH, *KDA_META),
                                    ("hidden", conv, pool), state))
            elif kind == KDA:
                def kda_in(params, hidden, conv_pool, fresh, *meta, _g=graph):
                    return self._layer(_g, params).kda_inputs(
                        hidden, reset_rows(conv_pool, fresh), KdaMeta(*meta))

                def core(params, meta, q, k, v, g, beta, state_pool, fresh, *kda_meta):
                    return kda_core(q, k, v, g, beta, reset_rows(state_pool, fresh),
                                    KdaMeta(*kda_meta), impl=impl, decode=False, mesh=self.mesh)

                def kda_out(params, hidden, positions, o, gate, _g=graph):
                    return (self._layer(_g, params).kda_outputs(
                        hidden, o, gate, mesh=self.mesh, live=positions >= 0),)

                qkv = ("q", "k", "v", "g", "beta")
                pieces += [
                    Piece(("kda_in", graph), self._fn(("kda_in", graph), lambda f=kda_in: f),
                          ("hidden", conv, FRESH, *KDA_META), (*qkv, "gate", conv), state),
                    Piece(("kda_core", impl), self._fn(("kda_core", impl), lambda f=core: f),
                          (*qkv, pool, FRESH, *KDA_META), ("o", pool), meta="kda",
                          donate=(pool,)),
                    Piece(("kda_out", graph), self._fn(("kda_out", graph), lambda f=kda_out: f),
                          ("hidden", "positions", "o", "gate"), ("hidden",), state),
                ]
            else:
                latent = f"latent.{i}"

                def mla_in(params, hidden, positions, _g=graph):
                    return self._layer(_g, params).mla_inputs(hidden, positions)

                def mla_out(params, hidden, positions, attn, _g=graph):
                    return (self._layer(_g, params).mla_outputs(hidden, attn, mesh=self.mesh,
                                                                live=positions >= 0),)

                pieces += [
                    Piece(("mla_in", graph), self._fn(("mla_in", graph), lambda f=mla_in: f),
                          ("hidden", "positions"), ("q_lat", "kv"), state),
                    Piece(("mla",), self._mla_prefill, ("q_lat", "kv", "positions", latent),
                          ("attn", latent), meta="attention", donate=(latent,)),
                    Piece(("mla_out", graph), self._fn(("mla_out", graph), lambda f=mla_out: f),
                          ("hidden", "positions", "attn"), ("hidden",), state),
                ]
        return [*pieces, ROWS_PIECE]

    def _mla_prefill(self, params, meta, q, kv, positions, pages) -> tuple:
        pages = write_latent(pages, kv, meta["slot_mapping"])
        attn = mla_prefill_step(q, pages, meta["page_tables"], meta["token_request"], positions,
                                meta.get("work"), scale=self.scale,
                                kv_lora_rank=self.model_config.kv_lora_rank,
                                kernel=self.mla_kernel)
        return attn, pages

    def decode_layers(self, params: Any, meta: Mapping[str, jax.Array], token_ids: jax.Array,
                      pools: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """KDA layers run the recurrent kernel, MLA layers ``mla_decode_step`` (which writes the
        step's latent rows)."""
        outer_state, layer_states = params
        pools = dict(pools)
        positions = meta["positions"]
        live = positions >= 0  # padding rows route to no expert (``moe.KimiMoE``)
        kda_meta = KdaMeta(*(meta[n] for n in KDA_META))
        hidden = self.outer(outer_state).embed(token_ids)
        for i, (kind, state) in enumerate(zip(self.kinds, layer_states)):
            layer = self._layer(self._layer_defs[i], state)
            if kind == KDA:
                conv, pool = f"conv.{i}", f"state.{i}"
                hidden, pools[conv], pools[pool] = layer.kda_block(
                    hidden, pools[conv], pools[pool], kda_meta, impl="pallas", decode=True,
                    mesh=self.mesh, live=live)
            else:
                latent = f"latent.{i}"
                q, rows = layer.mla_inputs(hidden, positions)
                attn, pools[latent] = mla_decode_step(
                    q, rows, pools[latent], meta["page_tables"], positions, scale=self.scale,
                    kv_lora_rank=self.model_config.kv_lora_rank, kernel=self.mla_kernel)
                hidden = layer.mla_outputs(hidden, attn, mesh=self.mesh, live=live)
        return hidden, pools

    def prefill_plan(self, route: str, pools: Sequence[str]) -> Plan:
        """The plan of ``route``: "inline", "ordinary", or "reference" (eager only)."""
        if route == "reference":
            route, impl = "ordinary", "reference"
        else:
            impl = "pallas"
        inputs = ("token_ids", "positions", "rows", FRESH, *KDA_META, *pools)
        return self._builder.plan(self._pieces(route, impl), inputs, ("rows_hidden", *pools))

    def prefill_route(self, requests: Sequence[Any]) -> str:
        """"ordinary" for a step with a one-token continuation chunk, else the first route."""
        if any(r.num_tokens == 1 and r.start_pos > 0 for r in requests):
            return "ordinary"
        return self.prefill_routes[0]

    # ----------------------------------------------------------------- host arrays

    def prefill_arrays(self, requests: Sequence[Any], packed: Any, num_rows: int
                       ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The KDA metadata of ``num_rows`` request rows as plan inputs; the attention's (with
        the work items of the Pallas MLA prefill kernel when that runs) and the KDA core's
        (none) as break metadata."""
        cu = np.full(num_rows + 1, sum(r.num_tokens for r in requests), np.int32)
        cu[:len(requests)] = packed.starts
        kda_slots = np.full(num_rows, -1, np.int32)
        ckpt_offsets = np.zeros(num_rows, np.int32)
        ckpt_slots = np.full(num_rows, -1, np.int32)
        fresh = np.full(num_rows, -1, np.int32)
        for n, request in enumerate(requests):
            kda_slots[n] = request.state_slot
            if request.start_pos == 0:
                fresh[n] = request.state_slot
            ckpt_offsets[n], ckpt_slots[n] = self._checkpoint(request)
        inputs = {"cu_seqlens": cu, FRESH: fresh, "kda_slots": kda_slots,
                  "checkpoint_offsets": ckpt_offsets, "checkpoint_slots": ckpt_slots}
        pallas = self.mla_kernel.backend == PALLAS
        attention = packed.attention(self.mla_kernel.prefill.block_q if pallas else None)
        return inputs, {"attention": attention, "kda": {}}

    def _checkpoint(self, request: Any) -> tuple[int, int]:
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

    def decode_field_defaults(self, rows: int) -> dict[str, np.ndarray]:
        return {"cu_seqlens": np.zeros(rows + 1, np.int32),
                "kda_slots": np.full(rows, -1, np.int32),
                "checkpoint_offsets": np.zeros(rows, np.int32),
                "checkpoint_slots": np.full(rows, -1, np.int32)}

    def write_decode_fields(self, fields: dict[str, np.ndarray],
                            requests: Sequence[Any]) -> None:
        """The KDA metadata of one token per request: request ``n`` is token ``n``."""
        count = len(requests)
        fields["cu_seqlens"][:] = np.minimum(np.arange(len(fields["cu_seqlens"])), count)
        for n, request in enumerate(requests):
            fields["kda_slots"][n] = request.state_slot
            fields["checkpoint_offsets"][n], fields["checkpoint_slots"][n] = self._checkpoint(
                request)

    def fingerprint_parts(self) -> list[str]:
        """The model's static structure, each layer kind's structure, the scale and the MLA
        kernels."""
        return [*map(structure_key, (self.model_def, *self._graphdefs)), f"scale={self.scale!r}",
                f"mla_kernel={self.mla_kernel!r}"]
