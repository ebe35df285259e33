"""The MoE's decode-sized kernels compiled for the GPU (Triton) at the shapes of Kimi-Linear
(hidden 2304, 256 experts of 1024, top-8, one group) and DeepSeek-V3 (hidden 7168, 256 experts
of 2048, top-8 in 4 of 8 groups) with their default knobs, against their plain-JAX references
(which test_routing.py and test_expert_rows.py check by hand on the CPU): the routing kernel
and the expert-rows kernel with the shared expert as a second stack, and the two in one call
(``routed_expert_rows``). What interpret mode cannot show: that the kernels lower, that the
compiled arithmetic matches, and that programs waiting on others' results see them.

Skipped without a GPU; on a GPU machine: ``pytest -m gpu tests/test_moe_kernels_gpu.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax.kernels.expert_rows import expert_rows_mlp, expert_rows_mlp_reference
from tokenspeed_jax.kernels.routed_expert_rows import routed_expert_rows_mlp
from tokenspeed_jax.kernels.routing import Routing, route_pallas, route_reference

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")]

SHAPES = {  # hidden, expert width, routing
    "kimi_linear": (2304, 1024, Routing(top_k=8, scaling=2.446)),
    "deepseek_v3": (7168, 2048, Routing(top_k=8, num_groups=8, topk_groups=4, scaling=2.5)),
}
NUM_EXPERTS = 256
ROUTED_STACK = 24  # experts made for the expert-rows check: the kernel's cost is per pair


@pytest.mark.parametrize("num_tokens", [1, 2, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPES.keys())
def test_routing_kernel_matches_reference(shape, num_tokens):
    hidden, _, routing = SHAPES[shape]
    rng = np.random.default_rng(num_tokens)
    x = jnp.asarray(rng.standard_normal((num_tokens, hidden)), jnp.bfloat16)
    gate = jnp.asarray(rng.standard_normal((hidden, NUM_EXPERTS)) / hidden ** 0.5, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(NUM_EXPERTS) / 10, jnp.float32)
    experts, weights = route_pallas(x, gate, bias, routing=routing, interpret=False)
    want_experts, want_weights = route_reference(x, gate, bias, routing=routing)
    np.testing.assert_array_equal(np.asarray(experts), np.asarray(want_experts))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("num_tokens", [1, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPES.keys())
def test_routing_kernel_matches_reference_call_after_call(shape, num_tokens):
    """The token's last program to finish its partial sums does the choice: 64 calls on fresh
    operands, so a program that read another's partial sums before they were stored would show
    as a wrong pick somewhere."""
    hidden, _, routing = SHAPES[shape]
    rng = np.random.default_rng(num_tokens)
    gate = jnp.asarray(rng.standard_normal((hidden, NUM_EXPERTS)) / hidden ** 0.5, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(NUM_EXPERTS) / 10, jnp.float32)
    xs = jnp.asarray(rng.standard_normal((64, num_tokens, hidden)), jnp.bfloat16)
    got = [route_pallas(x, gate, bias, routing=routing, interpret=False) for x in xs]
    for x, (experts, weights) in zip(xs, got, strict=True):
        want_experts, want_weights = route_reference(x, gate, bias, routing=routing)
        np.testing.assert_array_equal(np.asarray(experts), np.asarray(want_experts))
        np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPES.keys())
def test_expert_rows_with_the_shared_expert_matches_reference(shape):
    """Three tokens' 8 routed experts each (one of them -1, the third token not live) and the
    shared expert of each token, bf16."""
    hidden, width, _ = SHAPES[shape]
    rng = np.random.default_rng(0)

    def stack(count, rows, cols):
        return jnp.asarray(rng.standard_normal((count, rows, cols)) / rows ** 0.5, jnp.bfloat16)

    w1, w3, w2 = stack(ROUTED_STACK, hidden, width), stack(ROUTED_STACK, hidden, width), stack(
        ROUTED_STACK, width, hidden)
    shared = (stack(1, hidden, width), stack(1, hidden, width), stack(1, width, hidden))
    x = jnp.asarray(rng.standard_normal((3, hidden)), jnp.bfloat16)
    experts = rng.choice(ROUTED_STACK, size=(3, 8), replace=False)
    experts[0, 3] = -1
    args = (x, jnp.asarray(experts, jnp.int32), w1, w3, w2, shared,
            jnp.asarray([True, True, False]))
    out = np.asarray(expert_rows_mlp(*args, interpret=False), np.float32)
    want = np.asarray(expert_rows_mlp_reference(*args), np.float32)
    np.testing.assert_allclose(out, want, rtol=3e-2, atol=3e-2)
    assert not out[0, 3].any() and not out[2, :8].any()  # no expert; a row not live
    assert np.all(out[:, 8].any(axis=1))  # the shared pairs


@pytest.mark.parametrize("num_tokens", [2, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPES.keys())
def test_routing_inside_the_gate_up_call_matches_the_separate_kernels(shape, num_tokens):
    """16 calls on fresh rows (the second row not live): the experts and weights are the
    reference routing's, and the outputs are exactly the expert-rows kernel's over the experts
    the call chose; a gate/up program that read its token's experts before the routing stored
    them would show as a wrong output somewhere."""
    hidden, width, routing = SHAPES[shape]
    rng = np.random.default_rng(num_tokens)
    keys = iter(jax.random.split(jax.random.PRNGKey(num_tokens), 6))

    def stack(count, rows, cols):  # every expert the routing may pick, made on the device
        return jax.random.normal(next(keys), (count, rows, cols), jnp.bfloat16) / rows ** 0.5

    w1, w3, w2 = (stack(NUM_EXPERTS, hidden, width), stack(NUM_EXPERTS, hidden, width),
                  stack(NUM_EXPERTS, width, hidden))
    shared = (stack(1, hidden, width), stack(1, hidden, width), stack(1, width, hidden))
    gate = jnp.asarray(rng.standard_normal((hidden, NUM_EXPERTS)) / hidden ** 0.5, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(NUM_EXPERTS) / 10, jnp.float32)
    live = np.arange(num_tokens) != 1
    for x in jnp.asarray(rng.standard_normal((16, num_tokens, hidden)), jnp.bfloat16):
        out, experts, weights = routed_expert_rows_mlp(x, gate, bias, w1, w3, w2, shared,
                                                       jnp.asarray(live), routing=routing,
                                                       interpret=False)
        want_experts, want_weights = route_reference(x, gate, bias, routing=routing)
        np.testing.assert_array_equal(np.asarray(experts)[live], np.asarray(want_experts)[live])
        np.testing.assert_allclose(np.asarray(weights)[live], np.asarray(want_weights)[live],
                                   rtol=1e-5, atol=1e-6)
        assert np.all(np.asarray(experts)[~live] == -1) and not np.asarray(weights)[~live].any()
        want = expert_rows_mlp(x, experts, w1, w3, w2, shared, jnp.asarray(live),
                               interpret=False)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
