"""Sigmoid routing of a few tokens to their experts: router logits, grouped top-k, weights.

Contract: ``x [T, D]`` (any float dtype, taken as float32), ``gate f32[D, E]``, ``bias f32[E]``
-> ``(experts i32[T, k], weights f32[T, k])``, the rule of ``moe.KimiMoE``:

* logits = x @ gate in float32 (exact float32 products), scores = sigmoid(logits); the choice is
  scores + bias (the bias only picks, it never weights);
* with ``num_groups`` > 1 the experts split into that many equal groups, a group's rank is the
  sum of its two best choices and only the ``topk_groups`` best groups stay eligible;
* the ``top_k`` best eligible choices, best first, a tie to the lower expert id (``lax.top_k``'s
  order); their weights are their plain scores, divided by their sum plus ``ROUTER_EPS`` when
  ``renormalize``, then times ``scaling``.

Two implementations of one function, chosen statically by a ``RoutingKernel``:

* ``route_pallas``, one Pallas call (Triton lowering, ``pallas_backend``), a program per (token,
  ``block_k`` rows of the contraction) with every expert: a single load of its gate block,
  multiplied and summed in float32, stored as its partial logits (``[D / block_k, T, E]``, or
  ``[.., G, E / G]`` with groups). It then counts itself in on the token's arrival counter (a
  thread barrier first, so every thread's store precedes it; an acquire-release atomic add at
  GPU scope; the counters start at zero each call); the token's last program to arrive, which
  therefore sees every partial sum (read with volatile loads, from L2), does the choice: the
  partial sums added (in power-of-2 parts), the experts in registers (one row, or the groups as
  rows of a ``[G, E / G]`` block), k rounds of "take the best, mask it" (over one row a single
  arg-reduction a round, the weights gathered once after the rounds). Where XLA runs a split-K
  product, its reduction, a sort per top-k and gathers (about five kernels of a decode layer),
  this is one. (A program looping over the contraction for a few experts took 11 us a call on
  an H200 at Kimi-Linear's shape: one dependent load per step. The logits and the choice as two
  calls took 11-17 us more of the whole Kimi-Linear batch-1 step on the H200 in two
  measurements, and the same time at batch 8.)
* ``route_reference``, plain JAX (``lax.top_k``): every other token count and platform.

The two sum the logits in different orders, so a near-tie of two experts' choices (within a
float32 rounding) may pick differently; everything else is the same arithmetic.
``choose_routing_kernel`` picks the Pallas kernel on GPUs for shapes it takes (up to
``max_tokens`` tokens a call: decode sizes; a prefill's thousands of tokens would re-read the
gate per token) and the reference elsewhere. The kernel raises on what it cannot run; nothing
falls back at run time.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tokenspeed_jax.kernels import pallas_backend
from tokenspeed_jax.kernels.arrivals import count_in, fresh_counters, shared_load
from tokenspeed_jax.kernels.kernel_math import is_power_of_2, power_of_2_parts
from tokenspeed_jax.kernels.paged_attention_backend import (
    PALLAS,
    REFERENCE,
    check_pallas_or_reference,
    on_gpu,
)

ROUTER_EPS = 1e-20  # added to the renormalisation denominator, as in the reference router
MAX_TOKENS = 8  # tokens per call on the Pallas path: a decode step of up to 8 tokens


@dataclasses.dataclass(frozen=True)
class Routing:
    """The routing rule's static parameters (module docstring)."""

    top_k: int
    num_groups: int = 1
    topk_groups: int = 1
    renormalize: bool = True
    scaling: float = 1.0


@dataclasses.dataclass(frozen=True)
class RoutingBlocks:
    """Tuning knobs of the call."""

    block_k: int = 64  # contraction rows per program
    num_warps: int = 8

    def __post_init__(self) -> None:
        if not is_power_of_2(self.block_k):
            raise ValueError(f"block_k={self.block_k} must be a power of 2")


@dataclasses.dataclass(frozen=True)
class RoutingKernel:
    """Whether a call of some tokens takes the Pallas kernel (at most ``max_tokens``; 0: never)
    and its knobs; ``interpret`` None interprets on the CPU."""

    backend: str = REFERENCE
    max_tokens: int = MAX_TOKENS
    blocks: RoutingBlocks = RoutingBlocks()
    interpret: bool | None = None

    def __post_init__(self) -> None:
        check_pallas_or_reference(self.backend)
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 0")


REFERENCE_ROUTING = RoutingKernel()


def routing_problem(*, hidden: int, num_experts: int, routing: Routing,
                    blocks: RoutingBlocks = RoutingBlocks()) -> str | None:
    """Why the Pallas kernel cannot route this shape, or None when it can: every expert and
    every group of them in one block (powers of 2), the contraction in whole blocks."""
    group = num_experts // routing.num_groups
    if not (is_power_of_2(routing.num_groups) and is_power_of_2(group)):
        return (f"num_expert_group={routing.num_groups} and the group size {group} must be "
                f"powers of 2")
    if hidden % blocks.block_k:
        return f"hidden={hidden} must be a multiple of block_k={blocks.block_k}"
    return None


def choose_routing_kernel(*, hidden: int, num_experts: int, routing: Routing,
                          platform: str | None = None) -> RoutingKernel:
    """The Pallas kernel on a GPU for a shape it takes; the reference elsewhere."""
    if not on_gpu(platform) or routing_problem(hidden=hidden, num_experts=num_experts,
                                               routing=routing) is not None:
        return REFERENCE_ROUTING
    return RoutingKernel(PALLAS)


def check_routing(num_experts: int, routing: Routing) -> None:
    """Raise when ``routing`` cannot pick its experts among ``num_experts``."""
    if num_experts % routing.num_groups:
        raise ValueError(f"num_experts={num_experts} must be a multiple of "
                         f"num_expert_group={routing.num_groups}")
    if not 1 <= routing.topk_groups <= routing.num_groups:
        raise ValueError(f"topk_group={routing.topk_groups} must be in "
                         f"[1, {routing.num_groups}]")
    if routing.top_k > (num_experts // routing.num_groups) * routing.topk_groups:
        raise ValueError(f"num_experts_per_token={routing.top_k} exceeds the experts of "
                         f"{routing.topk_groups} group(s) of {num_experts // routing.num_groups}")


def _check_operands(x: jax.Array, gate: jax.Array, bias: jax.Array, routing: Routing) -> None:
    if x.ndim != 2 or gate.shape[:1] != x.shape[1:] or bias.shape != gate.shape[1:]:
        raise ValueError(f"x {x.shape}, gate {gate.shape} and bias {bias.shape} must be "
                         f"[T, D], [D, E] and [E]")
    check_routing(gate.shape[1], routing)


# ----------------------------------------------------------------------------- Pallas kernel


def _best(values, ids, size: int):
    """The largest of ``values`` and the lowest of ``ids`` where it is (``size`` where none)."""
    top = jnp.max(values)
    return top, jnp.min(jnp.where(values == top, ids, size))


def _best_id(values, ids):
    """The id of the largest of ``values``, the lowest on a tie: one arg-reduction over a row
    (whose ids are its positions), two reductions over a block of groups."""
    if values.ndim == 1:
        return jnp.argmax(values).astype(jnp.int32)
    return _best(values, ids, values.size)[1]


def _summed_partials(partials_ref, token, load):
    """The token's logits: its partial sums added, loaded by ``load`` in power-of-2 parts;
    ``[E]`` with one group, ``[G, E / G]`` with several."""
    return sum(jnp.sum(load(partials_ref.at[part, token]), axis=0)
               for part in power_of_2_parts(partials_ref.shape[0]))


def _choose(logits, bias, slots: int, routing: Routing):
    """(experts i32[slots], weights f32[slots]) of one token from its logits (slots past k
    hold expert -1 and weight 0)."""
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias
    ids = lax.broadcasted_iota(jnp.int32, choice.shape, 0)
    if choice.ndim == 2:
        groups, group = choice.shape
        ids = ids * group + lax.broadcasted_iota(jnp.int32, choice.shape, 1)
        column = lax.broadcasted_iota(jnp.int32, choice.shape, 1)
        first = jnp.max(choice, axis=1)
        at = jnp.min(jnp.where(choice == first[:, None], column, group), axis=1)
        second = jnp.max(jnp.where(column == at[:, None], -jnp.inf, choice), axis=1)
        rank, group_ids = first + second, lax.broadcasted_iota(jnp.int32, (groups,), 0)
        keep = jnp.zeros((groups,), jnp.bool_)
        for _ in range(routing.topk_groups):
            _, best = _best(rank, group_ids, groups)
            keep = keep | (group_ids == best)
            rank = jnp.where(group_ids == best, -jnp.inf, rank)
        choice = jnp.where(keep[:, None], choice, -jnp.inf)
    slot_ids = lax.broadcasted_iota(jnp.int32, (slots,), 0)
    experts = jnp.full((slots,), -1, jnp.int32)
    weights = jnp.zeros((slots,), jnp.float32)
    for slot in range(routing.top_k):
        best = _best_id(choice, ids)
        experts = jnp.where(slot_ids == slot, best, experts)
        if choice.ndim == 2:
            weights = jnp.where(slot_ids == slot, jnp.sum(jnp.where(ids == best, scores, 0.0)),
                                weights)
        choice = jnp.where(ids == best, -jnp.inf, choice)
    if choice.ndim == 1:  # every slot's score at once
        weights = jnp.sum(jnp.where(ids[None, :] == experts[:, None], scores[None, :], 0.0),
                          axis=1)
    if routing.renormalize:
        weights = weights / (jnp.sum(weights) + ROUTER_EPS)
    return experts, weights * routing.scaling


def route_share(x_ref, gate_ref, bias_ref, partials_ref, arrivals_ref, experts_ref, weights_ref,
                token, split, splits: int, *, block_k: int, routing: Routing, compiled: bool,
                chosen: Callable[[], None] = lambda: None) -> None:
    """One program's share of the routing (module docstring): ``block_k`` rows of token
    ``token``'s logits, and the choice when it is the token's last of ``splits`` programs to
    arrive; ``chosen`` runs after the choice is stored, in that program only."""
    depth = pl.ds(split * block_k, block_k)
    row = x_ref[token, depth].astype(jnp.float32)
    gate = gate_ref[depth]  # [block_k, E] or [block_k, G, E / G]
    partials_ref[split, token] = jnp.sum(row[(slice(None),) + (None,) * (gate.ndim - 1)] * gate,
                                         axis=0)
    arrived = count_in(arrivals_ref, token, compiled=compiled)

    @pl.when(arrived == splits - 1)  # the token's last program: every partial sum is written
    def _():
        logits = _summed_partials(partials_ref, token, shared_load(compiled=compiled))
        experts_ref[token], weights_ref[token] = _choose(logits, bias_ref[...],
                                                         experts_ref.shape[1], routing)
        chosen()


def _route_kernel(x_ref, gate_ref, bias_ref, _arrivals_in, partials_ref, arrivals_ref,
                  experts_ref, weights_ref, *, block_k: int, routing: Routing, compiled: bool):
    route_share(x_ref, gate_ref, bias_ref, partials_ref, arrivals_ref, experts_ref, weights_ref,
                pl.program_id(0), pl.program_id(1), pl.num_programs(1), block_k=block_k,
                routing=routing, compiled=compiled)


def routing_operands(x: jax.Array, gate: jax.Array, bias: jax.Array, *, routing: Routing,
                     blocks: RoutingBlocks) -> tuple[tuple[jax.Array, ...], list]:
    """The checked operands of a call running ``route_share`` (x, the gate and bias in the
    kernel's layout) and the shapes of its outputs (partial logits, arrival counters, then the
    expert ids and weights ``[T, slots]``, slots the power of 2 at or above ``top_k``)."""
    _check_operands(x, gate, bias, routing)
    (num_tokens, hidden), num_experts = x.shape, gate.shape[1]
    problem = routing_problem(hidden=hidden, num_experts=num_experts, routing=routing,
                              blocks=blocks)
    if problem is not None:
        raise ValueError(problem)
    splits = hidden // blocks.block_k
    slots = 1 << (routing.top_k - 1).bit_length()  # a Triton block is a power of 2
    grouped = ((num_experts,) if routing.num_groups == 1
               else (routing.num_groups, num_experts // routing.num_groups))
    operands = (x, gate.astype(jnp.float32).reshape(hidden, *grouped),
                bias.astype(jnp.float32).reshape(grouped))
    return operands, [jax.ShapeDtypeStruct((splits, num_tokens, *grouped), jnp.float32),
                      jax.ShapeDtypeStruct((num_tokens,), jnp.int32),
                      jax.ShapeDtypeStruct((num_tokens, slots), jnp.int32),
                      jax.ShapeDtypeStruct((num_tokens, slots), jnp.float32)]


@functools.partial(jax.jit, static_argnames=("routing", "blocks", "interpret"))
def route_pallas(x: jax.Array, gate: jax.Array, bias: jax.Array, *, routing: Routing,
                 blocks: RoutingBlocks = RoutingBlocks(),
                 interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """The routing through one Pallas call (module docstring)."""
    interpret = pallas_backend.resolve_interpret(interpret)
    operands, out_shape = routing_operands(x, gate, bias, routing=routing, blocks=blocks)
    whole = pl.BlockSpec()
    _, _, experts, weights = pl.pallas_call(
        functools.partial(_route_kernel, block_k=blocks.block_k, routing=routing,
                          compiled=not interpret),
        grid=(x.shape[0], x.shape[1] // blocks.block_k),
        in_specs=[whole] * 4,
        out_specs=[whole] * 4,
        out_shape=out_shape,
        input_output_aliases={3: 1},
        compiler_params=pallas_backend.compiler_params(num_warps=blocks.num_warps,
                                                       num_stages=1),
        interpret=interpret,
        name="router",
    )(*operands, fresh_counters(x.shape[0]))
    return experts[:, :routing.top_k], weights[:, :routing.top_k]


# ----------------------------------------------------------------------------- reference


def route_reference(x: jax.Array, gate: jax.Array, bias: jax.Array, *,
                    routing: Routing) -> tuple[jax.Array, jax.Array]:
    """The same function in plain JAX (``lax.top_k``)."""
    _check_operands(x, gate, bias, routing)
    logits = jnp.einsum("TD,DE->TE", x.astype(jnp.float32), gate,
                        precision=lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias
    if routing.num_groups > 1:
        per_group = choice.reshape(choice.shape[0], routing.num_groups, -1)
        group_rank = jnp.sum(lax.top_k(per_group, 2)[0], axis=-1)
        _, best_groups = lax.top_k(group_rank, routing.topk_groups)
        keep = jnp.zeros(group_rank.shape, bool).at[
            jnp.arange(group_rank.shape[0])[:, None], best_groups].set(True)
        keep = jnp.repeat(keep, per_group.shape[-1], axis=-1)
        choice = jnp.where(keep, choice, -jnp.inf)
    _, experts = lax.top_k(choice, routing.top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if routing.renormalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + ROUTER_EPS)
    return experts.astype(jnp.int32), weights * routing.scaling


def apply_routing(x: jax.Array, gate: jax.Array, bias: jax.Array, *, routing: Routing,
                  kernel: RoutingKernel) -> tuple[jax.Array, jax.Array]:
    """The routing through ``kernel``'s backend when it takes ``x``'s token count, else the
    reference."""
    if kernel.backend == PALLAS and x.shape[0] <= kernel.max_tokens:
        return route_pallas(x, gate, bias, routing=routing, blocks=kernel.blocks,
                            interpret=kernel.interpret)
    return route_reference(x, gate, bias, routing=routing)
