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
  same sub-block gets its exact pairwise decay exp(min(gc_i - gc_j, 0)) (the clamp only touches
  pairs j > i, which the masks drop).
- The in-sub-block pairs are kept compact, as [C / 16, 16, 16] blocks (blocks[b, r, o] is entry
  (16 b + r, 16 b + o)). `DIAGONAL_FORMS` names the two ways to form them: "broadcast" takes
  every pair at once as a product over [key_split, 16, 16, C / 16] reduced over the key axis;
  "columns" takes one column of every sub-block per loop step (16 dependent steps per slice).
- Register use is bounded by `key_split`: the products over K accumulate over slices of
  `key_split` channels in a `fori_loop`, so only [C, key_split] slices of q, k and gc (and, in
  the broadcast form, the [key_split, 16, 16, C / 16] pairwise product) are live.
- Whole matrices are [C, C] tiles and sub-blocks of them are masks (the Triton lowering slices
  refs, not values); values change shape only by reshapes, transposes and broadcasts. The
  Triton lowering lays a broadcast product out with its trailing axes over lanes and warps, so
  every product reduces over its leading axis, which stays inside each thread.
- The inverse is (I + M)^-1 (I + D)^-1, with D the diagonal sub-blocks of the lower matrix and
  M = (I + D)^-1 E (E the rest); both are nilpotent, so each inverse is a short product of
  squarings (the powers can cancel, so nothing there rounds below fp32): (I + D)^-1 on the
  compact blocks in fp32 arithmetic, the rest with `exact` dots.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tokenspeed_jax.kernels.kernel_math import dot, dot_nt

SUB_BLOCK = 16  # rows sharing one decay reference point; also Triton's smallest dot tile
DIAGONAL_FORMS = ("broadcast", "columns")  # how the in-sub-block products are formed
LOG2_E = 1.4426950408889634


def decay(log_decay):
    """exp(log_decay) as exp2(log_decay * log2(e)): one special-function instruction on the GPU,
    where exp takes several more. Callers pass log_decay <= 0, where the scaling is exact to
    fp32 rounding and results below fp32's normal range may flush to 0."""
    return jnp.exp2(log_decay * LOG2_E)


def batched_matmul(a, b):
    """[n, p, q] @ [n, q, r] per leading index in fp32 arithmetic (the Triton lowering has no
    batched dot), as a broadcast product over [q, n, p, r] reduced over its leading axis."""
    a = jnp.transpose(a, (2, 0, 1))  # [q, n, p]
    b = jnp.transpose(b, (1, 0, 2))  # [q, n, r]
    return jnp.sum(a[:, :, :, None] * b[:, :, None, :], axis=0)


def nilpotent_inverse(strict, nilpotency: int, matmul):
    """(I + N)^-1 for N ([..., n, n]) with N^nilpotency = 0 (nilpotency a power of two): the
    product (I - N)(I + N^2)(I + N^4)... up to N^(nilpotency / 2), each product by `matmul`."""
    size = strict.shape[-1]
    eye = (lax.broadcasted_iota(jnp.int32, (size, size), 0)
           == lax.broadcasted_iota(jnp.int32, (size, size), 1)).astype(jnp.float32)
    inverse, power, order = eye - strict, strict, 2
    while order < nilpotency:
        power = matmul(power, power)
        inverse = matmul(inverse, eye + power)
        order *= 2
    return inverse


def widen(blocks, precision):
    """[C / 16, 16, 16] diagonal blocks as the block-diagonal [C, C] matrix: a 0/1 dot repeats
    each row's 16 values across the row (exact with an fp32-exact `precision`), and the
    sub-block mask keeps the copy on the diagonal. (A broadcast and reshape does the same
    without a dot, but the layout change it costs in the Triton lowering spills registers.)"""
    num_sub = blocks.shape[0]
    chunk = num_sub * SUB_BLOCK
    spread = (lax.broadcasted_iota(jnp.int32, (SUB_BLOCK, chunk), 1) % SUB_BLOCK
              == lax.broadcasted_iota(jnp.int32, (SUB_BLOCK, chunk), 0)).astype(jnp.float32)
    rows = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0) // SUB_BLOCK
    cols = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1) // SUB_BLOCK
    return jnp.where(rows == cols, dot(blocks.reshape(chunk, SUB_BLOCK), spread, precision), 0.0)


def broadcast_diagonal(q, k, gc):
    """The diagonal blocks of one key slice ([C, key_split] q, k, gc), all pairs at once:
    (k_i . k_j, q_i . k_j) with the exact decay exp(min(gc_i - gc_j, 0)), each [C / 16, 16, 16].
    The product runs over [key, j, i, block], so each thread reduces its own key axis and holds
    several j (q, k and gc of row i are read once for them)."""
    chunk, key_split = k.shape
    key_major = (key_split, chunk // SUB_BLOCK, SUB_BLOCK)
    q, k, gc = (jnp.transpose(x.T.reshape(key_major), (0, 2, 1)) for x in (q, k, gc))
    decayed = k[:, :, None, :] * decay(jnp.minimum(gc[:, None, :, :] - gc[:, :, None, :], 0.0))
    return tuple(jnp.transpose(jnp.sum(x[:, None, :, :] * decayed, axis=0), (2, 1, 0))
                 for x in (k, q))


def column_diagonal(q, k, gc, k_ref, gc_ref, keys):
    """The same blocks as `broadcast_diagonal`, one column of every sub-block per loop step:
    step `offset` loads row 16 * b + offset of each sub-block b and pairs it with every row of
    that sub-block."""
    chunk, key_split = k.shape
    num_sub = chunk // SUB_BLOCK
    row_sub = lax.broadcasted_iota(jnp.int32, (chunk, key_split), 0) // SUB_BLOCK
    sub_cols = lax.broadcasted_iota(jnp.int32, (chunk, SUB_BLOCK), 1)

    def step(offset, products):  # products: [C, 16], column o of row i is entry (i, 16 b + o)
        diagonal_kk, diagonal_qk = products
        partner_k = jnp.zeros_like(k)
        partner_g = jnp.zeros_like(gc)
        for b in range(num_sub):
            row = pl.ds(b * SUB_BLOCK + offset, 1)
            partner_k = jnp.where(row_sub == b, k_ref[row, keys].astype(jnp.float32), partner_k)
            partner_g = jnp.where(row_sub == b, gc_ref[row, keys], partner_g)
        decayed = partner_k * decay(jnp.minimum(gc - partner_g, 0.0))
        at = sub_cols == offset
        diagonal_kk += jnp.where(at, jnp.sum(k * decayed, axis=1)[:, None], 0.0)
        diagonal_qk += jnp.where(at, jnp.sum(q * decayed, axis=1)[:, None], 0.0)
        return diagonal_kk, diagonal_qk

    zeros = jnp.zeros((chunk, SUB_BLOCK), jnp.float32)
    products = lax.fori_loop(0, SUB_BLOCK, step, (zeros, zeros))
    return tuple(p.reshape(num_sub, SUB_BLOCK, SUB_BLOCK) for p in products)


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
    diagonal_form: str,
    precision,
    exact,
):
    f32 = jnp.float32
    chunk, head_k = k_ref.shape
    num_sub = chunk // SUB_BLOCK
    row_sub = lax.broadcasted_iota(jnp.int32, (chunk, key_split), 0) // SUB_BLOCK
    rows = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    beta = beta_ref[...].astype(f32)

    def key_slice(s, products):
        keys = pl.ds(pl.multiple_of(s * key_split, key_split), key_split)
        q = q_ref[:, keys].astype(f32) * scale
        k = k_ref[:, keys].astype(f32)
        gc = gc_ref[:, keys]
        qg_ref[:, keys] = (q * decay(gc)).astype(qg_ref.dtype)
        last = gc_ref[chunk - 1, keys][None, :]
        kg_ref[:, keys] = (k * decay(jnp.minimum(last - gc, 0.0))).astype(kg_ref.dtype)

        boundary = [gc_ref[b * SUB_BLOCK, keys][None, :] for b in range(num_sub)]
        reference = jnp.zeros_like(gc)
        for b in range(num_sub):
            reference = jnp.where(row_sub == b, boundary[b], reference)
        to_reference = decay(gc - reference)
        k_left, q_left = k * to_reference, q * to_reference
        kk, qk, diagonal_kk, diagonal_qk = products
        for b in range(1, num_sub):
            k_right = k * decay(jnp.minimum(boundary[b] - gc, 0.0))
            in_block = (rows // SUB_BLOCK == b) & (cols < b * SUB_BLOCK)
            kk += jnp.where(in_block, dot_nt(k_left, k_right, precision), 0.0)
            qk += jnp.where(in_block, dot_nt(q_left, k_right, precision), 0.0)

        if diagonal_form == "broadcast":
            slice_kk, slice_qk = broadcast_diagonal(q, k, gc)
        else:
            slice_kk, slice_qk = column_diagonal(q, k, gc, k_ref, gc_ref, keys)
        return kk, qk, diagonal_kk + slice_kk, diagonal_qk + slice_qk

    zeros = jnp.zeros((chunk, chunk), f32)
    block_zeros = jnp.zeros((num_sub, SUB_BLOCK, SUB_BLOCK), f32)
    # kk and qk hold the pairs across sub-blocks (strictly lower), the blocks those within.
    kk, qk, diagonal_kk, diagonal_qk = lax.fori_loop(
        0, head_k // key_split, key_slice, (zeros, zeros, block_zeros, block_zeros))
    aqk_ref[...] = jnp.where(rows >= cols, qk + widen(diagonal_qk, exact), 0.0).astype(
        aqk_ref.dtype)

    block_rows = lax.broadcasted_iota(jnp.int32, block_zeros.shape, 1)
    block_cols = lax.broadcasted_iota(jnp.int32, block_zeros.shape, 2)
    block_beta = beta.reshape(num_sub, SUB_BLOCK)[:, :, None]
    diagonal = jnp.where(block_rows > block_cols, diagonal_kk * block_beta, 0.0)
    diagonal_inverse = widen(nilpotent_inverse(diagonal, SUB_BLOCK, batched_matmul), exact)
    exact_dot = functools.partial(dot, precision=exact)
    across = exact_dot(diagonal_inverse, kk * beta[:, None])
    t_mat = exact_dot(nilpotent_inverse(across, num_sub, exact_dot), diagonal_inverse)

    def solve_slice(s, carry):
        keys = pl.ds(pl.multiple_of(s * key_split, key_split), key_split)
        scaled = k_ref[:, keys].astype(f32) * decay(gc_ref[:, keys]) * beta[:, None]
        w_ref[:, keys] = dot(t_mat, scaled, precision).astype(w_ref.dtype)
        return carry

    lax.fori_loop(0, head_k // key_split, solve_slice, 0)
    u_ref[...] = dot(t_mat, v_ref[...].astype(f32) * beta[:, None], precision).astype(
        u_ref.dtype)
