"""A decode step's MoE from its input rows: the routing and the experts' gate/up projections in
one Pallas call, then the down call of ``expert_rows``.

Contract: ``x [T, D]``, the router's ``gate f32[D, E]`` and ``bias f32[E]`` (``routing``'s
rule), ``w1, w3 [E, D, F]``, ``w2 [E, F, D]``, one shared expert ``shared`` (its w1, w3, w2
stacked ``[1, D, F]`` / ``[1, F, D]``) and an optional ``live bool[T]`` -> ``(out [T, k + 1, D]
in x's dtype, experts i32[T, k], weights f32[T, k])``: ``routing.route_pallas`` followed by
``expert_rows.expert_rows_mlp`` over the chosen experts and the shared one, the same arithmetic.

Why one call: the routing reads little (2.4 MB at Kimi-Linear's shape) but is two dependent
memory trips, about 7.7 us as its own call on an H200 where its reads take under 1 us. Here
the routing runs in the first programs of the gate/up call, beside the shared expert's gate/up
programs that need no routing, and the routed pairs' programs start their reads the moment
their token's experts are known.

The call's 1-D grid, in program order:

1. ``T x D / route_blocks.block_k`` routing programs, ``routing.route_share``'s (token, rows)
   shares; a token's last to arrive stores its choice, then raises the token's ready flag (a
   barrier of its threads, then an acquire-release atomic add at GPU scope);
2. the shared expert's gate/up programs (``expert_rows.project_item``), tokens fastest;
3. the routed pairs' programs, pairs fastest. A live routed pair's program first polls its
   token's flag (atomic reads) until it is up, then reads its expert id from L2 (volatile).

Invariants:

* No deadlock: a program waits only on programs of lower ids, and the GPU starts a 1-D grid's
  programs in id order, so every program waited on holds its SM slot before its waiter takes
  one (the forward-progress assumption of a single-pass scan's look-back).
* Interpreted (the CPU), programs run one at a time in id order: every flag is up before its
  first reader polls it.
* The counters (``arrivals.fresh_counters``: T arrivals, then T flags) start at zero each call.
* A row that is not ``live`` runs no routing share and raises no flag: its experts are
  ``NO_EXPERT`` (-1) with weight 0, and its routed pairs read no weight and give zeros (its
  shared pair still runs, as in ``expert_rows``).
* ``top_k`` must be a power of 2 (the chosen experts' row is the expert-rows operand as it is).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from tokenspeed_jax.kernels import pallas_backend
from tokenspeed_jax.kernels.arrivals import fresh_counters, shared_load
from tokenspeed_jax.kernels.expert_rows import (
    NO_EXPERT,
    ExpertRowsBlocks,
    Stack,
    check_operands,
    down_rows,
    expert_rows_problem,
    live_rows,
    project_item,
    projection_plan,
)
from tokenspeed_jax.kernels.kernel_math import dot_precision, is_power_of_2
from tokenspeed_jax.kernels.routing import Routing, RoutingBlocks, route_share, routing_operands

ROUTE_BLOCKS = RoutingBlocks()  # its block_k; the call runs on the expert rows' warps
EXPERT_ROWS_BLOCKS = ExpertRowsBlocks()


def routed_rows_problem(*, routing: Routing, num_shared: int) -> str | None:
    """Why the one call cannot run this routing and shared experts (beyond what the routing and
    expert-rows kernels check), or None when it can."""
    if not is_power_of_2(routing.top_k):
        return f"top_k={routing.top_k} must be a power of 2"
    if num_shared != 1:
        return f"the call runs one shared expert, not {num_shared}"
    return None


def _gate_up_item(item, *, tokens: int, top_k: int, columns: int, splits: int):
    """(pair, column, split) of gate/up program ``item``: the shared pairs' items first, tokens
    fastest, then the routed pairs' items, pairs fastest."""
    shared_items = tokens * columns * splits
    token, rest = item % tokens, item // tokens
    shared = (token * (top_k + 1) + top_k, rest % columns, rest // columns)
    routed_pairs = tokens * top_k
    routed_item = item - shared_items
    pair, rest = routed_item % routed_pairs, routed_item // routed_pairs
    routed = ((pair // top_k) * (top_k + 1) + pair % top_k, rest % columns, rest // columns)
    return tuple(jnp.where(item < shared_items, a, b) for a, b in zip(shared, routed))


def _kernel(x_ref, gate_ref, bias_ref, live_ref, *refs, route_splits: int, route_block_k: int,
            routing: Routing, columns: int, splits: int, compiled: bool, item_static: dict):
    weight_refs, refs = refs[:4], refs[4:]  # the routed and the shared expert's w1 and w3
    _, partials_ref, counters_ref, experts_ref, weights_ref, *sum_refs = refs
    tokens, top_k = x_ref.shape[0], routing.top_k
    program, routers = pl.program_id(0), tokens * route_splits

    @pl.when(program < routers)
    def _():
        token, split = program // route_splits, program % route_splits

        @pl.when(live_ref[token] != 0)
        def _():
            def raise_flag():
                if compiled:
                    plgpu.debug_barrier()
                plgpu.atomic_add(counters_ref, tokens + token, jnp.int32(1))

            route_share(x_ref, gate_ref, bias_ref, partials_ref, counters_ref, experts_ref,
                        weights_ref, token, split, route_splits, block_k=route_block_k,
                        routing=routing, compiled=compiled, chosen=raise_flag)

        @pl.when((live_ref[token] == 0) & (split == 0))
        def _():  # a row that is not live routes to no expert, with weight 0
            experts_ref[token] = jnp.full(experts_ref.shape[1:], NO_EXPERT, jnp.int32)
            weights_ref[token] = jnp.zeros(weights_ref.shape[1:], jnp.float32)

    def expert_at(row, slot, wanted):
        def flag(_):
            return plgpu.atomic_add(counters_ref, tokens + row, jnp.int32(0))

        up = jnp.where(wanted, jnp.int32(0), jnp.int32(1))
        # interpreted, where the routing programs run first, the flag is read once
        up = lax.while_loop(lambda up: up == 0, flag, up) if compiled else up | flag(None)
        ids = shared_load(compiled=compiled)(experts_ref.at[row])
        expert = jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, ids.shape, 0) == slot, ids, 0))
        return jnp.where(up != 0, expert, NO_EXPERT)  # a flag still down: no weight read

    @pl.when(program >= routers)
    def _():
        pair, column, split = _gate_up_item(program - routers, tokens=tokens, top_k=top_k,
                                            columns=columns, splits=splits)
        project_item(pair, column, split, experts_ref, live_ref, x_ref, *weight_refs, *sum_refs,
                     expert_at=expert_at, **item_static)


@functools.partial(jax.jit, static_argnames=("routing", "blocks", "route_blocks", "interpret"))
def routed_expert_rows_mlp(
    x: jax.Array,  # [T, D]
    gate: jax.Array,  # f32[D, E]
    bias: jax.Array,  # f32[E]
    w1: jax.Array,  # [E, D, F]
    w3: jax.Array,  # [E, D, F]
    w2: jax.Array,  # [E, F, D]
    shared: Stack,  # (w1, w3, w2) of the one shared expert
    live: jax.Array | None = None,  # bool[T]
    *,
    routing: Routing,
    blocks: ExpertRowsBlocks = EXPERT_ROWS_BLOCKS,
    route_blocks: RoutingBlocks = ROUTE_BLOCKS,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(out [T, k + 1, D], experts i32[T, k], weights f32[T, k]) (module docstring)."""
    interpret = pallas_backend.resolve_interpret(interpret)
    route_ops, route_shapes = routing_operands(x, gate, bias, routing=routing,
                                               blocks=route_blocks)
    tokens, hidden = x.shape
    stacks = check_operands(x, jax.ShapeDtypeStruct((tokens, routing.top_k), jnp.int32), w1,
                            w3, w2, shared, live)
    problem = (routed_rows_problem(routing=routing, num_shared=shared[0].shape[0])
               or expert_rows_problem(hidden=hidden, intermediate=w1.shape[2], dtype=x.dtype,
                                      blocks=blocks))
    if problem is not None:
        raise ValueError(problem)
    live = live_rows(live, tokens)
    num_pairs = tokens * (routing.top_k + 1)
    columns, splits, steps = projection_plan(num_pairs, w1, blocks)
    route_splits = hidden // route_blocks.block_k
    item_static = {"per_stack": 2, "block_k": blocks.block_k, "block_n": blocks.block_n,
                   "steps": steps, "dot_rows": blocks.dot_rows, "swiglu_of": None,
                   "precision": dot_precision(x.dtype)}
    inputs = (*route_ops, live, w1, w3, *shared[:2], fresh_counters(2 * tokens))
    partials, _, experts, weights = route_shapes
    sums = jax.ShapeDtypeStruct((splits, num_pairs, w1.shape[2]), jnp.float32)
    whole = pl.BlockSpec()
    _, _, experts, weights, *gate_up = pl.pallas_call(
        functools.partial(_kernel, route_splits=route_splits,
                          route_block_k=route_blocks.block_k, routing=routing, columns=columns,
                          splits=splits, compiled=not interpret, item_static=item_static),
        grid=(tokens * route_splits + num_pairs * columns * splits,),
        in_specs=[whole] * len(inputs),
        out_specs=[whole] * 6,
        out_shape=[partials, jax.ShapeDtypeStruct((2 * tokens,), jnp.int32), experts, weights,
                   sums, sums],
        input_output_aliases={len(inputs) - 1: 1},
        compiler_params=pallas_backend.compiler_params(num_warps=blocks.num_warps,
                                                       num_stages=blocks.num_stages),
        interpret=interpret,
        name="routed_expert_rows_gate_up",
    )(*inputs)
    out = down_rows(gate_up, experts, live, stacks, x.dtype, blocks=blocks, interpret=interpret)
    return out, experts, weights
