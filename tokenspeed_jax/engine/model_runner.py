"""The model runner: one engine step (``StepBatch``) -> sampled tokens, on compiled plans.

Routes, chosen per step from static configuration and the step's sizes:

* **Decode graph**: every request decodes one token. One whole-step executable per decode batch
  bucket (embedding, all layers with paged attention inside, head and sampler). A step with more
  requests than the largest bucket is split into bucket-sized groups (counted).
* **Prefill graph** (prefill and mixed steps): an *encoder* plan per (token bucket, request
  bucket): segments ``embed+qkv(0)``, ``out(i)+qkv(i+1)``, ``out(L-1)``, with an ``attention``
  break per layer that writes K/V into the paged cache and attends over it. Then the *narrowing*
  break gathers each sampled request's last hidden row, and a *decoder* plan per row bucket runs
  the head and the sampler on rows only. Steps with more tokens than the largest bucket are cut
  into chunks (chunked prefill) or, with chunking off, run eagerly; more requests than the
  largest request bucket are split into groups.
* **Eager**: the same plans run op by op (``enforce_eager``, prefill graph off, or a model that
  declares ``supports_prefill_graph = False`` / ``supports_decode_graph = False``). Counted and
  logged; its compiles are declared to the guard.

Invariants: padding tokens have slot -1 and request -1, so they never write a KV page and never
change a real row; padding requests own no token and sample nothing that is returned. The KV
cache and the hand-off buffers are donated (updated in place). After ``compile_all`` nothing on
the graph routes compiles; the guard counts (strict: raises on) any compile.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.batch import StepBatch, StepOutput, StepRequest
from tokenspeed_jax.engine.sampler import SamplingArrays, sample, top_logprobs
from tokenspeed_jax.graph import (
    Break,
    Call,
    CompiledPlan,
    CompileGuard,
    CompileSummary,
    Plan,
    PlanCompiler,
    Segment,
    abstract,
    batch_ladder,
    choose_bucket,
    explicit_ladder,
    run_eager,
    token_ladder,
)
from tokenspeed_jax.kernels.attention import (
    paged_decode_attention,
    paged_prefill_attention,
    write_kv,
)

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20  # SamplingParams.logprobs is at most 20


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


@dataclasses.dataclass(frozen=True)
class Buckets:
    """The bucket ladders a runner compiles; empty tuples mean that route is off."""

    tokens: tuple[int, ...]
    prefill_requests: tuple[int, ...]
    decode_requests: tuple[int, ...]

    @classmethod
    def from_config(cls, config: EngineConfig, *, prefill: bool, decode: bool) -> Buckets:
        tokens: tuple[int, ...] = ()
        requests: tuple[int, ...] = ()
        if prefill and config.prefill_graph_enabled:
            top = config.prefill_token_limit
            tokens = (token_ladder(top) if config.prefill_graph_capture_token_sizes is None
                      else explicit_ladder(config.prefill_graph_capture_token_sizes, top))
            max_bs = min(config.prefill_graph_max_bs, top)
            requests = (batch_ladder(max_bs) if config.prefill_graph_capture_batch_sizes is None
                        else explicit_ladder(config.prefill_graph_capture_batch_sizes, max_bs))
        decode_requests: tuple[int, ...] = ()
        if decode and not config.enforce_eager:
            max_bs = config.decode_graph_max_bs
            decode_requests = (
                batch_ladder(max_bs) if config.decode_graph_capture_batch_sizes is None
                else explicit_ladder(config.decode_graph_capture_batch_sizes, max_bs))
        return cls(tokens, requests, decode_requests)


class ModelRunner:
    """Runs engine steps of a stage-structured causal LM on a paged KV cache it owns."""

    def __init__(self, model: Any, config: EngineConfig, num_pages: int, page_size: int = 16):
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
        layers = list(model.layers)
        self.num_layers = len(layers)
        self.layer_def = nnx.graphdef(layers[0])
        for index, layer in enumerate(layers):
            if nnx.graphdef(layer) != self.layer_def:
                raise ValueError(f"layer {index} differs in structure from layer 0")
        self.layer_states = [nnx.state(layer) for layer in layers]
        self.model_def, layers_state, self.outer_state = nnx.split(
            model, nnx.PathContains("layers"), ...)
        self._layers_placeholder = abstract(layers_state)
        cfg = model.config
        cache_shape = (num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
        dtype = getattr(model, "dtype", jnp.float32)
        self.k_pages = [jnp.zeros(cache_shape, dtype) for _ in layers]
        self.v_pages = [jnp.zeros(cache_shape, dtype) for _ in layers]
        self.guard = CompileGuard(strict=config.strict_no_compile)
        self._build_plans()
        self._encoders: dict[tuple[int, int], CompiledPlan] = {}
        self._narrowers: dict[tuple[int, int], CompiledPlan] = {}
        self._decoders: dict[int, CompiledPlan] = {}
        self._decode_steps: dict[int, CompiledPlan] = {}
        self.compiled = False
        self.counters = dict.fromkeys((
            "prefill_graph_runs", "decode_graph_runs", "eager_runs", "chunked_prefill_splits",
            "request_splits", "decode_splits", "real_tokens", "padded_tokens"), 0)

    # ----------------------------------------------------------------- stage functions

    def _outer(self, outer_state: Any) -> Any:
        return nnx.merge(self.model_def, self._layers_placeholder, outer_state)

    def _layer(self, state: Any) -> Any:
        return nnx.merge(self.layer_def, state)

    def _embed_qkv(self, params: Any, token_ids: jax.Array, positions: jax.Array) -> tuple:
        outer, layer = params
        hidden = self._outer(outer).embed(token_ids)
        return (hidden, *self._layer(layer).attention_inputs(hidden, positions))

    def _out_qkv(self, params: Any, hidden: jax.Array, attn: jax.Array,
                 positions: jax.Array) -> tuple:
        this, following = params
        hidden = self._layer(this).attention_outputs(hidden, attn)
        return (hidden, *self._layer(following).attention_inputs(hidden, positions))

    def _out(self, params: Any, hidden: jax.Array, attn: jax.Array) -> jax.Array:
        return self._layer(params).attention_outputs(hidden, attn)

    def _attention(self, params: Any, meta: dict, q: jax.Array, k: jax.Array, v: jax.Array,
                   positions: jax.Array, k_pages: jax.Array, v_pages: jax.Array) -> tuple:
        k_pages = write_kv(k_pages, k, meta["slot_mapping"])
        v_pages = write_kv(v_pages, v, meta["slot_mapping"])
        attn = paged_prefill_attention(q, k_pages, v_pages, meta["page_tables"],
                                       meta["token_request"], positions, scale=self.scale)
        return attn, k_pages, v_pages

    @staticmethod
    def _narrow(params: Any, meta: dict, hidden: jax.Array) -> jax.Array:
        return jnp.take(hidden, meta["rows"], axis=0)

    def _sample(self, outer_state: Any, sampling: SamplingArrays, hidden: jax.Array) -> tuple:
        logits = self._outer(outer_state).head(hidden)
        token_ids, logprobs = sample(logits, sampling)
        k = min(MAX_TOP_LOGPROBS, logits.shape[-1])
        top_values, top_ids = top_logprobs(logits, k)
        return token_ids, logprobs, top_values, top_ids

    def _head_sample(self, params: Any, meta: dict, hidden: jax.Array) -> tuple:
        return self._sample(params, meta["sampling"], hidden)

    def _decode_step(self, params: Any, meta: dict, *caches: jax.Array) -> tuple:
        outer_state, layer_states = params
        k_all, v_all = list(caches[:self.num_layers]), list(caches[self.num_layers:])
        positions, slots = meta["positions"], meta["slot_mapping"]
        hidden = self._outer(outer_state).embed(meta["token_ids"])
        for i, state in enumerate(layer_states):
            layer = self._layer(state)
            q, k, v = layer.attention_inputs(hidden, positions)
            k_all[i] = write_kv(k_all[i], k, slots)
            v_all[i] = write_kv(v_all[i], v, slots)
            attn = paged_decode_attention(q, k_all[i], v_all[i], meta["page_tables"], positions,
                                          scale=self.scale)
            hidden = layer.attention_outputs(hidden, attn)
        return (*self._sample(outer_state, meta["sampling"], hidden), *k_all, *v_all)

    # ----------------------------------------------------------------- plans

    def _cache_names(self) -> tuple[list[str], list[str]]:
        return ([f"k_pages.{i}" for i in range(self.num_layers)],
                [f"v_pages.{i}" for i in range(self.num_layers)])

    def _build_plans(self) -> None:
        k_names, v_names = self._cache_names()
        first = Segment("embed+qkv", self._embed_qkv, ("token_ids", "positions"),
                        ("hidden", "q", "k", "v"))
        middle = Segment("out+qkv", self._out_qkv, ("hidden", "attn", "positions"),
                         ("hidden", "q", "k", "v"), donate=("hidden", "attn"))
        last = Segment("out", self._out, ("hidden", "attn"), ("hidden",), donate=("hidden",))
        attention = Break("attention", self._attention,
                          ("q", "k", "v", "positions", "k_pages", "v_pages"),
                          ("attn", "k_pages", "v_pages"), donate=("q", "k_pages", "v_pages"))
        calls = [Call(first, (self.outer_state, self.layer_states[0]))]
        for i in range(self.num_layers):
            calls.append(Call(attention, (), {"k_pages": k_names[i], "v_pages": v_names[i]}))
            if i + 1 < self.num_layers:
                calls.append(Call(middle, (self.layer_states[i], self.layer_states[i + 1])))
        calls.append(Call(last, self.layer_states[-1]))
        caches = (*k_names, *v_names)
        self.encoder_plan = Plan(calls, ("token_ids", "positions", *caches), ("hidden", *caches))
        narrow = Break("narrow", self._narrow, ("hidden",), ("rows_hidden",))
        self.narrow_plan = Plan([Call(narrow)], ("hidden",), ("rows_hidden",))
        sampled = ("token_ids", "logprobs", "top_logprobs", "top_ids")
        head = Break("sample", self._head_sample, ("rows_hidden",), sampled)
        self.decoder_plan = Plan([Call(head, self.outer_state)], ("rows_hidden",), sampled)
        decode = Break("decode", self._decode_step, caches, (*sampled, *caches), donate=caches)
        self.decode_plan = Plan([Call(decode, (self.outer_state, tuple(self.layer_states)))],
                                caches, (*sampled, *caches))

    # ----------------------------------------------------------------- start-up compile

    def _cache_specs(self) -> dict[str, jax.ShapeDtypeStruct]:
        k_names, v_names = self._cache_names()
        specs = abstract(self.k_pages) + abstract(self.v_pages)
        return dict(zip(k_names + v_names, specs))

    def _prefill_meta(self, requests: Sequence[StepRequest], num_tokens: int,
                      num_requests: int) -> tuple[dict, dict, dict]:
        """Host-built (numpy) arrays of one padded prefill group: inputs, attention, sampling."""
        token_ids = np.zeros(num_tokens, np.int32)
        positions = np.full(num_tokens, -1, np.int32)
        slots = np.full(num_tokens, -1, np.int32)
        token_request = np.full(num_tokens, -1, np.int32)
        page_tables = np.zeros((num_requests, self.pages_per_request), np.int32)
        rows, sampled = [], []
        offset = 0
        for index, request in enumerate(requests):
            span = slice(offset, offset + request.num_tokens)
            pos = np.arange(request.start_pos, request.end_pos, dtype=np.int32)
            table = self._page_table(request)
            token_ids[span] = request.token_ids
            positions[span] = pos
            slots[span] = table[pos // self.page_size] * self.page_size + pos % self.page_size
            token_request[span] = index
            page_tables[index, :len(table)] = table
            offset += request.num_tokens
            if request.sample:
                rows.append(offset - 1)
                sampled.append(request)
        rows_arr = np.zeros(num_requests, np.int32)
        rows_arr[:len(rows)] = rows
        inputs = {"token_ids": token_ids, "positions": positions}
        attention = {"slot_mapping": slots, "token_request": token_request,
                     "page_tables": page_tables}
        head = {"rows": rows_arr, "sampling": self._sampling(sampled, num_requests)}
        return inputs, attention, head

    def _page_table(self, request: StepRequest) -> np.ndarray:
        table = np.asarray(request.page_table, np.int32)
        needed = math.ceil(request.end_pos / self.page_size)
        if len(table) < needed or len(table) > self.pages_per_request:
            raise ValueError(
                f"request {request.request_id}: page_table has {len(table)} pages; it needs "
                f">= {needed} and at most {self.pages_per_request} (max_model_len="
                f"{self.config.max_model_len}, page_size={self.page_size})")
        return table

    @staticmethod
    def _sampling(requests: Sequence[StepRequest], rows: int) -> SamplingArrays:
        return SamplingArrays.from_params(
            [(r.params, len(r.output_token_ids)) for r in requests], pad_to=rows)

    def _decode_meta(self, requests: Sequence[StepRequest], rows: int) -> dict:
        inputs, attention, head = self._prefill_meta(requests, rows, rows)
        return {"token_ids": inputs["token_ids"], "positions": inputs["positions"],
                "slot_mapping": attention["slot_mapping"],
                "page_tables": attention["page_tables"], "sampling": head["sampling"]}

    def compile_all(self) -> CompileSummary:
        """Compile every executable a request can reach; fatal on failure; then arm the guard."""
        compiler = PlanCompiler(progress=self.config.compile_progress,
                                description="compiling executables")
        caches = self._cache_specs()
        hidden_dtype = self.k_pages[0].dtype
        hidden_size = self.model_config.hidden_size
        for tokens in self.buckets.tokens:
            for requests in self.buckets.prefill_requests:
                if requests > tokens:
                    continue
                inputs, attention, head = (abstract(m) for m in
                                           self._prefill_meta([], tokens, requests))
                compiler.add(f"prefill T={tokens} B={requests}", self.encoder_plan,
                             {**inputs, **caches}, {"attention": attention})
                hidden = jax.ShapeDtypeStruct((tokens, hidden_size), hidden_dtype)
                compiler.add(f"narrow T={tokens} B={requests}", self.narrow_plan,
                             {"hidden": hidden}, {"narrow": {"rows": head["rows"]}})
        for rows in self.buckets.prefill_requests:
            hidden = jax.ShapeDtypeStruct((rows, hidden_size), hidden_dtype)
            sampling = abstract(self._sampling([], rows))
            compiler.add(f"head B={rows}", self.decoder_plan, {"rows_hidden": hidden},
                         {"sample": {"sampling": sampling}})
        for rows in self.buckets.decode_requests:
            compiler.add(f"decode B={rows}", self.decode_plan, caches,
                         {"decode": abstract(self._decode_meta([], rows))})
        plans, summary = compiler.compile_all()
        for label, plan in plans.items():
            kind, *sizes = label.split()
            key = tuple(int(s.split("=")[1]) for s in sizes)
            table = {"prefill": self._encoders, "narrow": self._narrowers,
                     "head": self._decoders, "decode": self._decode_steps}[kind]
            table[key if len(key) > 1 else key[0]] = plan
        logger.info("start-up compile:\n%s", summary.table())
        self.compiled = True
        self.guard.arm()
        return summary

    # ----------------------------------------------------------------- serving

    def step(self, batch: StepBatch) -> StepOutput:
        """Run one engine step; one sampled token per request with ``sample`` set, in order."""
        if not batch.requests:
            raise ValueError("a step needs at least one request")
        graphs = self.buckets.tokens or self.buckets.decode_requests
        if graphs and not self.compiled:
            raise RuntimeError("call compile_all() before step()")
        results = []
        if batch.is_decode and self.buckets.decode_requests:
            largest = self.buckets.decode_requests[-1]
            groups = [batch.requests[i:i + largest]
                      for i in range(0, len(batch.requests), largest)]
            self.counters["decode_splits"] += len(groups) - 1
            results = [self._run_decode(group) for group in groups]
        elif self.buckets.tokens:
            results = self._run_prefill_graph(batch.requests)
        else:
            results = [self._run_eager(batch.requests)]
        return _concat(results)

    def _run_prefill_graph(self, requests: list[StepRequest]) -> list[dict]:
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

    def _run_prefill_group(self, requests: list[StepRequest]) -> dict:
        num_tokens = sum(r.num_tokens for r in requests)
        tokens = choose_bucket(self.buckets.tokens, num_tokens)
        rows = choose_bucket(self.buckets.prefill_requests, len(requests))
        inputs, attention, head = self._prefill_meta(requests, tokens, rows)
        self.counters["prefill_graph_runs"] += 1
        self.counters["real_tokens"] += num_tokens
        self.counters["padded_tokens"] += tokens - num_tokens
        out = self._encoders[tokens, rows].run(
            {**jax.device_put(inputs), **self._caches()}, {"attention": attention})
        self._store_caches(out)
        narrowed = self._narrowers[tokens, rows].run(
            {"hidden": out["hidden"]}, {"narrow": {"rows": head["rows"]}})
        sampled = self._decoders[rows].run(narrowed, {"sample": {"sampling": head["sampling"]}})
        return _fetch(sampled, sum(r.sample for r in requests))

    def _run_decode(self, requests: list[StepRequest]) -> dict:
        rows = choose_bucket(self.buckets.decode_requests, len(requests))
        self.counters["decode_graph_runs"] += 1
        self.counters["real_tokens"] += len(requests)
        self.counters["padded_tokens"] += rows - len(requests)
        out = self._decode_steps[rows].run(self._caches(),
                                           {"decode": self._decode_meta(requests, rows)})
        self._store_caches(out)
        return _fetch(out, len(requests))

    def _run_eager(self, requests: list[StepRequest]) -> dict:
        """The same plans, op by op, at the exact sizes: no buckets, no padding."""
        self.counters["eager_runs"] += 1
        num_tokens = sum(r.num_tokens for r in requests)
        self.counters["real_tokens"] += num_tokens
        inputs, attention, head = self._prefill_meta(requests, num_tokens, len(requests))
        num_sampled = sum(r.sample for r in requests)
        with self.guard.allowed("eager forward"):
            out = run_eager(self.encoder_plan, {**jax.device_put(inputs), **self._caches()},
                            {"attention": attention})
            self._store_caches(out)
            rows = {"rows": head["rows"][:num_sampled]}
            narrowed = run_eager(self.narrow_plan, {"hidden": out["hidden"]}, {"narrow": rows})
            sampling = self._sampling([r for r in requests if r.sample], num_sampled)
            sampled = run_eager(self.decoder_plan, narrowed, {"sample": {"sampling": sampling}})
            return _fetch(sampled, num_sampled)

    def _caches(self) -> dict[str, jax.Array]:
        k_names, v_names = self._cache_names()
        return {**dict(zip(k_names, self.k_pages)), **dict(zip(v_names, self.v_pages))}

    def _store_caches(self, values: dict[str, jax.Array]) -> None:
        k_names, v_names = self._cache_names()
        self.k_pages = [values[n] for n in k_names]
        self.v_pages = [values[n] for n in v_names]

    def stats(self) -> dict[str, float]:
        """Runtime compiles, route counts and padding waste since start-up."""
        total = self.counters["real_tokens"] + self.counters["padded_tokens"]
        return {
            **self.counters,
            "runtime_compiles": self.guard.runtime_compiles,
            "eager_compiles": self.guard.allowed_compiles,
            "padding_waste": self.counters["padded_tokens"] / total if total else 0.0,
        }


def _fetch(sampled: dict[str, jax.Array], count: int) -> dict[str, np.ndarray]:
    """Device results -> numpy, the first ``count`` rows (the rest are padding)."""
    keys = ("token_ids", "logprobs", "top_logprobs", "top_ids")
    return {k: np.asarray(sampled[k])[:count] for k in keys}


def _concat(results: list[dict[str, np.ndarray]]) -> StepOutput:
    joined = {k: np.concatenate([r[k] for r in results]) for k in results[0]}
    return StepOutput(
        token_ids=joined["token_ids"].astype(np.int32),
        logprobs=joined["logprobs"].astype(np.float32),
        top_token_ids=joined["top_ids"].astype(np.int32),
        top_logprobs=joined["top_logprobs"].astype(np.float32),
    )
