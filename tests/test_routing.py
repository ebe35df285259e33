"""The routing kernel (``kernels/routing.py``): the Pallas kernel (interpreted on the CPU)
against the plain-JAX reference, the reference against a float64 loop written from the rule,
ties, the per-platform choice, the token-count switch and bad operands."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax.kernels.paged_attention_backend import PALLAS, REFERENCE
from tokenspeed_jax.kernels.routing import (
    REFERENCE_ROUTING,
    Routing,
    RoutingBlocks,
    RoutingKernel,
    apply_routing,
    choose_routing_kernel,
    route_pallas,
    route_reference,
)

D = 96
BLOCKS = RoutingBlocks(block_k=16)  # 6 partial sums: added in parts of 4 and 2
RULES = {  # (experts, rule): no groups, groups, a k that is not a power of 2, DeepSeek-V3's
    "flat": (16, Routing(top_k=4, renormalize=True, scaling=2.5)),
    "flat_k3": (16, Routing(top_k=3, renormalize=True)),  # a slot past k in the renormalized sum
    "groups": (32, Routing(top_k=4, num_groups=4, topk_groups=2, renormalize=True)),
    "k3_plain": (8, Routing(top_k=3, num_groups=2, topk_groups=2, renormalize=False,
                            scaling=1.5)),
    "deepseek_v3": (256, Routing(top_k=8, num_groups=8, topk_groups=4, scaling=2.5)),
}


def operands(num_tokens: int, num_experts: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((num_tokens, D)), jnp.bfloat16)
    gate = jnp.asarray(rng.standard_normal((D, num_experts)) / 8, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(num_experts) / 10, jnp.float32)
    return x, gate, bias


def loop_reference(x, gate, bias, routing: Routing):
    """float64, token by token, written from the rule in the module docstring."""
    x, gate, bias = (np.asarray(a, np.float64) for a in (x, gate, bias))
    experts, weights = [], []
    for row in x:
        scores = 1 / (1 + np.exp(-(row @ gate)))
        choice = scores + bias
        size = len(choice) // routing.num_groups
        if routing.num_groups > 1:
            ranks = [sum(sorted(choice[g * size:(g + 1) * size])[-2:])
                     for g in range(routing.num_groups)]
            kept = sorted(range(routing.num_groups), key=lambda g: (-ranks[g], g))
            for g in kept[routing.topk_groups:]:
                choice[g * size:(g + 1) * size] = -np.inf
        best = sorted(range(len(choice)), key=lambda e: (-choice[e], e))[:routing.top_k]
        picked = scores[best]
        if routing.renormalize:
            picked = picked / (picked.sum() + 1e-20)
        experts.append(best)
        weights.append(picked * routing.scaling)
    return np.array(experts), np.array(weights)


@pytest.mark.parametrize("num_tokens", [1, 2, 8])
@pytest.mark.parametrize("rule", RULES, ids=RULES.keys())
def test_kernel_matches_the_reference(rule, num_tokens):
    num_experts, routing = RULES[rule]
    args = operands(num_tokens, num_experts, seed=num_tokens)
    experts, weights = route_pallas(*args, routing=routing, blocks=BLOCKS, interpret=True)
    expected_experts, expected_weights = route_reference(*args, routing=routing)
    assert experts.shape == weights.shape == (num_tokens, routing.top_k)
    assert experts.dtype == jnp.int32 and weights.dtype == jnp.float32
    np.testing.assert_array_equal(experts, expected_experts)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("rule", RULES, ids=RULES.keys())
def test_reference_matches_a_loop_over_the_tokens(rule):
    num_experts, routing = RULES[rule]
    args = operands(5, num_experts, seed=7)
    experts, weights = route_reference(*args, routing=routing)
    expected_experts, expected_weights = loop_reference(*args, routing)
    np.testing.assert_array_equal(experts, expected_experts)
    np.testing.assert_allclose(weights, expected_weights, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("route", [route_reference, route_pallas], ids=["reference", "pallas"])
def test_ties_go_to_the_lower_expert_and_the_lower_group(route):
    """Zero tokens give every expert the score 0.5; with a bias that ties pairs of experts and
    of groups, the picks are worked out by hand."""
    x, gate, _ = operands(2, 8)
    x = jnp.zeros_like(x)
    # choices 0.6 0.6 | 0.6 0.6 | 0.5 0.9 | 0.7 0.7 in groups of 2
    bias = jnp.asarray([0.1, 0.1, 0.1, 0.1, 0.0, 0.4, 0.2, 0.2], jnp.float32)
    routing = Routing(top_k=5, num_groups=4, topk_groups=3, renormalize=False)
    kwargs = {"blocks": BLOCKS, "interpret": True} if route is route_pallas else {}
    experts, weights = route(x, gate, bias, routing=routing, **kwargs)
    # groups {4, 5} and {6, 7} rank 1.4, {0, 1} and {2, 3} tie at 1.2: the lower, {0, 1}, is
    # the third kept; then 5 (0.9), 6 and 7 (0.7), 0 and 1 (0.6; 2 and 3 are not eligible)
    np.testing.assert_array_equal(experts, [[5, 6, 7, 0, 1]] * 2)
    np.testing.assert_array_equal(weights, np.full((2, 5), 0.5, np.float32))
    routing = Routing(top_k=3, num_groups=2, topk_groups=1, renormalize=False)
    experts, _ = route(x, gate, bias, routing=routing, **kwargs)
    # group {0..3} ranks 1.2, {4..7} 1.6: the second; in it 5, then 6 and 7 tie at 0.7
    np.testing.assert_array_equal(experts, [[5, 6, 7]] * 2)


def test_the_pallas_kernel_is_chosen_on_gpus_for_shapes_it_takes():
    kimi = Routing(top_k=8, scaling=2.446)
    assert choose_routing_kernel(hidden=2304, num_experts=256, routing=kimi,
                                 platform="gpu").backend == PALLAS
    assert choose_routing_kernel(hidden=2304, num_experts=256, routing=kimi,
                                 platform="cpu") == REFERENCE_ROUTING
    three_groups = Routing(top_k=2, num_groups=3, topk_groups=1)
    assert choose_routing_kernel(hidden=2304, num_experts=96, routing=three_groups,
                                 platform="gpu") == REFERENCE_ROUTING


def test_the_token_count_picks_the_path():
    num_experts, routing = RULES["flat"]
    kernel = RoutingKernel(PALLAS, max_tokens=2, blocks=BLOCKS, interpret=True)

    def kernels(num_tokens: int) -> int:
        args = operands(num_tokens, num_experts)
        jaxpr = str(jax.make_jaxpr(lambda *a: apply_routing(*a, routing=routing,
                                                            kernel=kernel))(*args))
        return len(re.findall(r"\bpallas_call\[", jaxpr))

    assert kernels(2) == 1 and kernels(3) == 0


def test_bad_operands_and_knobs_are_rejected():
    x, gate, bias = operands(2, 16)
    routing = Routing(top_k=4, num_groups=4, topk_groups=1)
    with pytest.raises(ValueError, match="must be .T, D., .D, E. and .E."):
        route_reference(x, gate[:8], bias, routing=routing)
    with pytest.raises(ValueError, match="exceeds the experts of 1 group"):
        route_reference(x, gate, bias, routing=Routing(top_k=5, num_groups=4, topk_groups=1))
    with pytest.raises(ValueError, match="multiple of num_expert_group=3"):
        route_reference(x, gate, bias, routing=Routing(top_k=2, num_groups=3))
    with pytest.raises(ValueError, match="hidden=96 must be a multiple of block_k=64"):
        route_pallas(x, gate, bias, routing=routing, blocks=RoutingBlocks(64), interpret=True)
    with pytest.raises(ValueError, match="power of 2"):
        RoutingBlocks(48)
    with pytest.raises(ValueError, match="backend"):
        RoutingKernel("triton")
    assert RoutingKernel(REFERENCE).backend == REFERENCE
