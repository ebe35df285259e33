"""The fused KDA decode step compiled for the GPU (Triton) at Kimi-Linear's shape (32 heads of
128, gate rank 128, conv width 4, bf16, fp32 and bf16 state pools) against its plain-JAX
reference (which test_kda_decode_step.py checks against a float64 loop on the CPU). What
interpret mode cannot show: that the kernel lowers at this size and the compiled arithmetic
matches, padding rows included, and that programs updating the pools in place read every old
row before any program writes it (interpreted, the aliased pools are copies: a write cannot
reach another program's read). Heads split over programs are checked at 8 requests, where
more programs run than fit on the GPU at once.

Skipped without a GPU; on a GPU machine: ``pytest -m gpu tests/test_kda_decode_step_gpu.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax.kernels.kda_decode_step import (
    StepWeights,
    kda_decode_step_pallas,
    kda_decode_step_reference,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")]

H, K, W, POOL = 32, 128, 4, 80


def _operands(requests, state_dtype):
    rng = np.random.default_rng(requests)

    def normal(shape, scale, dtype=jnp.bfloat16):
        return jnp.asarray(rng.standard_normal(shape) * scale, dtype)

    weights = StepWeights(
        q_conv=normal((H * K, W), 0.5), k_conv=normal((H * K, W), 0.5),
        v_conv=normal((H * K, W), 0.5), f_b_proj=normal((K, H, K), K ** -0.5),
        g_b_proj=normal((K, H, K), K ** -0.5), A_log=normal((H,), 0.5, jnp.float32),
        dt_bias=normal((H, K), 0.5, jnp.float32), o_norm=normal((K,), 1.0))
    step = (normal((requests, 3, H, K), 1.0), normal((requests, 2 * K + H), 1.0))
    slots = rng.permutation(POOL)[:requests].astype(np.int32)
    slots[-1] = -1  # the bucket's last row is padding
    pools = (normal((POOL, W - 1, 3 * H * K), 1.0), normal((POOL, H, K, K), 0.3, state_dtype))
    return step, weights, pools, jnp.asarray(slots)


def _assert_step_matches(got, want):
    for name, g, w in zip(("out", "conv pool", "state pool"), got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=3e-2, atol=3e-2, err_msg=name)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.parametrize("state_dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("requests, block_v", [(2, None), (8, None), (64, None), (8, 32),
                                               (2, 64), (2, 128)])
def test_compiled_step_matches_reference(requests, block_v, state_dtype):
    step, weights, pools, slots = _operands(requests, state_dtype)
    want = kda_decode_step_reference(*step, weights, *pools, slots, eps=1e-6)
    copies = tuple(jnp.array(p) for p in pools)
    got = kda_decode_step_pallas(*step, weights, *copies, slots, eps=1e-6, block_v=block_v,
                                 interpret=False)
    _assert_step_matches(got, want)


def test_split_heads_match_reference_step_after_step():
    """32-row blocks, the batch-1 bucket: 48 steps, each output normed by the last of a head's
    four programs to finish (a counter per (request, head)); any step that read a block before
    it was written would differ from the reference."""
    step, weights, pools, slots = _operands(2, jnp.float32)
    rng = np.random.default_rng(11)
    for _ in range(48):
        mixed = jnp.asarray(rng.standard_normal(step[0].shape), jnp.bfloat16)
        low = jnp.asarray(rng.standard_normal(step[1].shape), jnp.bfloat16)
        copies = tuple(jnp.array(p) for p in pools)
        got = kda_decode_step_pallas(mixed, low, weights, *copies, slots, eps=1e-6, block_v=32,
                                     interpret=False)
        want = kda_decode_step_reference(mixed, low, weights, *pools, slots, eps=1e-6)
        _assert_step_matches(got, want)
        pools = want[1:]  # both start the next step from the reference's pools
