"""The per-chunk half of KDA's chunked prefill: one Pallas program per (64-token chunk, value head).

For one chunk it forms the strictly lower key-key matrix kk[i, j] = sum_d k_id k_jd
exp(gc_id - gc_jd) and the causal query-key matrix (gc the in-chunk cumulative log gate), inverts
(I + beta kk), and writes w = (I + beta kk)^-1 (beta exp(gc) k), u = (I + beta kk)^-1 (beta v),
the decayed q and k, and the query-key matrix. Nothing here depends on the recurrent state, so all
chunks run in parallel; the state scan in `kda` consumes these outputs.

Invariants:
- Every exponent is <= 0, so g down to -100 (and far below) underflows to 0 and never overflows.
  A pair (i, j) in different 16-row sub-blocks meets through the first row r of row i's
  sub-block, exp(gc_i - gc_r) * exp(gc_r - gc_j) (one dot per sub-block boundary); a pair in the
  same sub-block gets its exact pairwise decay, one column of every sub-block per loop step,
  accumulated in a compact [C, 16] form and widened once by an exact 0/1 dot.
- Register use is bounded by `key_split`: the products over K accumulate over slices of
  `key_split` channels in a `fori_loop`, so only [C, key_split] slices of q, k and gc are live.
- Every matrix is a whole [C, C] tile and sub-blocks are masks (the Triton lowering slices
  refs, not values).
- The inverse is (I + M)^-1 (I + D)^-1, with D the diagonal sub-blocks of the lower matrix and
  M = (I + D)^-1 E (E the rest); both are nilpotent, so each inverse is a short product of
  squarings, computed with `exact` dots (its powers can cancel).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tokenspeed_jax.kernels.kernel_math import dot, dot_nt

SUB_BLOCK = 16  # rows sharing one decay reference point; also Triton's smallest dot tile


def nilpotent_inverse(strict, nilpotency: int, precision):
    """(I + N)^-1 for a [n, n] N with N^nilpotency = 0 (nilpotency a power of two): the product
    (I - N)(I + N^2)(I + N^4)... up to N^(nilpotency / 2)."""
    size = strict.shape[0]
    eye = (lax.broadcasted_iota(jnp.int32, (size, size), 0)
           == lax.broadcasted_iota(jnp.int32, (size, size), 1)).astype(jnp.float32)
    inverse, power, order = eye - strict, strict, 2
    while order < nilpotency:
        power = dot(power, power, precision)
        inverse = dot(inverse, eye + power, precision)
        order *= 2
    return inverse


def intra_chunk_kernel(
    q_ref,  # [C, K]
    k_ref,  # [C, K]
    v_ref,  # [C, V]
    gc_ref,  # [C, K] fp32, in-chunk cumulative log decay
    beta_ref,  # [C]
    qg_ref,  # [C, K]  scale * q * exp(gc)
    w_ref,  # [C, K]  (I + A)^-1 (beta * exp(gc) * k)
    kg_ref,  # [C, K]  k * exp(gc_last - gc)
    u_ref,  # [C, V]  (I + A)^-1 (beta * v)
    aqk_ref,  # [C, C]  causal scale * q_i . k_j * exp(gc_i - gc_j)
    *,
    scale: float,
    key_split: int,
    precision,
    exact,
):
    f32 = jnp.float32
    chunk, head_k = k_ref.shape
    num_sub = chunk // SUB_BLOCK
    row_sub = lax.broadcasted_iota(jnp.int32, (chunk, key_split), 0) // SUB_BLOCK
    rows = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    sub_cols = lax.broadcasted_iota(jnp.int32, (chunk, SUB_BLOCK), 1)
    beta = beta_ref[...].astype(f32)[:, None]

    def key_slice(s, products):
        keys = pl.ds(pl.multiple_of(s * key_split, key_split), key_split)
        q = q_ref[:, keys].astype(f32) * scale
        k = k_ref[:, keys].astype(f32)
        gc = gc_ref[:, keys]
        qg_ref[:, keys] = (q * jnp.exp(gc)).astype(qg_ref.dtype)
        last = gc_ref[chunk - 1, keys][None, :]
        kg_ref[:, keys] = (k * jnp.exp(jnp.minimum(last - gc, 0.0))).astype(kg_ref.dtype)

        boundary = [gc_ref[b * SUB_BLOCK, keys][None, :] for b in range(num_sub)]
        reference = jnp.zeros_like(gc)
        for b in range(num_sub):
            reference = jnp.where(row_sub == b, boundary[b], reference)
        to_reference = jnp.exp(gc - reference)
        k_left, q_left = k * to_reference, q * to_reference
        kk, qk, diagonal_kk, diagonal_qk = products
        for b in range(1, num_sub):
            k_right = k * jnp.exp(jnp.minimum(boundary[b] - gc, 0.0))
            in_block = (rows // SUB_BLOCK == b) & (cols < b * SUB_BLOCK)
            kk += jnp.where(in_block, dot_nt(k_left, k_right, precision), 0.0)
            qk += jnp.where(in_block, dot_nt(q_left, k_right, precision), 0.0)

        # Step `offset` pairs every row with column `offset` of its own sub-block, kept compact
        # as [C, SUB_BLOCK] (column o of row i stands for column 16 * (i // 16) + o).
        def diagonal_column(offset, diagonal):
            diagonal_kk, diagonal_qk = diagonal
            partner_k = jnp.zeros_like(k)
            partner_g = jnp.zeros_like(gc)
            for b in range(num_sub):
                row = pl.ds(b * SUB_BLOCK + offset, 1)
                partner_k = jnp.where(row_sub == b, k_ref[row, keys].astype(f32), partner_k)
                partner_g = jnp.where(row_sub == b, gc_ref[row, keys], partner_g)
            decayed = partner_k * jnp.exp(jnp.minimum(gc - partner_g, 0.0))
            at = sub_cols == offset
            diagonal_kk += jnp.where(at, jnp.sum(k * decayed, axis=1)[:, None], 0.0)
            diagonal_qk += jnp.where(at, jnp.sum(q * decayed, axis=1)[:, None], 0.0)
            return diagonal_kk, diagonal_qk

        diagonal_kk, diagonal_qk = lax.fori_loop(
            0, SUB_BLOCK, diagonal_column, (diagonal_kk, diagonal_qk))
        return kk, qk, diagonal_kk, diagonal_qk

    zeros = jnp.zeros((chunk, chunk), f32)
    compact_zeros = jnp.zeros((chunk, SUB_BLOCK), f32)
    kk, qk, diagonal_kk, diagonal_qk = lax.fori_loop(
        0, head_k // key_split, key_slice, (zeros, zeros, compact_zeros, compact_zeros))
    # Widen the compact diagonal blocks: a 0/1 dot repeats each row's 16 values across the row,
    # and the sub-block mask keeps the copy on the diagonal.
    spread = (lax.broadcasted_iota(jnp.int32, (SUB_BLOCK, chunk), 1) % SUB_BLOCK
              == lax.broadcasted_iota(jnp.int32, (SUB_BLOCK, chunk), 0)).astype(f32)
    same_sub = rows // SUB_BLOCK == cols // SUB_BLOCK
    kk += jnp.where(same_sub, dot(diagonal_kk, spread, exact), 0.0)
    qk += jnp.where(same_sub, dot(diagonal_qk, spread, exact), 0.0)
    aqk_ref[...] = jnp.where(rows >= cols, qk, 0.0).astype(aqk_ref.dtype)

    lower = jnp.where(rows > cols, kk * beta, 0.0)
    diagonal = jnp.where(same_sub, lower, 0.0)
    diagonal_inverse = nilpotent_inverse(diagonal, SUB_BLOCK, exact)
    across = dot(diagonal_inverse, lower - diagonal, exact)
    t_mat = dot(nilpotent_inverse(across, num_sub, exact), diagonal_inverse, exact)

    def solve_slice(s, carry):
        keys = pl.ds(pl.multiple_of(s * key_split, key_split), key_split)
        scaled = k_ref[:, keys].astype(f32) * jnp.exp(gc_ref[:, keys]) * beta
        w_ref[:, keys] = dot(t_mat, scaled, precision).astype(w_ref.dtype)
        return carry

    lax.fori_loop(0, head_k // key_split, solve_slice, 0)
    u_ref[...] = dot(t_mat, v_ref[...].astype(f32) * beta, precision).astype(u_ref.dtype)
