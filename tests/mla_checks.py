"""Hand computations shared by the MLA attention kernel tests, in numpy float64.

A latent cache is ``[num_pages, page_size, R + r]``; a token of request row ``b`` at position
``p`` lives in page ``tables[b, p // page_size]``, row ``p % page_size``. A token with a negative
row or position is padding: it writes nothing and its output is zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The latent cache of Kimi-Linear and DeepSeek-V3 (R, r), with the engine's 16-token pages.
MODEL_RANK, MODEL_ROPE, MODEL_PAGE = 512, 64, 16
# The small latent cache both kernels' tests use: every width a power of 2 >= 16 (Triton-legal),
# 4-token pages, page tables 7 pages wide (no multiple of the kernels' pages per key block).
RANK, ROPE = 32, 16
PAGE = 4
WIDTH = 7
SCALE = 0.3


def random_arrays(rng, dtype, *shapes) -> list[np.ndarray]:
    """Standard-normal numpy arrays of ``shapes``, their values rounded to ``dtype``."""
    return [np.asarray(jnp.asarray(rng.standard_normal(shape), dtype)) for shape in shapes]


def write_by_hand(pages, rows, tables, token_request, positions) -> np.ndarray:
    """A copy of ``pages`` with each real token's latent row stored at its own slot."""
    out = np.array(pages)
    page_size = out.shape[1]
    for row, request, pos in zip(np.asarray(rows), token_request, positions):
        if request >= 0 and pos >= 0:
            out[tables[request, pos // page_size], pos % page_size] = row
    return out


def attention_by_hand(q, pages, tables, token_request, positions, *, scale: float,
                      rank: int) -> np.ndarray:
    """``[T, H, R]``: each real token's heads ``q [T, H, R + r]`` over its request's latent rows
    0..its position, the values being the rows' first ``rank`` columns."""
    pages = np.asarray(pages, np.float64)
    page_size = pages.shape[1]
    q = np.asarray(q, np.float64)
    out = np.zeros((*q.shape[:2], rank))
    for t, (request, pos) in enumerate(zip(token_request, positions)):
        if request < 0 or pos < 0:
            continue
        keys = np.arange(pos + 1)
        rows = pages[tables[request, keys // page_size], keys % page_size]  # [pos + 1, R + r]
        scores = q[t] @ rows.T * scale  # [H, pos + 1]
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out[t] = (weights / weights.sum(-1, keepdims=True)) @ rows[:, :rank]
    return out


def distinct_tables(rng, lengths, *, num_pages: int, page_size: int, width: int) -> np.ndarray:
    """i32[len(lengths), width] page tables: each row's first pages (enough for its length in
    tokens) distinct from every other row's, the rest random valid ids (masked by position)."""
    free = rng.permutation(num_pages)
    tables = rng.integers(0, num_pages, (len(lengths), width)).astype(np.int32)
    for row, length in enumerate(lengths):
        count = -(-length // page_size)
        tables[row, :count], free = free[:count], free[count:]
    return tables


def triton_kernels(fn, *shapes) -> int:
    """How many Triton kernels ``fn`` (jitted here) lowers to for a CUDA GPU, lowered on this
    machine: the Pallas-to-Triton lowering runs, so what it rejects (a block that is not a power
    of 2, an unsupported operation) raises here; Triton's own compilation runs only on a GPU."""
    lowered = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
    return lowered.as_text().count("xla.gpu.triton")
