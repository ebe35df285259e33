"""KDA (Kimi Delta Attention) chunked prefill as Pallas GPU kernels, over a state pool.

The function is the one `kda_ref` defines (token recurrence with per-channel decay and a delta
rule). Prefill runs in two kernels over 64-token chunks:

1. The per-chunk kernel, one program per (chunk, value head), all in parallel: the in-chunk part
   of the WY/UT transform. It builds the strictly lower key-key matrix L and the causal query-key
   matrix, inverts (I + L), and writes w, u, decayed q and k, the query-key matrix and the chunk's
   total log decay. `ChunkConfig.intra` picks the version: "blocked" (`kda_intra`, 16 x 16
   sub-blocks, all dots; the default) or "substitution" (`_substitution_intra_kernel`, the first
   version: 64 x 64 forward substitution one row per step), kept until both are timed side by side
   on the GPU.
2. `_state_scan_kernel`, one program per (request, value head, block of V): walks the request's
   chunks in order, carrying the [K, block_v] fp32 state, and writes the output.

Invariants:
- Inputs are packed ([T, ...], fla's `cu_seqlens` layout with B squeezed) and all shapes are
  static, fixed by the caller's bucket; request boundaries and slots are traced arrays.
- Every request starts its chunks at its own first token, so chunks never straddle requests; the
  last chunk is zero-padded, which is exact (k = v = beta = g = 0 leaves the state unchanged).
- States live in a pool [P, HV, K, V] fp32, read from and written to row `slots[n]`; the pool is
  donated and updated in place. A request with `slots[n] < 0` is padding: it reads zeros and writes
  no state. Slots (and checkpoint slots) in one call must be distinct.
- Checkpoints: a request with `checkpoint_slots[n] >= 0` also stores its state after
  `checkpoint_offsets[n]` tokens into that slot. Offsets are traced values: they must be positive
  multiples of 64 (prefix-cache granularities are multiples of the chunk) and at most the
  request's length; an offset that is not is rounded down to the chunk, and one out of range
  stores nothing. The scan runs the request in two
  loops, main up to the checkpoint's chunk and tail to the end, in one call; a request without a
  checkpoint has an empty main loop and no extra store.
- Numerics: decays are formed as exp of differences of in-chunk cumulative log gates, always with
  a non-positive exponent (g <= 0), so strong decay underflows to 0 and never overflows.

The Pallas backend (Triton lowering today, deprecated from jax 0.11 in favour of Mosaic GPU) is
chosen in `pallas_backend` alone.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tokenspeed_jax.kernels import pallas_backend
from tokenspeed_jax.kernels.kda_decode import fused_recurrent_kda, fused_recurrent_kda_pool
from tokenspeed_jax.kernels.kda_intra import SUB_BLOCK, dot, dot_nt, dot_tn, intra_chunk_kernel
from tokenspeed_jax.kernels.kda_ref import (
    CHUNK_SIZE,
    check_pool_call,
    fla_to_packed,
    prepare_qkg,
)

__all__ = [
    "ChunkConfig",
    "chunk_kda",
    "chunk_kda_prefill",
    "fused_recurrent_kda",
    "fused_recurrent_kda_pool",
]

@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Tuning knobs of the chunked prefill kernels."""

    block_v: int = 32  # V columns of state per scan program
    key_split: int = 32  # K columns per step of the exact in-block decay products
    # "substitution" (row-by-row over 64 x 64; the timed default) or "blocked" (kda_intra: 16 x 16
    # sub-blocks; correct on the GPU, not yet timed, and slow to compile: see docs/benchmarks.md)
    intra: str = "substitution"
    intra_num_warps: int = 8
    scan_num_warps: int = 4
    num_stages: int = 2


def _place_block(block, row0, col0, rows, cols):
    """Embeds a [b, b] block at (row0, col0) of a zero [rows, cols] matrix, exactly (0/1 dots)."""
    size = block.shape[0]
    exact = lax.Precision.HIGHEST
    to_cols = (lax.broadcasted_iota(jnp.int32, (size, cols), 1)
               == lax.broadcasted_iota(jnp.int32, (size, cols), 0) + col0).astype(jnp.float32)
    to_rows = (lax.broadcasted_iota(jnp.int32, (rows, size), 0)
               == lax.broadcasted_iota(jnp.int32, (rows, size), 1) + row0).astype(jnp.float32)
    return dot(to_rows, dot(block, to_cols, exact), exact)


def _substitution_intra_kernel(
    q_ref,  # [C, K]
    k_ref,  # [C, K]
    v_ref,  # [C, V]
    gc_ref,  # [C, K] fp32, in-chunk cumulative log decay
    beta_ref,  # [C]
    qg_ref,  # [C, K]  scale * q * exp(gc)
    w_ref,  # [C, K]  (I + L)^-1 (beta * exp(gc) * k)
    kg_ref,  # [C, K]  k * exp(gc_last - gc)
    u_ref,  # [C, V]  (I + L)^-1 (beta * v)
    aqk_ref,  # [C, C]  causal scale * q_i . k_j * exp(gc_i - gc_j)
    *,
    scale: float,
    key_split: int,
    precision,
):
    f32 = jnp.float32
    chunk, head_k = k_ref.shape
    q = q_ref[...].astype(f32) * scale
    k = k_ref[...].astype(f32)
    gc = gc_ref[...]
    beta = beta_ref[...].astype(f32)
    num_sub = chunk // SUB_BLOCK

    # Off-diagonal sub-blocks: row i of sub-block b and column j < 16b meet through the
    # reference point r = 16b, exp(gc_i - gc_r) * exp(gc_r - gc_j), both factors <= 1.
    row_sub = lax.broadcasted_iota(jnp.int32, (chunk, head_k), 0) // SUB_BLOCK
    reference = jnp.zeros_like(gc)
    for b in range(num_sub):
        reference = jnp.where(row_sub == b, gc_ref[b * SUB_BLOCK, :][None, :], reference)
    to_reference = jnp.exp(gc - reference)
    k_left, q_left = k * to_reference, q * to_reference
    rows = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    cols = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    kk = jnp.zeros((chunk, chunk), f32)
    qk = jnp.zeros((chunk, chunk), f32)
    for b in range(1, num_sub):
        g_ref_row = gc_ref[b * SUB_BLOCK, :][None, :]
        k_right = k * jnp.exp(jnp.minimum(g_ref_row - gc, 0.0))
        in_block = (rows // SUB_BLOCK == b) & (cols < b * SUB_BLOCK)
        kk += jnp.where(in_block, dot_nt(k_left, k_right, precision), 0.0)
        qk += jnp.where(in_block, dot_nt(q_left, k_right, precision), 0.0)

    # Diagonal sub-blocks: exact pairwise decays, a slice of K at a time.
    sub_rows = lax.broadcasted_iota(jnp.int32, (SUB_BLOCK, SUB_BLOCK), 0)
    sub_cols = lax.broadcasted_iota(jnp.int32, (SUB_BLOCK, SUB_BLOCK), 1)
    for b in range(num_sub):
        rows_b = pl.ds(b * SUB_BLOCK, SUB_BLOCK)
        kk_b = jnp.zeros((SUB_BLOCK, SUB_BLOCK), f32)
        qk_b = jnp.zeros((SUB_BLOCK, SUB_BLOCK), f32)
        for start in range(0, head_k, key_split):
            keys = pl.ds(start, key_split)
            k_b = k_ref[rows_b, keys].astype(f32)
            q_b = q_ref[rows_b, keys].astype(f32) * scale
            g_b = gc_ref[rows_b, keys]
            decayed_k = k_b[None, :, :] * jnp.exp(
                jnp.minimum(g_b[:, None, :] - g_b[None, :, :], 0.0))  # [i, j, d]
            kk_b += jnp.sum(k_b[:, None, :] * decayed_k, axis=-1)
            qk_b += jnp.sum(q_b[:, None, :] * decayed_k, axis=-1)
        row0 = b * SUB_BLOCK
        kk += _place_block(jnp.where(sub_rows > sub_cols, kk_b, 0.0), row0, row0, chunk, chunk)
        qk += _place_block(jnp.where(sub_rows >= sub_cols, qk_b, 0.0), row0, row0, chunk, chunk)

    # T = (I + diag(beta) L)^-1 by forward substitution, one row per step.
    lower = kk * beta[:, None]

    def substitute(i, t):
        l_row = jnp.sum(jnp.where(rows == i, lower, 0.0), axis=0)
        return t - jnp.where(rows == i, jnp.sum(l_row[:, None] * t, axis=0)[None, :], 0.0)

    t_mat = lax.fori_loop(1, chunk, substitute, (rows == cols).astype(f32))
    decay = jnp.exp(gc)
    w_ref[...] = dot(t_mat, k * decay * beta[:, None], precision).astype(w_ref.dtype)
    u_ref[...] = dot(t_mat, v_ref[...].astype(f32) * beta[:, None], precision).astype(u_ref.dtype)
    qg_ref[...] = (q * decay).astype(qg_ref.dtype)
    kg_ref[...] = (k * jnp.exp(gc_ref[chunk - 1, :][None, :] - gc)).astype(kg_ref.dtype)
    aqk_ref[...] = qk.astype(aqk_ref.dtype)


def _state_scan_kernel(
    table_ref,  # [N, 5] int32: chunk begin, checkpoint chunk, chunk end, slot, checkpoint slot
    qg_ref,  # [HV, NC, C, K]
    w_ref,  # [HV, NC, C, K]
    kg_ref,  # [HV, NC, C, K]
    u_ref,  # [HV, NC, C, V]
    aqk_ref,  # [HV, NC, C, C]
    glast_ref,  # [HV, NC, K] fp32, each chunk's total log decay
    pool_ref,  # [P, HV, K, V] fp32, aliased with pool_out_ref
    o_ref,  # [HV, NC, C, V]
    pool_out_ref,  # [P, HV, K, V] fp32
    *,
    block_v: int,
    precision,
):
    n, head, v_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    chunk_begin, chunk_ckpt, chunk_end = table_ref[n, 0], table_ref[n, 1], table_ref[n, 2]
    slot, ckpt_slot = table_ref[n, 3], table_ref[n, 4]
    head_k = qg_ref.shape[-1]
    cols = pl.ds(v_block * block_v, block_v)
    dot_dtype = w_ref.dtype

    state = lax.cond(
        slot >= 0,
        lambda: pool_ref[jnp.maximum(slot, 0), head, :, cols],
        lambda: jnp.zeros((head_k, block_v), jnp.float32),
    )

    def chunk_step(c, state):
        state_in = state.astype(dot_dtype)
        v_new = u_ref[head, c, :, cols].astype(jnp.float32) - dot(w_ref[head, c], state_in,
                                                                   precision)
        v_new_in = v_new.astype(dot_dtype)
        out = dot(qg_ref[head, c], state_in, precision) + dot(aqk_ref[head, c], v_new_in,
                                                                  precision)
        o_ref[head, c, :, cols] = out.astype(o_ref.dtype)
        chunk_decay = jnp.exp(glast_ref[head, c, :])
        return state * chunk_decay[:, None] + dot_tn(kg_ref[head, c], v_new_in, precision)

    state = lax.fori_loop(chunk_begin, chunk_ckpt, chunk_step, state)

    @pl.when(ckpt_slot >= 0)
    def _():
        pool_out_ref[ckpt_slot, head, :, cols] = state

    state = lax.fori_loop(chunk_ckpt, chunk_end, chunk_step, state)

    @pl.when(slot >= 0)
    def _():
        pool_out_ref[slot, head, :, cols] = state


def _chunk_layout(cu_seqlens, num_tokens: int, num_chunks: int):
    """Where each chunk row comes from: token indices [NC, C] (num_tokens marks padding), the
    first chunk of each request [N + 1], and for each token its row in the chunked layout [T]."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    first_chunk = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), jnp.cumsum((lengths + CHUNK_SIZE - 1) // CHUNK_SIZE)]
    ).astype(jnp.int32)
    num_requests = lengths.shape[0]
    chunk = jnp.arange(num_chunks, dtype=jnp.int32)
    owner = jnp.minimum(jnp.searchsorted(first_chunk[1:], chunk, side="right"), num_requests - 1)
    local = (chunk - first_chunk[owner])[:, None] * CHUNK_SIZE + jnp.arange(CHUNK_SIZE)[None, :]
    real = (chunk < first_chunk[-1])[:, None] & (local < lengths[owner][:, None])
    token_of_row = jnp.where(real, cu_seqlens[owner][:, None] + local, num_tokens)

    token = jnp.arange(num_tokens, dtype=jnp.int32)
    request = jnp.minimum(jnp.searchsorted(cu_seqlens[1:], token, side="right"), num_requests - 1)
    offset = token - cu_seqlens[request]
    row_of_token = (first_chunk[request] + offset // CHUNK_SIZE) * CHUNK_SIZE + offset % CHUNK_SIZE
    row_of_token = jnp.where(token < cu_seqlens[-1], row_of_token, num_chunks * CHUNK_SIZE)
    return token_of_row, first_chunk, row_of_token


def _to_chunks(x, token_of_row):
    rows = jnp.take(x, token_of_row.reshape(-1), axis=0, mode="fill", fill_value=0)
    return rows.reshape(*token_of_row.shape, *x.shape[1:])


@functools.partial(
    jax.jit,
    static_argnames=("scale", "use_qk_l2norm_in_kernel", "use_gate_in_kernel",
                     "config", "interpret"),
    donate_argnames=("state_pool",),
)
def chunk_kda_prefill(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state_pool: jax.Array,
    slots: jax.Array,
    cu_seqlens: jax.Array,
    checkpoint_offsets: jax.Array | None = None,
    checkpoint_slots: jax.Array | None = None,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    config: ChunkConfig = ChunkConfig(),
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Chunked KDA over a packed bucket of requests, states in a donated pool.

    q, k [T, H, K]; v [T, HV, V]; g [T, HV, K] (log decay, or raw with `use_gate_in_kernel`);
    beta [T, HV]; state_pool [P, HV, K, V] fp32; slots [N] int32 (< 0: padded request);
    cu_seqlens [N + 1] int32; checkpoint_offsets, checkpoint_slots [N] int32 (slot < 0: none).
    Returns (o [T, HV, V] in v's dtype, updated pool). Tokens past cu_seqlens[-1] get zeros.
    """
    interpret = pallas_backend.resolve_interpret(interpret)
    T, H, K, HV, V, num_requests = check_pool_call(
        q, k, v, g, beta, state_pool, slots, cu_seqlens)
    if (checkpoint_offsets is None) != (checkpoint_slots is None):
        raise ValueError("checkpoint_offsets and checkpoint_slots come together")
    block_v = min(config.block_v, V)
    key_split = min(config.key_split, K)
    if V % block_v or K % key_split:
        raise ValueError(f"{V=} must be a multiple of {block_v=} and {K=} of {key_split=}")
    if config.intra not in ("blocked", "substitution"):
        raise ValueError(f"config.intra must be 'blocked' or 'substitution', got {config.intra!r}")
    scale = K**-0.5 if scale is None else float(scale)
    group = HV // H
    precision = lax.Precision.HIGHEST if v.dtype == jnp.float32 else lax.Precision.DEFAULT
    dot_dtype = jnp.float32 if v.dtype == jnp.float32 else jnp.bfloat16

    q, k, g = prepare_qkg(q, k, g, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias)
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    num_chunks = pl.cdiv(T, CHUNK_SIZE) + num_requests
    token_of_row, first_chunk, row_of_token = _chunk_layout(cu_seqlens, T, num_chunks)
    q_c, k_c, v_c, g_c, beta_c = (_to_chunks(x, token_of_row) for x in (q, k, v, g, beta))

    C = CHUNK_SIZE
    squeezed = pl.squeezed
    qk_spec = pl.BlockSpec((squeezed, C, squeezed, K), lambda c, h: (c, 0, h // group, 0))
    per_head_k = pl.BlockSpec((squeezed, C, squeezed, K), lambda c, h: (c, 0, h, 0))
    per_head_v = pl.BlockSpec((squeezed, C, squeezed, V), lambda c, h: (c, 0, h, 0))
    beta_spec = pl.BlockSpec((squeezed, C, squeezed), lambda c, h: (c, 0, h))

    def out_spec(width):
        return pl.BlockSpec((squeezed, squeezed, C, width), lambda c, h: (h, c, 0, 0))

    def chunked(width, dtype):
        return jax.ShapeDtypeStruct((HV, num_chunks, C, width), dtype)

    out_specs = [out_spec(K), out_spec(K), out_spec(K), out_spec(V), out_spec(C)]
    out_shape = [chunked(K, dot_dtype), chunked(K, dot_dtype), chunked(K, dot_dtype),
                 chunked(V, dot_dtype), chunked(C, dot_dtype)]
    intra_params = {
        "grid": (num_chunks, HV),
        "in_specs": [qk_spec, qk_spec, per_head_v, per_head_k, beta_spec],
        "compiler_params": pallas_backend.compiler_params(
            num_warps=config.intra_num_warps, num_stages=config.num_stages),
        "interpret": interpret,
        "name": "kda_intra_chunk",
    }
    kernel_args = {"scale": scale, "key_split": key_split, "precision": precision}
    if config.intra == "blocked":
        qg, w, kg, u, aqk, glast = pl.pallas_call(
            functools.partial(intra_chunk_kernel, **kernel_args),
            out_specs=[*out_specs, pl.BlockSpec((squeezed, squeezed, K),
                                                lambda c, h: (h, c, 0))],
            out_shape=[*out_shape, jax.ShapeDtypeStruct((HV, num_chunks, K), jnp.float32)],
            **intra_params,
        )(q_c, k_c, v_c, g_c, beta_c)
    else:
        gc = jnp.cumsum(g_c, axis=1)
        qg, w, kg, u, aqk = pl.pallas_call(
            functools.partial(_substitution_intra_kernel, **kernel_args),
            out_specs=out_specs, out_shape=out_shape, **intra_params,
        )(q_c, k_c, v_c, gc, beta_c)
        glast = jnp.transpose(gc[:, -1], (1, 0, 2))

    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    ckpt_chunk, ckpt_slot = first_chunk[:-1], jnp.full((num_requests,), -1, jnp.int32)
    if checkpoint_offsets is not None:
        offsets = checkpoint_offsets.astype(jnp.int32)
        has_ckpt = (checkpoint_slots >= 0) & (offsets > 0) & (offsets <= lengths)
        ckpt_chunk = jnp.where(has_ckpt, first_chunk[:-1] + offsets // C, first_chunk[:-1])
        ckpt_slot = jnp.where(has_ckpt, checkpoint_slots.astype(jnp.int32), -1)
    table = jnp.stack(
        [first_chunk[:-1], ckpt_chunk, first_chunk[1:], slots.astype(jnp.int32), ckpt_slot],
        axis=1,
    )
    o_c, state_pool = pl.pallas_call(
        functools.partial(_state_scan_kernel, block_v=block_v, precision=precision),
        grid=(num_requests, HV, V // block_v),
        out_shape=[chunked(V, v.dtype), jax.ShapeDtypeStruct(state_pool.shape, jnp.float32)],
        input_output_aliases={7: 1},
        compiler_params=pallas_backend.compiler_params(
            num_warps=config.scan_num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="kda_state_scan",
    )(table, qg, w, kg, u, aqk, glast, state_pool)
    o_rows = jnp.transpose(o_c, (1, 2, 0, 3)).reshape(num_chunks * C, HV, V)
    o = jnp.take(o_rows, row_of_token, axis=0, mode="fill", fill_value=0)
    return o, state_pool


@functools.partial(
    jax.jit,
    static_argnames=("scale", "output_final_state", "use_qk_l2norm_in_kernel",
                     "use_gate_in_kernel", "interpret"),
)
def chunk_kda(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: jax.Array | None = None,
    interpret: bool | None = None,
    use_gate_in_kernel: bool = False,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """fla's `chunk_kda`: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV].

    With `cu_seqlens` [N + 1], B must be 1. Returns (o [B, T, HV, V], final state [N, HV, K, V]
    fp32 or None).
    """
    packed, pool, slots, cu_seqlens = fla_to_packed(q, k, v, g, beta, initial_state, cu_seqlens)
    o, pool = chunk_kda_prefill(
        *packed, pool, slots, cu_seqlens, A_log=A_log, dt_bias=dt_bias,
        scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, interpret=interpret,
    )
    return o.reshape(v.shape), (pool if output_final_state else None)
