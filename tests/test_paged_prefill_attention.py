"""Ragged paged prefill attention: the Pallas kernel (interpreted on the CPU) and the plain-JAX
reference against ``attention_ref.masked_attention`` over each token's dense context, read from
the pages by hand, and against each other.

The batch is ragged on purpose: cached prefixes ending mid-page and on a page boundary, new
tokens straddling pages and query blocks, a one-token request, padding tokens, unused page-table
rows, page tables whose width the kernel's key blocks do not divide.

Under tensor parallelism the kernel runs per shard of the KV heads (``jax.shard_map``); those
checks need several devices, so they run in a subprocess that sees 4 CPU devices: this file run
as a script is that worker (``python tests/test_paged_prefill_attention.py sharded``; it prints
one JSON line).
"""

from __future__ import annotations

import json
import logging
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax.kernels.attention import write_kv
from tokenspeed_jax.kernels.attention_ref import masked_attention
from tokenspeed_jax.kernels.paged_attention_backend import PALLAS, REFERENCE
from tokenspeed_jax.kernels.paged_prefill_attention import (
    PrefillBlocks,
    PrefillKernel,
    choose_prefill_kernel,
    num_work_items,
    paged_prefill_attention,
    prefill_unsupported_reason,
    prefill_work,
    ragged_paged_prefill_attention,
    ragged_paged_prefill_attention_reference,
)

PAGE = 4
NUM_PAGES = 40
WIDTH = 10  # page-table width: not a multiple of pages_per_block = 4
SCALE = 0.3
BLOCKS = PrefillBlocks(block_q=16, pages_per_block=4)
# (cached prefix, new tokens) per request row: a prefix ending mid-page with new tokens crossing
# pages, a fresh prompt longer than one query block, one token after a page-aligned prefix, a
# prefix ending mid-page with a short piece.
REQUESTS = ((5, 7), (0, 20), (8, 1), (13, 3))
NUM_ROWS = 6  # two unused page-table rows
NUM_PADDING = 4


def ragged_batch(rng, requests=REQUESTS, num_padding=NUM_PADDING):
    """Per-token rows and positions, page tables (distinct random pages per row)."""
    token_request, positions = [], []
    for row, (cached, new) in enumerate(requests):
        token_request += [row] * new
        positions += range(cached, cached + new)
    token_request += [-1] * num_padding
    positions += [-1] * num_padding
    pages = rng.permutation(np.arange(1, NUM_PAGES)).astype(np.int32)
    tables = np.zeros((NUM_ROWS, WIDTH), np.int32)
    for row, (cached, new) in enumerate(requests):
        count = -(-(cached + new) // PAGE)
        tables[row, :count] = pages[:count]
        pages = pages[count:]
    return np.array(token_request, np.int32), np.array(positions, np.int32), tables


def filled_cache(rng, token_request, positions, tables, num_q_heads, num_kv_heads, head_dim,
                 dtype):
    """Random pages (the cached prefixes) with the step's new K/V written as the break does;
    returns q and the pages."""
    shape = (num_kv_heads, NUM_PAGES, PAGE, head_dim)
    k_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    v_pages = jnp.asarray(rng.standard_normal(shape), dtype)
    num_tokens = len(token_request)
    real = (token_request >= 0) & (positions >= 0)
    table_of_token = tables[np.maximum(token_request, 0)]
    page_of_token = table_of_token[np.arange(num_tokens), np.maximum(positions, 0) // PAGE]
    slots = np.where(real, page_of_token * PAGE + positions % PAGE, -1).astype(np.int32)
    k_new = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), dtype)
    v_new = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, head_dim)), dtype)
    k_pages = write_kv(k_pages, k_new, jnp.asarray(slots))
    v_pages = write_kv(v_pages, v_new, jnp.asarray(slots))
    q = jnp.asarray(rng.standard_normal((num_tokens, num_q_heads, head_dim)), dtype)
    return q, k_pages, v_pages


def expected(q, k_pages, v_pages, token_request, positions, tables):
    """Each token over its row's positions 0..its own, gathered densely by hand, in float32."""
    q, k_pages, v_pages = (np.asarray(x, np.float32) for x in (q, k_pages, v_pages))
    num_keys = positions.max() + 1
    keys = np.arange(num_keys)
    pages = tables[np.maximum(token_request, 0)][:, keys // PAGE]  # [T, S]
    k = k_pages[:, pages, keys % PAGE].transpose(1, 2, 0, 3)  # [T, S, Hkv, Dh]
    v = v_pages[:, pages, keys % PAGE].transpose(1, 2, 0, 3)
    real = (token_request >= 0) & (positions >= 0)
    mask = (keys[None, :] <= positions[:, None]) & real[:, None]
    return np.asarray(masked_attention(q[:, None], k, v, mask[:, None, :], scale=SCALE))[:, 0]


def run_both(q, k_pages, v_pages, token_request, positions, tables, blocks=BLOCKS):
    work = prefill_work(token_request, positions, num_rows=NUM_ROWS, block_q=blocks.block_q)
    kernel = ragged_paged_prefill_attention(
        q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(positions), jnp.asarray(work),
        scale=SCALE, blocks=blocks, interpret=True)
    reference = ragged_paged_prefill_attention_reference(
        q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(token_request),
        jnp.asarray(positions), scale=SCALE)
    return (np.asarray(kernel.astype(jnp.float32)), np.asarray(reference.astype(jnp.float32)))


@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])
def test_kernel_and_reference_match_dense_attention_fp32(num_q_heads, num_kv_heads):
    rng = np.random.default_rng(num_q_heads * 10 + num_kv_heads)
    token_request, positions, tables = ragged_batch(rng)
    q, k_pages, v_pages = filled_cache(rng, token_request, positions, tables, num_q_heads,
                                       num_kv_heads, 16, jnp.float32)
    kernel, reference = run_both(q, k_pages, v_pages, token_request, positions, tables)
    want = expected(q, k_pages, v_pages, token_request, positions, tables)
    np.testing.assert_allclose(kernel, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(reference, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(kernel, reference, rtol=2e-5, atol=2e-5)
    padding = token_request < 0
    assert not np.any(kernel[padding]) and not np.any(reference[padding])


def test_kernel_and_reference_match_dense_attention_bf16():
    """bf16 inputs: float32 scores and softmax; the kernel's probabilities are rounded to bf16
    for the value dot, hence the looser tolerance."""
    rng = np.random.default_rng(7)
    token_request, positions, tables = ragged_batch(rng)
    q, k_pages, v_pages = filled_cache(rng, token_request, positions, tables, 8, 2, 32,
                                       jnp.bfloat16)
    kernel, reference = run_both(q, k_pages, v_pages, token_request, positions, tables)
    want = expected(q, k_pages, v_pages, token_request, positions, tables)
    np.testing.assert_allclose(reference, want, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(kernel, want, rtol=3e-2, atol=3e-2)


def test_bucket_smaller_than_a_query_block_and_wide_key_blocks():
    """8 tokens under block_q = 16 (the kernel pads the block), keys in blocks of 8 pages."""
    rng = np.random.default_rng(3)
    token_request, positions, tables = ragged_batch(rng, ((6, 3), (0, 2), (9, 1)), 2)
    q, k_pages, v_pages = filled_cache(rng, token_request, positions, tables, 4, 2, 16,
                                       jnp.float32)
    blocks = PrefillBlocks(block_q=16, pages_per_block=8)
    kernel, reference = run_both(q, k_pages, v_pages, token_request, positions, tables, blocks)
    want = expected(q, k_pages, v_pages, token_request, positions, tables)
    np.testing.assert_allclose(kernel, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(reference, want, rtol=2e-5, atol=2e-5)


def test_dispatch_follows_the_kernel_choice():
    rng = np.random.default_rng(5)
    token_request, positions, tables = ragged_batch(rng)
    q, k_pages, v_pages = filled_cache(rng, token_request, positions, tables, 4, 2, 16,
                                       jnp.float32)
    work = jnp.asarray(prefill_work(token_request, positions, num_rows=NUM_ROWS,
                                    block_q=BLOCKS.block_q))
    args = (q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(token_request),
            jnp.asarray(positions))
    pallas = paged_prefill_attention(*args, work, scale=SCALE,
                                     kernel=PrefillKernel(PALLAS, BLOCKS, interpret=True))
    reference = paged_prefill_attention(*args, None, scale=SCALE)
    want = expected(q, k_pages, v_pages, token_request, positions, tables)
    np.testing.assert_allclose(np.asarray(pallas), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(reference), want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="work items"):
        paged_prefill_attention(*args, None, scale=SCALE, kernel=PrefillKernel(PALLAS))


def test_work_items_cover_each_run_in_query_blocks():
    token_request = np.array([0] * 20 + [1] * 3 + [-1] * 5, np.int32)
    positions = np.array([*range(4, 24), *range(7, 10), *[-1] * 5], np.int32)
    work = prefill_work(token_request, positions, num_rows=3, block_q=8)
    assert work.shape == (num_work_items(28, 3, 8), 4) == (8, 4)
    np.testing.assert_array_equal(work[:5], [[0, 0, 8, 12], [0, 8, 16, 20], [0, 16, 20, 24],
                                             [1, 20, 23, 10], [-1, 23, 28, 0]])
    np.testing.assert_array_equal(work[5:], [[-1, 0, 0, 0]] * 3)


def test_work_items_reject_a_row_split_in_two_runs():
    token_request = np.array([0, 1, 0, 1, 0, 1], np.int32)
    positions = np.array([0, 0, 1, 1, 2, 2], np.int32)
    with pytest.raises(ValueError, match="6 work items exceed 5"):
        prefill_work(token_request, positions, num_rows=2, block_q=4)


def test_backend_choice_is_static_and_declared():
    assert choose_prefill_kernel(head_dim=64, page_size=16, dtype=jnp.bfloat16,
                                 platform="cpu").backend == REFERENCE
    assert choose_prefill_kernel(head_dim=128, page_size=16, dtype=jnp.bfloat16,
                                 platform="gpu") == PrefillKernel(PALLAS)
    assert "head_dim=80" in prefill_unsupported_reason(head_dim=80, page_size=16,
                                                       dtype=jnp.bfloat16)


# ----------------------------------------------------------------------------- tensor parallel


def _pallas_calls(jaxpr, within=()) -> list[tuple[tuple[str, ...], list[tuple[int, ...]]]]:
    """Every pallas_call in ``jaxpr`` and the jaxprs nested in it: (the primitives it is nested
    in, its operand shapes)."""
    calls = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            calls.append((within, [tuple(v.aval.shape) for v in eqn.invars]))
            continue
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                calls += _pallas_calls(inner, (*within, eqn.primitive.name))
    return calls


def _sharded_kernel(mesh_size: int) -> dict:
    """The Pallas kernel (interpreted) per shard of 4 KV heads over ``mesh_size`` devices, on
    q and pages placed with the runner's shardings, vs the unsharded reference and by hand."""
    from tokenspeed_jax import parallel
    from tokenspeed_jax.models.llama import sharding as llama_sharding

    mesh = parallel.make_mesh(mesh_size)
    kernel = PrefillKernel(PALLAS, BLOCKS, interpret=True, mesh=mesh)
    rng = np.random.default_rng(mesh_size)
    token_request, positions, tables = ragged_batch(rng)
    q, k_pages, v_pages = filled_cache(rng, token_request, positions, tables, 8, 4, 16,
                                       jnp.float32)
    work = prefill_work(token_request, positions, num_rows=NUM_ROWS, block_q=BLOCKS.block_q)
    config = types.SimpleNamespace(num_key_value_heads=4)
    heads = llama_sharding.attention_value_shardings(config, mesh)["q"]
    pages = llama_sharding.kv_cache_sharding(config, mesh)
    metadata = [jax.device_put(x, parallel.replicated(mesh))
                for x in (tables, token_request, positions, work)]
    args = (jax.device_put(q, heads), jax.device_put(k_pages, pages),
            jax.device_put(v_pages, pages), *metadata)
    attend = jax.jit(lambda *a: paged_prefill_attention(*a, scale=SCALE, kernel=kernel),
                     out_shardings=heads)
    ((within, shapes),) = _pallas_calls(jax.make_jaxpr(attend)(*args).jaxpr)
    sharded = attend(*args)
    reference = np.asarray(paged_prefill_attention(q, k_pages, v_pages, *map(jnp.asarray, (
        tables, token_request, positions)), None, scale=SCALE))
    got = np.asarray(sharded)
    want = expected(q, k_pages, v_pages, token_request, positions, tables)
    return {"vs_reference": float(np.max(np.abs(got - reference))),
            "vs_dense": float(np.max(np.abs(got - want))),
            "padding_zero": not np.any(got[token_request < 0]),
            "devices": len(sharded.sharding.device_set),
            "under_shard_map": "shard_map" in within,
            "q_heads_per_call": shapes[3][1], "kv_heads_per_call": shapes[4][0]}


def _choices() -> dict:
    """``choose_prefill_kernel`` with meshes: the backend and mesh size it picks, and what it
    logged."""
    from tokenspeed_jax.kernels import paged_attention_backend as module  # the one that logs
    from tokenspeed_jax.parallel import make_mesh

    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    module.logger.addHandler(handler)

    def choice(platform: str, mesh_size: int, kv_heads: int) -> str:
        kernel = choose_prefill_kernel(head_dim=128, page_size=16, dtype=jnp.bfloat16,
                                       platform=platform, mesh=make_mesh(mesh_size),
                                       num_kv_heads=kv_heads)
        return f"{kernel.backend} {0 if kernel.mesh is None else kernel.mesh.size}"

    return {"gpu 2 devices 8 kv": choice("gpu", 2, 8), "gpu 4 devices 2 kv": choice("gpu", 4, 2),
            "cpu 2 devices 8 kv": choice("cpu", 2, 8), "logged": logged}


def _tiny_llama(tp: int) -> dict:
    """tiny_llama (4 query, 2 KV heads) through LLM over ``tp`` devices with the prefill kernel
    the runner is given by ``choose_prefill_kernel``."""
    from test_tensor_parallel import ENGINE, GOLDEN, SUFFIXES

    from tokenspeed_jax import LLM, SamplingParams

    golden = np.load(GOLDEN / "tiny_llama.npz")
    llm = LLM(str(GOLDEN / "tiny_llama"), tensor_parallel_size=tp,
              **{**ENGINE, "compile_cache": False})
    prompts = [golden[f"prompt_ids{s}"].tolist() for s in SUFFIXES]
    completions = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6,
                                                             logprobs=0, ignore_eos=True))
    kernel, stats = llm.runner.forward.prefill_kernel, llm.stats()
    llm.runner.guard.disarm()
    return {"tokens": [c.token_ids for c in completions],
            "logprobs": [[lp.logprob for lp in c.logprobs] for c in completions],
            "backend": kernel.backend, "kernel_devices": 0 if kernel.mesh is None
            else kernel.mesh.size, "prefill_runs": stats["prefill_runs"],
            "runtime_compiles": stats["runtime_compiles"]}


def _runner_runs() -> dict:
    """tp=1 with the reference prefill (this CPU's choice), then tp=2 with the Pallas kernel
    (interpreted) per KV-head shard, chosen as on a GPU."""
    import dataclasses

    from tokenspeed_jax.models.llama import forward as llama_forward

    reference = _tiny_llama(1)

    def pallas_kernel(**options):
        kernel = choose_prefill_kernel(**options, platform="gpu")
        return dataclasses.replace(kernel, blocks=PrefillBlocks(block_q=16, pages_per_block=2),
                                   interpret=True)

    llama_forward.choose_prefill_kernel = pallas_kernel
    return {"reference": reference, "pallas": _tiny_llama(2)}


@pytest.fixture(scope="module")
def sharded() -> dict:
    from parallel_checks import run_on_cpu_devices

    return run_on_cpu_devices(__file__, "sharded")


@pytest.mark.parametrize("mesh_size", ["2", "4"])
def test_kernel_per_kv_head_shard_matches_the_unsharded_reference(sharded, mesh_size):
    """8 query and 4 KV heads: 4 and 2 per device over 2 devices, 2 and 1 over 4; the same
    ragged batch as above."""
    run = sharded["kernel"][mesh_size]
    assert run["devices"] == int(mesh_size) and run["under_shard_map"]
    assert (run["q_heads_per_call"], run["kv_heads_per_call"]) == (8 // int(mesh_size),
                                                                    4 // int(mesh_size))
    assert run["vs_reference"] < 2e-5 and run["vs_dense"] < 2e-5
    assert run["padding_zero"]


def test_choice_with_a_mesh_runs_per_shard_or_declares_replicated_kv_heads(sharded):
    choices = sharded["choices"]
    assert choices["gpu 2 devices 8 kv"] == "pallas 2"
    assert choices["gpu 4 devices 2 kv"] == "reference 0"
    assert choices["cpu 2 devices 8 kv"] == "reference 0"
    (message,) = choices["logged"]
    assert "num_kv_heads=2 are replicated over 4 devices" in message


def test_pallas_prefill_per_shard_in_the_tp2_runner(sharded):
    reference, pallas = sharded["runner"]["reference"], sharded["runner"]["pallas"]
    assert (reference["backend"], reference["kernel_devices"]) == (REFERENCE, 0)
    assert (pallas["backend"], pallas["kernel_devices"]) == (PALLAS, 2)
    assert pallas["tokens"] == reference["tokens"]
    for got, want in zip(pallas["logprobs"], reference["logprobs"]):
        np.testing.assert_allclose(got, want, atol=2e-5)
    for run in (reference, pallas):
        assert run["prefill_runs"] > 0 and run["runtime_compiles"] == 0


if __name__ == "__main__" and sys.argv[1:] == ["sharded"]:
    print(json.dumps({"kernel": {size: _sharded_kernel(int(size)) for size in ("2", "4")},
                      "choices": _choices(), "runner": _runner_runs()}))
