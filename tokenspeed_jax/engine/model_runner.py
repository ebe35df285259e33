"""The model runner: one engine step (``StepBatch``) -> sampled tokens, on compiled plans.

Routes, chosen per step from static configuration and the step's sizes:

* **Decode graph**: every request decodes one token. One whole-step executable per decode batch
  bucket (embedding, all layers with paged attention inside, head and the in-step sampler); the
  executables have at least ``MIN_DECODE_ROWS`` rows, so bucket 1 runs on the bucket-2 one. A
  step with more requests than the largest bucket is split into bucket-sized groups (counted).
  Each decode executable also writes its sampled token ids to the *token board* (one device
  array, a row per sequence), and reads a row's input token from the previous
  step's board when ``StepRequest.token_row`` asks: so ``launch`` can leave a decode step
  running, and the engine can launch the next one before the tokens reach the host.
  With ``stack_decode_weights`` (auto for small models on a GPU) the executables of buckets of
  at most ``STACKED_DECODE_MAX_ROWS`` rows take each layer weight stacked over the layers, a
  start-up copy, so their argument count does not grow with depth: on a GPU each argument
  costs host time at every call, which only small batches notice. Larger buckets keep one
  argument per layer weight: stacked, each layer's products are a different fused computation
  that XLA autotunes on its own (about 10x the compile time), for no gain at 32 rows and more.
  The inline prefill encoder keeps one argument per layer weight: stacked, its larger products
  ran slower.
  Successive decode steps of a bucket take its two *turns* (``decode_turns``), each writing its
  sampled rows into a buffer of its own, donated like the caches and the board. With
  ``alternate_decode_executables`` (auto on one GPU) each turn runs its own loaded copy of the
  bucket's executable (``PlanCompiler.add(copies=2)``), so each copy's command buffer sees the
  same addresses at every call and is never re-recorded (a re-record costs host time at
  every step).
  Decode attention is the kernel ``paged_attention_backend.choose_decode_kernel`` picks once (on a
  GPU the fused kernel that also writes the step's K/V, or with ``fused_decode_attention`` off
  the Pallas op), so its cost follows the live context, not ``max_model_len``.
* **Mixed steps** (some requests decode, others prefill) run as two: the decode rows on the
  decode graph and the rest on the prefill graph, the sampled rows joined back in batch order
  (counted as ``mixed_splits``). On the prefill graph alone, every decode row would cost a
  request slot, and a step with more of them than the largest request bucket one more encoder
  run per bucketful.
* **Prefill graph** (prefill steps): an *encoder* plan per token bucket, written as pieces
  (``graph.pieces``) that fuse into the segments ``embed+qkv(0)``, ``out(i)+qkv(i+1)`` and
  ``out(L-1)+rows``, with an ``attention`` break per layer that
  writes the step's K/V into the paged cache, then lets every token attend to its request's keys
  0..its position through the request's page table (``paged_prefill_attention``: the Pallas
  kernel on a GPU, per KV-head shard under tensor parallelism, chosen once by
  ``choose_prefill_kernel``). The attention metadata holds
  ``min(tokens, largest request bucket)`` page-table rows, so its shapes, and the executable
  count, do not depend on how much context is cached. With ``inline_prefill_attention`` (auto
  for small models on a GPU) the encoder is instead one executable per token bucket, attention
  inside (as decode has it): two host calls per prefill step instead of 2L+2, for models whose
  prefill is dispatch-bound, at the price of compiling the whole forward per bucket. Either way
  the encoder ends by gathering each sampled request's last hidden row (input ``rows``) into a
  block of ``narrow_rows`` rows, and a *decoder* plan per row bucket runs the head and the
  in-step sampler on its first rows. On a GPU the encoders compile without XLA's autotuning
  (``prefill_autotune``; ``engine/ladders.py``), as fast to run and several at once. Steps with
  more tokens than the largest bucket are cut into
  chunks (chunked prefill) or, with chunking off, run eagerly; more requests than the largest
  request bucket are split into groups.
* **Sampling in two tiers** (``sampling_plans``): heads and decode steps end with the in-step
  sampler and also return their logits; when a sampled request needs penalties, truncation or
  top log-probabilities, the runner's ``Resampler`` samples those rows again with the full
  sampler (one plan per row bucket of either route). Counted as ``resample_runs``.
* **Eager**: the same plans run op by op (``enforce_eager``, prefill graph off, or a model that
  declares ``supports_prefill_graph = False`` / ``supports_decode_graph = False``). Counted and
  logged; its compiles are declared to the guard.

Invariants: the KV cache of a layer is ``[Hkv, num_pages, page_size, Dh]`` (``attention.py``).
Padding tokens have slot -1 and request -1, so they never write a KV page and never change a
real row; padding requests own no token and sample nothing that is returned. The KV
cache and the hand-off buffers are donated (updated in place). After ``compile_all`` nothing on
the graph routes compiles; the guard counts (strict: raises on) any compile. The settings that
depend on the platform (the "auto" ones and both attention kernels) are resolved in one place,
``runner_settings``, once per runner. With background compile (``background_compile``)
``compile_all`` compiles a skeleton of the buckets and a thread the others
(``engine/ladders.py``); steps choose among the buckets that are ready (``ready``), whose
largest are the full ladders' largest, so only the padding changes.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tokenspeed_jax import parallel
from tokenspeed_jax.config import EngineConfig, warn_inapplicable
from tokenspeed_jax.engine.batch import StepBatch, StepRequest
from tokenspeed_jax.engine.buckets import Buckets
from tokenspeed_jax.engine.compilers import engine_compiler
from tokenspeed_jax.engine.ladders import LadderCompiler
from tokenspeed_jax.engine.packed import Packed
from tokenspeed_jax.engine.sampling_plans import (
    fast_sample,
    sampling_arrays,
    sampling_fields,
    unpack_sampling,
)
from tokenspeed_jax.engine.step_runner import StepRunner, alternates_decode_executables
from tokenspeed_jax.engine.token_board import (
    read_tokens,
    write_board,
)
from tokenspeed_jax.graph import (
    Break,
    Call,
    CompiledPlan,
    Piece,
    Plan,
    PlanBuilder,
    PlanCompiler,
    abstract,
    choose_bucket,
    run_eager,
)
from tokenspeed_jax.graph import arrays as device_arrays
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
from tokenspeed_jax.models.cache_spec import PAGE, pool_specs
from tokenspeed_jax.models.registry import family_of

logger = logging.getLogger(__name__)



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


SMALL_MODEL_MAX_BYTES = 2 * 2**30  # layer weights up to this: a small model (auto settings)
# Decode buckets up to this many rows take stacked weights (``stack_decode_weights``).
STACKED_DECODE_MAX_ROWS = 8


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
    """What a runner's platform-dependent settings resolve to (``runner_settings``)."""

    stack_decode_weights: bool
    inline_prefill_attention: bool
    alternate_decode_executables: bool
    decode_kernel: DecodeKernel
    prefill_kernel: PrefillKernel


def runner_settings(config: EngineConfig, model: Any, *, page_size: int,
                    platform: str | None = None, mesh: Any = None) -> RunnerSettings:
    """The one place a runner's "auto" settings and attention kernels are resolved, for
    ``model`` (its layer weights, head shape and dtype) on ``platform`` (None: JAX's default
    backend, the runner's; the tests resolve a GPU's on the CPU)."""
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


def stack_layer_states(layer_states: Sequence[Any], compiler: PlanCompiler) -> Any:
    """One state whose every leaf stacks that leaf of each layer along a new leading axis, made
    by an executable of ``compiler`` (``graph/arrays.py``: loaded from its cache when warm)."""
    return device_arrays.stack(compiler, layer_states)


def unstack_layer_states(stacked: Any, num_layers: int) -> list[Any]:
    """Inside a trace: each layer's state as static slices of the stacked leaves. On a GPU XLA
    reads them in place (the products cost what separate weights cost); the CPU backend does
    not (a step several times slower), hence auto only on GPUs."""
    return [jax.tree_util.tree_map(lambda leaf, i=i: leaf[i], stacked) for i in range(num_layers)]


class ModelRunner(StepRunner):
    """Runs engine steps of a stage-structured causal LM on a paged KV cache it owns."""

    @staticmethod
    def extra_device_bytes(config: EngineConfig, model: Any) -> int:
        """Device bytes a runner of ``model`` adds besides its caches, which start-up reserves
        before sizing the KV cache: the stacked decode weights' copy (0 when it keeps them per
        layer)."""
        layer_states = [nnx.state(layer) for layer in model.layers]
        if stacks_decode_weights(config, layer_states, jax.default_backend()):
            return layer_weight_bytes(layer_states)
        return 0

    def __init__(self, model: Any, config: EngineConfig, num_pages: int, page_size: int = 16,
                 *, settings: RunnerSettings | None = None):
        """``settings``: the resolved settings to run with (the tests give the GPU's); None =
        ``runner_settings`` on JAX's default backend."""
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages={num_pages} and page_size={page_size} must be >= 1")
        self.config = config
        self.model_config = model.config
        self.num_pages = num_pages
        self.page_size = page_size
        self.pages_per_request = math.ceil(config.max_model_len / page_size)
        self.scale = float(model.attention_scale)
        self.buckets = Buckets.from_config(
            config,
            prefill=getattr(model, "supports_prefill_graph", True),
            decode=getattr(model, "supports_decode_graph", True),
        )
        self.mesh = parallel.make_mesh(config.tensor_parallel_size)
        if self.mesh is not None:
            family_of(model.config).place_model(model, self.mesh)
        layers = list(model.layers)
        self.num_layers = len(layers)
        self.layer_def = nnx.graphdef(layers[0])
        for index, layer in enumerate(layers):
            if nnx.graphdef(layer) != self.layer_def:
                raise ValueError(f"layer {index} differs in structure from layer 0")
        self._model_classes = {type(m) for _, m in nnx.iter_modules(model)}
        self.layer_states = [nnx.state(layer) for layer in layers]
        if settings is None:
            settings = runner_settings(config, model, page_size=page_size, mesh=self.mesh)
        self.settings = settings
        self.stacked_layers = None
        if settings.stack_decode_weights:
            self.stacked_layers = stack_layer_states(self.layer_states, engine_compiler(
                config, description="stacking decode weights", fingerprint=None, mesh=self.mesh))
        self.inline_prefill = settings.inline_prefill_attention
        self.alternate_decode = settings.alternate_decode_executables
        self.decode_kernel = settings.decode_kernel
        self.prefill_kernel = settings.prefill_kernel
        self.model_def, layers_state, self.outer_state = nnx.split(
            model, nnx.PathContains("layers"), ...)
        self._layers_placeholder = abstract(layers_state)
        pools = family_of(model.config).cache_pools(
            model.config, page_size, getattr(model, "dtype", jnp.float32),
            config.kda_state_dtype, parallel.mesh_size(self.mesh))
        self.store_kv_caches(device_arrays.zeros(
            engine_compiler(config, description="allocating the KV cache", fingerprint=None,
                            mesh=self.mesh),
            pool_specs(pools, {PAGE: num_pages}, self.mesh)))
        warn_inapplicable(config, ("disable_kda_prefill_graph",), "Llama-family models", logger)
        self._init_step_state()
        self._build_plans()
        self._encoders: dict[int, CompiledPlan] = {}
        self._decoders: dict[int, CompiledPlan] = {}

    # ----------------------------------------------------------------- stage functions

    def _outer(self, outer_state: Any) -> Any:
        return nnx.merge(self.model_def, self._layers_placeholder, outer_state)

    def _layer(self, state: Any) -> Any:
        return nnx.merge(self.layer_def, state)

    def _embed(self, params: Any, token_ids: jax.Array) -> tuple:
        return (self._outer(params).embed(token_ids),)

    def _qkv(self, params: Any, hidden: jax.Array, positions: jax.Array) -> tuple:
        return self._layer(params).attention_inputs(hidden, positions)

    def _out(self, params: Any, hidden: jax.Array, attn: jax.Array) -> tuple:
        return (self._layer(params).attention_outputs(hidden, attn),)

    @staticmethod
    def _sampled_rows(params: Any, hidden: jax.Array, rows: jax.Array) -> tuple:
        return (jnp.take(hidden, rows, axis=0),)

    def _attention(self, params: Any, packed: Packed, q: jax.Array, k: jax.Array, v: jax.Array,
                   positions: jax.Array, k_pages: jax.Array, v_pages: jax.Array) -> tuple:
        meta = packed.unpack()
        k_pages = write_kv(k_pages, k, meta["slot_mapping"])
        v_pages = write_kv(v_pages, v, meta["slot_mapping"])
        attn = paged_prefill_attention(q, k_pages, v_pages, meta["page_tables"],
                                       meta["token_request"], positions, meta.get("work"),
                                       scale=self.scale, kernel=self.prefill_kernel)
        return attn, k_pages, v_pages

    def _head(self, params: Any, packed: Packed, hidden: jax.Array) -> tuple:
        """The head and the in-step sampler on the first rows of ``hidden``, one per sampling
        row (a narrowed block holds ``narrow_rows`` rows): (sampled rows, fp32 logits)."""
        sampling = unpack_sampling(packed.unpack())
        hidden = hidden[:sampling.temperature.shape[0]]
        logits = self._outer(params).head(hidden).astype(jnp.float32)
        return fast_sample(sampling, logits), logits

    def _decode_step(self, params: Any, packed: Packed, *values: jax.Array) -> tuple:
        """One decode step: the in-step sampler's rows, the logits (for ``resample``), the token
        board, caches. A row with ``token_rows >= 0`` reads its input token from the board the
        previous decode step wrote. The last value (the turn's sampled-rows buffer) is not read:
        it is donated so that the sampled rows are written into it."""
        outer_state, layer_states = params
        if not isinstance(layer_states, tuple):  # stacked (``stack_decode_weights``)
            layer_states = unstack_layer_states(layer_states, self.num_layers)
        meta = packed.unpack()
        *caches, board, _ = values
        positions, slots = meta["positions"], meta["slot_mapping"]
        rotary = self._layer(layer_states[0]).rotary_tables(positions)  # every layer's

        def attend(q, k, v, k_pages, v_pages):
            return decode_attention_step(q, k, v, k_pages, v_pages, meta["page_tables"],
                                         positions, slots, rotary, scale=self.scale,
                                         kernel=self.decode_kernel)

        token_ids = read_tokens(meta["token_ids"], meta["token_rows"], board)
        hidden, *caches = self._every_layer((outer_state, layer_states), token_ids, positions,
                                            caches, attend, attend_rotates=True)
        logits = self._outer(outer_state).head(hidden).astype(jnp.float32)
        sampled = fast_sample(unpack_sampling(meta), logits)
        return (sampled, logits, write_board(board, sampled), *caches)

    def _every_layer(self, params: Any, token_ids: jax.Array, positions: jax.Array,
                     caches: Sequence[jax.Array], attend, *, attend_rotates: bool = False
                     ) -> tuple:
        """Embed, then every layer with its attention inside, ``attend(q, k, v, k_pages,
        v_pages) -> (attn, k_pages, v_pages)`` (given q and k before RoPE if
        ``attend_rotates``): the hidden states and the written caches (the K caches, then the V
        caches)."""
        outer_state, layer_states = params
        k_all, v_all = list(caches[:self.num_layers]), list(caches[self.num_layers:])
        hidden = self._outer(outer_state).embed(token_ids)
        for i, state in enumerate(layer_states):
            layer = self._layer(state)
            q, k, v = (layer.unrotated_attention_inputs(hidden) if attend_rotates
                       else layer.attention_inputs(hidden, positions))
            attn, k_all[i], v_all[i] = attend(q, k, v, k_all[i], v_all[i])
            hidden = layer.attention_outputs(hidden, attn)
        return (hidden, *k_all, *v_all)

    # ----------------------------------------------------------------- plans

    def _cache_names(self) -> tuple[list[str], list[str]]:
        return ([f"k_pages.{i}" for i in range(self.num_layers)],
                [f"v_pages.{i}" for i in range(self.num_layers)])

    def _inline_encoder(self, params: Any, packed: Packed, token_ids: jax.Array,
                        positions: jax.Array, rows: jax.Array, *caches: jax.Array) -> tuple:
        """The whole encoder with attention inside: the hidden states of ``rows`` and the
        written caches."""

        def attend(q, k, v, k_pages, v_pages):
            return self._attention((), packed, q, k, v, positions, k_pages, v_pages)

        hidden, *caches = self._every_layer(params, token_ids, positions, caches, attend)
        return (*self._sampled_rows((), hidden, rows), *caches)

    def _encoder_pieces(self, k_names: list[str], v_names: list[str]) -> list[Piece]:
        """The segmented encoder as pieces (``graph.pieces``): the embedding; per layer its
        attention inputs, the attention break (writing the layer's K/V pages) and its outputs;
        last the sampled rows' gather. They fuse into the segments ``embed+qkv``, ``out+qkv``
        (one executable for every layer) and ``out+rows``."""
        pieces = [Piece(("embed",), self._embed, ("token_ids",), ("hidden",), self.outer_state)]
        for layer, k_pages, v_pages in zip(self.layer_states, k_names, v_names):
            pieces += [
                Piece(("qkv",), self._qkv, ("hidden", "positions"), ("q", "k", "v"), layer),
                Piece(("attention",), self._attention,
                      ("q", "k", "v", "positions", k_pages, v_pages),
                      ("attn", k_pages, v_pages), meta="attention", donate=("q",)),
                Piece(("out",), self._out, ("hidden", "attn"), ("hidden",), layer,
                      donate=("attn",))]
        pieces.append(Piece(("rows",), self._sampled_rows, ("hidden", "rows"), ("rows_hidden",)))
        return pieces

    def _build_plans(self) -> None:
        k_names, v_names = self._cache_names()
        caches = (*k_names, *v_names)
        encoder_inputs = ("token_ids", "positions", "rows", *caches)
        if self.inline_prefill:
            encoder = Break("attention", self._inline_encoder, encoder_inputs,
                            ("rows_hidden", *caches), donate=caches)
            self.encoder_plan = Plan([Call(encoder, (self.outer_state, tuple(self.layer_states)))],
                                     encoder_inputs, ("rows_hidden", *caches))
        else:
            self.encoder_plan = PlanBuilder().plan(self._encoder_pieces(k_names, v_names),
                                                   encoder_inputs, ("rows_hidden", *caches))
        head = Break("head", self._head, ("rows_hidden",), ("sampled", "logits"))
        self.decoder_plan = Plan([Call(head, self.outer_state)], ("rows_hidden",),
                                 ("sampled", "logits"))
        decoded = ("sampled", "logits", "board", *caches)
        carried = (*caches, "board", "sampled")
        decode = Break("decode", self._decode_step, carried, decoded, donate=carried)
        per_layer = Plan([Call(decode, (self.outer_state, tuple(self.layer_states)))], carried,
                         decoded)
        self.stacked_decode_plan = None if self.stacked_layers is None else Plan(
            [Call(decode, (self.outer_state, self.stacked_layers))], carried, decoded)
        # Also the quick skeleton's decode (engine/ladders.py): stacked weights make every
        # layer's products a different fused computation, each compiled (and autotuned) alone.
        self.per_layer_decode_plan = per_layer

    def decode_plan(self, rows: int) -> Plan:
        """The decode plan of a bucket of ``rows`` rows: stacked weights for small buckets when
        the runner stacks them (module docstring), one argument per layer weight otherwise."""
        if self.stacked_decode_plan is not None and rows <= STACKED_DECODE_MAX_ROWS:
            return self.stacked_decode_plan
        return self.per_layer_decode_plan

    # ----------------------------------------------------------------- start-up compile

    def _cache_specs(self) -> dict[str, jax.ShapeDtypeStruct]:
        k_names, v_names = self._cache_names()
        specs = abstract(self.k_pages) + abstract(self.v_pages)
        return dict(zip(k_names + v_names, specs))

    @property
    def narrow_rows(self) -> int:
        """Rows every encoder gathers for the head (the largest request bucket): one encoder
        per token bucket serves every request bucket, whose head reads its first rows."""
        return self.buckets.prefill_requests[-1]

    def _table_rows(self, num_tokens: int) -> int:
        """Page-table rows of a token bucket's attention: every group it can hold fits."""
        return min(num_tokens, self.narrow_rows)

    def prefill_arrays(self, requests: Sequence[StepRequest], num_tokens: int,
                       num_rows: int, num_table_rows: int | None = None
                       ) -> tuple[dict, Packed]:
        """Host-built (numpy) arrays of one padded prefill group: the inputs (``rows``: each
        sampled request's last token, padded to ``num_rows``) and the attention's (packed).

        The attention arrays are the token slots, each token's request (``token_request``), the
        requests' page tables padded to ``num_table_rows`` rows (default ``_table_rows``: fixed
        by the token bucket) and, for the Pallas kernel, its work items.
        """
        if num_table_rows is None:
            num_table_rows = self._table_rows(num_tokens)
        packed = self.pack_tokens(requests, num_tokens, num_table_rows)
        inputs = {"token_ids": packed.token_ids, "positions": packed.positions,
                  "rows": packed.sampled_rows(num_rows)}
        pallas = self.prefill_kernel.backend == PALLAS
        return inputs, Packed.of(packed.attention(
            self.prefill_kernel.blocks.block_q if pallas else None))

    def _decode_field_defaults(self, rows: int) -> dict[str, np.ndarray]:
        return {"slot_mapping": np.full(rows, -1, np.int32)}

    def _write_decode_fields(self, fields: dict[str, np.ndarray],
                             requests: Sequence[StepRequest]) -> None:
        """Each decode row's slot: where the step writes its K/V."""
        count = len(requests)
        positions = fields["positions"][:count]
        pages = fields["page_tables"][np.arange(count), positions // self.page_size]
        fields["slot_mapping"][:count] = pages * self.page_size + positions % self.page_size

    def encoder(self, tokens: int) -> CompiledPlan:
        """The compiled prefill encoder plan of a token bucket."""
        return self._encoders[tokens]

    def cache_fingerprint(self) -> str:
        """What the stage functions read besides their arguments, for the executable cache key:
        the model's static structure and attributes (config, dtypes, eps), the scale, the flax
        version, and the bytecode of the runner's and the model's classes."""
        return self._fingerprint(repr(self.model_def), repr(self.layer_def),
                                 f"scale={self.scale!r}", f"decode_kernel={self.decode_kernel!r}",
                                 f"prefill_kernel={self.prefill_kernel!r}")

    def _add_plans(self, ladders: LadderCompiler) -> None:
        """Every bucket plan: the decode step and its resamplers per decode executable, the
        head and its resamplers per request bucket, the encoder per token bucket."""
        caches = self._cache_specs()
        shardings = self._value_shardings(list(caches))
        hidden_dtype = self.k_pages[0].dtype
        hidden_size = self.model_config.hidden_size
        # Added rung by rung, each rung's plans together: deferred plans compile in this order.
        self._add_decode_plans(ladders, self.decode_plan, caches, shardings,
                               quick_plan=self.per_layer_decode_plan)
        for rows in self.buckets.prefill_requests:
            narrowed = jax.ShapeDtypeStruct((self.narrow_rows, hidden_size), hidden_dtype)
            ladders.add([("prefill_requests", rows)], f"head B={rows}",
                        functools.partial(self._decoders.__setitem__, rows), self.decoder_plan,
                        {"rows_hidden": narrowed}, abstract(self._head_meta([], rows)))
            ladders.add_resampler(self.resampler, rows)
        for tokens in self.buckets.tokens:
            ladders.add([("tokens", tokens)], f"prefill T={tokens}",
                        functools.partial(self._encoders.__setitem__, tokens), self.encoder_plan,
                        *self.encoder_specs(tokens), shardings=shardings,
                        autotune=False)

    def encoder_specs(self, tokens: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """The abstract (inputs, metadata) of the encoder plan of token bucket ``tokens``, for a
        ``PlanCompiler``."""
        inputs, attention = abstract(self.prefill_arrays([], tokens, self.narrow_rows))
        return {**inputs, **self._cache_specs()}, {"attention": attention}

    # ----------------------------------------------------------------- serving

    def _on_decode_graph(self, batch: StepBatch) -> bool:
        return (bool(self.buckets.decode_requests) and batch.is_decode
                and len(batch.requests) <= self.buckets.decode_requests[-1])

    def _run(self, requests: list[StepRequest]) -> list[np.ndarray]:
        """The packed sampled rows of ``requests`` on the route their shape takes."""
        if StepBatch(requests).is_decode and self.buckets.decode_requests:
            return self._run_decode_groups(requests)
        if self.buckets.tokens:
            return self._run_prefill_graph(requests)
        return [self._run_eager(requests)]

    def _run_prefill_graph(self, requests: list[StepRequest]) -> list[np.ndarray]:
        max_tokens = self.buckets.tokens[-1]
        max_requests = self.buckets.prefill_requests[-1]
        total = sum(r.num_tokens for r in requests)
        if total > max_tokens and not self.config.chunked_prefill_size:
            logger.info("%d tokens exceed the largest prefill bucket %d and chunked prefill is "
                        "off: running eagerly", total, max_tokens)
            return [self._run_eager(requests)]
        by_requests = split_requests(requests, total, max_requests)
        groups = split_requests(requests, max_tokens, max_requests)
        self.counters["request_splits"] += len(by_requests) - 1
        self.counters["chunked_prefill_splits"] += len(groups) - len(by_requests)
        return [self._run_prefill_group(group) for group in groups]

    def _run_prefill_group(self, requests: list[StepRequest]) -> np.ndarray:
        num_tokens = sum(r.num_tokens for r in requests)
        ready = self.ready
        tokens = choose_bucket(ready.tokens, num_tokens)
        rows = choose_bucket(ready.prefill_requests, len(requests))
        inputs, attention = self.prefill_arrays(requests, tokens, self.narrow_rows)
        self.counters["prefill_runs"] += 1
        self.counters["real_tokens"] += num_tokens
        self.counters["padded_tokens"] += tokens - num_tokens
        out = self._encoders[tokens].run(
            {**jax.device_put(inputs), **self.kv_caches()}, {"attention": attention})
        self.store_kv_caches(out)
        sampled_requests = [r for r in requests if r.sample]
        out = self._decoders[rows].run({"rows_hidden": out["rows_hidden"]},
                                       self._head_meta(sampled_requests, rows))
        return self.resampler.finish(sampled_requests, rows, out["sampled"], out["logits"])

    def _head_meta(self, sampled: Sequence[StepRequest], rows: int) -> dict:
        """The packed metadata of the head plan: the in-step sampler's settings."""
        return {"head": Packed.of(sampling_fields(sampling_arrays(sampled, rows)))}

    def _run_eager(self, requests: list[StepRequest]) -> np.ndarray:
        """The same plans, op by op, at the exact sizes: no buckets, no padding."""
        self.counters["eager_runs"] += 1
        num_tokens = sum(r.num_tokens for r in requests)
        self.counters["real_tokens"] += num_tokens
        inputs, attention = self.prefill_arrays(requests, num_tokens, len(requests),
                                                len(requests))
        sampled_requests = [r for r in requests if r.sample]
        num_sampled = len(sampled_requests)
        with self.guard.allowed("eager forward"):
            out = run_eager(self.encoder_plan, {**jax.device_put(inputs), **self.kv_caches()},
                            {"attention": attention})
            self.store_kv_caches(out)
            out = run_eager(self.decoder_plan, {"rows_hidden": out["rows_hidden"]},
                            self._head_meta(sampled_requests, num_sampled))
            return self.resampler.finish(sampled_requests, num_sampled, out["sampled"],
                                         out["logits"], eager=True)

    def decode_caches(self) -> list[jax.Array]:
        """The KV caches a decode step carries: the K caches, then the V caches."""
        return [*self.k_pages, *self.v_pages]

    def adopt_decode_caches(self, caches: Sequence[jax.Array]) -> None:
        self.k_pages, self.v_pages = caches[:self.num_layers], caches[self.num_layers:]

    def kv_caches(self) -> dict[str, jax.Array]:
        """The paged KV cache as plan values (``k_pages.i``, ``v_pages.i``); donated per step."""
        k_names, v_names = self._cache_names()
        return {**dict(zip(k_names, self.k_pages)), **dict(zip(v_names, self.v_pages))}

    def store_kv_caches(self, values: dict[str, jax.Array]) -> None:
        """Adopt the KV cache arrays a plan returned (the donated ones are gone)."""
        k_names, v_names = self._cache_names()
        self.k_pages = [values[n] for n in k_names]
        self.v_pages = [values[n] for n in v_names]

