"""KDA (Kimi Delta Attention) chunked prefill as Pallas GPU kernels, over a state pool.

The function is the one `kda_ref` defines (token recurrence with per-channel decay and a delta
rule). Prefill runs in two stages over 64-token chunks:

1. `intra_stage` (the cumsum, scores and solve kernels in `kda_intra`), all chunks in
   parallel: the in-chunk part of the WY/UT transform, which does not depend on the state. It
   builds the strictly lower key-key matrix L and the causal query-key matrix, inverts (I + L),
   and writes w, u, decayed q and k and the query-key matrix.
2. `scan_stage` (`_state_scan_kernel`), one program per (request, value head, block of V): walks
   the request's chunks in order, carrying the [K, block_v] fp32 state, and writes the output
   rows straight to their tokens.

Invariants:
- Inputs are packed ([T, ...], fla's `cu_seqlens` layout with B squeezed) and all shapes are
  static, fixed by the caller's bucket; request boundaries and slots are traced arrays.
- Every request starts its chunks at its own first token, so chunks never straddle requests; the
  last chunk is zero-padded, which is exact (k = v = beta = g = 0 leaves the state unchanged).
- States live in a pool [P, HV, V, K] (each state transposed, `kda_ref.pool_layout`), read from
  and written to row `slots[n]`; the pool is donated and updated in place. The scan carries a
  [K, block_v] block and transposes it where it loads and stores it. The pool is fp32 or bf16
  (`kda_ref.STATE_DTYPES`): the scan carries the state in fp32 and rounds it to the pool's dtype
  only where it stores it (at the checkpoint and at the end), so a bf16 pool costs one rounding
  per call, not one per chunk.
  A request with `slots[n] < 0` is padding: it reads zeros and writes no state. Slots (and
  checkpoint slots) in one call must be distinct.
- Checkpoints: a request with `checkpoint_slots[n] >= 0` also stores its state after
  `checkpoint_offsets[n]` tokens into that slot. Offsets are traced values: they must be positive
  multiples of 64 (prefix-cache granularities are multiples of the chunk) and at most the
  request's length; an offset that is not is rounded down to the chunk, and one out of range
  stores nothing. The scan runs the request in two
  loops, main up to the checkpoint's chunk and tail to the end, in one call; a request without a
  checkpoint has an empty main loop and no extra store.
- The scan stores a chunk's output as one window of C token rows inside [0, T), masked to the
  chunk's tokens: a window that would pass T starts earlier (at T - C) and its rows are computed
  from query rows read as far back, so every store and every load stays in bounds (T is padded to
  C when smaller). Rows of tokens past cu_seqlens[-1] are zeroed by the last request's programs.
- Numerics: decays are formed as exp of differences of in-chunk cumulative log gates, always with
  a non-positive exponent (g <= 0), so strong decay underflows to 0 and never overflows.

The Pallas backend (Triton lowering today, deprecated from jax 0.11 in favour of Mosaic GPU) is
chosen in `pallas_backend` alone.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tokenspeed_jax.kernels import pallas_backend
from tokenspeed_jax.kernels.kda_config import DEFAULT_CHUNK_CONFIG, ChunkConfig
from tokenspeed_jax.kernels.kda_decode import fused_recurrent_kda, fused_recurrent_kda_pool
from tokenspeed_jax.kernels.kda_intra import intra_stage
from tokenspeed_jax.kernels.kda_ref import (
    CHUNK_SIZE,
    check_pool_call,
    fla_to_packed,
    pool_layout,
    prepare_gate,
)
from tokenspeed_jax.kernels.kernel_math import count_at_most, dot, dot_tn

__all__ = [
    "ChunkConfig",
    "chunk_kda",
    "chunk_kda_prefill",
    "fused_recurrent_kda",
    "fused_recurrent_kda_pool",
]


def _state_scan_kernel(
    table_ref,  # [N, 7] int32: chunk begin, checkpoint chunk, chunk end, slot, checkpoint slot,
                # first token, end token
    qg_ref,  # [HV, NC * C, K]: chunk rows
    w_ref,  # [HV, NC, C, K]
    kg_ref,  # [HV, NC, C, K]
    u_ref,  # [HV, NC, C, V]
    aqk_ref,  # [HV, NC * C, C]: chunk rows
    glast_ref,  # [HV, NC, K] fp32, each chunk's total log decay
    pool_ref,  # [P, HV, V, K] fp32 or bf16, aliased with pool_out_ref
    o_ref,  # [T, HV, V]: token rows
    pool_out_ref,  # [P, HV, V, K] fp32 or bf16
    *,
    block_v: int,
    precision,
):
    n, head, v_block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    chunk_begin, chunk_ckpt, chunk_end = table_ref[n, 0], table_ref[n, 1], table_ref[n, 2]
    slot, ckpt_slot = table_ref[n, 3], table_ref[n, 4]
    token_begin, token_end = table_ref[n, 5], table_ref[n, 6]
    head_k = qg_ref.shape[-1]
    num_tokens, chunk = o_ref.shape[0], w_ref.shape[2]
    cols = pl.ds(v_block * block_v, block_v)
    dot_dtype = w_ref.dtype
    row = lax.broadcasted_iota(jnp.int32, (chunk, block_v), 0)

    state = lax.cond(
        slot >= 0,
        lambda: pool_ref[jnp.maximum(slot, 0), head, cols, :].astype(jnp.float32).T,
        lambda: jnp.zeros((head_k, block_v), jnp.float32),
    )

    def chunk_step(c, state):
        state_in = state.astype(dot_dtype)
        v_new = u_ref[head, c, :, cols].astype(jnp.float32) - dot(w_ref[head, c], state_in,
                                                                   precision)
        v_new_in = v_new.astype(dot_dtype)
        first = token_begin + (c - chunk_begin) * chunk
        window = jnp.minimum(first, num_tokens - chunk)  # a window of rows inside [0, T)
        query_rows = pl.ds(c * chunk - (first - window), chunk)  # the window's chunk rows
        out = dot(qg_ref[head, query_rows], state_in, precision) + dot(
            aqk_ref[head, query_rows], v_new_in, precision)
        token = window + row
        pallas_backend.masked_store(o_ref.at[pl.ds(window, chunk), head, cols],
                                    out.astype(o_ref.dtype), (token >= first) & (token < token_end))
        chunk_decay = jnp.exp(glast_ref[head, c, :])
        return state * chunk_decay[:, None] + dot_tn(kg_ref[head, c], v_new_in, precision)

    state = lax.fori_loop(chunk_begin, chunk_ckpt, chunk_step, state)

    @pl.when(ckpt_slot >= 0)
    def _():
        pool_out_ref[ckpt_slot, head, cols, :] = state.T.astype(pool_out_ref.dtype)

    state = lax.fori_loop(chunk_ckpt, chunk_end, chunk_step, state)

    @pl.when(slot >= 0)
    def _():
        pool_out_ref[slot, head, cols, :] = state.T.astype(pool_out_ref.dtype)

    @pl.when(n == pl.num_programs(0) - 1)
    def _():
        def zero_rows(block, carry):
            window = jnp.minimum(token_end + block * chunk, num_tokens - chunk)
            pallas_backend.masked_store(o_ref.at[pl.ds(window, chunk), head, cols],
                                        jnp.zeros((chunk, block_v), o_ref.dtype),
                                        window + row >= token_end)
            return carry

        lax.fori_loop(0, pl.cdiv(num_tokens - token_end, chunk), zero_rows, 0)


def scan_blocking(num_requests: int, value_heads: int, V: int, dot_dtype,
                  config: ChunkConfig) -> tuple[int, int]:
    """(block_v, pipeline stages) of the state scan, one program per (request, value head,
    block of V). Every stage of its load pipeline holds one chunk's qg, w, kg, aqk and u block,
    about 60 KB in bf16 at block_v 32, so one program fills an SM's shared memory (227 KB on an
    H200) at 3 stages. Programs beyond a wave of ``config.scan_wave`` then run in later waves,
    each walking its request's chunks again. Unset knobs are chosen so:

    - the narrowest block (32, 64, then 128 columns, dividing V) whose programs fit in one
      wave, at 3 stages up to 64 columns and 2 above;
    - when none fits (many requests), whole-V blocks at 1 stage, so several share an SM;
    - fp32 operands double every buffer: block_v 32 at 2 stages at most."""
    fp32_operands = jnp.dtype(dot_dtype).itemsize > 2
    widths = [b for b in sorted({min(b, V) for b in (32, 64, 128)}) if V % b == 0]
    if config.block_v is not None:
        block_v = min(config.block_v, V)
        if V % block_v:
            raise ValueError(f"{V=} must be a multiple of {block_v=}")
        stages = _full_depth(block_v)
    elif fp32_operands:
        block_v, stages = widths[0], 2
    else:
        fits = [b for b in widths if num_requests * value_heads * (V // b) <= config.scan_wave]
        block_v, stages = (fits[0], _full_depth(fits[0])) if fits else (widths[-1], 1)
    if config.num_stages is not None:
        stages = config.num_stages
    return block_v, min(stages, 2) if fp32_operands else stages


def _full_depth(block_v: int) -> int:
    """The scan's pipeline stages for one program alone on an SM: 3 up to 64 columns, 2 above."""
    return 3 if block_v <= 64 else 2


def _request_table(cu_seqlens, first_chunk, slots, checkpoint_offsets, checkpoint_slots):
    """[N, 7] int32 per request: chunk begin, checkpoint chunk, chunk end, slot, checkpoint slot
    (checkpoint chunk = chunk begin and checkpoint slot = -1 where there is none), first token,
    end token."""
    num_requests = slots.shape[0]
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    ckpt_chunk, ckpt_slot = first_chunk[:-1], jnp.full((num_requests,), -1, jnp.int32)
    if checkpoint_offsets is not None:
        offsets = checkpoint_offsets.astype(jnp.int32)
        has_ckpt = (checkpoint_slots >= 0) & (offsets > 0) & (offsets <= lengths)
        ckpt_chunk = jnp.where(has_ckpt, first_chunk[:-1] + offsets // CHUNK_SIZE,
                               first_chunk[:-1])
        ckpt_slot = jnp.where(has_ckpt, checkpoint_slots.astype(jnp.int32), -1)
    return jnp.stack(
        [first_chunk[:-1], ckpt_chunk, first_chunk[1:], slots.astype(jnp.int32), ckpt_slot,
         cu_seqlens[:-1], cu_seqlens[1:]],
        axis=1,
    )


def scan_stage(table, qg, w, kg, u, aqk, glast, state_pool, *, num_tokens: int, out_dtype,
               config: ChunkConfig, interpret: bool):
    """The sequential state scan over the per-chunk outputs: returns (o [num_tokens, HV, V] in
    out_dtype, zero past the table's last end token; updated pool)."""
    HV, num_chunks, C, V = u.shape
    block_v, num_stages = scan_blocking(table.shape[0], HV, V, u.dtype, config)
    precision = lax.Precision.HIGHEST if u.dtype == jnp.float32 else lax.Precision.DEFAULT
    padded_tokens = max(num_tokens, C)  # the kernel's windows are C rows
    o, state_pool = pl.pallas_call(
        functools.partial(_state_scan_kernel, block_v=block_v, precision=precision),
        grid=(table.shape[0], HV, V // block_v),
        out_shape=[jax.ShapeDtypeStruct((padded_tokens, HV, V), out_dtype),
                   jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)],
        input_output_aliases={7: 1},
        compiler_params=pallas_backend.compiler_params(
            num_warps=config.scan_num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_state_scan",
    )(table, qg.reshape(HV, num_chunks * C, -1), w, kg, u, aqk.reshape(HV, num_chunks * C, C),
      glast, state_pool)
    return o[:num_tokens], state_pool



def _chunk_layout(cu_seqlens, num_tokens: int, num_chunks: int):
    """Where each chunk row comes from: token indices [NC, C] (num_tokens marks padding), and the
    first chunk of each request [N + 1]."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    first_chunk = jnp.concatenate(
        [jnp.zeros((1,), jnp.int32), jnp.cumsum((lengths + CHUNK_SIZE - 1) // CHUNK_SIZE)]
    ).astype(jnp.int32)
    num_requests = lengths.shape[0]
    chunk = jnp.arange(num_chunks, dtype=jnp.int32)
    owner = jnp.minimum(count_at_most(first_chunk[1:], chunk), num_requests - 1)
    local = (chunk - first_chunk[owner])[:, None] * CHUNK_SIZE + jnp.arange(CHUNK_SIZE)[None, :]
    real = (chunk < first_chunk[-1])[:, None] & (local < lengths[owner][:, None])
    token_of_row = jnp.where(real, cu_seqlens[owner][:, None] + local, num_tokens)
    return token_of_row, first_chunk


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
    config: ChunkConfig = DEFAULT_CHUNK_CONFIG,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Chunked KDA over a packed bucket of requests, states in a donated pool.

    q, k [T, H, K]; v [T, HV, V]; g [T, HV, K] (log decay, or raw with `use_gate_in_kernel`);
    beta [T, HV]; state_pool [P, HV, V, K] fp32 or bf16; slots [N] int32 (< 0: padded request);
    cu_seqlens [N + 1] int32; checkpoint_offsets, checkpoint_slots [N] int32 (slot < 0: none).
    Returns (o [T, HV, V] in v's dtype, updated pool). Tokens past cu_seqlens[-1] get zeros.
    """
    interpret = pallas_backend.resolve_interpret(interpret)
    T, H, K, HV, _, num_requests = check_pool_call(
        q, k, v, g, beta, state_pool, slots, cu_seqlens)
    if (checkpoint_offsets is None) != (checkpoint_slots is None):
        raise ValueError("checkpoint_offsets and checkpoint_slots come together")
    scale = K**-0.5 if scale is None else float(scale)
    group = HV // H

    g = prepare_gate(g, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias)
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    num_chunks = pl.cdiv(T, CHUNK_SIZE) + num_requests
    token_of_row, first_chunk = _chunk_layout(cu_seqlens, T, num_chunks)
    intra_out = intra_stage(q, k, v, g, _to_chunks(beta, token_of_row), token_of_row,
                            first_chunk[-1], group=group, scale=scale,
                            normalize_qk=use_qk_l2norm_in_kernel, config=config,
                            interpret=interpret)
    table = _request_table(cu_seqlens, first_chunk, slots, checkpoint_offsets, checkpoint_slots)
    return scan_stage(table, *intra_out, state_pool, num_tokens=T, out_dtype=v.dtype,
                      config=config, interpret=interpret)


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
    return o.reshape(v.shape), (pool_layout(pool) if output_final_state else None)
