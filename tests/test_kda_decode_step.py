"""The fused KDA decode step (``kernels/kda_decode_step.py``): the Pallas kernel, interpreted,
against the plain-JAX reference, whole heads and heads split over programs; the reference
against a float64 loop written from the module's contract; the layer's fused decode against its
unfused route; the per-platform choice; bad operands."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tokenspeed_jax.kernels.kda_decode_step import (
    REFERENCE_STEP,
    StepKernel,
    StepWeights,
    choose_step_kernel,
    kda_decode_step_pallas,
    kda_decode_step_reference,
    value_block,
)
from tokenspeed_jax.kernels.paged_attention_backend import PALLAS
from tokenspeed_jax.models.kimi_linear.layers import KdaMeta, KimiDeltaAttention

H, K, R, W, POOL = 2, 16, 8, 4, 5
EPS = 1e-5
SLOTS = np.array([3, -1, 0], np.int32)  # request 1 is padding
UNTOUCHED = [1, 2, 4]


def _operands(dtype, state_dtype, seed=0):
    rng = np.random.default_rng(seed)
    n = len(SLOTS)

    def normal(shape, scale=1.0, dt=dtype):
        return jnp.asarray(rng.standard_normal(shape) * scale, dt)

    weights = StepWeights(
        q_conv=normal((H * K, W), 0.5), k_conv=normal((H * K, W), 0.5),
        v_conv=normal((H * K, W), 0.5), f_b_proj=normal((R, H, K), 0.5),
        g_b_proj=normal((R, H, K), 0.5), A_log=normal((H,), 0.5, jnp.float32),
        dt_bias=normal((H, K), 0.5, jnp.float32), o_norm=normal((K,), 1.0))
    step = (normal((n, 3, H, K), 2.0), normal((n, 2 * R + H)))  # mixed, [f | gate | beta]
    conv_pool = normal((POOL, W - 1, 3 * H * K))
    state_pool = normal((POOL, H, K, K), 1.0, state_dtype)
    return step, weights, conv_pool, state_pool


def _run(fn, dtype, state_dtype, **kwargs):
    step, weights, conv_pool, state_pool = _operands(dtype, state_dtype)
    return fn(*step, weights, conv_pool, state_pool, jnp.asarray(SLOTS), eps=EPS, **kwargs)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _loop_step(step, weights, conv_pool, state_pool):
    """The contract, request by request and head by head, in float64 numpy (no roundings)."""
    mixed, low = (np.asarray(x, np.float64) for x in step)
    f_low, gate_low, beta_logits = low[:, :R], low[:, R:2 * R], low[:, 2 * R:]
    w = {c: np.asarray(getattr(weights, f"{c}_conv"), np.float64).reshape(H, K, W) for c in "qkv"}
    fb, gb = (np.asarray(x, np.float64) for x in (weights.f_b_proj, weights.g_b_proj))
    a_log, dt_bias, o_norm = (np.asarray(x, np.float64)
                              for x in (weights.A_log, weights.dt_bias, weights.o_norm))
    conv_pool = np.asarray(conv_pool, np.float64).reshape(POOL, W - 1, H, 3, K)
    state_pool = np.asarray(state_pool, np.float64)
    out = np.zeros((len(SLOTS), H, K))
    for n, slot in enumerate(SLOTS):
        for h in range(H):
            history = conv_pool[slot, :, h] if slot >= 0 else np.zeros((W - 1, 3, K))
            channels = []
            for c, name in enumerate("qkv"):
                taps = np.concatenate([history[:, c], mixed[n, c, h][None]], axis=0)  # [W, K]
                channels.append(_silu(np.sum(taps.T * w[name][h], axis=1)))
                if slot >= 0:
                    conv_pool[slot, :, h, c] = taps[1:]
            q, k, v = channels
            q, k = (x / np.sqrt(np.sum(x * x) + 1e-6) for x in (q, k))
            x = f_low[n] @ fb[:, h] + dt_bias[h]
            g = -np.exp(a_log[h]) * np.log1p(np.exp(x))
            beta = _sigmoid(beta_logits[n, h])
            state = state_pool[slot, h].T if slot >= 0 else np.zeros((K, K))  # [K, V]
            state = state * np.exp(g)[:, None]
            state = state + np.outer(k, beta * (v - k @ state))
            o = K**-0.5 * (q @ state)
            normed = o / np.sqrt(np.mean(o * o) + EPS)
            out[n, h] = normed * o_norm * _sigmoid(gate_low[n] @ gb[:, h])
            if slot >= 0:
                state_pool[slot, h] = state.T
    return out, conv_pool.reshape(POOL, W - 1, 3 * H * K), state_pool


def test_reference_matches_a_float64_loop_of_the_contract():
    step, weights, conv_pool, state_pool = _operands(jnp.float32, jnp.float32, seed=3)
    want = _loop_step(step, weights, conv_pool, state_pool)
    got = kda_decode_step_reference(*step, weights, conv_pool, state_pool, jnp.asarray(SLOTS),
                                    eps=EPS)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype, state_dtype, tol, block_v", [
    (jnp.float32, jnp.float32, 1e-5, None),  # three requests: a program per whole head
    (jnp.float32, jnp.float32, 1e-5, 4),  # four programs a head: the last one norms
    (jnp.bfloat16, jnp.float32, 3e-2, None),
    (jnp.bfloat16, jnp.bfloat16, 3e-2, 8),
])
def test_kernel_matches_reference(dtype, state_dtype, tol, block_v):
    want = _run(kda_decode_step_reference, dtype, state_dtype)
    got = _run(kda_decode_step_pallas, dtype, state_dtype, block_v=block_v, interpret=True)
    names = ("out", "conv pool", "state pool")
    for name, g, w in zip(names, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=tol, atol=tol, err_msg=name)
    _, _, conv_pool, state_pool = _operands(dtype, state_dtype)
    # the conv states are copies: exact; padding and unused rows are not written
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    for new, old in ((got[1], conv_pool), (got[2], state_pool)):
        np.testing.assert_array_equal(np.asarray(new)[UNTOUCHED], np.asarray(old)[UNTOUCHED])


def test_two_steps_continue_from_the_pools():
    step, weights, conv_pool, state_pool = _operands(jnp.float32, jnp.float32, seed=5)
    slots = jnp.asarray(SLOTS)
    pools = {"ref": (conv_pool, state_pool), "kernel": (jnp.array(conv_pool),
                                                         jnp.array(state_pool))}
    for _ in range(2):
        _, *pools["ref"] = kda_decode_step_reference(*step, weights, *pools["ref"], slots,
                                                     eps=EPS)
        _, *pools["kernel"] = kda_decode_step_pallas(*step, weights, *pools["kernel"], slots,
                                                     eps=EPS, block_v=8, interpret=True)
    for got, want in zip(pools["kernel"], pools["ref"]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _layer(step_kernel):
    return KimiDeltaAttention(32, num_heads=H, head_dim=K, conv_size=W, norm_eps=EPS,
                              dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0),
                              step_kernel=step_kernel)


def test_layer_decode_through_the_kernel_matches_the_unfused_route():
    fused = _layer(StepKernel(PALLAS, interpret=True))
    unfused = _layer(REFERENCE_STEP)
    assert fused.fuses_decode(None, 3) and not fused.fuses_decode(object(), 3)
    assert not fused.fuses_decode(None, 33) and not unfused.fuses_decode(None, 3)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((len(SLOTS), 32)), jnp.float32)
    conv_pool = jnp.asarray(rng.standard_normal((POOL, W - 1, 3 * H * K)), jnp.float32)
    state_pool = jnp.asarray(rng.standard_normal((POOL, H, K, K)), jnp.float32)
    meta = dataclasses.replace(KdaMeta.dense(len(SLOTS), 1), slots=SLOTS)
    got = fused(x, jnp.array(conv_pool), jnp.array(state_pool), meta, impl="pallas",
                decode=True)
    want = unfused(x, jnp.array(conv_pool), jnp.array(state_pool), meta, impl="pallas",
                   decode=True)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_kernel_is_chosen_on_gpus_for_power_of_2_shapes():
    assert choose_step_kernel(head_dim=128, rank=128, platform="gpu").backend == PALLAS
    assert choose_step_kernel(head_dim=128, rank=128, platform="cpu") == REFERENCE_STEP
    assert choose_step_kernel(head_dim=96, rank=128, platform="gpu") == REFERENCE_STEP
    with pytest.raises(ValueError, match="backend"):
        StepKernel("triton")
    kernel = StepKernel(PALLAS, max_requests=8)
    assert kernel.takes(8) and not kernel.takes(9) and not REFERENCE_STEP.takes(1)
    # value rows per program: 32-row blocks up to two requests, the whole head beyond
    assert [value_block(n, 128) for n in (1, 2, 3, 32)] == [32, 32, 128, 128]
    assert value_block(1, 16) == 16


def test_bad_operands_are_refused():
    step, weights, conv_pool, state_pool = _operands(jnp.float32, jnp.float32)
    slots = jnp.asarray(SLOTS)
    with pytest.raises(ValueError, match="f_b_proj"):
        kda_decode_step_reference(*step, dataclasses.replace(weights, f_b_proj=weights.g_b_proj[:, :1]),
                                  conv_pool, state_pool, slots, eps=EPS)
    with pytest.raises(ValueError, match="mixed"):
        kda_decode_step_pallas(step[0][:, :2], *step[1:], weights, conv_pool, state_pool, slots,
                               eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="state_pool"):
        kda_decode_step_reference(*step, weights, conv_pool, state_pool.astype(jnp.float16),
                                  slots, eps=EPS)
    odd = _operands(jnp.float32, jnp.float32)
    wide = dataclasses.replace(odd[1], f_b_proj=jnp.zeros((6, H, K)), g_b_proj=jnp.zeros((6, H, K)))
    with pytest.raises(ValueError, match="powers of 2"):
        kda_decode_step_pallas(odd[0][0], jnp.zeros((3, 12 + H)), wide, odd[2], odd[3], slots,
                               eps=EPS, interpret=True)
    for block_v in (3, 32):  # not a power of 2; more rows than the head has
        with pytest.raises(ValueError, match="block_v"):
            kda_decode_step_pallas(*step, weights, conv_pool, state_pool, slots, eps=EPS,
                                   block_v=block_v, interpret=True)
    with pytest.raises(ValueError, match="low"):
        kda_decode_step_reference(step[0], step[1][:, :-1], weights, conv_pool, state_pool,
                                  slots, eps=EPS)
