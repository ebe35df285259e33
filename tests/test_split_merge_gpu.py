"""The merge of split decode states compiled for the GPU (Triton) at 512- and 128-wide states,
against the plain-JAX merge (which test_split_merge.py checks against a
float64 computation on the CPU). What interpret mode cannot show: that the kernel compiles, and
that the compiled arithmetic matches.

Skipped without a GPU; on a GPU machine: ``pytest -m gpu tests/test_split_merge_gpu.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax.kernels.split_merge import merge_splits, merge_splits_pallas

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a GPU")]


@pytest.mark.parametrize("splits, heads, width", [(4, 32, 512), (3, 32, 128), (32, 128, 512)])
def test_split_merge_matches_reference(splits, heads, width):
    """Request 1 a padding row (no split saw anything)."""
    rng = np.random.default_rng(splits)
    acc = rng.standard_normal((splits, 2, heads, width)).astype(np.float32)
    row_max = rng.uniform(-4, 4, (splits, 2, heads)).astype(np.float32)
    row_sum = rng.uniform(0.5, 8, (splits, 2, heads)).astype(np.float32)
    acc[:, 1], row_max[:, 1], row_sum[:, 1] = 0, -np.inf, 0
    operands = tuple(map(jnp.asarray, (acc, row_max, row_sum)))
    got = merge_splits_pallas(*operands, interpret=False)
    np.testing.assert_allclose(np.asarray(got), np.asarray(merge_splits(*operands)), rtol=1e-5,
                               atol=1e-6)
    rounded = merge_splits_pallas(*operands, dtype=jnp.bfloat16, interpret=False)
    np.testing.assert_array_equal(np.asarray(rounded, np.float32),
                                  np.asarray(got.astype(jnp.bfloat16), np.float32))
