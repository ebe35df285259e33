"""The merge of split decode states (``kernels/split_merge.py``): the Pallas call (interpreted on
the CPU) and the plain-JAX merge against a float64 computation of the contract, with splits that
saw nothing and a padding row; its Triton lowering; the choice by interpretation; bad shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mla_checks import triton_kernels

from tokenspeed_jax.kernels.split_merge import (
    merge_split_results,
    merge_splits,
    merge_splits_pallas,
)


def states(splits: int, batch: int = 3, heads: int = 4, width: int = 32, seed: int = 0):
    """Per-split states of ``batch`` requests: request 0's last split saw nothing (a short
    request), request ``batch - 1`` no split (a padding row)."""
    rng = np.random.default_rng(seed)
    acc = rng.standard_normal((splits, batch, heads, width)).astype(np.float32)
    row_max = rng.uniform(-4, 4, (splits, batch, heads)).astype(np.float32)
    row_sum = rng.uniform(0.5, 8, (splits, batch, heads)).astype(np.float32)
    empty = [(splits - 1, 0), *((s, batch - 1) for s in range(splits))]
    if splits == 1:
        empty = [(0, batch - 1)]
    for split, request in empty:
        acc[split, request], row_max[split, request], row_sum[split, request] = 0, -np.inf, 0
    return acc, row_max, row_sum


def contract(acc, row_max, row_sum) -> np.ndarray:
    """float64: sum_s w_s acc_s / sum_s w_s row_sum_s, w_s = 2^(max_s - max); zeros where no
    split saw anything."""
    acc, row_max, row_sum = (np.asarray(a, np.float64) for a in (acc, row_max, row_sum))
    top = np.max(row_max, axis=0)
    seen = np.isfinite(top)
    weight = np.where(seen, np.exp2(row_max - np.where(seen, top, 0.0)), 0.0)
    total = np.sum(weight * row_sum, axis=0)
    out = np.sum(weight[..., None] * acc, axis=0)
    return np.where(seen[..., None], out / np.where(seen, total, 1.0)[..., None], 0.0)


@pytest.mark.parametrize("splits", [1, 2, 3, 6])
def test_both_merges_meet_the_contract(splits):
    """3 and 6 splits are loaded in power-of-2 parts (2 + 1, 4 + 2); the padding row's output
    is zeros."""
    operands = states(splits)
    want = contract(*operands)
    for got in (merge_splits_pallas(*map(jnp.asarray, operands), interpret=True),
                merge_splits(*map(jnp.asarray, operands))):
        assert got.shape == want.shape and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-6)


def test_interpreted_kernels_keep_the_plain_merge():
    operands = tuple(map(jnp.asarray, states(3)))
    for dtype in (jnp.float32, jnp.bfloat16):
        got = merge_split_results(*operands, dtype=dtype, interpret=True)
        assert got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32),
                                      np.asarray(merge_splits(*operands).astype(dtype),
                                                 np.float32))


def test_the_kernel_rounds_its_float32_result_once_to_the_dtype():
    """bf16 out: the float32 merge rounded to nearest even, element for element."""
    operands = tuple(map(jnp.asarray, states(3)))
    got = merge_splits_pallas(*operands, dtype=jnp.bfloat16, interpret=True)
    want = merge_splits_pallas(*operands, interpret=True).astype(jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("splits, width", [(3, 512), (6, 128), (32, 512)])
def test_lowers_to_one_triton_kernel(splits, width, dtype):
    """The bf16 result too: the rounding is inside the call, no conversion kernel after it."""
    spec = jax.ShapeDtypeStruct
    shapes = (spec((splits, 2, 32, width), jnp.float32), *[spec((splits, 2, 32), jnp.float32)] * 2)

    def merge(*operands):
        return merge_split_results(*operands, dtype=dtype, interpret=False)

    assert triton_kernels(merge, *shapes) == 1
    lowered = jax.jit(merge).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.convert" not in lowered


def test_bad_shapes_raise():
    acc, row_max, row_sum = map(jnp.asarray, states(2))
    with pytest.raises(ValueError, match="must be"):
        merge_splits_pallas(acc, row_max[:, :1], row_sum, interpret=True)
    with pytest.raises(ValueError, match="power of 2"):
        merge_splits_pallas(acc[..., :24], row_max, row_sum, interpret=True)
