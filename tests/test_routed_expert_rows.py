"""The routing inside the expert-rows gate/up call (``kernels/routed_expert_rows.py``),
interpreted on the CPU: its experts and weights against the routing reference, its outputs against
the expert-rows kernel over those experts and the expert-rows reference, rows that are not live,
the problems it refuses, and the MoE taking it when both kernels are Pallas.

(The compiled kernel, where programs wait on other programs' flags, is checked on a GPU by
``test_moe_kernels_gpu.py``.)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tokenspeed_jax.kernels.expert_rows import (
    NO_EXPERT_ROWS,
    ExpertRowsBlocks,
    ExpertRowsKernel,
    expert_rows_mlp,
    expert_rows_mlp_reference,
)
from tokenspeed_jax.kernels.paged_attention_backend import PALLAS
from tokenspeed_jax.kernels.routed_expert_rows import (
    NO_EXPERT,
    routed_expert_rows_mlp,
    routed_rows_problem,
)
from tokenspeed_jax.kernels.routing import (
    REFERENCE_ROUTING,
    Routing,
    RoutingBlocks,
    RoutingKernel,
    route_reference,
)
from tokenspeed_jax.models.moe import KimiMoE

D, F, E = 64, 32, 16
BLOCKS = ExpertRowsBlocks(16, 16)  # gate/up in 4 steps of K, down in 2
ROUTE_BLOCKS = RoutingBlocks(block_k=16)  # 4 routing programs per token
RULES = {
    "flat": Routing(top_k=4, renormalize=True, scaling=2.5),
    "groups": Routing(top_k=2, num_groups=4, topk_groups=2, renormalize=False, scaling=1.5),
}


def operands(num_tokens: int, seed: int = 0):
    """x, the router's gate and bias, the routed stacks and one shared expert, float32."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    x = normal(num_tokens, D)
    gate, bias = normal(D, E, scale=0.2), normal(E, scale=0.1)
    w1, w3, w2 = normal(E, D, F, scale=D ** -0.5), normal(E, D, F, scale=D ** -0.5), \
        normal(E, F, D, scale=F ** -0.5)
    shared = (normal(1, D, F, scale=D ** -0.5), normal(1, D, F, scale=D ** -0.5),
              normal(1, F, D, scale=F ** -0.5))
    return x, gate, bias, w1, w3, w2, shared


def routed(x, gate, bias, w1, w3, w2, shared, live, routing):
    return routed_expert_rows_mlp(x, gate, bias, w1, w3, w2, shared, live, routing=routing,
                                  blocks=BLOCKS, route_blocks=ROUTE_BLOCKS, interpret=True)


@pytest.mark.parametrize("num_tokens", [3])
@pytest.mark.parametrize("rule", RULES, ids=RULES.keys())
def test_the_call_routes_as_the_reference_and_projects_as_the_rows_kernel(rule, num_tokens):
    routing = RULES[rule]
    x, gate, bias, w1, w3, w2, shared = operands(num_tokens)
    out, experts, weights = routed(x, gate, bias, w1, w3, w2, shared, None, routing)
    want_experts, want_weights = route_reference(x, gate, bias, routing=routing)
    np.testing.assert_array_equal(np.asarray(experts), np.asarray(want_experts))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-5,
                               atol=1e-6)
    kernel = expert_rows_mlp(x, experts, w1, w3, w2, shared, blocks=BLOCKS, interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(kernel))  # the same programs
    reference = expert_rows_mlp_reference(x, want_experts, w1, w3, w2, shared)
    assert out.shape == (num_tokens, routing.top_k + 1, D)
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference), rtol=1e-5, atol=1e-5)


def test_rows_that_are_not_live_route_to_no_expert():
    routing = RULES["flat"]
    x, gate, bias, w1, w3, w2, shared = operands(4, seed=1)
    live = np.array([True, False, True, False])
    out, experts, weights = routed(x, gate, bias, w1, w3, w2, shared, jnp.asarray(live), routing)
    whole, whole_experts, whole_weights = routed(x, gate, bias, w1, w3, w2, shared, None, routing)
    np.testing.assert_array_equal(np.asarray(experts)[live], np.asarray(whole_experts)[live])
    np.testing.assert_array_equal(np.asarray(weights)[live], np.asarray(whole_weights)[live])
    np.testing.assert_array_equal(np.asarray(out)[live], np.asarray(whole)[live])
    assert np.all(np.asarray(experts)[~live] == NO_EXPERT)
    assert not np.asarray(weights)[~live].any()
    assert not np.asarray(out)[~live, :-1].any()  # routed pairs: zeros, no weight read
    np.testing.assert_array_equal(np.asarray(out)[~live, -1], np.asarray(whole)[~live, -1])
    assert np.abs(np.asarray(whole)[~live, :-1]).max() > 1e-3  # they had routed outputs


def test_problems_the_call_refuses():
    assert routed_rows_problem(routing=RULES["flat"], num_shared=1) is None
    assert "power of 2" in routed_rows_problem(routing=Routing(top_k=3), num_shared=1)
    assert "one shared expert" in routed_rows_problem(routing=RULES["flat"], num_shared=2)
    x, gate, bias, w1, w3, w2, shared = operands(2)
    with pytest.raises(ValueError, match="power of 2"):
        routed(x, gate, bias, w1, w3, w2, shared, None, Routing(top_k=3))
    two_shared = tuple(jnp.concatenate([w, w]) for w in shared)
    with pytest.raises(ValueError, match="one shared expert"):
        routed(x, gate, bias, w1, w3, w2, two_shared, None, RULES["flat"])


PALLAS_ROWS = ExpertRowsKernel(PALLAS, blocks=BLOCKS, interpret=True)
PALLAS_ROUTING = RoutingKernel(PALLAS, blocks=ROUTE_BLOCKS, interpret=True)


def moe(routing_kernel: RoutingKernel, expert_rows_kernel: ExpertRowsKernel) -> KimiMoE:
    return KimiMoE(D, F, num_experts=E, top_k=4, num_groups=4, topk_groups=2, num_shared=1,
                   renormalize=True, scaling=2.0, dtype=jnp.float32, param_dtype=jnp.float32,
                   rngs=nnx.Rngs(5), routing_kernel=routing_kernel,
                   expert_rows_kernel=expert_rows_kernel)


def test_the_moe_takes_the_one_call_when_both_kernels_are_pallas():
    num_tokens = 4
    x = operands(num_tokens, seed=2)[0]
    live = jnp.arange(num_tokens) != 1
    fused = moe(PALLAS_ROUTING, PALLAS_ROWS)
    assert fused._routes_in_rows(num_tokens)
    assert not moe(REFERENCE_ROUTING, PALLAS_ROWS)._routes_in_rows(num_tokens)
    for kernels in [(REFERENCE_ROUTING, NO_EXPERT_ROWS), (PALLAS_ROUTING, NO_EXPERT_ROWS)]:
        expected = moe(*kernels)(x, live=live)
        np.testing.assert_allclose(np.asarray(fused(x, live=live)), np.asarray(expected),
                                   rtol=1e-5, atol=1e-5)
