"""The Pallas KDA decode kernel (interpreted) against the reference recurrence: one token per
request, states from a pool by slot, fused q/k L2 norm and gate, padded requests untouched."""

import jax.numpy as jnp
import numpy as np

from tokenspeed_jax.kernels import kda_decode, kda_ref

H, HV, K, V = 2, 4, 16, 32


def test_decode_step_with_fused_gate_and_l2norm_updates_pool_in_place():
    rng = np.random.default_rng(0)
    n = 5
    q = jnp.asarray(rng.standard_normal((n, H, K)) * 3, jnp.float32)
    k = jnp.asarray(rng.standard_normal((n, H, K)) * 3, jnp.float32)
    v = jnp.asarray(rng.standard_normal((n, HV, V)), jnp.float32)
    g_raw = rng.standard_normal((n, HV, K)).astype(np.float32)
    g_raw[0, 0] = 60.0  # strong decay: softplus(60) * exp(A_log) is far below -20
    beta = jnp.asarray(rng.uniform(0.1, 1.0, (n, HV)), jnp.float32)
    a_log = jnp.asarray(rng.standard_normal(HV) + 1.0, jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal(HV * K), jnp.float32)
    pool = jnp.asarray(rng.standard_normal((8, HV, V, K)), jnp.float32)  # states transposed
    slots = np.array([3, -1, 0, 6, 1], np.int32)
    real = slots >= 0
    init = np.where(real[:, None, None, None], np.asarray(pool)[np.maximum(slots, 0)], 0)
    init = kda_ref.pool_layout(init)

    o_ref, s_ref = kda_ref.recurrent_kda_reference(
        q[:, None], k[:, None], v[:, None], jnp.asarray(g_raw)[:, None], beta[:, None],
        initial_state=jnp.asarray(init), output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias,
    )
    o, new_pool = kda_decode.kda_decode(
        q, k, v, jnp.asarray(g_raw), beta, jnp.array(pool), jnp.asarray(slots), a_log, dt_bias,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, interpret=True,
    )
    assert np.all(np.isfinite(np.asarray(o)))
    np.testing.assert_allclose(o, o_ref[:, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(new_pool)[slots[real]],
                               kda_ref.pool_layout(s_ref[real]), rtol=1e-5, atol=1e-5)
    untouched = [2, 4, 5, 7]
    np.testing.assert_array_equal(np.asarray(new_pool)[untouched], np.asarray(pool)[untouched])


def test_decode_continues_a_recurrent_prefill():
    rng = np.random.default_rng(1)
    steps = 4
    q = jnp.asarray(rng.standard_normal((1, steps, H, K)), jnp.float32)
    k = kda_ref.l2_normalize(jnp.asarray(rng.standard_normal((1, steps, H, K)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((1, steps, HV, V)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.0, 2.0, (1, steps, HV, K)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 1.0, (1, steps, HV)), jnp.float32)
    o_ref, s_ref = kda_ref.recurrent_kda_reference(q, k, v, g, beta, output_final_state=True)
    pool = jnp.zeros((2, HV, V, K), jnp.float32)
    slots = jnp.array([1], jnp.int32)
    for t in range(steps):
        o_t, pool = kda_decode.kda_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], pool,
                                          slots, interpret=True)
        np.testing.assert_allclose(o_t[0], o_ref[0, t], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pool[1], kda_ref.pool_layout(s_ref[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(pool[0], 0)


def test_decode_with_a_bf16_pool_rounds_the_state_once_a_step():
    rng = np.random.default_rng(2)
    steps, n = 3, 2
    q = jnp.asarray(rng.standard_normal((steps, n, H, K)), jnp.float32)
    k = kda_ref.l2_normalize(jnp.asarray(rng.standard_normal((steps, n, H, K)), jnp.float32))
    v = jnp.asarray(rng.standard_normal((steps, n, HV, V)), jnp.float32)
    g = -jnp.asarray(rng.uniform(0.0, 2.0, (steps, n, HV, K)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 1.0, (steps, n, HV)), jnp.float32)
    start = np.asarray(jnp.asarray(rng.standard_normal((3, HV, V, K)), jnp.bfloat16))
    pool = jnp.asarray(start)
    slots = jnp.array([2, 0], jnp.int32)
    state = pool[slots]
    for t in range(steps):
        o_ref, s_ref = kda_ref.recurrent_kda_reference(
            *(x[t][:, None] for x in (q, k, v, g, beta)),
            initial_state=kda_ref.pool_layout(state.astype(jnp.float32)),
            output_final_state=True)
        o_t, pool = kda_decode.kda_decode(q[t], k[t], v[t], g[t], beta[t], pool, slots,
                                          interpret=True)
        assert pool.dtype == jnp.bfloat16
        np.testing.assert_allclose(o_t, o_ref[:, 0], rtol=1e-5, atol=1e-5)
        s_ref = kda_ref.pool_layout(s_ref)
        np.testing.assert_allclose(pool[slots].astype(jnp.float32), s_ref, rtol=2.0**-8,
                                   atol=1e-6)
        state = s_ref.astype(jnp.bfloat16)  # what a bf16 pool keeps between steps
    np.testing.assert_array_equal(pool[1], start[1])
