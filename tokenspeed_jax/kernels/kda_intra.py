"""The per-chunk half of KDA's chunked prefill: one Pallas program per (64-token chunk, value head).

For one chunk it forms, in 16 x 16 sub-blocks, the strictly lower key-key matrix
A[i, j] = beta_i * sum_d k_id k_jd exp(gc_id - gc_jd) and the causal query-key matrix, inverts
(I + A) block by block (each diagonal block through the nilpotent product
(I - N)(I + N^2)(I + N^4)(I + N^8), the off-diagonal blocks by block forward substitution, all
dots), and writes w = (I + A)^-1 (beta exp(gc) k), u = (I + A)^-1 (beta v), the decayed q and k,
the query-key matrix and the chunk's total log decay. gc is the in-chunk cumulative log gate,
summed here from the raw gate.

Invariants:
- Every exponent is <= 0, so g down to -100 (and far below) underflows to 0 and never overflows:
  a pair (i, j) in different sub-blocks meets through the boundaries of the two sub-blocks,
  exp(gc_i - r_i) * exp(r_i - e_j) * exp(e_j - gc_j), with r_i the log decay before row i's
  sub-block and e_j the one after column j's; a pair in the same sub-block gets its exact
  pairwise decay, `key_split` channels at a time.
- Sub-blocks are read from and written to the refs directly (no value slicing, no 0/1 placement
  dots); every dot has operands of at least 16 x 16, as the Triton lowering needs.
- The inverse of each diagonal block uses exact fp32 dots whatever `precision` is (its powers
  can cancel); everything else uses `precision`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

SUB_BLOCK = 16  # rows sharing one decay reference point; also Triton's smallest dot tile
EXACT = lax.Precision.HIGHEST


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


def unit_lower_inverse(strict):
    """(I + N)^-1 for a strictly lower [b, b] N, b a power of two: N^b = 0, so the inverse is
    the product of (I - N) and (I + N^(2^m)) for 2 <= 2^m < b."""
    size = strict.shape[0]
    eye = (lax.broadcasted_iota(jnp.int32, (size, size), 0)
           == lax.broadcasted_iota(jnp.int32, (size, size), 1)).astype(jnp.float32)
    inverse, power, order = eye - strict, strict, 2
    while order < size:
        power = dot(power, power, EXACT)
        inverse = dot(inverse, eye + power, EXACT)
        order *= 2
    return inverse


def _sub_block_cumsum(g):
    """Cumulative sum down the rows of a [SUB_BLOCK, n] block, as an exact fp32 dot with the
    lower-triangular ones (dots lower more safely through Triton than a scan along rows)."""
    rows = lax.broadcasted_iota(jnp.int32, (SUB_BLOCK, SUB_BLOCK), 0)
    cols = lax.broadcasted_iota(jnp.int32, (SUB_BLOCK, SUB_BLOCK), 1)
    return dot((rows >= cols).astype(jnp.float32), g, EXACT)


def _diagonal_products(q_ref, k_ref, g_ref, rows, scale, key_split):
    """Exact in-sub-block k_i.k_j and q_i.k_j with decay exp(gc_i - gc_j), for i >= j."""
    f32 = jnp.float32
    kk = jnp.zeros((SUB_BLOCK, SUB_BLOCK), f32)
    qk = jnp.zeros((SUB_BLOCK, SUB_BLOCK), f32)
    for start in range(0, k_ref.shape[1], key_split):
        keys = pl.ds(start, key_split)
        k = k_ref[rows, keys].astype(f32)
        q = q_ref[rows, keys].astype(f32) * scale
        local = _sub_block_cumsum(g_ref[rows, keys])
        decayed_k = k[None, :, :] * jnp.exp(
            jnp.minimum(local[:, None, :] - local[None, :, :], 0.0))  # [i, j, d]
        kk += jnp.sum(k[:, None, :] * decayed_k, axis=-1)
        qk += jnp.sum(q[:, None, :] * decayed_k, axis=-1)
    return kk, qk


def intra_chunk_kernel(
    q_ref,  # [C, K]
    k_ref,  # [C, K]
    v_ref,  # [C, V]
    g_ref,  # [C, K] fp32 log gate of each token
    beta_ref,  # [C]
    qg_ref,  # [C, K]  scale * q * exp(gc)
    w_ref,  # [C, K]  (I + A)^-1 (beta * exp(gc) * k)
    kg_ref,  # [C, K]  k * exp(gc_last - gc)
    u_ref,  # [C, V]  (I + A)^-1 (beta * v)
    aqk_ref,  # [C, C]  causal scale * q_i . k_j * exp(gc_i - gc_j)
    glast_ref,  # [K] fp32, gc of the chunk's last row
    *,
    scale: float,
    key_split: int,
    precision,
):
    f32 = jnp.float32
    chunk, head_k = k_ref.shape
    num_sub = chunk // SUB_BLOCK
    sub_rows = lax.broadcasted_iota(jnp.int32, (SUB_BLOCK, SUB_BLOCK), 0)
    sub_cols = lax.broadcasted_iota(jnp.int32, (SUB_BLOCK, SUB_BLOCK), 1)
    blocks = [pl.ds(b * SUB_BLOCK, SUB_BLOCK) for b in range(num_sub)]

    # Per sub-block: boundaries r (before) and e (after), and the factors to and from them.
    before, after, from_before, to_after = [], [], [], []
    boundary = jnp.zeros((head_k,), f32)
    for rows in blocks:
        g = g_ref[rows, :]
        local = _sub_block_cumsum(g)
        before.append(boundary)
        boundary = boundary + jnp.sum(g, axis=0)
        after.append(boundary)
        from_before.append(jnp.exp(local))  # exp(gc - r)
        gc = before[-1][None, :] + local
        to_after.append(jnp.exp(jnp.minimum(boundary[None, :] - gc, 0.0)))  # exp(e - gc)
    glast = boundary
    glast_ref[...] = glast

    beta = [beta_ref[rows].astype(f32)[:, None] for rows in blocks]
    k = [k_ref[rows, :].astype(f32) for rows in blocks]
    q_left = [q_ref[rows, :].astype(f32) * (scale * from_before[b])
              for b, rows in enumerate(blocks)]
    k_left = [k[b] * from_before[b] for b in range(num_sub)]
    k_right = [k[b] * to_after[b] for b in range(num_sub)]

    lower = {}  # (i, j) -> beta_i * kk block, i > j; (i, i) strictly lower
    zeros = jnp.zeros((SUB_BLOCK, SUB_BLOCK), aqk_ref.dtype)
    for i, rows in enumerate(blocks):
        for j in range(num_sub):
            if j > i:
                aqk_ref[rows, blocks[j]] = zeros
                continue
            if j == i:
                kk, qk = _diagonal_products(q_ref, k_ref, g_ref, rows, scale, key_split)
                lower[i, i] = jnp.where(sub_rows > sub_cols, beta[i] * kk, 0.0)
                qk = jnp.where(sub_rows >= sub_cols, qk, 0.0)
            else:
                bridge = jnp.exp(jnp.minimum(before[i] - after[j], 0.0))[None, :]
                right = k_right[j] * bridge
                lower[i, j] = beta[i] * dot_nt(k_left[i], right, precision)
                qk = dot_nt(q_left[i], right, precision)
            aqk_ref[rows, blocks[j]] = qk.astype(aqk_ref.dtype)

    # Block forward substitution: T_ii = (I + A_ii)^-1, T_ij = -T_ii sum_{j<=m<i} A_im T_mj.
    inverse = {}
    for i in range(num_sub):
        inverse[i, i] = unit_lower_inverse(lower[i, i])
        for j in range(i - 1, -1, -1):
            acc = dot(lower[i, j], inverse[j, j], precision)
            for m in range(j + 1, i):
                acc += dot(lower[i, m], inverse[m, j], precision)
            inverse[i, j] = -dot(inverse[i, i], acc, precision)

    k_decayed = [k_left[b] * (beta[b] * jnp.exp(before[b])[None, :]) for b in range(num_sub)]
    v_scaled = [v_ref[rows, :].astype(f32) * beta[b] for b, rows in enumerate(blocks)]
    for i, rows in enumerate(blocks):
        w = dot(inverse[i, 0], k_decayed[0], precision)
        u = dot(inverse[i, 0], v_scaled[0], precision)
        for j in range(1, i + 1):
            w += dot(inverse[i, j], k_decayed[j], precision)
            u += dot(inverse[i, j], v_scaled[j], precision)
        w_ref[rows, :] = w.astype(w_ref.dtype)
        u_ref[rows, :] = u.astype(u_ref.dtype)
        qg_ref[rows, :] = (q_left[i] * jnp.exp(before[i])[None, :]).astype(qg_ref.dtype)
        tail = jnp.exp(jnp.minimum(glast - after[i], 0.0))[None, :]
        kg_ref[rows, :] = (k_right[i] * tail).astype(kg_ref.dtype)
