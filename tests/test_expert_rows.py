"""The expert-rows kernel (``kernels/expert_rows.py``): the Pallas kernel (interpreted on the CPU)
against its reference, the reference against a float64 loop over the pairs, the split count, the
choice per platform; and the MoE's rows path against its sorted grouped path, on one device and
with the experts split over 2 devices.

The split run happens in a subprocess that sees several CPU devices (``parallel_checks``): this
file run as a script is that worker and prints one JSON line.
"""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tokenspeed_jax.kernels.expert_rows import (
    MAX_PAIRS,
    NO_EXPERT_ROWS,
    ExpertRowsBlocks,
    ExpertRowsKernel,
    _swiglu_rounded,
    choose_expert_rows_kernel,
    expert_rows_mlp,
    expert_rows_mlp_reference,
    split_count,
)
from tokenspeed_jax.kernels.paged_attention_backend import PALLAS, REFERENCE
from tokenspeed_jax.models.moe import KimiMoE

T, D, F, E = 16, 32, 64, 6
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
BLOCKS = {  # with 16-wide blocks the up projection has 2 steps of K, the down projection 4
    "unsplit": ExpertRowsBlocks(16, 16, dot_rows=False, fill_programs=1),
    "split": ExpertRowsBlocks(16, 16, dot_rows=False, fill_programs=10**6),  # a split per step
    "dot_rows": ExpertRowsBlocks(16, 16, fill_programs=10**6),
}
DTYPES = [jnp.float32, jnp.bfloat16]


def operands(dtype, num_tokens: int, per_token: int = 2, seed: int = 0):
    """x [T, D] and experts [num_tokens, per_token] (rows of x past num_tokens are not used by
    any pair), w1, w3, w2. From 2 tokens on the second token's first expert repeats the first
    token's and the last pair has expert -1 (another device's); from 4 tokens on the third
    token's first expert is E (past the stack)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((num_tokens, D)), dtype)
    w1, w3 = (jnp.asarray(rng.standard_normal((E, D, F)) / np.sqrt(D), dtype) for _ in range(2))
    w2 = jnp.asarray(rng.standard_normal((E, F, D)) / np.sqrt(F), dtype)
    experts = rng.integers(0, E, (num_tokens, per_token))
    if num_tokens >= 2:
        experts[1, 0], experts[-1, -1] = experts[0, 0], -1
    if num_tokens >= 4:
        experts[2, 0] = E
    return x, jnp.asarray(experts, jnp.int32), w1, w3, w2


def assert_close(actual, expected, dtype):
    tolerance = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                               rtol=tolerance, atol=tolerance)


def round_to(value, dtype) -> np.ndarray:
    """``value`` rounded to float32, then to ``dtype`` (to nearest even), as float64."""
    return np.asarray(jnp.asarray(value, jnp.float32).astype(dtype), np.float64)


def loop_reference(x, experts, w1, w3, w2, dtype, live=None) -> np.ndarray:
    """float64, pair by pair, rounding each projection and the activation to ``dtype`` as the
    module's contract says; zeros for an expert outside the stack or a row not live. Experts
    at ids E, E + 1, ... of ``w1`` etc. past ``experts``' columns are shared: one more pair of
    every token each."""
    rounded = functools.partial(round_to, dtype=dtype)
    x, w1, w3, w2 = (np.asarray(a, np.float64) for a in (x, w1, w3, w2))
    experts = np.asarray(experts)
    num_shared = w1.shape[0] - E
    out = np.zeros((*experts.shape[:1], experts.shape[1] + num_shared, x.shape[1]))
    for t, row in enumerate(experts):
        routed = [e if live is None or live[t] else -1 for e in row]
        for j, e in enumerate([*routed, *range(E, E + num_shared)]):
            if 0 <= e < w1.shape[0] and (j >= len(row) or e < E):
                gate, up = rounded(x[t] @ w1[e]), rounded(x[t] @ w3[e])
                out[t, j] = rounded(rounded(gate / (1 + np.exp(-gate))) * up) @ w2[e]
    return out


@pytest.mark.parametrize("blocks", BLOCKS.values(), ids=BLOCKS.keys())
@pytest.mark.parametrize("num_tokens, per_token", [(1, 1), (2, 2), (4, 2), (8, 8)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_kernel_matches_the_reference(dtype, num_tokens, per_token, blocks):
    args = operands(dtype, num_tokens, per_token)
    out = expert_rows_mlp(*args, blocks=blocks, interpret=True)
    assert out.shape == (num_tokens, per_token, D) and out.dtype == dtype
    assert_close(out, expert_rows_mlp_reference(*args), dtype)
    outside = ~((args[1] >= 0) & (args[1] < E))
    assert not np.any(np.asarray(out, np.float32)[np.asarray(outside)])


def with_shared(num_shared: int = 2, seed: int = 5):
    """Float32 ``operands`` of 8 tokens with 3 routed experts each, plus a shared stack of
    ``num_shared`` experts; some routed ids past the routed stack (not the shared one's)."""
    x, experts, w1, w3, w2 = operands(jnp.float32, 8, 3, seed=seed)
    rng = np.random.default_rng(seed)
    shared = tuple(jnp.asarray(rng.standard_normal((num_shared, *w.shape[1:])) / 8, w.dtype)
                   for w in (w1, w3, w2))
    experts = experts.at[5, 1].set(E + 1)  # not a shared pair: ids of the routed stack only
    return (x, experts, w1, w3, w2), shared


@pytest.mark.parametrize("blocks", BLOCKS.values(), ids=BLOCKS.keys())
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_kernel_with_a_shared_stack_and_live_rows_matches_the_reference(dtype, blocks):
    (x, experts, *weights), shared = with_shared()
    x, weights, shared = x.astype(dtype), [w.astype(dtype) for w in weights], tuple(
        w.astype(dtype) for w in shared)
    live = jnp.asarray([True, True, False, True, True, True, False, True])
    out = expert_rows_mlp(x, experts, *weights, shared, live, blocks=blocks, interpret=True)
    assert out.shape == (8, 3 + 2, D)
    assert_close(out, expert_rows_mlp_reference(x, experts, *weights, shared, live), dtype)
    out = np.asarray(out, np.float32)
    assert not out[[2, 6], :3].any() and not out[5, 1].any()  # rows not live; an id past E
    assert np.all(out[:, 3:].any(axis=2))  # the shared pairs of every row, live or not


def test_reference_with_a_shared_stack_and_live_rows_matches_a_loop():
    (x, experts, w1, w3, w2), shared = with_shared(seed=2)
    live = np.array([True, False, True, True, True, True, True, False])
    whole = (jnp.concatenate([w, s]) for w, s in zip((w1, w3, w2), shared))
    assert_close(expert_rows_mlp_reference(x, experts, w1, w3, w2, shared, jnp.asarray(live)),
                 loop_reference(x, experts, *whole, jnp.float32, live), jnp.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_reference_matches_a_loop_over_the_pairs(dtype):
    args = operands(dtype, 4, 3, seed=1)
    assert_close(expert_rows_mlp_reference(*args), loop_reference(*args, dtype), dtype)


def test_the_kernels_activation_rounds_each_operation():
    """The down call's in-kernel activation against its contract computed in float64: silu of
    the bf16-rounded gate, each operation's result rounded to bf16, times the rounded up."""
    rng = np.random.default_rng(3)
    gate, up = (rng.standard_normal(8192) * 4 for _ in range(2))

    rounded = functools.partial(round_to, dtype=jnp.bfloat16)
    g, u = rounded(gate), rounded(up)
    want = rounded(rounded(g * rounded(1 / (1 + np.exp(-g)))) * u)
    got = np.asarray(_swiglu_rounded(jnp.asarray(gate, jnp.float32),
                                     jnp.asarray(up, jnp.float32), jnp.bfloat16), np.float64)
    assert np.mean(got == want) > 0.999  # float32's sigmoid may round the other way, rarely
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=0)


def test_split_count_is_the_fewest_dividing_splits_that_fill_the_programs():
    assert split_count(programs=8, steps=36, fill_programs=128) == 18  # 16 does not divide 36
    assert split_count(programs=64, steps=36, fill_programs=128) == 2
    assert split_count(programs=144, steps=16, fill_programs=128) == 1
    assert split_count(programs=1, steps=4, fill_programs=128) == 4  # at most one per step
    assert split_count(programs=8, steps=7, fill_programs=1) == 1


def test_bad_operands_and_knobs_are_rejected():
    x, experts, w1, w3, w2 = operands(jnp.float32, 3)
    with pytest.raises(ValueError, match=r"w3 \(6, 32, 64\) and w2 \(6, 32, 64\) must be"):
        expert_rows_mlp_reference(x, experts, w1, w3, w3)
    with pytest.raises(ValueError, match="one dtype"):
        expert_rows_mlp_reference(x.astype(jnp.bfloat16), experts, w1, w3, w2)
    with pytest.raises(ValueError, match=r"experts \(2, 2\) must be \[3, n\]"):
        expert_rows_mlp_reference(x, experts[:2], w1, w3, w2)
    with pytest.raises(ValueError, match=r"live \(2,\) must be \[3\]"):
        expert_rows_mlp_reference(x, experts, w1, w3, w2, live=jnp.ones(2, bool))
    with pytest.raises(ValueError, match="hidden=32 and intermediate=64 must be multiples"):
        expert_rows_mlp(x, experts, w1, w3, w2, blocks=ExpertRowsBlocks(64, 16),
                        interpret=True)
    with pytest.raises(ValueError, match="powers of 2"):
        ExpertRowsBlocks(48, 16)
    with pytest.raises(ValueError, match="max_pairs=-1"):
        ExpertRowsKernel(max_pairs=-1)


def test_the_pallas_kernel_is_chosen_on_gpus_and_shows_in_the_repr():
    kimi = {"hidden": 2304, "intermediate": 1024, "dtype": jnp.bfloat16}
    gpu = choose_expert_rows_kernel(**kimi, platform="gpu")
    assert (gpu.backend, gpu.max_pairs) == (PALLAS, MAX_PAIRS)
    assert "backend='pallas'" in repr(gpu) and f"max_pairs={MAX_PAIRS}" in repr(gpu)
    assert choose_expert_rows_kernel(**kimi, platform="cpu") == NO_EXPERT_ROWS
    # shapes or dtypes the kernel cannot take turn the path off on a GPU: the reference would
    # copy every pair's expert weights there
    assert choose_expert_rows_kernel(hidden=2304, intermediate=1000, dtype=jnp.bfloat16,
                                     platform="gpu") == NO_EXPERT_ROWS
    assert choose_expert_rows_kernel(hidden=2304, intermediate=1024, dtype=jnp.int8,
                                     platform="gpu") == NO_EXPERT_ROWS


# ----------------------------------------------------------------------------- the MoE's paths

PALLAS_ROWS = ExpertRowsKernel(PALLAS, blocks=ExpertRowsBlocks(16, 16), interpret=True)


def small_moe(dtype, expert_rows_kernel: ExpertRowsKernel) -> KimiMoE:
    return KimiMoE(32, 16, num_experts=8, top_k=2, num_groups=2, topk_groups=2, num_shared=1,
                   renormalize=True, scaling=2.0, dtype=dtype, param_dtype=dtype,
                   rngs=nnx.Rngs(3), expert_rows_kernel=expert_rows_kernel)


def tokens(dtype, num_tokens: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(4).standard_normal((num_tokens, 32)), dtype)


@pytest.mark.parametrize("rows", [ExpertRowsKernel(REFERENCE), PALLAS_ROWS],
                         ids=["reference", "pallas"])
@pytest.mark.parametrize("num_tokens", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_moe_rows_path_matches_the_sorted_path(dtype, num_tokens, rows):
    x = tokens(dtype, num_tokens)
    expected = small_moe(dtype, NO_EXPERT_ROWS)(x)
    actual = small_moe(dtype, rows)(x)
    assert actual.shape == x.shape and actual.dtype == expected.dtype
    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("rows", [NO_EXPERT_ROWS, ExpertRowsKernel(REFERENCE), PALLAS_ROWS],
                         ids=["sorted", "reference", "pallas"])
def test_rows_that_are_not_live_route_to_no_expert(rows):
    moe = small_moe(jnp.float32, rows)
    x = tokens(jnp.float32, 4)
    live = np.array([True, False, True, False])
    masked, whole = np.asarray(moe(x, live=jnp.asarray(live))), np.asarray(moe(x))
    # a live row keeps its pairs, in their order: the same result
    np.testing.assert_allclose(masked[live], whole[live], rtol=1e-6, atol=1e-6)
    # the others keep the shared experts alone: their routed part is zero (on the rows paths
    # the shared expert is a pair of the kernel call: its own summation order)
    np.testing.assert_allclose(masked[~live], np.asarray(moe.shared_experts(x))[~live],
                               rtol=1e-6, atol=1e-6)
    assert np.abs(whole[~live] - masked[~live]).max() > 1e-3  # they had a routed part


def count_outside_kernels(jaxpr, primitive: str) -> int:
    """Equations of ``primitive`` in ``jaxpr`` and its nested jaxprs, not inside a Pallas
    kernel's body."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == primitive
        if eqn.primitive.name == "pallas_call":
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += count_outside_kernels(sub, primitive)
    return count


@pytest.mark.parametrize("rows", [ExpertRowsKernel(REFERENCE), PALLAS_ROWS],
                         ids=["reference", "pallas"])
def test_the_shared_expert_is_a_pair_of_the_rows_call(rows):
    """On the rows path the shared expert's three products are the kernel's: the step's only
    dot left is the router's (the sorted path keeps the shared SwiGLU's three)."""
    x = tokens(jnp.float32, 3)

    def dots(moe: KimiMoE) -> int:
        return count_outside_kernels(jax.make_jaxpr(moe)(x).jaxpr, "dot_general")

    assert dots(small_moe(jnp.float32, NO_EXPERT_ROWS)) == 4
    moe = small_moe(jnp.float32, rows)
    assert dots(moe) == 1 + (3 if rows.backend == REFERENCE else 0)  # the reference's einsums
    expected = np.asarray(small_moe(jnp.float32, NO_EXPERT_ROWS)(x))
    np.testing.assert_allclose(np.asarray(moe(x)), expected, rtol=1e-5, atol=1e-5)


def test_the_pair_count_picks_the_path():
    moe = small_moe(jnp.float32, ExpertRowsKernel(max_pairs=4))  # top-2: 2 tokens, 4 pairs

    def sorts(num_tokens: int) -> bool:
        jaxpr = str(jax.make_jaxpr(moe)(tokens(jnp.float32, num_tokens)))
        return re.search(r"\bsort\[", jaxpr) is not None  # the primitive, not a parameter

    assert not sorts(2) and sorts(3)


def _split_experts_worker() -> dict:
    """The largest |difference| between the rows path with the experts split over 2 devices
    and, unsplit, the rows path and the sorted path (float32, 3 tokens: 6 pairs)."""
    from tokenspeed_jax.parallel import make_mesh

    x = tokens(jnp.float32, 3)
    mesh = make_mesh(2)
    split = small_moe(jnp.float32, PALLAS_ROWS)(x, mesh=mesh)
    whole = {"rows": small_moe(jnp.float32, PALLAS_ROWS)(x),
             "sorted": small_moe(jnp.float32, NO_EXPERT_ROWS)(x),
             "sorted_split": small_moe(jnp.float32, NO_EXPERT_ROWS)(x, mesh=mesh)}
    return {name: float(jnp.abs(split - out).max()) for name, out in whole.items()}


def test_rows_path_with_the_experts_split_over_two_devices():
    from parallel_checks import run_on_cpu_devices

    differences = run_on_cpu_devices(__file__)
    assert set(differences) == {"rows", "sorted", "sorted_split"}
    assert max(differences.values()) < 1e-5, differences


if __name__ == "__main__":
    print(json.dumps(_split_experts_worker()))
