"""The KDA decode recurrence (``kda_decode.kda_decode``, the kernel of steps past the fused
step's request limit) compiled for the GPU (Triton) at Kimi-Linear's shape (32 heads of 128)
against the plain-JAX recurrence (which test_kda_decode.py checks interpreted on the CPU), with
padding requests in the batch. What interpret mode cannot show: that compiled, a padding request
starts from zeros and writes no pool row whatever the pool holds at row 0 (the row its clamped
slot reads), and that the live rows land at their slots and no others.

Skipped without a GPU; on a GPU machine: ``pytest -m gpu tests/test_kda_decode_gpu.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax.kernels import kda_decode, kda_ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")]

H, K, POOL, REQUESTS = 32, 128, 64, 40


def test_decode_with_padding_requests_matches_the_reference():
    rng = np.random.default_rng(3)

    def normal(shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)

    q, k, v = normal((REQUESTS, H, K), 3), normal((REQUESTS, H, K), 3), normal((REQUESTS, H, K))
    g_raw = normal((REQUESTS, H, K))
    beta = jnp.asarray(rng.uniform(0.1, 1.0, (REQUESTS, H)), jnp.float32)
    a_log, dt_bias = normal((H,), 0.5), normal((H * K,), 0.5)
    pool = normal((POOL, H, K, K))  # every row holds states, row 0 too
    slots = rng.permutation(np.arange(1, POOL))[:REQUESTS].astype(np.int32)
    slots[[5, 17, -1]] = -1  # padding rows: zero states in, no row out
    live = slots >= 0
    init = kda_ref.pool_layout(np.where(live[:, None, None, None],
                                        np.asarray(pool)[np.maximum(slots, 0)], 0))
    with jax.default_matmul_precision("highest"):  # float32 sums, no TF32
        want_o, want_state = kda_ref.recurrent_kda_reference(
            q[:, None], k[:, None], v[:, None], g_raw[:, None], beta[:, None],
            initial_state=jnp.asarray(init), output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=a_log, dt_bias=dt_bias)
    o, new_pool = kda_decode.kda_decode(q, k, v, g_raw, beta, jnp.copy(pool), jnp.asarray(slots),
                                        a_log, dt_bias, use_qk_l2norm_in_kernel=True,
                                        use_gate_in_kernel=True, interpret=False)
    np.testing.assert_allclose(np.asarray(o), np.asarray(want_o[:, 0]), rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(np.asarray(new_pool)[slots[live]],
                               np.asarray(kda_ref.pool_layout(want_state[live])), rtol=2e-4,
                               atol=2e-4)
    untouched = np.setdiff1d(np.arange(POOL), slots[live])
    np.testing.assert_array_equal(np.asarray(new_pool)[untouched], np.asarray(pool)[untouched])
