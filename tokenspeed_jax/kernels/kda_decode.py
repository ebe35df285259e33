"""KDA token-by-token recurrence as a Pallas GPU kernel: decode, and fla's `fused_recurrent_kda`.

One program per (block of V, value head, request) carries a block of the state through the
request's tokens (the blocks of one head's state are neighbouring programs). The pool holds each
state transposed, so the block is [block_v, K], a value column's K channels in one row, and
every sum over K stays inside a warp. With D = S * exp(g_t) (the decayed state) and
e = beta_t * (v_t - k_t @ D), the step is S = D + outer(k_t, e) and
o_t = scale * (q_t @ D + (q_t . k_t) e): both sums over K read D, so they run side by side.
The q/k L2 normalisation and the gate -exp(A_log) * softplus(g + dt_bias) are fused into the
kernel, so decode is one launch over the whole batch.

Invariants (shared with the chunked prefill in `kda`): inputs are packed [T, ...] with request
boundaries `cu_seqlens` [N + 1]; states live in a donated pool [P, HV, V, K]
(`kda_ref.pool_layout`) at row `slots[n]`, fp32 or bf16 (`kda_ref.STATE_DTYPES`; the kernel
computes in fp32 and rounds the state to the pool's dtype only when it stores it); a request
with `slots[n] < 0` is padding, reads zeros and writes no state; slots in one call are
distinct. Decode is the case of one token per request (`kda_decode`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tokenspeed_jax.kernels import pallas_backend
from tokenspeed_jax.kernels.kda_ref import (
    L2NORM_EPS,
    check_pool_call,
    fla_to_packed,
    gate_params,
    pool_layout,
    softplus,
)

__all__ = ["RecurrentConfig", "fused_recurrent_kda", "fused_recurrent_kda_pool", "kda_decode"]


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """Tuning knobs of the recurrent kernel."""

    block_v: int = 8  # V columns (rows of the transposed state) per program
    num_warps: int = 1  # a transposed row keeps each sum over K inside one warp
    num_stages: int = 1


def _recurrent_kernel(
    table_ref,  # [N, 3] int32: first token, end token, slot
    q_ref,  # [T, H, K]
    k_ref,  # [T, H, K]
    v_ref,  # [T, HV, V]
    g_ref,  # [T, HV, K] log decay, or the raw gate input with use_gate
    beta_ref,  # [T, HV]
    *refs,  # with use_gate: a_log_ref [HV], dt_bias_ref [HV, K]; then pool_ref, o_ref, pool_out
    scale: float,
    group: int,
    block_v: int,
    use_l2norm: bool,
    use_gate: bool,
    one_token: bool,
):
    if use_gate:
        a_log_ref, dt_bias_ref, pool_ref, o_ref, pool_out_ref = refs
    else:
        pool_ref, o_ref, pool_out_ref = refs  # [P, HV, V, K], [T, HV, V], [P, HV, V, K]
    f32 = jnp.float32
    v_block, head, n = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    begin, end, slot = table_ref[n, 0], table_ref[n, 1], table_ref[n, 2]
    qk_head = head // group
    cols = pl.ds(v_block * block_v, block_v)
    if use_gate:
        decay_rate = jnp.exp(a_log_ref[head].astype(f32))
        bias = dt_bias_ref[head, :].astype(f32)

    state = jnp.where(slot >= 0, pool_ref[jnp.maximum(slot, 0), head, cols, :].astype(f32), 0.0)

    def token_step(t, state):
        q_t = q_ref[t, qk_head, :].astype(f32)
        k_t = k_ref[t, qk_head, :].astype(f32)
        if use_l2norm:
            q_t = q_t * lax.rsqrt(jnp.sum(q_t * q_t) + L2NORM_EPS)
            k_t = k_t * lax.rsqrt(jnp.sum(k_t * k_t) + L2NORM_EPS)
        g_t = g_ref[t, head, :].astype(f32)
        if use_gate:
            g_t = -decay_rate * softplus(g_t + bias)
        decayed = state * jnp.exp(g_t)[None, :]
        error = beta_ref[t, head].astype(f32) * (
            v_ref[t, head, cols].astype(f32) - jnp.sum(decayed * k_t[None, :], axis=1))
        out = jnp.sum(decayed * q_t[None, :], axis=1) + jnp.sum(q_t * k_t) * error
        o_ref[t, head, cols] = (scale * out).astype(o_ref.dtype)
        return decayed + error[:, None] * k_t[None, :]

    if one_token:  # token n is request n: straight-line code, no loop
        state = token_step(n, state)
    else:
        state = lax.fori_loop(begin, end, token_step, state)

    @pl.when(slot >= 0)
    def _():
        pool_out_ref[slot, head, cols, :] = state.astype(pool_out_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "config",
                     "interpret", "one_token_per_request"),
    donate_argnames=("state_pool",),
)
def fused_recurrent_kda_pool(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state_pool: jax.Array,
    slots: jax.Array,
    cu_seqlens: jax.Array,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    config: RecurrentConfig = RecurrentConfig(),
    interpret: bool | None = None,
    one_token_per_request: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Recurrent KDA over packed requests: q, k [T, H, K]; v [T, HV, V]; g [T, HV, K];
    beta [T, HV]; state_pool [P, HV, V, K] fp32 or bf16 (donated); slots [N]; cu_seqlens [N + 1].

    Returns (o [T, HV, V] in v's dtype, updated pool). Tokens past cu_seqlens[-1] are unwritten
    and come back as zeros. `one_token_per_request` (decode) promises cu_seqlens = arange(N + 1),
    so T = N, and compiles the kernel without its token loop.
    """
    interpret = pallas_backend.resolve_interpret(interpret)
    T, H, K, HV, V, num_requests = check_pool_call(
        q, k, v, g, beta, state_pool, slots, cu_seqlens)
    block_v = min(config.block_v, V)
    if V % block_v:
        raise ValueError(f"{V=} must be a multiple of {block_v=}")
    if one_token_per_request and T != num_requests:
        raise ValueError(f"one token per request needs T == N, got {T=} and N={num_requests}")
    gate_args = gate_params(use_gate_in_kernel, A_log, dt_bias, HV, K) or ()
    scale = K**-0.5 if scale is None else float(scale)
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    table = jnp.stack([cu_seqlens[:-1], cu_seqlens[1:], slots.astype(jnp.int32)], axis=1)
    kernel = functools.partial(
        _recurrent_kernel, scale=scale, group=HV // H, block_v=block_v,
        use_l2norm=use_qk_l2norm_in_kernel, use_gate=use_gate_in_kernel,
        one_token=one_token_per_request,
    )
    pool_index = 6 + len(gate_args)
    o, state_pool = pl.pallas_call(
        kernel,
        grid=(V // block_v, HV, num_requests),
        out_shape=[jax.ShapeDtypeStruct((T, HV, V), v.dtype),
                   jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)],
        input_output_aliases={pool_index: 1},
        compiler_params=pallas_backend.compiler_params(
            num_warps=config.num_warps, num_stages=config.num_stages),
        interpret=interpret,
        name="kda_recurrent",
    )(table, q, k, v, g, beta, *gate_args, state_pool)
    token = jnp.arange(T)
    o = jnp.where((token < cu_seqlens[-1])[:, None, None], o, 0).astype(v.dtype)
    return o, state_pool


def kda_decode(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state_pool: jax.Array,
    slots: jax.Array,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    config: RecurrentConfig = RecurrentConfig(),
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One decode step, one token per request: q, k [N, H, K]; v [N, HV, V]; g [N, HV, K];
    beta [N, HV]; slots [N]. Returns (o [N, HV, V], updated pool); the pool is donated."""
    cu_seqlens = jnp.arange(slots.shape[0] + 1, dtype=jnp.int32)
    return fused_recurrent_kda_pool(
        q, k, v, g, beta, state_pool, slots, cu_seqlens, A_log, dt_bias, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        config=config, interpret=interpret, one_token_per_request=True,
    )


@functools.partial(
    jax.jit,
    static_argnames=("scale", "output_final_state", "use_qk_l2norm_in_kernel",
                     "use_gate_in_kernel", "interpret"),
)
def fused_recurrent_kda(
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
    """fla's `fused_recurrent_kda`, same arguments and layouts as `kda.chunk_kda`."""
    packed, pool, slots, cu_seqlens = fla_to_packed(q, k, v, g, beta, initial_state, cu_seqlens)
    o, pool = fused_recurrent_kda_pool(
        *packed, pool, slots, cu_seqlens, A_log, dt_bias, scale=scale,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel,
        interpret=interpret,
    )
    return o.reshape(v.shape), (pool_layout(pool) if output_final_state else None)
