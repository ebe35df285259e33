"""Kimi Delta Attention (KDA) as a layer over packed requests with per-request state pools.

One KDA layer, on the normed hidden ``x [T, D]`` of a packed batch (requests delimited by
``cu_seqlens [N + 1]``, request ``n`` owning state row ``slots[n]`` of both pools):

    q, k, v  = silu(short_conv(x @ {q,k,v}_proj))        conv state: conv pool [P, W - 1, H 3 K]
    g        = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)    (float32, log-space decay)
    beta     = sigmoid(x @ b)
    o        = KDA(l2norm(q), l2norm(k), v, g, beta)      recurrent state: pool [P, H, V, K]
                                                         (transposed; fp32 or bf16)
    out      = o_proj(rmsnorm(o) * sigmoid(g_b(g_a(x))))   (the gated norm runs per head, fp32)

Invariants:

* The conv channels are head-major (``[H, 3, K]``: head h's q, k, v channels side by side), so
  splitting them into N equal parts splits them by head (tensor parallelism).
* With a ``mesh`` the Pallas KDA kernels run per shard under ``jax.shard_map``, heads split over
  ``parallel.AXIS`` (heads are independent; the metadata is replicated).
* A request with ``slots[n] < 0`` is padding: it reads zero states and writes neither pool.
* Checkpoints: when ``checkpoint_slots[n] >= 0`` the request also stores both states as they are
  after ``checkpoint_offsets[n]`` of its tokens into row ``checkpoint_slots[n]`` (the offset is a
  positive multiple of the 64-token KDA chunk, at most the request's length).
* The KDA core has two implementations with one contract (``KdaMeta`` and the pools):
  ``"pallas"`` (the chunked prefill and recurrent decode kernels; traceable, used in every
  compiled plan) and ``"reference"`` (the pure-JAX reference of ``kernels.kda_ref``; it needs
  concrete, host-side metadata, so it runs in eager execution and in the plain forward only).
* A decode step (one token per request) of at most ``StepKernel.max_requests`` requests, with
  no mesh, runs everything after the projections as one Pallas call when the layer's
  ``step_kernel`` is the Pallas one (``kernels.kda_decode_step``; chosen on GPUs): the conv,
  gate, beta, recurrence, gated norm and both pools' rows. Elsewhere decode runs ``inputs``,
  the recurrent kernel and ``outputs``, the route the kernel is checked against.
* Weight layouts: ``{q,k,v}_proj [D, H, K]``, ``{q,k,v}_conv [H K, W]``, ``low_proj [D, 2 K +
  H]`` (the checkpoint's ``f_a``, ``g_a`` and ``b`` side by side, so one product reads all three
  with no copy), ``f_b_proj [K, H, K]``, ``dt_bias [H, K]`` and ``A_log [H]`` (float32),
  ``g_b_proj [K, H, K]``, ``o_norm [K]``, ``o_proj [H, K, D]``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from tokenspeed_jax import parallel
from tokenspeed_jax.kernels.kda import chunk_kda_prefill
from tokenspeed_jax.kernels.kda_decode import kda_decode
from tokenspeed_jax.kernels.kda_decode_step import (
    StepKernel,
    StepWeights,
    choose_step_kernel,
    kda_decode_step_pallas,
)
from tokenspeed_jax.kernels.kda_ref import (
    gated_rms_norm,
    kda_gate,
    pool_layout,
    recurrent_kda_reference,
)
from tokenspeed_jax.kernels.short_conv import head_major_weight, short_conv_pool
from tokenspeed_jax.models.layers import linear, normal_param

KdaImpl = Literal["pallas", "reference"]
KDA_IMPLS = ("pallas", "reference")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KdaMeta:
    """Per-request KDA metadata of one packed batch (int32 arrays)."""

    cu_seqlens: Any  # [N + 1]
    slots: Any  # [N]; < 0: padding request
    checkpoint_offsets: Any  # [N]
    checkpoint_slots: Any  # [N]; < 0: no checkpoint

    @classmethod
    def dense(cls, batch: int, length: int) -> KdaMeta:
        """``batch`` rows of ``length`` tokens, row b in state slot b, no checkpoints."""
        none = np.full(batch, -1, np.int32)
        return cls(np.arange(batch + 1, dtype=np.int32) * length,
                   np.arange(batch, dtype=np.int32), np.zeros(batch, np.int32), none)


def _kda_reference(q, k, v, g, beta, pool, meta: KdaMeta):
    """The reference core, request by request, on concrete metadata (see the module docs)."""
    cu, slots = np.asarray(meta.cu_seqlens), np.asarray(meta.slots)
    offsets, ckpt_slots = np.asarray(meta.checkpoint_offsets), np.asarray(meta.checkpoint_slots)
    out = jnp.zeros(v.shape, v.dtype)

    def run(lo: int, hi: int, state: jax.Array) -> jax.Array:
        nonlocal out
        o, final = recurrent_kda_reference(
            *(x[None, lo:hi] for x in (q, k, v, g, beta)), initial_state=state[None],
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        out = out.at[lo:hi].set(o[0])
        return final[0]

    for n in range(len(slots)):
        lo, hi, slot = int(cu[n]), int(cu[n + 1]), int(slots[n])
        state = pool_layout(pool[slot] if slot >= 0 else jnp.zeros(pool.shape[1:], pool.dtype))
        if hi == lo:
            continue
        split = int(offsets[n])
        if ckpt_slots[n] >= 0 and 0 < split <= hi - lo:
            state = run(lo, lo + split, state)
            pool = pool.at[int(ckpt_slots[n])].set(pool_layout(state).astype(pool.dtype))
            lo += split
        if hi > lo:
            state = run(lo, hi, state)
        if slot >= 0:
            pool = pool.at[slot].set(pool_layout(state).astype(pool.dtype))
    return out, pool


def _kda_kernels(q, k, v, g, beta, state_pool, meta: KdaMeta, *, decode: bool):
    if decode:
        return kda_decode(q, k, v, g, beta, state_pool, meta.slots,
                          use_qk_l2norm_in_kernel=True)
    return chunk_kda_prefill(q, k, v, g, beta, state_pool, meta.slots, meta.cu_seqlens,
                             meta.checkpoint_offsets, meta.checkpoint_slots,
                             use_qk_l2norm_in_kernel=True)


def kda_core(q, k, v, g, beta, state_pool, meta: KdaMeta, *, impl: KdaImpl, decode: bool,
             mesh: Mesh | None = None):
    """KDA over packed q, k [T, H, K], v [T, H, V], log decay g [T, H, K], beta [T, H].

    Returns (o [T, H, V], updated state pool). ``decode`` (one token per request, no
    checkpoints) selects the recurrent kernel on the Pallas path. ``mesh``: the Pallas kernels
    run per shard of the heads (the reference is plain JAX, partitioned by XLA).
    """
    if impl == "reference":
        return _kda_reference(q, k, v, g, beta, state_pool, meta)
    if impl != "pallas":
        raise ValueError(f"unknown KDA implementation {impl!r}; expected one of {KDA_IMPLS}")
    kernels = functools.partial(_kda_kernels, decode=decode)
    if mesh is None:
        return kernels(q, k, v, g, beta, state_pool, meta)
    heads, pool = parallel.head_spec(3), parallel.head_spec(4)
    per_shard = jax.shard_map(
        kernels, mesh=mesh, in_specs=(heads, heads, heads, heads, parallel.head_spec(2), pool,
                                      PartitionSpec()),
        out_specs=(heads, pool), check_vma=False)
    return per_shard(q, k, v, g, beta, state_pool, meta)


def conv_checkpoint(x: jax.Array, conv_pool: jax.Array, meta: KdaMeta) -> jax.Array:
    """Store, for each checkpointing request, its conv state after ``checkpoint_offsets[n]``
    tokens (the W - 1 inputs before that point, oldest first; offsets >= W - 1)."""
    width = conv_pool.shape[1]
    cu = jnp.asarray(meta.cu_seqlens, jnp.int32)
    offsets = jnp.asarray(meta.checkpoint_offsets, jnp.int32)
    slots = jnp.asarray(meta.checkpoint_slots, jnp.int32)
    rows = cu[:-1, None] + offsets[:, None] - width + jnp.arange(width)[None, :]
    states = jnp.take(x, rows, axis=0, mode="clip")
    valid = (slots >= 0) & (offsets > 0) & (offsets <= cu[1:] - cu[:-1])
    target = jnp.where(valid, slots, conv_pool.shape[0])
    return conv_pool.at[target].set(states.astype(conv_pool.dtype), mode="drop")


class KimiDeltaAttention(nnx.Module):
    """The KDA token mixer; see the module docstring for the computation and layouts."""

    def __init__(self, hidden: int, *, num_heads: int, head_dim: int, conv_size: int,
                 norm_eps: float, dtype: Any, param_dtype: Any, rngs: nnx.Rngs,
                 step_kernel: StepKernel | None = None) -> None:
        h, k = num_heads, head_dim
        self.q_proj = normal_param(rngs, (hidden, h, k), param_dtype)
        self.k_proj = normal_param(rngs, (hidden, h, k), param_dtype)
        self.v_proj = normal_param(rngs, (hidden, h, k), param_dtype)
        self.q_conv = normal_param(rngs, (h * k, conv_size), param_dtype)
        self.k_conv = normal_param(rngs, (h * k, conv_size), param_dtype)
        self.v_conv = normal_param(rngs, (h * k, conv_size), param_dtype)
        self.low_proj = normal_param(rngs, (hidden, 2 * k + h), param_dtype)
        self.f_b_proj = normal_param(rngs, (k, h, k), param_dtype)
        self.dt_bias = nnx.Param(jnp.zeros((h, k), jnp.float32))
        self.A_log = nnx.Param(jnp.zeros((h,), jnp.float32))
        self.g_b_proj = normal_param(rngs, (k, h, k), param_dtype)
        self.o_norm = nnx.Param(jnp.ones((k,), param_dtype))
        self.o_proj = normal_param(rngs, (h, k, hidden), param_dtype)
        self.num_heads, self.head_dim, self.conv_size = h, k, conv_size
        self.norm_eps = norm_eps
        self.dtype = dtype
        self.step_kernel = step_kernel or choose_step_kernel(head_dim=k, rank=k)

    @property
    def conv_dim(self) -> int:
        return 3 * self.num_heads * self.head_dim

    def _projections(self, x: jax.Array) -> tuple[list, tuple]:
        """Normed hidden [T, D] -> ([q, k, v] projections [T, H, K], (f_low [T, K], gate_low
        [T, K], beta logits [T, H]))."""
        qkv = [linear("TD,DHK->THK", x, getattr(self, f"{n}_proj"), self.dtype) for n in "qkv"]
        low = linear("TD,DR->TR", x, self.low_proj, self.dtype)
        return qkv, tuple(jnp.split(low, [self.head_dim, 2 * self.head_dim], axis=1))

    def inputs(self, x: jax.Array, conv_pool: jax.Array, meta: KdaMeta, *,
               decode: bool = False) -> tuple:
        """Normed hidden [T, D] -> (q, k, v [T, H, K], g fp32, beta [T, H], gate [T, H, K],
        updated conv pool). ``decode`` (one token per request) stores no conv checkpoint: a
        checkpoint needs a whole chunk of the request's tokens, so a decode step has none."""
        h, dim, tokens = self.num_heads, self.head_dim, x.shape[0]
        qkv, (f, gate_low, beta_logits) = self._projections(x)
        # channels head-major [H, 3, K] (module invariants)
        mixed = jnp.stack(qkv, axis=2).reshape(tokens, 3 * h * dim)
        weight = head_major_weight([getattr(self, f"{n}_conv")[...] for n in "qkv"], h)
        conv_out, conv_pool = short_conv_pool(
            mixed, weight, conv_pool, jnp.asarray(meta.slots, jnp.int32),
            jnp.asarray(meta.cu_seqlens, jnp.int32), activation="silu")
        if not decode:
            conv_pool = conv_checkpoint(mixed, conv_pool, meta)
        conv_out = conv_out.reshape(tokens, h, 3, dim)
        q, k, v = (conv_out[:, :, i] for i in range(3))
        g = kda_gate(linear("TK,KHJ->THJ", f, self.f_b_proj, self.dtype), self.A_log[...],
                     self.dt_bias[...])
        beta = jax.nn.sigmoid(beta_logits)
        gate = linear("TK,KHJ->THJ", gate_low, self.g_b_proj, self.dtype)
        return q, k, v, g, beta, gate, conv_pool

    def step_weights(self) -> StepWeights:
        """The weights ``kda_decode_step`` reads."""
        return StepWeights(*(getattr(self, name)[...] for name in (
            "q_conv", "k_conv", "v_conv", "f_b_proj", "g_b_proj", "A_log", "dt_bias", "o_norm")))

    def decode_step(self, x: jax.Array, conv_pool: jax.Array, state_pool: jax.Array,
                    slots: jax.Array) -> tuple:
        """A decode step through the fused kernel (``step_kernel``): normed hidden [N, D], one
        token per request -> (out [N, D], conv pool, state pool).

        Two products feed the kernel, each read whole: ``x @ [q | k | v]`` (XLA reads the three
        weights' concatenation inside its product, no copy) and ``x @ low_proj``. The second
        takes ``x`` through an optimization barrier: XLA would otherwise merge the two products
        and copy their weights side by side, every step (58 MB a layer at Kimi-Linear's
        shape)."""
        (tokens, hidden), h, k = x.shape, self.num_heads, self.head_dim
        qkv_proj = jnp.concatenate(
            [getattr(self, f"{n}_proj")[...].reshape(hidden, h * k) for n in "qkv"], axis=1)
        mixed = linear("TD,DC->TC", x, qkv_proj, self.dtype).reshape(tokens, 3, h, k)
        low = linear("TD,DR->TR", jax.lax.optimization_barrier(x), self.low_proj, self.dtype)
        gated, conv_pool, state_pool = kda_decode_step_pallas(
            mixed, low, self.step_weights(), conv_pool, state_pool,
            jnp.asarray(slots, jnp.int32), eps=self.norm_eps,
            num_warps=self.step_kernel.num_warps, interpret=self.step_kernel.interpret)
        return self._project_out(gated), conv_pool, state_pool

    def fuses_decode(self, mesh: Mesh | None, requests: int) -> bool:
        """Whether a decode step of ``requests`` requests takes ``decode_step``: the Pallas step
        kernel was chosen and takes that many, and the heads are not split over a mesh."""
        return self.step_kernel.takes(requests) and mesh is None

    def outputs(self, o: jax.Array, gate: jax.Array) -> jax.Array:
        """KDA output [T, H, V] and gate [T, H, K] -> [T, D] (gated per-head RMSNorm, o_proj)."""
        return self._project_out(gated_rms_norm(o, gate, self.o_norm[...], self.norm_eps))

    def _project_out(self, gated: jax.Array) -> jax.Array:
        return linear("THK,HKD->TD", gated.astype(self.dtype), self.o_proj, self.dtype)

    def __call__(self, x: jax.Array, conv_pool: jax.Array, state_pool: jax.Array, meta: KdaMeta,
                 *, impl: KdaImpl, decode: bool = False, mesh: Mesh | None = None) -> tuple:
        """The whole mixer: (out [T, D], conv pool, state pool)."""
        if decode and impl == "pallas" and self.fuses_decode(mesh, x.shape[0]):
            return self.decode_step(x, conv_pool, state_pool, meta.slots)
        q, k, v, g, beta, gate, conv_pool = self.inputs(x, conv_pool, meta, decode=decode)
        o, state_pool = kda_core(q, k, v, g, beta, state_pool, meta, impl=impl, decode=decode,
                                 mesh=mesh)
        return self.outputs(o, gate), conv_pool, state_pool
