"""Small helpers shared by the Pallas kernels and their wrappers.

Invariant: every dot here accumulates in float32 whatever its operand dtype, so kernels that feed
bf16 operands keep fp32 sums (the arithmetic their references use); ``precision`` is passed
through (``HIGHEST`` keeps fp32 operands exact).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

LOG2E = math.log2(math.e)  # attention scores are taken in base 2: exp(x) = exp2(x * log2(e))
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)  # finite: an all-masked block makes no NaN


def count_at_most(sorted_bounds, values):
    """For each of ``values``, how many of the ascending ``sorted_bounds`` are <= it (the
    request or run a token or tile falls in). One comparison of every pair, not JAX's default
    binary search: that runs as a while loop, one kernel launch per halving step on a GPU, inside
    every compiled step that needs it; the bounds here are a few hundred at most."""
    return jnp.searchsorted(sorted_bounds, values, side="right", method="compare_all")


def dot_precision(dtype) -> lax.Precision:
    """The precision of a kernel's dots over ``dtype`` operands: exact float32 (``HIGHEST``, no
    TF32) for float32, the default for narrower types (their products are exact in float32)."""
    return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def dot(a, b, precision):
    """a @ b in fp32."""
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def dot_nt(a, b, precision):
    """a @ b.T in fp32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def dot_tn(a, b, precision):
    """a.T @ b in fp32."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def rounded_to(value: jnp.ndarray, dtype: jnp.dtype) -> jnp.ndarray:
    """``value`` rounded to ``dtype`` and back to float32: an XLA operation's rounding of its
    result, inside a kernel that computes in float32 (Triton has no bf16 arithmetic)."""
    return value.astype(dtype).astype(jnp.float32)


def power_of_2_parts(count: int) -> list[slice]:
    """``range(count)`` cut into slices of distinct powers of 2, largest first (Triton blocks
    are powers of 2): 36 -> [0:32, 32:36]."""
    parts, start = [], 0
    for bit in reversed(range(count.bit_length())):
        if count >> bit & 1:
            parts.append(slice(start, start + (1 << bit)))
            start += 1 << bit
    return parts


def is_power_of_2(value: int) -> bool:
    """Whether ``value`` is 1, 2, 4, ... (Triton blocks must be powers of two)."""
    return value >= 1 and value & (value - 1) == 0


def online_softmax_step(q, k_pages_ref, v_pages_ref, pages, visible, carry, *, scale: float,
                        precision):
    """One key block of flash attention read through a page table: the keys and values of
    ``pages`` (i32[pages_per_block] ids into ``[num_pages, page_size, Dh]`` refs) against the
    query rows ``q [rows, Dh]``, where ``visible [rows, block_k]``. ``carry`` is (unnormalised
    output [rows, Dh], running maximum, running sum [rows]) in base 2 (scores times log2(e)); a
    masked score is ``MASK_VALUE``, finite, so a row that sees nothing stays NaN-free."""
    block_k, head_dim = pages.shape[0] * k_pages_ref.shape[1], k_pages_ref.shape[-1]
    k = k_pages_ref[pages].reshape(block_k, head_dim)
    v = v_pages_ref[pages].reshape(block_k, head_dim)
    scores = jnp.where(visible, dot_nt(q, k, precision) * (scale * LOG2E), MASK_VALUE)
    return online_softmax_update(scores, v, carry, precision)


def online_softmax_update(scores, v, carry, precision, *, keys_axis: int = 1):
    """Fold one key block into the running flash-attention state: ``scores [rows, block_k]``
    already scaled to base 2 and masked (``MASK_VALUE``), values ``v [block_k, Dv]``, ``carry``
    as in ``online_softmax_step``. With ``keys_axis=0`` the keys are the rows instead: scores
    ``[block_k, rows]`` and the unnormalised output ``[Dv, rows]``."""
    acc, row_max, row_sum = carry
    new_max = jnp.maximum(row_max, scores.max(axis=keys_axis))
    correction = jnp.exp2(row_max - new_max)
    weights = jnp.exp2(scores - jnp.expand_dims(new_max, keys_axis))
    row_sum = row_sum * correction + weights.sum(axis=keys_axis)
    acc = acc * jnp.expand_dims(correction, keys_axis) + (
        dot(weights.astype(v.dtype), v, precision) if keys_axis == 1
        else dot_tn(v, weights.astype(v.dtype), precision))
    return acc, new_max, row_sum
