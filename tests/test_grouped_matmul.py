"""The grouped matmul: the Pallas kernel (interpreted on the CPU) against ``lax.ragged_dot`` and
against a float64 loop over the groups; the tile schedule's cover of the rows; the MoE through
either kernel.

Group sizes are data, so one compile per (dtype, blocks) serves every case of ``SIZES``: empty
groups, a group crossing tile boundaries, one group holding every row, no row in any group, rows
past the last group, and sizes adding up past M (cut at M, as ragged_dot does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tokenspeed_jax.kernels.expert_rows import NO_EXPERT_ROWS
from tokenspeed_jax.kernels.grouped_matmul import (
    REFERENCE_GROUPED_MATMUL,
    GroupedMatmulBlocks,
    GroupedMatmulKernel,
    choose_grouped_kernel,
    grouped_matmul,
    grouped_matmul_reference,
    num_tiles,
    tile_schedule,
)
from tokenspeed_jax.kernels.kernel_math import count_at_most
from tokenspeed_jax.kernels.paged_attention_backend import PALLAS
from tokenspeed_jax.models.moe import KimiMoE

M, K, N, G = 40, 32, 32, 4
SIZES = (
    (5, 0, 19, 12),  # empty group, a group crossing tiles, 4 rows past the last group
    (0, 40, 0, 0),  # one group holds every row
    (0, 0, 0, 0),  # every row past the groups
    (16, 16, 8, 0),  # groups ending on tile boundaries
    (30, 30, 0, 0),  # sizes past M: the second group is cut at row 40
    (3, 1, 2, 1),  # 33 rows past the groups
)
BLOCKS = (GroupedMatmulBlocks(16, 16, 16), GroupedMatmulBlocks(32, 32, 16),
          GroupedMatmulBlocks(64, 16, 32))  # block_m = 64 > M: the rows are padded
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def loop_reference(lhs, rhs, sizes) -> np.ndarray:
    """float64: each group's rows times its weights, cut at M; every other row zero."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for group, size in enumerate(sizes):
        end = min(start + size, lhs.shape[0])
        out[start:end] = lhs[start:end] @ rhs[group]
        start = end
    return out


def operands(dtype, num_rows=M, seed=0):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((num_rows, K)), dtype)
    rhs = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), dtype)
    return lhs, rhs


def assert_close(actual, expected, dtype):
    tolerance = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                               rtol=tolerance, atol=tolerance)


def test_hand_computed_case():
    # rhs[g] = (g + 1) * I, so a row of group g comes out as (g + 1) times itself.
    lhs = jnp.arange(5 * 16, dtype=jnp.float32).reshape(5, 16)
    rhs = jnp.stack([(g + 1) * jnp.eye(16, dtype=jnp.float32) for g in range(3)])
    out = grouped_matmul(lhs, rhs, jnp.array([2, 0, 2], jnp.int32),
                         blocks=GroupedMatmulBlocks(16, 16, 16), interpret=True)
    expected = np.concatenate([1 * np.asarray(lhs[:2]), 3 * np.asarray(lhs[2:4]),
                               np.zeros((1, 16))])
    np.testing.assert_array_equal(np.asarray(out), expected)


@pytest.mark.parametrize("blocks", BLOCKS, ids=lambda b: f"{b.block_m}x{b.block_n}x{b.block_k}")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_kernel_matches_ragged_dot_and_the_loop(dtype, blocks):
    lhs, rhs = operands(dtype)
    for sizes in SIZES:
        group_sizes = jnp.array(sizes, jnp.int32)
        out = grouped_matmul(lhs, rhs, group_sizes, blocks=blocks, interpret=True)
        assert out.shape == (M, N) and out.dtype == dtype
        reference = grouped_matmul_reference(lhs, rhs, group_sizes)
        assert_close(out, reference, dtype)
        assert_close(out, loop_reference(lhs, rhs, sizes), dtype)
        covered = min(sum(sizes), M)
        assert not np.any(np.asarray(out[covered:], np.float32)), sizes


def test_fewer_rows_than_one_tile():
    lhs, rhs = operands(jnp.float32, num_rows=5, seed=1)
    sizes = (1, 0, 3, 0)
    out = grouped_matmul(lhs, rhs, jnp.array(sizes, jnp.int32),
                         blocks=GroupedMatmulBlocks(32, 16, 16), interpret=True)
    assert out.shape == (5, N)
    assert_close(out, loop_reference(lhs, rhs, sizes), jnp.float32)


def assert_schedule_covers(sizes, num_rows: int, block_m: int) -> None:
    """The tile schedule of ``sizes`` has ``num_tiles`` tiles and covers every row once, each
    with its group (-1 past the last group)."""
    groups = len(sizes)
    tiles = np.asarray(tile_schedule(jnp.array(sizes, jnp.int32), num_rows, block_m))
    assert tiles.shape == (num_tiles(num_rows, groups, block_m), 3)
    ends = np.minimum(np.cumsum(sizes), num_rows)
    row_group = np.searchsorted(ends, np.arange(num_rows), side="right")
    row_group[row_group == groups] = -1  # past the last group
    owner = np.full(num_rows, -2)
    for group, first, end in tiles:
        assert 0 <= end - first <= block_m
        if end > first:
            assert np.all(owner[first:end] == -2), (sizes, tiles)  # no row twice
            assert np.all(row_group[first:end] == group), (sizes, tiles)
            owner[first:end] = group
    assert np.all(owner != -2), (sizes, tiles)


@pytest.mark.parametrize("block_m", [16, 32])
def test_tile_schedule_covers_every_row_once_with_its_group(block_m):
    rng = np.random.default_rng(2)
    for sizes in list(SIZES) + [tuple(rng.integers(0, 20, G)) for _ in range(20)]:
        assert_schedule_covers(sizes, M, block_m)


def test_the_tile_schedule_and_its_sorted_bound_count_run_no_loop():
    """The schedule is part of every compiled MoE step: it must not hold a while loop (a binary
    search runs as one, a kernel launch per halving step on a GPU). ``count_at_most`` counts as
    numpy's right-side search does, repeated and out-of-range values included."""
    bounds = jnp.array([0, 3, 3, 7, 12], jnp.int32)
    values = jnp.arange(-2, 15, dtype=jnp.int32)
    np.testing.assert_array_equal(
        count_at_most(bounds, values),
        np.searchsorted(np.asarray(bounds), np.asarray(values), side="right"))
    sizes = jnp.array([3, 0, 5, 2], jnp.int32)
    for fn, args in ((count_at_most, (bounds, values)),
                     (lambda s: tile_schedule(s, 16, 4), (sizes,))):
        assert "while" not in str(jax.make_jaxpr(fn)(*args))


def test_a_few_rows_among_many_groups_take_a_few_tiles():
    """A decode step's shape, 6 rows over 48 groups: the schedule has cdiv(6, 16) + 6 tiles,
    not one per group, still covers every row once with its group (rows routed to distinct
    groups, to shared ones, and past the last group), and the kernel matches the loop."""
    rows, groups = 6, 48
    assert num_tiles(rows, groups, 16) == 7
    rng = np.random.default_rng(3)
    lhs = jnp.asarray(rng.standard_normal((rows, K)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((groups, K, N)) / np.sqrt(K), jnp.float32)
    cases = [np.bincount(rng.choice(groups, size=used, replace=shared), minlength=groups)
             for used, shared in ((6, False), (6, True), (4, False), (0, True))]
    for sizes in cases:
        assert_schedule_covers(tuple(sizes), rows, 16)
        out = grouped_matmul(lhs, rhs, jnp.array(sizes, jnp.int32),
                             blocks=GroupedMatmulBlocks(16, 16, 16), interpret=True)
        assert_close(out, loop_reference(lhs, rhs, sizes), jnp.float32)


def test_shapes_the_blocks_do_not_divide_are_rejected():
    lhs, rhs = operands(jnp.float32)
    with pytest.raises(ValueError, match="K=32 and N=32 must be multiples"):
        grouped_matmul(lhs, rhs, jnp.zeros(G, jnp.int32),
                       blocks=GroupedMatmulBlocks(16, 64, 16), interpret=True)
    with pytest.raises(ValueError, match="powers of 2"):
        GroupedMatmulBlocks(16, 48, 16)
    with pytest.raises(ValueError, match="dtype"):
        grouped_matmul(lhs, rhs.astype(jnp.bfloat16), jnp.zeros(G, jnp.int32), interpret=True)


def test_the_pallas_kernel_is_chosen_on_gpus_for_sizes_its_blocks_divide():
    kimi = {"sizes": (2304, 1024), "dtype": jnp.bfloat16}
    assert choose_grouped_kernel(**kimi, platform="gpu").backend == PALLAS
    assert choose_grouped_kernel(**kimi, platform="cpu") == REFERENCE_GROUPED_MATMUL
    assert choose_grouped_kernel(sizes=(2304, 1000), dtype=jnp.bfloat16,
                                 platform="gpu") == REFERENCE_GROUPED_MATMUL
    assert choose_grouped_kernel(sizes=(2304, 1024), dtype=jnp.int8,
                                 platform="gpu") == REFERENCE_GROUPED_MATMUL


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_moe_with_the_pallas_kernel_matches_ragged_dot(dtype):
    def moe(kernel=None):  # the sorted path at every pair count: it runs the grouped matmuls
        extra = {} if kernel is None else {"grouped_kernel": kernel}
        return KimiMoE(32, 16, num_experts=8, top_k=2, num_groups=2, topk_groups=2,
                       num_shared=1, renormalize=True, scaling=2.0, dtype=dtype,
                       param_dtype=dtype, rngs=nnx.Rngs(3), expert_rows_kernel=NO_EXPERT_ROWS,
                       **extra)

    pallas = GroupedMatmulKernel(PALLAS, GroupedMatmulBlocks(16, 16, 16), interpret=True)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 12, 32)), dtype)
    expected = moe()(x)
    actual = moe(pallas)(x)
    assert actual.shape == x.shape and actual.dtype == expected.dtype
    assert_close(actual, expected, dtype)
