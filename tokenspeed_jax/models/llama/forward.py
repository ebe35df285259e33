"""The Llama family's forward in segments: paged K/V attention at the breaks of prefill, inside
the decode step.

* **Prefill** (route ``"prefill"``): the pieces ``embed``, per layer ``qkv``, the ``attention``
  break (writes the step's K/V into the paged cache, then every token attends to its request's
  keys 0..its position through the request's page table: ``paged_prefill_attention``, the Pallas
  kernel on a GPU, per KV-head shard under tensor parallelism) and ``out``, last the sampled rows'
  gather. They fuse into the segments ``embed+qkv(0)``, ``out(i)+qkv(i+1)`` (one executable for
  every layer) and ``out(L-1)+rows``. One plan per token bucket: its attention metadata holds
  ``table_rows`` page-table rows, so shapes do not depend on how much context is cached. With
  ``inline_prefill_attention`` (auto for small models on a GPU) the plan is instead one
  executable with attention inside: two host calls per prefill step instead of 2L+2, for models
  whose prefill is dispatch-bound, at the price of compiling the whole forward per bucket.
* **Decode**: every layer with the decode attention kernel ``choose_decode_kernel`` picks once
  (on a GPU the fused kernel that also writes the step's K/V), so its cost follows the live
  context, not ``max_model_len``. With ``stack_decode_weights`` (auto for small models on a GPU)
  the runner's small decode buckets take each layer weight stacked over the layers
  (``stacks_decode_weights``): on a GPU each executable argument costs host time at every call,
  which only small batches notice; larger buckets keep one argument per layer weight (stacked,
  each layer's products are a fused computation XLA autotunes alone, about 10x the compile time,
  for no gain at 32 rows and more).

Invariants: the K/V cache of a layer is ``[Hkv, num_pages, page_size, Dh]`` (``attention.py``),
pools ``k_pages.i`` and ``v_pages.i`` (``family.cache_pools``). Padding tokens have slot -1 and
request -1, so they never write a page and never change a real row. Every layer has layer 0's
structure. The platform-dependent settings (the "auto" ones and both attention kernels) are
resolved in one place, ``runner_settings``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tokenspeed_jax.config import EngineConfig, warn_inapplicable
from tokenspeed_jax.graph import Break, Call, Piece, Plan, PlanBuilder
from tokenspeed_jax.graph.packed import Packed
from tokenspeed_jax.kernels.attention import write_kv
from tokenspeed_jax.kernels.paged_attention_backend import (
    PALLAS,
    DecodeKernel,
    choose_decode_kernel,
)
from tokenspeed_jax.kernels.paged_decode import decode_attention_step
from tokenspeed_jax.kernels.paged_prefill_attention import (
    PrefillKernel,
    choose_prefill_kernel,
    paged_prefill_attention,
)
from tokenspeed_jax.models.forward import (
    ROWS_PIECE,
    Forward,
    alternates_decode_executables,
    sampled_rows,
    structure_key,
)

logger = logging.getLogger(__name__)

SMALL_MODEL_MAX_BYTES = 2 * 2**30  # layer weights up to this: a small model (auto settings)


def layer_weight_bytes(layer_states: Sequence[Any]) -> int:
    """Bytes of every layer's weights together."""
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(list(layer_states)))


def small_model_on_one_gpu(config: EngineConfig, layer_states: Sequence[Any],
                           platform: str) -> bool:
    """The auto rule of ``stack_decode_weights`` and ``inline_prefill_attention``: a GPU, no
    tensor parallelism, layer weights of at most ``SMALL_MODEL_MAX_BYTES``."""
    return (platform == "gpu" and config.tensor_parallel_size == 1
            and layer_weight_bytes(layer_states) <= SMALL_MODEL_MAX_BYTES)


def stacks_decode_weights(config: EngineConfig, layer_states: Sequence[Any],
                          platform: str) -> bool:
    """Whether the decode step takes stacked layer weights on ``platform``."""
    if config.stack_decode_weights is not None:
        return config.stack_decode_weights
    return small_model_on_one_gpu(config, layer_states, platform)


def inlines_prefill_attention(config: EngineConfig, layer_states: Sequence[Any],
                              platform: str) -> bool:
    """Whether each prefill encoder is one executable with attention inside, on ``platform``."""
    if config.inline_prefill_attention is not None:
        return config.inline_prefill_attention
    return small_model_on_one_gpu(config, layer_states, platform)


@dataclasses.dataclass(frozen=True)
class RunnerSettings:
    """What a Llama runner's platform-dependent settings resolve to (``runner_settings``)."""

    stack_decode_weights: bool
    inline_prefill_attention: bool
    alternate_decode_executables: bool
    decode_kernel: DecodeKernel
    prefill_kernel: PrefillKernel


def runner_settings(config: EngineConfig, model: Any, *, page_size: int,
                    platform: str | None = None, mesh: Any = None) -> RunnerSettings:
    """The one place the "auto" settings and attention kernels are resolved, for ``model`` (its
    layer weights, head shape and dtype) on ``platform`` (None: JAX's default backend, the
    runner's; the tests resolve a GPU's on the CPU)."""
    layer_states = [nnx.state(layer) for layer in model.layers]
    cfg = model.config
    cache = {"head_dim": cfg.head_dim, "page_size": page_size,
             "dtype": getattr(model, "dtype", jnp.float32), "mesh": mesh,
             "num_kv_heads": cfg.num_key_value_heads}
    if platform is None:  # the kernel choosers take JAX's default backend themselves
        platform = jax.default_backend()
    else:
        cache["platform"] = platform
    return RunnerSettings(
        stack_decode_weights=stacks_decode_weights(config, layer_states, platform),
        inline_prefill_attention=inlines_prefill_attention(config, layer_states, platform),
        alternate_decode_executables=alternates_decode_executables(config, platform),
        decode_kernel=choose_decode_kernel(**cache, fused=config.fused_decode_attention),
        prefill_kernel=choose_prefill_kernel(**cache),
    )


def unstack_layer_states(stacked: Any, num_layers: int) -> list[Any]:
    """Inside a trace: each layer's state as static slices of the stacked leaves. On a GPU XLA
    reads them in place (the products cost what separate weights cost); the CPU backend does
    not (a step several times slower), hence auto only on GPUs."""
    return [jax.tree_util.tree_map(lambda leaf, i=i: leaf[i], stacked) for i in range(num_layers)]


class LlamaForward(Forward):
    """The forward of a stage-structured causal LM over a paged K/V cache (module docstring)."""

    eager_route = "prefill"

    @staticmethod
    def extra_device_bytes(config: EngineConfig, model: Any) -> int:
        """The stacked decode weights' copy (0 when the runner keeps them per layer)."""
        layer_states = [nnx.state(layer) for layer in model.layers]
        if stacks_decode_weights(config, layer_states, jax.default_backend()):
            return layer_weight_bytes(layer_states)
        return 0

    def __init__(self, model: Any, config: EngineConfig, *, page_size: int, mesh: Any,
                 settings: RunnerSettings | None = None) -> None:
        """``settings``: the resolved settings to run with (the tests give the GPU's); None =
        ``runner_settings`` on JAX's default backend."""
        self._split(model, config, mesh)
        self.page_size = page_size
        self.num_layers = len(self.layer_states)
        self.layer_def = nnx.graphdef(model.layers[0])
        for index, layer in enumerate(model.layers):
            if nnx.graphdef(layer) != self.layer_def:
                raise ValueError(f"layer {index} differs in structure from layer 0")
        self.scale = float(model.attention_scale)
        self.supports_prefill_graph = getattr(model, "supports_prefill_graph", True)
        self.supports_decode_graph = getattr(model, "supports_decode_graph", True)
        self.settings = settings or runner_settings(config, model, page_size=page_size,
                                                    mesh=mesh)
        self.inline_prefill = self.settings.inline_prefill_attention
        self.alternate_decode = self.settings.alternate_decode_executables
        self.decode_kernel = self.settings.decode_kernel
        self.prefill_kernel = self.settings.prefill_kernel
        self.prefill_routes = ("prefill",)
        warn_inapplicable(config, ("disable_kda_prefill_graph",), "Llama-family models", logger)

    def stacks_decode_weights(self) -> bool:
        return self.settings.stack_decode_weights

    # ----------------------------------------------------------------- stage functions

    def _layer(self, state: Any) -> Any:
        return nnx.merge(self.layer_def, state)

    def _qkv(self, params: Any, hidden: jax.Array, positions: jax.Array) -> tuple:
        return self._layer(params).attention_inputs(hidden, positions)

    def _out(self, params: Any, hidden: jax.Array, attn: jax.Array) -> tuple:
        return (self._layer(params).attention_outputs(hidden, attn),)

    def _attention(self, params: Any, packed: Packed, q: jax.Array, k: jax.Array, v: jax.Array,
                   positions: jax.Array, k_pages: jax.Array, v_pages: jax.Array) -> tuple:
        meta = packed.unpack()
        k_pages = write_kv(k_pages, k, meta["slot_mapping"])
        v_pages = write_kv(v_pages, v, meta["slot_mapping"])
        attn = paged_prefill_attention(q, k_pages, v_pages, meta["page_tables"],
                                       meta["token_request"], positions, meta.get("work"),
                                       scale=self.scale, kernel=self.prefill_kernel)
        return attn, k_pages, v_pages

    def _every_layer(self, params: Any, token_ids: jax.Array, positions: jax.Array,
                     caches: Sequence[jax.Array], attend, *, attend_rotates: bool = False
                     ) -> tuple:
        """Embed, then every layer with its attention inside, ``attend(q, k, v, k_pages,
        v_pages) -> (attn, k_pages, v_pages)`` (given q and k before RoPE if
        ``attend_rotates``): the hidden states and the written caches (the K caches, then the V
        caches)."""
        outer_state, layer_states = params
        k_all, v_all = list(caches[:self.num_layers]), list(caches[self.num_layers:])
        hidden = self.outer(outer_state).embed(token_ids)
        for i, state in enumerate(layer_states):
            layer = self._layer(state)
            q, k, v = (layer.unrotated_attention_inputs(hidden) if attend_rotates
                       else layer.attention_inputs(hidden, positions))
            attn, k_all[i], v_all[i] = attend(q, k, v, k_all[i], v_all[i])
            hidden = layer.attention_outputs(hidden, attn)
        return (hidden, *k_all, *v_all)

    def _inline_encoder(self, params: Any, packed: Packed, token_ids: jax.Array,
                        positions: jax.Array, rows: jax.Array, *caches: jax.Array) -> tuple:
        """The whole prefill with attention inside: the hidden states of ``rows`` and the
        written caches."""

        def attend(q, k, v, k_pages, v_pages):
            return self._attention((), packed, q, k, v, positions, k_pages, v_pages)

        hidden, *caches = self._every_layer(params, token_ids, positions, caches, attend)
        return (*sampled_rows((), hidden, rows), *caches)

    def decode_layers(self, params: Any, meta: Mapping[str, jax.Array], token_ids: jax.Array,
                      pools: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Every layer with the decode attention kernel, which writes each row's K/V at its
        ``slot_mapping`` slot."""
        outer_state, layer_states = params
        if not isinstance(layer_states, tuple):  # stacked (``stack_decode_weights``)
            layer_states = unstack_layer_states(layer_states, self.num_layers)
        positions, slots = meta["positions"], meta["slot_mapping"]
        rotary = self._layer(layer_states[0]).rotary_tables(positions)  # every layer's

        def attend(q, k, v, k_pages, v_pages):
            return decode_attention_step(q, k, v, k_pages, v_pages, meta["page_tables"],
                                         positions, slots, rotary, scale=self.scale,
                                         kernel=self.decode_kernel)

        hidden, *caches = self._every_layer((outer_state, layer_states), token_ids, positions,
                                            list(pools.values()), attend, attend_rotates=True)
        return hidden, dict(zip(pools, caches))

    # ----------------------------------------------------------------- plans

    def prefill_plan(self, route: str, pools: Sequence[str]) -> Plan:
        """The prefill plan (module docstring): pieces, or one executable with
        ``inline_prefill_attention``."""
        inputs = ("token_ids", "positions", "rows", *pools)
        outputs = ("rows_hidden", *pools)
        if self.inline_prefill:
            encoder = Break("attention", self._inline_encoder, inputs, outputs, donate=pools)
            return Plan([Call(encoder, (self.outer_state, tuple(self.layer_states)))], inputs,
                        outputs)
        k_names, v_names = pools[:self.num_layers], pools[self.num_layers:]
        pieces = [self.embed_piece()]
        for layer, k_pages, v_pages in zip(self.layer_states, k_names, v_names):
            pieces += [
                Piece(("qkv",), self._qkv, ("hidden", "positions"), ("q", "k", "v"), layer),
                Piece(("attention",), self._attention,
                      ("q", "k", "v", "positions", k_pages, v_pages),
                      ("attn", k_pages, v_pages), meta="attention", donate=("q",)),
                Piece(("out",), self._out, ("hidden", "attn"), ("hidden",), layer,
                      donate=("attn",))]
        return PlanBuilder().plan([*pieces, ROWS_PIECE], inputs, outputs)

    # ----------------------------------------------------------------- host arrays

    def prefill_arrays(self, requests: Sequence[Any], packed: Any, num_rows: int
                       ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """No inputs of its own; the attention's metadata packed: slots, each token's request,
        page tables and, for the Pallas kernel, its work items."""
        pallas = self.prefill_kernel.backend == PALLAS
        block_q = self.prefill_kernel.blocks.block_q if pallas else None
        return {}, {"attention": Packed.of(packed.attention(block_q))}

    def decode_field_defaults(self, rows: int) -> dict[str, np.ndarray]:
        return {"slot_mapping": np.full(rows, -1, np.int32)}

    def write_decode_fields(self, fields: dict[str, np.ndarray],
                            requests: Sequence[Any]) -> None:
        """Each decode row's slot: where the step writes its K/V."""
        count = len(requests)
        positions = fields["positions"][:count]
        pages = fields["page_tables"][np.arange(count), positions // self.page_size]
        fields["slot_mapping"][:count] = pages * self.page_size + positions % self.page_size

    def fingerprint_parts(self) -> list[str]:
        """The model's and a layer's static structure, the scale and both attention kernels."""
        return [structure_key(self.model_def), structure_key(self.layer_def),
                f"scale={self.scale!r}",
                f"decode_kernel={self.decode_kernel!r}", f"prefill_kernel={self.prefill_kernel!r}"]
