"""Pure-JAX reference for KDA (Kimi Delta Attention), in fp32, in two forms that agree.

Per value head the state S is a [K, V] matrix. For each token t of a sequence:

    S   = S * exp(g_t)[:, None]          # per-key-channel decay, g_t <= 0 in log space
    e   = v_t - k_t @ S                  # delta-rule error
    S   = S + outer(k_t, beta_t * e)
    o_t = scale * q_t @ S

`recurrent_kda_reference` runs exactly this loop; `chunk_kda_reference` computes the same function
64 tokens at a time through the WY/UT transform (the form the Pallas prefill kernel uses), so the
two check each other. Layouts follow fla: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K];
beta [B, T, HV]; states [N, HV, K, V] in fp32. Value head h reads query/key head h // (HV // H).
With `cu_seqlens` (B must be 1) the packed tokens hold N sequences; each starts from its own
initial state (zeros by default) and yields its own final state.

The kernels' state *pools* hold each state transposed, [P, HV, V, K] (`pool_layout` converts):
a value column's K channels lie together, so the decode kernel's sums over K stay inside a warp.

Options shared with the kernels: `use_qk_l2norm_in_kernel` normalises q and k per head,
x / sqrt(sum(x^2) + 1e-6); `use_gate_in_kernel` turns a raw g into the log decay
-exp(A_log[h]) * softplus(g + dt_bias[h, :]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

CHUNK_SIZE = 64
L2NORM_EPS = 1e-6
# dtypes a kernel's state pool may have; the kernels compute in fp32 either way and round a state
# to the pool's dtype only when they store it
STATE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def softplus(x: jax.Array) -> jax.Array:
    """log(1 + exp(x)), written without overflow for large x."""
    return jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x)))


def gate_params(
    use_gate_in_kernel: bool,
    A_log: jax.Array | None,
    dt_bias: jax.Array | None,
    num_heads: int,
    head_dim: int,
) -> tuple[jax.Array, jax.Array] | None:
    """Checks the gate's parameters against `use_gate_in_kernel`; returns None without the gate,
    else (A_log [HV], dt_bias [HV, K]) in fp32, a missing dt_bias as zeros.

    A_log has HV elements; dt_bias has HV * K elements (any shape of that size) or is None.
    """
    if not use_gate_in_kernel:
        if A_log is not None or dt_bias is not None:
            raise ValueError("A_log and dt_bias are only used with use_gate_in_kernel=True")
        return None
    if A_log is None:
        raise ValueError("use_gate_in_kernel=True needs A_log")
    if A_log.size != num_heads:
        raise ValueError(f"A_log has {A_log.size} elements, expected HV={num_heads}")
    if dt_bias is None:
        dt_bias = jnp.zeros((num_heads, head_dim), jnp.float32)
    if dt_bias.size != num_heads * head_dim:
        raise ValueError(
            f"dt_bias has {dt_bias.size} elements, expected HV*K={num_heads * head_dim}"
        )
    return (A_log.reshape(num_heads).astype(jnp.float32),
            dt_bias.reshape(num_heads, head_dim).astype(jnp.float32))


def kda_gate(g: jax.Array, A_log: jax.Array, dt_bias: jax.Array | None = None) -> jax.Array:
    """Log-space decay -exp(A_log) * softplus(g + dt_bias) in fp32; g is [..., HV, K].

    A_log has HV elements; dt_bias has HV * K elements (any shape of that size) or is None.
    """
    return _gate(g, *gate_params(True, A_log, dt_bias, *g.shape[-2:]))


def _gate(g: jax.Array, A_log: jax.Array, dt_bias: jax.Array) -> jax.Array:
    """-exp(A_log) * softplus(g + dt_bias) for parameters checked by `gate_params`."""
    return -jnp.exp(A_log)[:, None] * softplus(g.astype(jnp.float32) + dt_bias)


def l2_normalize(x: jax.Array, eps: float = L2NORM_EPS) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in fp32."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gated_rms_norm(o: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """KDA's output norm, per head in fp32: rmsnorm(o) over V * weight * sigmoid(gate);
    o, gate [..., V], weight [V]."""
    o32 = o.astype(jnp.float32)
    normed = o32 * lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)
    return normed * weight.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))


def prepare_qkg(
    q: jax.Array,
    k: jax.Array,
    g: jax.Array,
    *,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    A_log: jax.Array | None,
    dt_bias: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Applies the optional q/k normalisation and gate; g comes back in fp32 log space."""
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q).astype(q.dtype), l2_normalize(k).astype(k.dtype)
    return q, k, prepare_gate(g, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
                              dt_bias=dt_bias)


def prepare_gate(g: jax.Array, *, use_gate_in_kernel: bool, A_log: jax.Array | None,
                 dt_bias: jax.Array | None) -> jax.Array:
    """The optional gate applied to ``g`` [..., HV, K]; returned in fp32 log space."""
    gate = gate_params(use_gate_in_kernel, A_log, dt_bias, *g.shape[-2:])
    if gate is not None:
        g = _gate(g, *gate)
    return g.astype(jnp.float32)


def check_shapes(q, k, v, g, beta) -> tuple[int, int, int, int, int, int]:
    """Checks fla's layouts and returns (B, T, H, K, HV, V)."""
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, K], got {q.shape=} {k.shape=}")
    B, T, H, K = q.shape
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, HV, V] with {B=} {T=}, got {v.shape=}")
    HV, V = v.shape[2:]
    if HV % H:
        raise ValueError(f"value heads HV={HV} must be a multiple of query/key heads H={H}")
    if g.shape != (B, T, HV, K):
        raise ValueError(f"g must be [B, T, HV, K]={(B, T, HV, K)}, got {g.shape=}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV]={(B, T, HV)}, got {beta.shape=}")
    return B, T, H, K, HV, V


def pool_layout(states: jax.Array) -> jax.Array:
    """States [..., K, V] (fla's layout) as pool rows [..., V, K], and back (its own inverse)."""
    return jnp.swapaxes(states, -1, -2)


def check_pool_call(q, k, v, g, beta, state_pool, slots, cu_seqlens) -> tuple[int, ...]:
    """Checks a packed pool call (q, k [T, H, K]; v [T, HV, V]; g [T, HV, K]; beta [T, HV];
    state_pool [P, HV, V, K] fp32 or bf16; slots [N]; cu_seqlens [N + 1]) and returns
    (T, H, K, HV, V, N)."""
    if q.ndim != 3:
        raise ValueError(f"q must be packed [T, H, K], got {q.shape=}")
    _, T, H, K, HV, V = check_shapes(q[None], k[None], v[None], g[None], beta[None])
    num_requests = slots.shape[0]
    if cu_seqlens.shape != (num_requests + 1,):
        raise ValueError(f"cu_seqlens must be [N + 1] for N={num_requests} slots, "
                         f"got {cu_seqlens.shape=}")
    if state_pool.ndim != 4 or state_pool.shape[1:] != (HV, V, K):
        raise ValueError(f"state_pool must be [P, HV, V, K] = [P, {HV}, {V}, {K}], "
                         f"got {state_pool.shape=}")
    if state_pool.dtype not in STATE_DTYPES:
        raise TypeError(f"state_pool must be one of {[str(d) for d in STATE_DTYPES]}, "
                        f"got {state_pool.dtype}")
    return T, H, K, HV, V, num_requests


def check_initial_state(initial_state, num_seqs: int, HV: int, K: int, V: int) -> None:
    """Checks that initial_state, when given, is [N, HV, K, V]."""
    if initial_state is not None and initial_state.shape != (num_seqs, HV, K, V):
        raise ValueError(f"initial_state must be [N, HV, K, V]={(num_seqs, HV, K, V)}, "
                         f"got {initial_state.shape}")


def sequence_bounds(cu_seqlens, batch: int, seq_len: int) -> np.ndarray:
    """Host-side cumulative lengths [N + 1] for fla's two layouts (needs concrete values)."""
    if cu_seqlens is None:
        return np.arange(batch + 1, dtype=np.int64) * seq_len
    if batch != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1, got {batch}")
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    if cu.ndim != 1 or cu.size < 2 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > seq_len:
        raise ValueError(f"cu_seqlens must rise from 0 to at most T={seq_len}, got {cu.tolist()}")
    return cu


def fla_to_packed(q, k, v, g, beta, initial_state, cu_seqlens):
    """fla's [B, T, ...] call as a packed pool call: returns ((q, k, v, g, beta) as [B*T, ...],
    state pool [N, HV, V, K] fp32 (initial states or zeros, in `pool_layout`), slots [N],
    cu_seqlens [N + 1])."""
    B, T, _, K, HV, V = check_shapes(q, k, v, g, beta)
    if cu_seqlens is None:
        cu_seqlens = jnp.arange(B + 1, dtype=jnp.int32) * T
    elif B != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1, got {B}")
    num_seqs = cu_seqlens.shape[0] - 1
    check_initial_state(initial_state, num_seqs, HV, K, V)
    if initial_state is None:
        pool = jnp.zeros((num_seqs, HV, V, K), jnp.float32)
    else:
        pool = pool_layout(initial_state.astype(jnp.float32))
    packed = tuple(x.reshape(B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    return packed, pool, jnp.arange(num_seqs, dtype=jnp.int32), cu_seqlens


def _recurrent_one(q, k, v, g, beta, state):
    """One sequence: q, k [T, HV, K]; v [T, HV, V]; g [T, HV, K]; beta [T, HV]; state [HV, K, V]."""

    def step(s, xs):
        q_t, k_t, v_t, g_t, b_t = xs
        s = s * jnp.exp(g_t)[..., None]
        err = v_t - jnp.einsum("hk,hkv->hv", k_t, s)
        s = s + jnp.einsum("hk,hv->hkv", k_t, b_t[:, None] * err)
        return s, jnp.einsum("hk,hkv->hv", q_t, s)

    return lax.scan(step, state, (q, k, v, g, beta))[::-1]


def _chunk_one(q, k, v, g, beta, state, chunk_size):
    """The same function as `_recurrent_one`, computed chunk by chunk (WY/UT transform)."""
    T = q.shape[0]
    pad = -T % chunk_size
    # Zero padding is exact: a token with k = v = beta = 0 and g = 0 leaves the state unchanged.
    q, k, v, g, beta = (jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in (q, k, v, g, beta))
    n = (T + pad) // chunk_size

    def chunks(x):  # [T, HV, ...] -> [n, HV, C, ...]
        return jnp.swapaxes(x.reshape(n, chunk_size, *x.shape[1:]), 1, 2)

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    gc = jnp.cumsum(g, axis=2)
    rows = jnp.arange(chunk_size)
    lower = rows[:, None] > rows[None, :]
    causal = rows[:, None] >= rows[None, :]
    # exp(gc_i - gc_j) for j <= i is at most 1; the clamp only touches entries masked out below.
    pair_decay = jnp.exp(jnp.minimum(gc[..., :, None, :] - gc[..., None, :, :], 0.0))
    kk = jnp.einsum("nhik,nhjk,nhijk->nhij", k, k, pair_decay)
    qk = jnp.einsum("nhik,nhjk,nhijk->nhij", q, k, pair_decay)
    lmat = jnp.where(lower, kk * beta[..., :, None], 0.0)
    eye = jnp.eye(chunk_size, dtype=jnp.float32)
    tmat = jax.scipy.linalg.solve_triangular(eye + lmat, eye, lower=True, unit_diagonal=True)
    w = tmat @ (beta[..., None] * jnp.exp(gc) * k)
    u = tmat @ (beta[..., None] * v)
    aqk = jnp.where(causal, qk, 0.0)
    q_decayed = q * jnp.exp(gc)
    k_to_end = k * jnp.exp(gc[..., -1:, :] - gc)
    chunk_decay = jnp.exp(gc[..., -1, :])

    def step(s, xs):
        w_c, u_c, a_c, q_c, k_c, d_c = xs
        v_new = u_c - w_c @ s
        o_c = q_c @ s + a_c @ v_new
        s = s * d_c[..., None] + jnp.swapaxes(k_c, -1, -2) @ v_new
        return s, o_c

    state, o = lax.scan(step, state, (w, u, aqk, q_decayed, k_to_end, chunk_decay))
    o = jnp.swapaxes(o, 1, 2).reshape(n * chunk_size, o.shape[1], o.shape[-1])
    return o[:T], state


def _kda_reference(
    one_sequence, q, k, v, g, beta, *, scale, initial_state, output_final_state,
    use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, cu_seqlens,
):
    B, T, H, K, HV, V = check_shapes(q, k, v, g, beta)
    cu = sequence_bounds(cu_seqlens, B, T)
    num_seqs = cu.size - 1
    check_initial_state(initial_state, num_seqs, HV, K, V)
    scale = K**-0.5 if scale is None else scale
    out_dtype = v.dtype
    q, k, g = prepare_qkg(
        q, k, g, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias,
    )
    group = HV // H
    f32 = jnp.float32
    q = jnp.repeat(q.astype(f32), group, axis=2).reshape(B * T, HV, K) * scale
    k = jnp.repeat(k.astype(f32), group, axis=2).reshape(B * T, HV, K)
    v, g, beta = (x.astype(f32).reshape(B * T, *x.shape[2:]) for x in (v, g, beta))
    outputs, finals = [], []
    for n in range(num_seqs):
        lo, hi = int(cu[n]), int(cu[n + 1])
        s0 = jnp.zeros((HV, K, V), f32) if initial_state is None else initial_state[n].astype(f32)
        o_n, s_n = one_sequence(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], s0)
        outputs.append(o_n)
        finals.append(s_n)
    outputs.append(jnp.zeros((B * T - int(cu[-1]), HV, V), f32))
    o = jnp.concatenate(outputs).reshape(B, T, HV, V).astype(out_dtype)
    return o, (jnp.stack(finals) if output_final_state else None)


def recurrent_kda_reference(
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
    use_gate_in_kernel: bool = False,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    cu_seqlens=None,
) -> tuple[jax.Array, jax.Array | None]:
    """KDA as the token-by-token recurrence; returns (o [B, T, HV, V], final_state or None)."""
    return _kda_reference(
        _recurrent_one, q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
    )


def chunk_kda_reference(
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
    use_gate_in_kernel: bool = False,
    A_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    cu_seqlens=None,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[jax.Array, jax.Array | None]:
    """KDA in chunks of `chunk_size` tokens (WY/UT form); same contract as the recurrence."""

    def one_sequence(*args):
        return _chunk_one(*args, chunk_size)

    return _kda_reference(
        one_sequence, q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu_seqlens,
    )
