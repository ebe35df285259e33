"""The per-chunk half of KDA's chunked prefill: four Pallas kernels over 64-token chunks.

The cumsum kernel, one program per (chunk, value head), writes gc, the in-chunk cumulative log
gate, which the others read. For one chunk and value head, let
kk[i, j] = sum_d k_id k_jd exp(gc_id - gc_jd) (strictly lower), A = beta kk (row-scaled), D its
diagonal 16 x 16 blocks and E the rest. Then (I + A)^-1 = (I + M)^-1 (I + D)^-1 with
M = (I + D)^-1 E. The entries of D and of the causal query-key matrix inside a 16-row block
are formed by one of two kernels, chosen per block and value head by `near_blocks`: for a
*near* block (no channel decays by NEAR_DECAY or more over it) the scores kernel forms them by
dots through the block's first row; for the others the diagonal kernel, one program per few
rows (and a few value heads), forms them pair by pair. The scores kernel, one call per 16-row
block with one program per (chunk, value head), also forms the block's entries left of its
diagonal block, inverts that block and writes its rows of M + (I + D)^-1 (the two never share
an entry: M lies left of the diagonal blocks) and of the query-key matrix.
The solve kernel, one program per (chunk, value head), finishes the inverse and writes
w = (I + A)^-1 (beta exp(gc) k), u = (I + A)^-1 (beta v) and the decayed q and k. Nothing here
depends on the recurrent state, so all chunks run in parallel; the state scan in `kda` consumes
the outputs.

Invariants:
- No exponent exceeds NEAR_DECAY (64: exp(64) and exp(-64) are normal fp32 numbers), so g
  down to -100 (and far below) underflows to 0 and never overflows. A pair (i, j) with j in an
  earlier 16-row block than i meets through the first row r of i's block,
  exp(gc_i - gc_r) * exp(gc_r - gc_j), both exponents <= 0: one dot per 64-key slice. A pair
  inside a near block meets through r too, the key grown by exp(gc_r - gc_j) < exp(NEAR_DECAY):
  two [16, 64] x [64, 16] dots per key slice. A pair inside any other block gets its exact
  pairwise decay exp(gc_i - gc_j) (j <= i): the diagonal kernel walks only the keys j <= i of
  each of its rows' block (a loop of dynamic length), one [heads, K] product and two row sums
  per key. A 16-row program would spend the same exps on the pairs j > i too, and assemble its
  [16, 16] block from per-key columns.
- Both kernels read one flag per (chunk, block, value head) from `near_blocks`, so they never
  disagree. The diagonal kernel leaves a block's rows unwritten when the block is near for all
  of a program's heads; the scores kernel never reads a near block's rows. Gates of fla's
  benchmark (-softplus(x - 1)) make every block near; 2% of gates at -100 make almost none.
- Programs are small on purpose: a program holds 4 rows (`ChunkConfig.diagonal_rows`; one-row
  programs spend their time skipping near blocks, 16-row ones are slower on the exact pairs),
  one row block's products or one chunk's solve, so an SM holds several and their waits
  overlap.
- A row block meets only the keys before it. Each block is its own call (its offsets static:
  under a branch on the block id the compiler took 180-255 registers), so block b decays and
  multiplies the first 16 b keys, padded to a power-of-two width (16, 32, 64) and masked,
  instead of all C keys. The calls write one parts and one aqk buffer, aliased through them.
- The scores kernel writes disjoint column ranges of a row block, each once: the earlier
  blocks' columns and zeros in aqk's later columns (masked stores), and its own 16 x 16 diagonal
  block (no two threads store to one address, so no ordering between them is needed). Columns
  of parts after the diagonal block are never written: the solve kernel masks them out.
- D and M are nilpotent (orders 16 and C / 16), so each inverse is a short product of
  squarings. For fp32 inputs (and in the interpreter) their dots are fp32 (`HIGHEST`); for bf16
  inputs they run the algorithm `ChunkConfig` names (`INVERSE_DOTS`), three-pass bf16 by
  default: about 16 bits of each operand, more than one-pass TF32 (fla's choice for its
  triangular solve) and less than fp32. The whole prefill is faster than with three-pass
  TF32 and fp32 FMAs, with the same errors against the fp32 reference; the inverse is rounded
  to bf16 anyway before its products with v and k.
- The solve kernel's inverse stays fp32; its products with v and k then take operands in the
  dot dtype (bf16 for bf16 inputs, fp32 sums), as the scan's do: u and w are stored in it
  anyway, and fp32 operands held twice the registers (218 against 188 per thread, offline).
- The Triton lowering slices refs, not values: every sub-block or key slice is a ref load.
- v and g are read where they lie ([T, HV, *]): the cumsum and solve kernels take a chunk's
  rows through its token indices (clamped into the array, padding rows zeroed), which saves
  gathering them into chunks. q and k are read so too, by their own kernel, which normalises
  them and writes them chunked once for the others (the diagonal kernel reads a row up to 16
  times); in XLA, the norms and the gather were two passes. beta arrives chunked.
- gc is formed once, by its own kernel: XLA's cumsum (an associative scan that fuses with the
  chunk gather and recomputes) cost more than both other kernels' loads of gc, and a scan inside
  the scores and solve kernels slowed them by half.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tokenspeed_jax.kernels import pallas_backend
from tokenspeed_jax.kernels.kda_config import INVERSE_DOTS, SUB_BLOCK, ChunkConfig
from tokenspeed_jax.kernels.kda_ref import l2_normalize
from tokenspeed_jax.kernels.kernel_math import dot, dot_nt

LOG2_E = 1.4426950408889634
COLUMN_SLICE = 64  # key or value columns per wide dot
NEAR_DECAY = 64.0  # a block's in-block log decay below which its pairs go through one row


def decay(log_decay):
    """exp(log_decay) as exp2(log_decay * log2(e)): one special-function instruction on the GPU,
    where exp takes several more. Callers pass log_decay <= 0, where the scaling is exact to
    fp32 rounding and results below fp32's normal range may flush to 0."""
    return jnp.exp2(log_decay * LOG2_E)


def near_blocks(gc) -> jax.Array:
    """i32 [NC, C / 16, HV], 1 where a 16-row block is *near*: from its first row to its last
    no channel of gc ([NC, C, HV, K] fp32) decays by NEAR_DECAY or more. Computed once, so the
    diagonal and scores kernels take the same decision for every block."""
    first, last = gc[:, ::SUB_BLOCK], gc[:, SUB_BLOCK - 1::SUB_BLOCK]
    return (jnp.max(first - last, axis=-1) < NEAR_DECAY).astype(jnp.int32)


def chunk_is_live(live_ref):
    """Whether this program's chunk (grid axis 0) is one of the first live_ref[0] (i32[1]), the
    chunks that hold tokens. The chunk grid is sized for any packing of the bucket; its unused
    tail is never read, so a kernel skips it and leaves it unwritten. (Kernels read their other
    program ids before this test: the interpreter resolves program ids only outside branches.)"""
    return pl.program_id(0) < live_ref[0]


def nilpotent_inverse(strict, nilpotency: int, matmul):
    """(I + N)^-1 for N ([n, n]) with N^nilpotency = 0 (nilpotency a power of two): the product
    (I - N)(I + N^2)(I + N^4)... up to N^(nilpotency / 2), each product by `matmul`."""
    size = strict.shape[-1]
    eye = (lax.broadcasted_iota(jnp.int32, (size, size), 0)
           == lax.broadcasted_iota(jnp.int32, (size, size), 1)).astype(jnp.float32)
    inverse, power, order = eye - strict, strict, 2
    while order < nilpotency:
        power = matmul(power, power)
        inverse = matmul(inverse, eye + power)
        order *= 2
    return inverse


def token_rows(ref, tokens, head: jax.Array, cols=slice(None)) -> jax.Array:
    """One chunk's rows of ``ref [T, HV, width]`` for ``head``: token ``tokens[i]`` (i32[C]) in
    row i, zeros where ``tokens[i] == T`` (padding). The index is clamped first, so no load
    leaves the array in either the compiled kernel or the interpreter."""
    num_tokens = ref.shape[0]
    rows = ref[jnp.minimum(tokens, num_tokens - 1), head, cols]
    return jnp.where((tokens < num_tokens)[:, None], rows, 0)


def cumsum_kernel(live_ref, tokens_ref, g_ref, gc_ref, glast_ref):
    """gc = the cumulative sum of the chunk's rows of g ([T, HV, K] fp32 log decay) for this
    program's value head, and glast = their sum (the chunk's total decay; padding rows are 0)."""
    head = pl.program_id(1)

    @pl.when(chunk_is_live(live_ref))
    def _():
        rows = token_rows(g_ref, tokens_ref[...], head)
        gc_ref[...] = jnp.cumsum(rows, axis=0)
        glast_ref[...] = jnp.sum(rows, axis=0)


def queries_keys_kernel(live_ref, tokens_ref, q_ref, k_ref, q_c_ref, k_c_ref, *,
                        normalize: bool):
    """The chunk's rows of q and k ([T, H, K]) for this program's query head, L2-normalised in
    fp32 when ``normalize`` (the reference's formula), written chunked ([C, K] blocks)."""
    head = pl.program_id(1)

    @pl.when(chunk_is_live(live_ref))
    def _():
        tokens = tokens_ref[...]
        for x_ref, out_ref in ((q_ref, q_c_ref), (k_ref, k_c_ref)):
            rows = token_rows(x_ref, tokens, head)
            out_ref[...] = (l2_normalize(rows) if normalize else rows).astype(out_ref.dtype)


def diagonal_row(
    row,  # a row of the chunk
    q_ref,  # [C, Hq, K]: the chunk's query heads that this program's value heads read
    k_ref,  # [C, Hq, K]
    gc_ref,  # [C, heads, K] fp32
    beta_ref,  # [C, heads]
    *,
    scale: float,
    group: int,
):
    """The row's [heads, 16] entries of kk (fp32: beta_i k_i . k_j exp(gc_i - gc_j), j < i in
    the row's block) and qk (scale q_i . k_j exp(gc_i - gc_j), j <= i)."""
    f32 = jnp.float32
    start = row // SUB_BLOCK * SUB_BLOCK
    heads = gc_ref.shape[1]
    shared = lax.broadcasted_iota(jnp.int32, (heads,), 0) // group  # each value head's q/k head
    gc = gc_ref[row]
    q = q_ref[row, shared].astype(f32) * scale
    k = k_ref[row, shared].astype(f32)
    column = lax.broadcasted_iota(jnp.int32, (heads, SUB_BLOCK), 1)

    def earlier_key(j, sums):
        decayed = k_ref[j, shared].astype(f32) * decay(gc - gc_ref[j])
        at = column == j - start
        return tuple(jnp.where(at, jnp.sum(x * decayed, axis=1)[:, None], total)
                     for x, total in zip((k, q), sums))

    zeros = jnp.zeros((heads, SUB_BLOCK), f32)
    kk, qk = lax.fori_loop(start, row + 1, earlier_key, (zeros, zeros))
    beta = beta_ref[row].astype(f32)[:, None]
    return jnp.where(column < row - start, kk, 0.0) * beta, qk


def score_rows(
    block: int,  # this call's 16-row block of the chunk (static)
    near,  # whether the block is near (`near_blocks`): its pairs go through its first row
    q_ref,  # [C, K]
    k_ref,  # [C, K]
    gc_ref,  # [C, K] fp32, in-chunk cumulative log decay
    beta_ref,  # [C]
    kk_diag_ref,  # [C, 16] fp32, `diagonal_row`'s kk of every row of a block not near
    qk_diag_ref,  # [C, 16]  and its qk
    parts_ref,  # [16, C] fp32, this block's rows of M + (I + D)^-1
    aqk_ref,  # [16, C]  this block's rows of the causal scale * q_i . k_j * exp(gc_i - gc_j)
    *,
    scale: float,
    precision,
    exact,
):
    f32 = jnp.float32
    chunk, head_k = k_ref.shape
    start = block * SUB_BLOCK
    rows = pl.ds(start, SUB_BLOCK)
    beta = beta_ref[rows].astype(f32)[:, None]
    exact_dot = functools.partial(dot, precision=exact)

    def decayed_rows(keys):  # the block's rows decayed to its first row, in columns `keys`
        reference = gc_ref[pl.ds(start, 1), keys]
        to_reference = gc_ref[rows, keys] - reference  # <= 0
        k_rows = k_ref[rows, keys].astype(f32)
        q_rows = q_ref[rows, keys].astype(f32)
        return (reference, to_reference, k_rows, k_rows * decay(to_reference),
                q_rows * (scale * decay(to_reference)))

    def pairs_through_first_row():  # a near block: its keys grown to the first row (< NEAR_DECAY)
        in_kk = in_qk = jnp.zeros((SUB_BLOCK, SUB_BLOCK), f32)
        for keys in _column_slices(head_k):
            _, to_reference, k_rows, left_k, left_q = decayed_rows(keys)
            grown = k_rows * jnp.exp2(-to_reference * LOG2_E)
            in_kk += dot_nt(left_k, grown, precision)
            in_qk += dot_nt(left_q, grown, precision)
        row_in_block = lax.broadcasted_iota(jnp.int32, (SUB_BLOCK, SUB_BLOCK), 0)
        col_in_block = lax.broadcasted_iota(jnp.int32, (SUB_BLOCK, SUB_BLOCK), 1)
        return (jnp.where(col_in_block < row_in_block, in_kk * beta, 0.0),
                jnp.where(col_in_block <= row_in_block, in_qk, 0.0))

    kk_block, qk_block = lax.cond(
        near, pairs_through_first_row,
        lambda: (kk_diag_ref[rows, :], qk_diag_ref[rows, :].astype(f32)))
    block_inverse = nilpotent_inverse(kk_block, SUB_BLOCK, exact_dot)
    parts_ref[:, rows] = block_inverse
    aqk_ref[:, rows] = qk_block.astype(aqk_ref.dtype)

    if block:  # the earlier blocks' keys, decayed from the first row; padded to a power of two
        width = 1 << (start - 1).bit_length()  # 16, 32, 64 for blocks 1, 2, 3
        earlier = pl.ds(0, width)
        is_earlier = lax.broadcasted_iota(jnp.int32, (width, 1), 0) < start
        across_kk = across_qk = jnp.zeros((SUB_BLOCK, width), f32)
        for keys in _column_slices(head_k):
            reference, _, _, left_k, left_q = decayed_rows(keys)
            right = jnp.where(is_earlier, k_ref[earlier, keys].astype(f32) * decay(
                jnp.minimum(reference - gc_ref[earlier, keys], 0.0)), 0.0)
            across_kk += dot_nt(left_k, right, precision)
            across_qk += dot_nt(left_q, right, precision)
        earlier_columns = lax.broadcasted_iota(jnp.int32, (SUB_BLOCK, width), 1) < start
        pallas_backend.masked_store(parts_ref.at[:, earlier],
                                    exact_dot(block_inverse, across_kk * beta), earlier_columns)
        pallas_backend.masked_store(aqk_ref.at[:, earlier], across_qk.astype(aqk_ref.dtype),
                                    earlier_columns)
    if start + SUB_BLOCK < chunk:  # zeros in aqk's columns after the diagonal block
        later_columns = lax.broadcasted_iota(jnp.int32, (SUB_BLOCK, chunk), 1) >= start + SUB_BLOCK
        pallas_backend.masked_store(aqk_ref, jnp.zeros((SUB_BLOCK, chunk), aqk_ref.dtype),
                                    later_columns)


def solve_chunk(
    head,  # this program's value head
    tokens_ref,  # i32[C]: the token of each chunk row (T: padding)
    q_ref,  # [C, K]
    k_ref,  # [C, K]
    v_ref,  # [T, HV, V]: every token's values
    gc_ref,  # [C, K] fp32
    beta_ref,  # [C]
    parts_ref,  # [C, C] fp32, M + (I + D)^-1
    qg_ref,  # [C, K]  scale * q * exp(gc)
    w_ref,  # [C, K]  (I + A)^-1 (beta * exp(gc) * k)
    kg_ref,  # [C, K]  k * exp(gc_last - gc)
    u_ref,  # [C, V]  (I + A)^-1 (beta * v)
    *,
    scale: float,
    precision,
    exact,
):
    f32 = jnp.float32
    chunk = k_ref.shape[0]
    beta = beta_ref[...].astype(f32)[:, None]
    row_block = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0) // SUB_BLOCK
    col_block = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1) // SUB_BLOCK
    parts = parts_ref[...]
    exact_dot = functools.partial(dot, precision=exact)
    across = jnp.where(row_block > col_block, parts, 0.0)
    t_mat = exact_dot(nilpotent_inverse(across, chunk // SUB_BLOCK, exact_dot),
                      jnp.where(row_block == col_block, parts, 0.0))

    operand = u_ref.dtype  # the dot dtype: bf16 operands (fp32 sums) for bf16 inputs
    t_mat = t_mat.astype(operand)
    tokens = tokens_ref[...]
    for cols in _column_slices(v_ref.shape[-1]):
        v = token_rows(v_ref, tokens, head, cols).astype(f32)
        u_ref[:, cols] = dot(t_mat, (v * beta).astype(operand), precision).astype(u_ref.dtype)
    for keys in _column_slices(k_ref.shape[1]):
        gc = gc_ref[:, keys]
        k = k_ref[:, keys].astype(f32)
        w_ref[:, keys] = dot(t_mat, (k * decay(gc) * beta).astype(operand),
                             precision).astype(w_ref.dtype)
        qg_ref[:, keys] = (q_ref[:, keys].astype(f32) * scale * decay(gc)).astype(qg_ref.dtype)
        last = gc_ref[pl.ds(chunk - 1, 1), keys]
        kg_ref[:, keys] = (k * decay(jnp.minimum(last - gc, 0.0))).astype(kg_ref.dtype)


def diagonal_kernel(live_ref, near_ref, *refs, **params):
    """``diagonal_row`` for each of this program's rows ([rows, heads, 16] blocks of kk and
    qk, the last two refs) in a live chunk, unless their 16-row block is near for every one of
    the program's heads (``near_ref`` [heads]): then they are left unwritten, and the scores
    kernel forms them. The rows are read here, outside the branch."""
    *inputs, kk_ref, qk_ref = refs
    rows = kk_ref.shape[0]
    first_row = pl.program_id(1) * rows
    far = jnp.min(near_ref[...]) == 0

    def one_row(r, carry):
        kk, qk = diagonal_row(first_row + r, *inputs, **params)
        kk_ref[r] = kk
        qk_ref[r] = qk.astype(qk_ref.dtype)
        return carry

    @pl.when(chunk_is_live(live_ref) & far)
    def _():
        lax.fori_loop(0, rows, one_row, 0)


def scores_kernel(live_ref, near_ref, *refs, block: int, **params):
    """``score_rows`` of row block ``block`` for a live chunk, ``near_ref`` [C / 16] the
    chunk's near flags for this head. ``refs`` are its six inputs, then (for every block but
    the first) the parts and aqk buffers as aliased inputs (the earlier calls' rows, left alone
    here), then the same two as outputs."""
    near = near_ref[block] != 0
    pl.when(chunk_is_live(live_ref))(
        lambda: score_rows(block, near, *refs[:6], *refs[-2:], **params))


def solve_kernel(live_ref, *refs, **params):
    """``solve_chunk`` for a live chunk; the head id is read here, outside the branch."""
    head = pl.program_id(1)
    pl.when(chunk_is_live(live_ref))(lambda: solve_chunk(head, *refs, **params))


def _column_slices(width: int):
    """Static slices of at most COLUMN_SLICE columns: the [64, width] operands of the kernels'
    wide dots are taken a slice at a time, which bounds the registers they hold."""
    step = min(width, COLUMN_SLICE)
    return [pl.ds(first, step) for first in range(0, width, step)]


def diagonal_heads(most: int, value_heads: int, group: int) -> int:
    """The value heads per diagonal program: the largest count up to ``most`` that divides
    ``value_heads`` and that divides, or is a multiple of, the ``group`` value heads sharing a
    query head (so a program's query heads are one block of them)."""
    if most < 1:
        raise ValueError(f"diagonal_heads must be at least 1, got {most}")
    return max(h for h in range(1, min(most, value_heads) + 1)
               if value_heads % h == 0 and (h % group == 0 or group % h == 0))


def diagonal_pairs(q_c, k_c, gc, beta_c, near, live_chunks, *, group: int, scale: float,
                   config: ChunkConfig, interpret: bool):
    """`diagonal_row` over every chunk row of the blocks that are not near: q_c, k_c [NC, C,
    H, K], gc [NC, C, HV, K] fp32, beta_c [NC, C, HV], near i32[NC, C / 16, HV], live_chunks
    i32[1]; returns kk [NC, C, HV, 16] fp32 and qk in q's dtype (bf16 or fp32), unwritten in
    the rows of a block near for all of a program's heads."""
    num_chunks, C, HV, K = gc.shape
    heads = diagonal_heads(config.diagonal_heads, HV, group)
    rows = config.diagonal_rows  # divides 16 (`ChunkConfig` checks it)
    squeezed = pl.squeezed
    query_heads = max(1, heads // group)
    query_spec = pl.BlockSpec((squeezed, C, query_heads, K),
                              lambda c, r, h: (c, 0, h * heads // group // query_heads, 0))
    pair_spec = pl.BlockSpec((squeezed, rows, heads, SUB_BLOCK), lambda c, r, h: (c, r, h, 0))
    return pl.pallas_call(
        functools.partial(diagonal_kernel, scale=scale, group=group),
        grid=(num_chunks, C // rows, HV // heads),
        in_specs=[pl.BlockSpec(index_map=lambda *_: (0,)),
                  pl.BlockSpec((squeezed, squeezed, heads),
                               lambda c, r, h: (c, r * rows // SUB_BLOCK, h)),
                  query_spec, query_spec,
                  pl.BlockSpec((squeezed, C, heads, K), lambda c, r, h: (c, 0, h, 0)),
                  pl.BlockSpec((squeezed, C, heads), lambda c, r, h: (c, 0, h))],
        out_specs=[pair_spec, pair_spec],
        out_shape=[jax.ShapeDtypeStruct((num_chunks, C, HV, SUB_BLOCK), dtype)
                   for dtype in (jnp.float32, q_c.dtype)],
        compiler_params=pallas_backend.compiler_params(num_warps=config.diagonal_num_warps,
                                                       num_stages=1),
        interpret=interpret,
        name="kda_chunk_diagonal",
    )(live_chunks, near, q_c, k_c, gc, beta_c)


def intra_stage(q, k, v, g, beta_c, tokens, live_chunks, *, group: int, scale: float,
                normalize_qk: bool, config: ChunkConfig, interpret: bool):
    """The per-chunk kernels over chunked beta_c [NC, C, HV], and q, k [T, H, K] (L2-normalised
    here when ``normalize_qk``), v [T, HV, V] and the log gate g [T, HV, K] read in place
    through ``tokens`` (i32[NC, C], the token of each chunk row, T for padding), of which the
    first ``live_chunks`` (i32[1]) hold tokens: returns qg, w, kg, u, aqk [HV, NC, C, *] and
    glast [HV, NC, K] fp32 (each chunk's total log decay), garbage past the live chunks."""
    (num_chunks, C), (_, HV, K) = tokens.shape, g.shape
    V = v.shape[-1]
    precision = lax.Precision.HIGHEST if v.dtype == jnp.float32 else lax.Precision.DEFAULT
    fp32_inverses = interpret or v.dtype == jnp.float32
    block_exact, exact = (lax.Precision.HIGHEST if fp32_inverses else INVERSE_DOTS[name]
                          for name in (config.block_inverse_dots, config.inverse_dots))
    dot_dtype = jnp.float32 if v.dtype == jnp.float32 else jnp.bfloat16
    squeezed = pl.squeezed

    def chunk_spec(width, head_of):
        return pl.BlockSpec((squeezed, C, squeezed, width),
                            lambda c, h, *_: (c, 0, head_of(h), 0))

    def shared_head(h):
        return h // group

    def own_head(h):
        return h

    def chunked(width, dtype=dot_dtype):
        return jax.ShapeDtypeStruct((HV, num_chunks, C, width), dtype)

    beta_spec = pl.BlockSpec((squeezed, C, squeezed), lambda c, h, *_: (c, 0, h))
    near_spec = pl.BlockSpec((squeezed, C // SUB_BLOCK, squeezed), lambda c, h: (c, 0, h))
    live_spec = pl.BlockSpec(index_map=lambda *_: (0,))
    tokens_spec = pl.BlockSpec((squeezed, C), lambda c, *_: (c, 0))
    whole = pl.BlockSpec()
    live_chunks = live_chunks.astype(jnp.int32).reshape(1)
    tokens = tokens.astype(jnp.int32)
    gc, glast = pl.pallas_call(
        cumsum_kernel,
        grid=(num_chunks, HV),
        in_specs=[live_spec, tokens_spec, whole],
        out_specs=[chunk_spec(K, own_head),
                   pl.BlockSpec((squeezed, squeezed, K), lambda c, h, *_: (h, c, 0))],
        out_shape=[jax.ShapeDtypeStruct((num_chunks, C, HV, K), jnp.float32),
                   jax.ShapeDtypeStruct((HV, num_chunks, K), jnp.float32)],
        compiler_params=pallas_backend.compiler_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="kda_chunk_cumsum",
    )(live_chunks, tokens, g.astype(jnp.float32))
    q_c, k_c = pl.pallas_call(
        functools.partial(queries_keys_kernel, normalize=normalize_qk),
        grid=(num_chunks, q.shape[1]),
        in_specs=[live_spec, tokens_spec, whole, whole],
        out_specs=[chunk_spec(K, own_head)] * 2,
        out_shape=[jax.ShapeDtypeStruct((num_chunks, C, *q.shape[1:]), q.dtype)] * 2,
        compiler_params=pallas_backend.compiler_params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="kda_chunk_queries_keys",
    )(live_chunks, tokens, q, k)
    near = near_blocks(gc)
    kk_diag, qk_diag = diagonal_pairs(q_c, k_c, gc, beta_c, near, live_chunks, group=group,
                                      scale=scale, config=config, interpret=interpret)
    parts_and_aqk = []
    for block in range(C // SUB_BLOCK):  # one call per row block: its code has static offsets
        parts_and_aqk = pl.pallas_call(
            functools.partial(scores_kernel, block=block, scale=scale, precision=precision,
                              exact=block_exact),
            grid=(num_chunks, HV),
            in_specs=[live_spec, near_spec, chunk_spec(K, shared_head),
                      chunk_spec(K, shared_head), chunk_spec(K, own_head), beta_spec,
                      chunk_spec(SUB_BLOCK, own_head), chunk_spec(SUB_BLOCK, own_head)]
                     + [whole] * len(parts_and_aqk),
            out_specs=[pl.BlockSpec((squeezed, squeezed, SUB_BLOCK, C),
                                    lambda c, h, b=block: (h, c, b, 0))] * 2,
            out_shape=[chunked(C, jnp.float32), chunked(C)],
            input_output_aliases={8: 0, 9: 1} if parts_and_aqk else {},
            compiler_params=pallas_backend.compiler_params(num_warps=config.scores_num_warps,
                                                           num_stages=1),
            interpret=interpret,
            name="kda_chunk_scores",
        )(live_chunks, near, q_c, k_c, gc, beta_c, kk_diag, qk_diag, *parts_and_aqk)
    parts, aqk = parts_and_aqk

    def out_spec(width):
        return pl.BlockSpec((squeezed, squeezed, C, width), lambda c, h: (h, c, 0, 0))

    qg, w, kg, u = pl.pallas_call(
        functools.partial(solve_kernel, scale=scale, precision=precision, exact=exact),
        grid=(num_chunks, HV),
        in_specs=[live_spec, tokens_spec, chunk_spec(K, shared_head),
                  chunk_spec(K, shared_head), whole, chunk_spec(K, own_head), beta_spec,
                  out_spec(C)],
        out_specs=[out_spec(K), out_spec(K), out_spec(K), out_spec(V)],
        out_shape=[chunked(K), chunked(K), chunked(K), chunked(V)],
        compiler_params=pallas_backend.compiler_params(num_warps=config.solve_num_warps,
                                                       num_stages=1),
        interpret=interpret,
        name="kda_chunk_solve",
    )(live_chunks, tokens, q_c, k_c, v, gc, beta_c, parts)
    return qg, w, kg, u, aqk, glast
