"""MLA's paged latent prefill attention against a per-token numpy computation (each query token
over its own request's latent rows 0..its position, the values being the first R features), and
its memory, which must not grow with page-table rows x width (``max_model_len``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tokenspeed_jax.models.mla import paged_latent_prefill

PAGE = 4
RANK, ROPE, HEADS = 8, 4, 3


def expected(q, pages, tables, token_request, positions, scale):
    flat = pages.reshape(-1, pages.shape[-1]).astype(np.float64)
    out = np.zeros((q.shape[0], HEADS, RANK))
    for t, (row, pos) in enumerate(zip(token_request, positions)):
        if row < 0 or pos < 0:
            continue
        keys = np.arange(pos + 1)
        rows = flat[tables[row][keys // PAGE] * PAGE + keys % PAGE]  # [pos + 1, R + r]
        scores = q[t].astype(np.float64) @ rows.T * scale  # [H, pos + 1]
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out[t] = (weights / weights.sum(-1, keepdims=True)) @ rows[:, :RANK]
    return out


def test_prefill_reads_each_requests_own_rows_with_prefix_and_padding():
    rng = np.random.default_rng(0)
    pages = rng.standard_normal((20, PAGE, RANK + ROPE)).astype(np.float32)
    tables = rng.permutation(20)[:16].reshape(4, 4).astype(np.int32)  # row 3 belongs to nobody
    # request 0 extends a cached 5-token prefix; requests 1 and 2 start at 0; two padding tokens
    token_request = np.array([0] * 5 + [1] * 7 + [2] * 3 + [-1] * 2, np.int32)
    positions = np.r_[5:10, 0:7, 0:3, -1, -1].astype(np.int32)
    q = rng.standard_normal((len(positions), HEADS, RANK + ROPE)).astype(np.float32)
    scale = (RANK + ROPE) ** -0.5
    got = paged_latent_prefill(jnp.asarray(q), jnp.asarray(pages), jnp.asarray(tables),
                               jnp.asarray(token_request), jnp.asarray(positions), scale=scale,
                               kv_lora_rank=RANK)
    want = expected(q, pages, tables, token_request, positions, scale)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    assert not np.asarray(got)[-2:].any()


def temp_bytes(rows: int, width: int, tokens: int = 64) -> int:
    spec = jax.ShapeDtypeStruct
    compiled = jax.jit(paged_latent_prefill, static_argnames=("scale", "kv_lora_rank")).lower(
        spec((tokens, HEADS, RANK + ROPE), jnp.float32),
        spec((rows * width, PAGE, RANK + ROPE), jnp.float32),
        spec((rows, width), jnp.int32), spec((tokens,), jnp.int32), spec((tokens,), jnp.int32),
        scale=1.0, kv_lora_rank=RANK).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_prefill_memory_does_not_grow_with_rows_times_context():
    """Gathering every row's whole context (rows x width x page slots per query) would grow
    this 64x; the chunked loop over each row's live keys keeps it flat."""
    small, large = temp_bytes(rows=2, width=8), temp_bytes(rows=16, width=64)
    assert large < 2 * small
