"""Paged attention kernels against the plain masked-attention reference on small shapes.

The Pallas decode op (JAX's ``pallas.ops.gpu.paged_attention``) and the fused decode kernel
(``paged_decode``) run in interpret mode on the CPU; expectations come from
``attention_ref.masked_attention`` over each request's dense context, built here from the pages by
hand, and from ``write_kv``'s pages.

Under tensor parallelism the fused kernel runs per shard of the KV heads; that check needs several
devices, so it runs in a subprocess that sees 4 CPU devices: this file run as a script is that
worker (``python tests/test_paged_attention.py sharded``; it prints one JSON line).
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax.kernels.attention import paged_decode_attention, write_kv
from tokenspeed_jax.kernels.attention_ref import masked_attention
from tokenspeed_jax.kernels.paged_attention_backend import (
    FUSED,
    PALLAS,
    REFERENCE,
    DecodeKernel,
    choose_decode_kernel,
    pallas_unsupported_reason,
)
from tokenspeed_jax.kernels.paged_decode import (
    FILL_PROGRAMS,
    decode_attention_step,
    fused_paged_decode,
    fused_paged_decode_reference,
    fused_split_count,
)
from tokenspeed_jax.kernels.rotary import rotary_tables

PAGE = 4
NUM_PAGES = 24
SCALE = 0.3


def cache(rng, num_kv_heads, head_dim):
    shape = (num_kv_heads, NUM_PAGES, PAGE, head_dim)
    return (jnp.asarray(rng.standard_normal(shape), jnp.float32),
            jnp.asarray(rng.standard_normal(shape), jnp.float32))


def dense_context(pages, table, length):
    """[length, Hkv, Dh]: a request's positions 0..length-1 read from its pages."""
    pos = np.arange(length)
    return np.asarray(pages)[:, table[pos // PAGE], pos % PAGE].transpose(1, 0, 2)


def expected_decode(q, k_pages, v_pages, tables, positions):
    rows = []
    for i, position in enumerate(positions):
        if position < 0:
            rows.append(np.zeros(q.shape[1:], np.float32))
            continue
        k = dense_context(k_pages, tables[i], position + 1)[None]
        v = dense_context(v_pages, tables[i], position + 1)[None]
        mask = np.ones((1, 1, position + 1), bool)
        rows.append(np.asarray(masked_attention(q[i][None, None], k, v, mask, scale=SCALE))[0, 0])
    return np.stack(rows)


@pytest.mark.parametrize("kernel", [DecodeKernel(REFERENCE),
                                    DecodeKernel(PALLAS, pages_per_compute_block=2, k_splits=2,
                                                 interpret=True)],
                         ids=["reference", "pallas-interpret"])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(9, 3), (4, 2), (32, 2)])
def test_decode_matches_dense_attention(kernel, num_q_heads, num_kv_heads):
    """Head groups of 3 (SmolLM2: 9 q / 3 kv heads, padded to block_h=16), 2 and 16; a padding
    row, lengths inside and at the end of a page, a table width (5) the op's blocks don't divide."""
    rng = np.random.default_rng(num_q_heads)
    head_dim = 16
    k_pages, v_pages = cache(rng, num_kv_heads, head_dim)
    tables = np.array([[3, 7, 1, 0, 0], [2, 4, 6, 8, 10], [5, 0, 0, 0, 0], [9, 0, 0, 0, 0]],
                      np.int32)
    positions = np.array([9, 19, 3, -1], np.int32)
    q = rng.standard_normal((4, num_q_heads, head_dim)).astype(np.float32)
    out = paged_decode_attention(jnp.asarray(q), k_pages, v_pages, jnp.asarray(tables),
                                 jnp.asarray(positions), scale=SCALE, kernel=kernel)
    np.testing.assert_allclose(np.asarray(out), expected_decode(q, k_pages, v_pages, tables,
                                                                positions),
                               rtol=2e-5, atol=2e-5)
    assert not np.any(np.asarray(out)[3])


TABLES = np.array([[3, 7, 1, 0, 0], [2, 4, 6, 8, 10], [5, 0, 0, 0, 0], [9, 0, 0, 0, 0]], np.int32)
POSITIONS = np.array([9, 19, 3, -1], np.int32)  # inside and at the end of a page; padding


def slots_of(tables, positions):
    """Each row's slot for its position, by hand (-1 for padding)."""
    rows = np.arange(len(positions))
    return np.where(positions >= 0, tables[rows, positions // PAGE] * PAGE + positions % PAGE, -1)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(9, 3), (4, 2), (32, 2)])
def test_fused_decode_writes_kv_and_matches_dense_attention(num_q_heads, num_kv_heads, splits):
    """The fused kernel (interpreted) and its plain-JAX reference against the unfused route: the
    pages equal ``write_kv``'s bit for bit and the output the dense attention over the written
    context. Three splits of a context of 3, 5 and 10 pages leave some splits empty."""
    rng = np.random.default_rng(num_q_heads + splits)
    head_dim = 16
    k_pages, v_pages = cache(rng, num_kv_heads, head_dim)
    tables, positions = TABLES, POSITIONS
    q = rng.standard_normal((4, num_q_heads, head_dim)).astype(np.float32)
    k_new, v_new = (jnp.asarray(rng.standard_normal((4, num_kv_heads, head_dim)), jnp.float32)
                    for _ in "kv")
    slots = slots_of(tables, positions)
    want_k = write_kv(k_pages, k_new, jnp.asarray(slots, jnp.int32))
    want_v = write_kv(v_pages, v_new, jnp.asarray(slots, jnp.int32))
    out, got_k, got_v = fused_paged_decode(
        jnp.asarray(q), k_new, v_new, k_pages, v_pages, jnp.asarray(tables),
        jnp.asarray(positions), scale=SCALE, pages_per_block=2, splits=splits, interpret=True)
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(want_v))
    want = expected_decode(q, want_k, want_v, tables, positions)
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)
    assert not np.any(np.asarray(out)[3])
    ref_out, ref_k, ref_v = fused_paged_decode_reference(
        jnp.asarray(q), k_new, v_new, k_pages, v_pages, jnp.asarray(tables),
        jnp.asarray(positions), scale=SCALE)
    np.testing.assert_array_equal(np.asarray(ref_k), np.asarray(want_k))
    np.testing.assert_array_equal(np.asarray(ref_v), np.asarray(want_v))
    np.testing.assert_allclose(np.asarray(ref_out), want, rtol=2e-5, atol=2e-5)


def _primitives(jaxpr) -> list[str]:
    """Every primitive name in ``jaxpr`` and the jaxprs inside it (jit, pallas_call bodies
    excluded: a kernel counts once)."""
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        if eqn.primitive.name == "pallas_call":
            continue
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                names += _primitives(inner)
    return names


def decode_step_inputs(rng, num_q_heads: int, num_kv_heads: int) -> tuple:
    """``decode_attention_step``'s arguments for TABLES and POSITIONS (head size 16): q, the
    step's k and v, the pages, then the page tables, positions and slots."""
    k_pages, v_pages = cache(rng, num_kv_heads, 16)
    q = jnp.asarray(rng.standard_normal((4, num_q_heads, 16)), jnp.float32)
    k_new, v_new = (jnp.asarray(rng.standard_normal((4, num_kv_heads, 16)), jnp.float32)
                    for _ in "kv")
    return (q, k_new, v_new, k_pages, v_pages, jnp.asarray(TABLES), jnp.asarray(POSITIONS),
            jnp.asarray(slots_of(TABLES, POSITIONS), jnp.int32))


def test_fused_decode_step_is_one_kernel_without_scatters():
    """A decode layer's attention on the fused kernel: one pallas_call and no scatter (the
    unfused route scatters K and V before its kernel)."""
    args = decode_step_inputs(np.random.default_rng(1), 9, 3)

    def primitives(kernel):
        step = functools.partial(decode_attention_step, scale=SCALE, kernel=kernel)
        return _primitives(jax.make_jaxpr(step)(*args).jaxpr)

    fused = primitives(DecodeKernel(FUSED, pages_per_compute_block=2, k_splits=1,
                                    interpret=True))
    assert fused.count("pallas_call") == 1 and "scatter" not in fused
    unfused = primitives(DecodeKernel(PALLAS, pages_per_compute_block=2, interpret=True))
    assert unfused.count("scatter") == 2 and unfused.count("pallas_call") == 1


def test_fused_decode_in_bfloat16():
    """bf16 query and cache: the output within bf16 rounding of the fp32 attention over the
    same (bf16) values, the written rows (position 13: table entry 3, page 1, row 1) exactly the
    new K/V."""
    rng = np.random.default_rng(5)
    k_pages, v_pages = (x.astype(jnp.bfloat16) for x in cache(rng, 3, 32))
    tables = np.array([[4, 2, 9, 1, 0, 0, 0, 0]], np.int32)
    positions = np.array([13], np.int32)
    q = jnp.asarray(rng.standard_normal((1, 9, 32)), jnp.bfloat16)
    k_new, v_new = (jnp.asarray(rng.standard_normal((1, 3, 32)), jnp.bfloat16) for _ in "kv")
    out, got_k, got_v = fused_paged_decode(q, k_new, v_new, k_pages, v_pages,
                                           jnp.asarray(tables), jnp.asarray(positions),
                                           scale=SCALE, interpret=True)
    np.testing.assert_array_equal(np.asarray(got_k[:, 1, 1], np.float32),
                                  np.asarray(k_new[0], np.float32))
    np.testing.assert_array_equal(np.asarray(got_v[:, 1, 1], np.float32),
                                  np.asarray(v_new[0], np.float32))
    want = expected_decode(np.asarray(q, np.float32), np.asarray(got_k, np.float32),
                           np.asarray(got_v, np.float32), tables, positions)
    np.testing.assert_allclose(np.asarray(out, np.float32), want, rtol=2e-2, atol=2e-2)


def rotate_half_by_hand(x, positions, inv_freq):
    """HF's rotate-half RoPE of rows ``x [B, N, Dh]`` at ``positions [B]``, in numpy float32."""
    angles = positions.astype(np.float32)[:, None] * inv_freq.astype(np.float32)
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
    first, second = np.split(np.asarray(x, np.float32), 2, axis=-1)
    return np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
def test_decode_step_rotates_q_and_k(fused):
    """Given unrotated q and k and RoPE tables, the fused kernel (interpreted, 4 splits) and the
    reference route write the hand-rotated keys into the pages and attend with the hand-rotated
    queries."""
    args = decode_step_inputs(np.random.default_rng(7), 9, 3)
    q, k_new, v_new, k_pages, v_pages, _, _, slots = args
    inv_freq = 1.0 / 500.0 ** (np.arange(0, 16, 2) / 16)
    kernel = (DecodeKernel(FUSED, pages_per_compute_block=2, k_splits=4, interpret=True)
              if fused else DecodeKernel(REFERENCE))
    out, got_k, got_v = decode_attention_step(
        *args, rotary_tables(jnp.asarray(POSITIONS), inv_freq), scale=SCALE, kernel=kernel)
    rotated_k = rotate_half_by_hand(k_new, POSITIONS, inv_freq)
    want_k = np.asarray(write_kv(k_pages, jnp.asarray(rotated_k), slots))
    np.testing.assert_allclose(np.asarray(got_k), want_k, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(write_kv(v_pages, v_new, slots)))
    want = expected_decode(rotate_half_by_hand(q, POSITIONS, inv_freq), want_k,
                           np.asarray(got_v), TABLES, POSITIONS)
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)


def test_fused_split_count_fills_the_gpu_at_small_batches():
    """Hand-computed against FILL_PROGRAMS = 128: the fewest splits (at most 4) that reach 128
    (request, KV head, split) programs."""
    assert FILL_PROGRAMS == 128
    assert fused_split_count(1, 8, 4) == 4  # 8 programs: capped at 4 splits
    assert fused_split_count(8, 3, 4) == 4  # 24: 6 would fill, capped
    assert fused_split_count(32, 3, 4) == 2  # 96: 2 splits make 192
    assert fused_split_count(32, 8, 4) == 1  # 256 already
    assert fused_split_count(1, 8, 1) == 1


def test_fused_decode_step_splits_small_batches():
    """At 4 requests and 3 KV heads the fused step takes 4 splits and merges them (the merge's
    exp2 appears beside the one pallas_call); its output and pages match the reference route."""
    args = decode_step_inputs(np.random.default_rng(2), 9, 3)
    kernel = DecodeKernel(FUSED, pages_per_compute_block=2, k_splits=4, interpret=True)
    step = functools.partial(decode_attention_step, scale=SCALE, kernel=kernel)
    names = _primitives(jax.make_jaxpr(step)(*args).jaxpr)
    assert names.count("pallas_call") == 1 and "exp2" in names
    got = step(*args)
    want = decode_attention_step(*args, scale=SCALE)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=2e-5, atol=2e-5)
    for got_pages, want_pages in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(np.asarray(got_pages), np.asarray(want_pages))


def test_write_kv_drops_padding_slots():
    k_pages = jnp.zeros((2, 3, PAGE, 4), jnp.float32)
    new = jnp.arange(3 * 2 * 4, dtype=jnp.float32).reshape(3, 2, 4) + 1
    out = np.asarray(write_kv(k_pages, new, jnp.asarray([5, -1, 0], jnp.int32)))
    np.testing.assert_array_equal(out[:, 1, 1], np.asarray(new[0]))
    np.testing.assert_array_equal(out[:, 0, 0], np.asarray(new[2]))
    assert np.count_nonzero(out) == 2 * 2 * 4


def test_backend_choice_is_static_and_declared():
    assert choose_decode_kernel(head_dim=64, page_size=16, dtype=jnp.bfloat16,
                                platform="cpu").backend == REFERENCE
    assert choose_decode_kernel(head_dim=64, page_size=16, dtype=jnp.bfloat16,
                                platform="gpu").backend == PALLAS
    assert "head_dim=80" in pallas_unsupported_reason(head_dim=80, page_size=16,
                                                      dtype=jnp.bfloat16)
    assert "page_size=12" in pallas_unsupported_reason(head_dim=64, page_size=12,
                                                       dtype=jnp.bfloat16)
    assert choose_decode_kernel(head_dim=80, page_size=16, dtype=jnp.bfloat16,
                                platform="gpu").backend == REFERENCE
    with pytest.raises(ValueError, match="block_h=8"):
        DecodeKernel(PALLAS, block_h=8)
    fused = choose_decode_kernel(head_dim=64, page_size=16, dtype=jnp.bfloat16, platform="gpu",
                                 fused=True)
    assert (fused.backend, fused.k_splits) == (FUSED, 4)
    assert choose_decode_kernel(head_dim=64, page_size=16, dtype=jnp.bfloat16, platform="cpu",
                                fused=True).backend == REFERENCE
    # The fused kernel's 4 pages of 2 tokens make an 8-key block, below Triton's dot minimum;
    # the op's 8 pages make 16.
    assert choose_decode_kernel(head_dim=64, page_size=2, dtype=jnp.bfloat16, platform="gpu",
                                fused=True).backend == PALLAS
    with pytest.raises(ValueError, match="'fused'"):
        DecodeKernel("fast")


def _sharded_fused_decode(mesh_size: int) -> dict:
    """``decode_attention_step`` with the fused kernel (interpreted, rotating q and k) per shard
    of 4 KV heads over ``mesh_size`` devices, against the unfused reference route on one
    device."""
    from tokenspeed_jax import parallel

    mesh = parallel.make_mesh(mesh_size)
    kernel = DecodeKernel(FUSED, pages_per_compute_block=2, k_splits=4, interpret=True,
                          mesh=mesh)
    q, k_new, v_new, k_pages, v_pages, *metadata = decode_step_inputs(
        np.random.default_rng(mesh_size), 8, 4)
    metadata += rotary_tables(metadata[1], 1.0 / 100.0 ** (np.arange(8) / 8))
    want = decode_attention_step(q, k_new, v_new, k_pages, v_pages, *metadata[:3], metadata[3:],
                                 scale=SCALE)
    heads, pages = (jax.NamedSharding(mesh, parallel.head_spec(3)),
                    jax.NamedSharding(mesh, parallel.head_spec(4, axis=0)))
    args = (jax.device_put(q, heads), jax.device_put(k_new, heads), jax.device_put(v_new, heads),
            jax.device_put(k_pages, pages), jax.device_put(v_pages, pages),
            *(jax.device_put(x, parallel.replicated(mesh)) for x in metadata))
    got = jax.jit(lambda *a: decode_attention_step(*a[:8], a[8:], scale=SCALE,
                                                   kernel=kernel))(*args)
    return {"output": float(np.max(np.abs(np.asarray(got[0]) - np.asarray(want[0])))),
            "k_pages_error": float(np.max(np.abs(np.asarray(got[1]) - np.asarray(want[1])))),
            "v_pages_equal": bool(np.array_equal(np.asarray(got[2]), np.asarray(want[2]))),
            "devices": len(got[0].sharding.device_set),
            "pages_split": list(got[1].addressable_shards[0].data.shape)}


@pytest.fixture(scope="module")
def sharded() -> dict:
    from parallel_checks import run_on_cpu_devices

    return run_on_cpu_devices(__file__, "sharded")


@pytest.mark.parametrize("mesh_size", ["2", "4"])
def test_fused_decode_per_kv_head_shard(sharded, mesh_size):
    """8 query and 4 KV heads split over 2 and 4 devices: the same output and pages (rotated
    keys to fp32 rounding) as the unfused reference route on one device."""
    run = sharded[mesh_size]
    assert run["devices"] == int(mesh_size)
    assert run["pages_split"] == [4 // int(mesh_size), NUM_PAGES, PAGE, 16]
    # rotated keys agree to fp32 rounding (XLA contracts multiply-adds differently per program)
    assert run["v_pages_equal"] and run["k_pages_error"] < 1e-6 and run["output"] < 2e-5


if __name__ == "__main__" and sys.argv[1:] == ["sharded"]:
    print(json.dumps({size: _sharded_fused_decode(int(size)) for size in ("2", "4")}))
