"""The MLA kernel choice and the two steps that run it (``kernels/mla_attention.py``): the
Pallas route (interpreted) and the reference route against the hand computation of
``mla_checks``, and the choice from platform and cache shape.

Under tensor parallelism the kernels run per shard of the query heads with the latent cache
replicated; that check needs several devices, so it runs in a subprocess that sees 4 CPU
devices: this file run as a script is that worker (``python tests/test_mla_attention.py
sharded``; it prints one JSON line).
"""

from __future__ import annotations

import json
import logging
import sys

import jax
import jax.numpy as jnp
import mla_checks as hand
import numpy as np
import pytest
from mla_checks import PAGE, RANK, ROPE, SCALE, WIDTH

from tokenspeed_jax.kernels.mla_attention import (
    REFERENCE_MLA,
    MLAKernel,
    choose_mla_kernel,
    mla_decode_step,
    mla_prefill_step,
)
from tokenspeed_jax.kernels.mla_decode import MLADecodeBlocks
from tokenspeed_jax.kernels.mla_prefill import MLAPrefillBlocks
from tokenspeed_jax.kernels.paged_attention_backend import PALLAS, REFERENCE
from tokenspeed_jax.kernels.paged_prefill_attention import prefill_work

NUM_PAGES = 32
HEADS = 8
BLOCKS = {"decode": MLADecodeBlocks(pages_per_block=4),
          "prefill": MLAPrefillBlocks(block_q=8, block_h=2, pages_per_block=4)}
DECODE_POSITIONS = np.array([9, 0, 15, -1], np.int32)  # mid-page, no context, page end, padding
# (cached, new) per request: a prefix ending mid-page, a fresh prompt; then two padding tokens
PREFILL_REQUESTS = ((5, 7), (0, 10))


def pallas(mesh=None) -> MLAKernel:
    return MLAKernel(PALLAS, **BLOCKS, interpret=True, mesh=mesh)


def decode_case(seed: int):
    """(q, latent, pages, tables, positions) as jax arrays, and the hand outputs and pages."""
    rng = np.random.default_rng(seed)
    tables = hand.distinct_tables(rng, np.maximum(DECODE_POSITIONS + 1, 0), num_pages=NUM_PAGES,
                                  page_size=PAGE, width=WIDTH)
    q, latent, pages = hand.random_arrays(rng, jnp.float32, (4, HEADS, RANK + ROPE),
                                          (4, RANK + ROPE), (NUM_PAGES, PAGE, RANK + ROPE))
    requests = np.arange(4)
    written = hand.write_by_hand(pages, latent, tables, requests, DECODE_POSITIONS)
    want = hand.attention_by_hand(q, written, tables, requests, DECODE_POSITIONS, scale=SCALE,
                                  rank=RANK)
    args = tuple(map(jnp.asarray, (q, latent, pages, tables, DECODE_POSITIONS)))
    return args, want, written


def prefill_case(seed: int):
    """(q, written pages, tables, token_request, positions) as jax arrays, the work items and
    the hand output."""
    rng = np.random.default_rng(seed)
    token_request = np.r_[[row for row, (_, n) in enumerate(PREFILL_REQUESTS) for _ in range(n)],
                          -1, -1].astype(np.int32)
    positions = np.r_[[p for c, n in PREFILL_REQUESTS for p in range(c, c + n)],
                      -1, -1].astype(np.int32)
    tables = hand.distinct_tables(rng, [c + n for c, n in PREFILL_REQUESTS], num_pages=NUM_PAGES,
                                  page_size=PAGE, width=WIDTH)
    q, latent, pages = hand.random_arrays(rng, jnp.float32, (len(positions), HEADS, RANK + ROPE),
                                          (len(positions), RANK + ROPE),
                                          (NUM_PAGES, PAGE, RANK + ROPE))
    written = hand.write_by_hand(pages, latent, tables, token_request, positions)
    want = hand.attention_by_hand(q, written, tables, token_request, positions, scale=SCALE,
                                  rank=RANK)
    work = prefill_work(token_request, positions, num_rows=len(tables),
                        block_q=BLOCKS["prefill"].block_q)
    args = tuple(map(jnp.asarray, (q, written, tables, token_request, positions)))
    return args, jnp.asarray(work), want


@pytest.mark.parametrize("kernel", [REFERENCE_MLA, pallas()], ids=["reference", "pallas"])
def test_decode_step_writes_and_attends_on_either_route(kernel):
    args, want, written = decode_case(1)
    out, pages = mla_decode_step(*args, scale=SCALE, kv_lora_rank=RANK, kernel=kernel)
    np.testing.assert_array_equal(np.asarray(pages), written)
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kernel", [REFERENCE_MLA, pallas()], ids=["reference", "pallas"])
def test_prefill_step_on_either_route(kernel):
    args, work, want = prefill_case(2)
    out = mla_prefill_step(*args, work, scale=SCALE, kv_lora_rank=RANK, kernel=kernel)
    np.testing.assert_allclose(np.asarray(out), want, rtol=2e-5, atol=2e-5)


def test_pallas_prefill_step_needs_work_items():
    args, _, _ = prefill_case(2)
    with pytest.raises(ValueError, match="work items"):
        mla_prefill_step(*args, None, scale=SCALE, kv_lora_rank=RANK, kernel=pallas())


def test_choice_is_static_and_declared(caplog):
    kimi = {"kv_lora_rank": 512, "rope_dim": 64, "page_size": 16, "dtype": jnp.bfloat16}
    assert choose_mla_kernel(**kimi, platform="cpu") == REFERENCE_MLA
    assert choose_mla_kernel(**kimi, platform="gpu").backend == PALLAS
    fp32 = choose_mla_kernel(**{**kimi, "dtype": jnp.float32}, platform="gpu")
    assert fp32.backend == PALLAS and fp32.prefill.pages_per_block == 1  # shared memory
    with caplog.at_level(logging.WARNING, logger="tokenspeed_jax.kernels.paged_attention_backend"):
        assert choose_mla_kernel(**{**kimi, "kv_lora_rank": 576},
                                 platform="gpu") == REFERENCE_MLA
    assert "kv_lora_rank" in caplog.text
    assert choose_mla_kernel(**{**kimi, "page_size": 4}, platform="gpu").backend == REFERENCE
    with pytest.raises(ValueError, match="'fast'"):
        MLAKernel("fast")


def _sharded(mesh_size: int) -> dict:
    """Both steps on the Pallas route (interpreted) per shard of the 8 query heads over
    ``mesh_size`` devices, the latent cache replicated, against the hand computation."""
    from tokenspeed_jax import parallel

    mesh = parallel.make_mesh(mesh_size)
    heads = jax.NamedSharding(mesh, parallel.head_spec(3))
    replicated = parallel.replicated(mesh)
    (q, *rest), want_decode, written = decode_case(3)
    decode_args = (jax.device_put(q, heads), *(jax.device_put(x, replicated) for x in rest))
    out, pages = jax.jit(lambda *a: mla_decode_step(
        *a, scale=SCALE, kv_lora_rank=RANK, kernel=pallas(mesh)))(*decode_args)
    (q, *rest), work, want_prefill = prefill_case(4)
    prefill_args = (jax.device_put(q, heads), *(jax.device_put(x, replicated) for x in rest),
                    jax.device_put(work, replicated))
    prefill_out = jax.jit(lambda *a: mla_prefill_step(
        *a, scale=SCALE, kv_lora_rank=RANK, kernel=pallas(mesh)))(*prefill_args)
    return {"decode": float(np.max(np.abs(np.asarray(out) - want_decode))),
            "pages_equal": bool(np.array_equal(np.asarray(pages), written)),
            "prefill": float(np.max(np.abs(np.asarray(prefill_out) - want_prefill))),
            "devices": len(out.sharding.device_set),
            "heads_per_shard": out.addressable_shards[0].data.shape[1],
            "pages_per_device": list(pages.addressable_shards[0].data.shape)}


@pytest.fixture(scope="module")
def sharded() -> dict:
    from parallel_checks import run_on_cpu_devices

    return run_on_cpu_devices(__file__, "sharded")


@pytest.mark.parametrize("mesh_size", ["2", "4"])
def test_kernels_per_head_shard_with_the_cache_replicated(sharded, mesh_size):
    run = sharded[mesh_size]
    assert run["devices"] == int(mesh_size)
    assert run["heads_per_shard"] == HEADS // int(mesh_size)
    assert run["pages_per_device"] == [NUM_PAGES, PAGE, RANK + ROPE]  # the whole cache
    assert run["pages_equal"] and run["decode"] < 2e-5 and run["prefill"] < 2e-5


if __name__ == "__main__" and sys.argv[1:] == ["sharded"]:
    print(json.dumps({size: _sharded(int(size)) for size in ("2", "4")}))
