"""Kimi-Linear feed-forward blocks: the SwiGLU MLP and the sigmoid-routed mixture of experts.

Routing (``KimiMoE.route``): sigmoid scores of a float32 router, grouped top-k, weights from the
plain scores; ``kernels/routing.py`` states the rule and holds it, a Pallas kernel for
decode-sized token counts on GPUs (``routing_kernel``, by default
``routing.choose_routing_kernel``), plain JAX otherwise.

The routed experts take one of two paths, chosen statically by the call's (token, expert) pair
count, tokens x top-k (a static shape under jit, as a decode step's batch bucket is):

* up to ``expert_rows_kernel.max_pairs`` pairs (decode sizes), ``routed_through_rows``: the pairs
  in their (token, k) order, each row through its own expert's weights
  (``kernels/expert_rows.py``), then each token's weighted sum over its k; no sort, no scatter;
* more, ``routed_through_groups``: grouped matmuls (``expert_mlp``) over the pairs sorted by
  expert, scattered back by token.

Both compute the same function with the same roundings (up to summation order); shapes stay
static. Shared experts run on every token and add; on the rows path without a mesh, a single
shared expert of the routed experts' size (Kimi-Linear's, DeepSeek-V3's) is one more pair of each
token in the same kernel call (``experts_through_rows``), so a decode step reads its weights in
the same launch as the routed ones; otherwise it is its own ``SwiGLU``. When the routing kernel
is Pallas too (a GPU's decode step) and takes the token count, the routing runs inside that
call's gate/up launch (``kernels/routed_expert_rows.py``, ``KimiMoE._routes_in_rows``): one launch
fewer per layer, on the expert-rows kernel's knobs and the routing's ``block_k``, with the same
experts as the routing kernel and its weights up to summation order. Rows that are not ``live``
(a compiled step's padding past its real tokens) route to no expert: their routed part is zero and
their pairs read no expert weights (a batch-1 decode step in a 2-row bucket would otherwise read
16 experts, not 8); the rows kernel reads ``live`` itself, the other paths mask the routed ids
with ``NO_EXPERT``. ``grouped_kernel`` picks the grouped matmul; by default
``grouped_matmul.choose_grouped_kernel`` does: the Pallas kernel (tokens x top-k of work) on GPUs,
``lax.ragged_dot`` elsewhere (XLA on the GPU lowers it densely, tokens x experts of work).
``expert_rows_kernel`` picks the other path's implementation and its threshold; by default
``expert_rows.choose_expert_rows_kernel`` does (the Pallas kernel on GPUs; off elsewhere, so the
CPU runs the sorted path).

Expert parallelism (``mesh`` given, ``parallel`` splits ``w1``/``w3``/``w2`` over the experts):
the router runs replicated, so every device picks the same experts; under ``jax.shard_map`` each
device runs only the pairs routed to its own contiguous range of experts (on the sorted path the
others sort last and are masked out; on the rows path their expert ids fall outside the local
range and give zeros without a weight read) and one ``psum`` adds the devices' partial sums.
Without a mesh the same code runs with all experts local. Weight layouts: ``gate [D, E]``
(float32), ``w1, w3 [E, D, F]``, ``w2 [E, F, D]``, MLP ``gate_proj, up_proj [D, F]``,
``down_proj [F, D]``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from tokenspeed_jax import parallel
from tokenspeed_jax.kernels.expert_rows import (
    NO_EXPERT,
    ExpertRowsKernel,
    Stack,
    apply_expert_rows,
    choose_expert_rows_kernel,
)
from tokenspeed_jax.kernels.grouped_matmul import (
    REFERENCE_GROUPED_MATMUL,
    GroupedMatmulKernel,
    apply_grouped_matmul,
    choose_grouped_kernel,
)
from tokenspeed_jax.kernels.paged_attention_backend import PALLAS
from tokenspeed_jax.kernels.routed_expert_rows import routed_expert_rows_mlp, routed_rows_problem
from tokenspeed_jax.kernels.routing import (
    Routing,
    RoutingKernel,
    apply_routing,
    check_routing,
    choose_routing_kernel,
)
from tokenspeed_jax.models.layers import linear, normal_param


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)): the dense MLP and the shared experts."""

    def __init__(self, hidden: int, intermediate: int, *, dtype: Any, param_dtype: Any,
                 rngs: nnx.Rngs) -> None:
        self.gate_proj = normal_param(rngs, (hidden, intermediate), param_dtype)
        self.up_proj = normal_param(rngs, (hidden, intermediate), param_dtype)
        self.down_proj = normal_param(rngs, (intermediate, hidden), param_dtype)
        self.dtype = dtype

    def __call__(self, x: jax.Array, *, mesh: Mesh | None = None,
                 live: jax.Array | None = None) -> jax.Array:
        del mesh  # column/row parallel weights: XLA partitions the matmuls
        del live  # every row reads the same weights: padding rows cost no extra reads
        gate = linear("...D,DF->...F", x, self.gate_proj, self.dtype)
        up = linear("...D,DF->...F", x, self.up_proj, self.dtype)
        return linear("...F,FD->...D", nnx.silu(gate) * up, self.down_proj, self.dtype)


def expert_mlp(rows: jax.Array, sizes: jax.Array, w1: jax.Array, w3: jax.Array, w2: jax.Array,
               *, dtype: Any, kernel: GroupedMatmulKernel = REFERENCE_GROUPED_MATMUL) -> jax.Array:
    """w2(silu(w1(row)) * w3(row)) of each row through its expert's weights, [M, D] in ``dtype``:
    ``rows [M, D]`` sorted by expert, ``sizes i32[E]`` rows per expert; rows past ``sum(sizes)``
    give zeros."""
    def grouped(lhs: jax.Array, weight: jax.Array) -> jax.Array:
        return apply_grouped_matmul(lhs, weight.astype(dtype), sizes, kernel=kernel)

    rows = rows.astype(dtype)
    return grouped(nnx.silu(grouped(rows, w1)) * grouped(rows, w3), w2)


def routed_through_groups(x: jax.Array, experts: jax.Array, weights: jax.Array, w1: jax.Array,
                          w3: jax.Array, w2: jax.Array, first: jax.Array | int, *, dtype: Any,
                          kernel: GroupedMatmulKernel = REFERENCE_GROUPED_MATMUL) -> jax.Array:
    """float32 [T, D]: the weighted outputs of the (token, expert) pairs (``experts`` int32 and
    ``weights`` float32 [T, k]) whose expert is one of the ``w1.shape[0]`` local experts
    ``first, first + 1, ...``, through grouped matmuls over the pairs sorted by expert."""
    local = w1.shape[0]
    flat = experts.reshape(-1) - first
    mine = (flat >= 0) & (flat < local)
    key = jnp.where(mine, flat, local)  # pairs of other experts sort last, in no group
    order = jnp.argsort(key, stable=True)
    token = order // experts.shape[1]
    sizes = jnp.bincount(key, length=local + 1)[:local].astype(jnp.int32)
    out = expert_mlp(jnp.take(x, token, axis=0), sizes, w1, w3, w2, dtype=dtype,
                     kernel=kernel).astype(jnp.float32)
    keep = jnp.take(mine, order)[:, None]  # rows past the local groups hold no result
    out = jnp.where(keep, out * jnp.take(weights.reshape(-1), order)[:, None], 0.0)
    return jnp.zeros(x.shape, jnp.float32).at[token].add(out)


def _cast(stack: Stack, dtype: Any) -> Stack:
    return tuple(w.astype(dtype) for w in stack)


def _weighted_sum(weights: jax.Array, out: jax.Array) -> jax.Array:
    """float32 [T, D]: each token's pair outputs ``out [T, k, D]`` times ``weights [T, k]``."""
    return jnp.sum(weights[..., None] * out.astype(jnp.float32), axis=1)


def routed_through_rows(x: jax.Array, experts: jax.Array, weights: jax.Array, w1: jax.Array,
                        w3: jax.Array, w2: jax.Array, first: jax.Array | int, *, dtype: Any,
                        kernel: ExpertRowsKernel) -> jax.Array:
    """``routed_through_groups``'s result with the pairs in their (token, k) order, each through
    its own expert (``kernels/expert_rows.py``), then each token's weighted sum over its k."""
    out = apply_expert_rows(x.astype(dtype), experts - first, *_cast((w1, w3, w2), dtype),
                            kernel=kernel)
    return _weighted_sum(weights, out)


def experts_through_rows(x: jax.Array, experts: jax.Array, weights: jax.Array, w1: jax.Array,
                         w3: jax.Array, w2: jax.Array, shared: Stack, *, dtype: Any,
                         kernel: ExpertRowsKernel, live: jax.Array | None = None) -> jax.Array:
    """[T, D] in ``dtype``: the routed experts' weighted sum (``routed_through_rows``) plus the
    one shared expert ``shared`` (its (w1, w3, w2) stacked [1, D, F] / [1, F, D]) in the same
    expert-rows call, the shared expert one more pair of each token; rows not ``live`` get the
    shared expert alone. The combination rounds as ``KimiMoE``'s does with the shared experts
    apart."""
    out = apply_expert_rows(x.astype(dtype), experts, *_cast((w1, w3, w2), dtype),
                            _cast(shared, dtype), live, kernel=kernel)
    return _combined(weights, out, dtype)


def _combined(weights: jax.Array, out: jax.Array, dtype: Any) -> jax.Array:
    """[T, D] in ``dtype``: the routed pairs' outputs ``out[:, :-1]`` weighted and summed, plus
    the shared expert's ``out[:, -1]``."""
    return _weighted_sum(weights, out[:, :-1]).astype(dtype) + out[:, -1]




class KimiMoE(nnx.Module):
    """Routed experts plus shared experts; see the module docstring for the routing rule."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        *,
        num_experts: int,
        top_k: int,
        num_groups: int,
        topk_groups: int,
        num_shared: int,
        renormalize: bool,
        scaling: float,
        dtype: Any,
        param_dtype: Any,
        rngs: nnx.Rngs,
        grouped_kernel: GroupedMatmulKernel | None = None,
        expert_rows_kernel: ExpertRowsKernel | None = None,
        routing_kernel: RoutingKernel | None = None,
    ) -> None:
        self.routing = Routing(top_k, num_groups, topk_groups, renormalize, scaling)
        check_routing(num_experts, self.routing)
        self.gate = normal_param(rngs, (hidden, num_experts), jnp.float32)
        self.e_score_correction_bias = nnx.Param(jnp.zeros((num_experts,), jnp.float32))
        self.w1 = normal_param(rngs, (num_experts, hidden, intermediate), param_dtype)
        self.w3 = normal_param(rngs, (num_experts, hidden, intermediate), param_dtype)
        self.w2 = normal_param(rngs, (num_experts, intermediate, hidden), param_dtype)
        self.shared_experts = SwiGLU(hidden, intermediate * num_shared, dtype=dtype,
                                     param_dtype=param_dtype, rngs=rngs)
        self.num_experts = num_experts
        self.dtype = dtype
        self.grouped_kernel = grouped_kernel or choose_grouped_kernel(
            sizes=(hidden, intermediate), dtype=dtype)
        self.expert_rows_kernel = expert_rows_kernel or choose_expert_rows_kernel(
            hidden=hidden, intermediate=intermediate, dtype=dtype)
        self.routing_kernel = routing_kernel or choose_routing_kernel(
            hidden=hidden, num_experts=num_experts, routing=self.routing)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, D] -> (expert ids int32 [T, k], float32 weights [T, k])."""
        return apply_routing(x, self.gate[...], self.e_score_correction_bias[...],
                             routing=self.routing, kernel=self.routing_kernel)

    def _shared_rides_rows(self, num_pairs: int) -> bool:
        """Whether the shared expert runs as one more pair of each token in the expert-rows
        call of ``num_pairs`` routed pairs: when that path takes them and there is one shared
        expert of the routed experts' size."""
        return (self.expert_rows_kernel.takes(num_pairs)
                and self.shared_experts.down_proj.shape[0] == self.w2.shape[1])

    def _routes_in_rows(self, num_tokens: int) -> bool:
        """Whether the routing runs inside the expert-rows gate/up call
        (``kernels/routed_expert_rows.py``): both take the Pallas kernels at this token count,
        the shared expert rides the rows, and the routing is one that call runs."""
        return (self.routing_kernel.backend == PALLAS and self.expert_rows_kernel.backend == PALLAS
                and num_tokens <= self.routing_kernel.max_tokens
                and self._shared_rides_rows(num_tokens * self.routing.top_k)
                and routed_rows_problem(routing=self.routing, num_shared=1) is None)

    def _shared_stack(self) -> Stack:
        """The one shared expert's (w1, w3, w2) stacked [1, D, F] / [1, F, D]."""
        mlp = self.shared_experts
        return tuple(w[...][None] for w in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))

    def _routed(self, x: jax.Array, experts: jax.Array, weights: jax.Array, w1: jax.Array,
                w3: jax.Array, w2: jax.Array, first: jax.Array | int) -> jax.Array:
        """float32 [T, D]: the weighted outputs of the pairs of the local experts ``first, ...``,
        on the path the pair count picks (module docstring)."""
        if self.expert_rows_kernel.takes(experts.size):
            return routed_through_rows(x, experts, weights, w1, w3, w2, first, dtype=self.dtype,
                                       kernel=self.expert_rows_kernel)
        return routed_through_groups(x, experts, weights, w1, w3, w2, first, dtype=self.dtype,
                                     kernel=self.grouped_kernel)

    def __call__(self, x: jax.Array, *, mesh: Mesh | None = None,
                 live: jax.Array | None = None) -> jax.Array:
        """x [..., D] -> [..., D]; ``mesh``: experts split over it; ``live`` bool [...]: the
        rows that are real tokens, the others routed to no expert (module docstring)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1]).astype(self.dtype)
        w1, w3, w2 = self.w1[...], self.w3[...], self.w2[...]
        rows_live = None if live is None else live.reshape(-1)
        if mesh is None and self._routes_in_rows(x.shape[0]):
            out, _, weights = routed_expert_rows_mlp(
                x, self.gate[...], self.e_score_correction_bias[...],
                *_cast((w1, w3, w2), self.dtype), _cast(self._shared_stack(), self.dtype),
                rows_live, routing=self.routing, blocks=self.expert_rows_kernel.blocks,
                route_blocks=self.routing_kernel.blocks,
                interpret=self.expert_rows_kernel.interpret)
            return _combined(weights, out, self.dtype).reshape(shape)
        experts, weights = self.route(x)
        if mesh is None and self._shared_rides_rows(experts.size):
            return experts_through_rows(
                x, experts, weights, w1, w3, w2, self._shared_stack(), dtype=self.dtype,
                kernel=self.expert_rows_kernel, live=rows_live).reshape(shape)
        if live is not None:
            experts = jnp.where(live.reshape(-1, 1), experts, NO_EXPERT)
        if mesh is None:
            routed = self._routed(x, experts, weights, w1, w3, w2, 0)
        else:
            def per_device(x, experts, weights, w1, w3, w2):
                first = jax.lax.axis_index(parallel.AXIS) * w1.shape[0]
                partial = self._routed(x, experts, weights, w1, w3, w2, first)
                return jax.lax.psum(partial, parallel.AXIS)

            split, whole = parallel.head_spec(3, axis=0), PartitionSpec()
            routed = jax.shard_map(
                per_device, mesh=mesh, in_specs=(whole, whole, whole, split, split, split),
                out_specs=whole, check_vma=False)(x, experts, weights, w1, w3, w2)
        return (routed.astype(self.dtype) + self.shared_experts(x)).reshape(shape)
