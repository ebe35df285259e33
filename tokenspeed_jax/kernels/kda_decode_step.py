"""One KDA layer's decode step after its projections, as one Pallas GPU call.

Contract (one token per request, N requests; ``dtype`` is the activations' dtype):

* in: ``mixed [N, 3, H, K]`` (the q, k, v projections, before the conv), ``low [N, 2 R + H]``
  (side by side: ``f_low`` and ``gate_low``, the low-rank halves of the decay and output gates,
  then ``beta_logits``; one product over the three weights), the layer's ``StepWeights``, the
  conv pool ``[P, W - 1, 3 H K]`` (channels head-major ``[H, 3, K]``, states oldest first), the
  recurrent pool ``[P, H, V, K]`` (fp32 or bf16, transposed states) and ``slots [N]``;
* out: the gated, normed KDA output ``[N, H, V]`` in ``dtype`` (what the layer's ``o_proj``
  takes), and both pools with each live request's row advanced by its token.

Per request and head, in this order (the layer's prefill-side arithmetic, roundings included):
q, k, v = silu(causal conv of the conv state and the token) rounded to ``dtype``; the decay
g = -exp(A_log) * softplus(round(f_low @ f_b) + dt_bias) and beta = round(sigmoid(beta_logits));
the recurrent step of ``kda_decode`` with L2-normed q, k (fp32); o rounded to ``dtype``; then
rmsnorm(o) * o_norm * sigmoid(round(gate_low @ g_b)) over the head's V channels, in fp32.

Two implementations, chosen by a ``StepKernel``:

* ``kda_decode_step_pallas``: one program per (head, request, block of ``block_v`` value
  rows) owns those rows of the head's state ``[V, K]`` and the matching v conv channels, so it
  reads the old rows and writes the new ones with no other program touching them (the pools are
  updated in place). Each program stores its rows of o and of the output gate; the norm over V
  needs every row, so the (request, head)'s last program to finish does it (``kernels.arrivals``:
  a counter per (request, head)) and writes the output. Every program reads the old q and k conv
  rows (q and k are whole in each), so the last one also writes their new rows, once all have
  read them. At small batches the head is split into 32-row blocks (``value_block``): more
  programs start their state reads at once; beyond, one program takes the whole head. Where the
  unfused step runs ten or so XLA kernels around the recurrent one (the conv, the q/k/v split,
  two low-rank products, the gate and beta, the gated norm, the conv-state scatter), this is one
  launch. It reads ``mixed`` and ``low`` whole, so the products that make them need no split
  into copies.
* ``kda_decode_step_reference``: plain JAX from the pieces the prefill uses (``short_conv_pool``,
  ``kda_gate``, ``recurrent_kda_reference``, ``gated_rms_norm``).

Invariants: a request with ``slots[n] < 0`` is padding (zero states in, no pool row written;
its output is computed and meaningless); slots in one call are distinct; the pools are donated.
The kernel takes shapes whose K (= V) and R are powers of 2 (``step_problem``) and blocks of
32 to K value rows (``block_problem``), and raises on others; ``choose_step_kernel`` picks it on
GPUs only, so nothing falls back at run time.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from tokenspeed_jax.kernels import pallas_backend
from tokenspeed_jax.kernels.arrivals import count_in, fresh_counters, shared_load
from tokenspeed_jax.kernels.kda_ref import (
    L2NORM_EPS,
    STATE_DTYPES,
    gated_rms_norm,
    kda_gate,
    pool_layout,
    recurrent_kda_reference,
    softplus,
)
from tokenspeed_jax.kernels.kernel_math import is_power_of_2, rounded_to
from tokenspeed_jax.kernels.paged_attention_backend import (
    PALLAS,
    REFERENCE,
    check_pallas_or_reference,
    on_gpu,
)
from tokenspeed_jax.kernels.short_conv import head_major_weight, short_conv_pool

__all__ = ["StepKernel", "StepWeights", "block_problem", "choose_step_kernel",
           "kda_decode_step_pallas", "kda_decode_step_reference", "step_problem", "value_block"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepWeights:
    """A KDA layer's weights the step reads (the layer's layouts)."""

    q_conv: Any  # [H K, W]
    k_conv: Any  # [H K, W]
    v_conv: Any  # [H K, W]
    f_b_proj: Any  # [R, H, K]
    g_b_proj: Any  # [R, H, V]
    A_log: Any  # [H] float32
    dt_bias: Any  # [H, K] float32
    o_norm: Any  # [V]


# Value rows per program: the smallest compiled block that computes correctly (16-row blocks gave
# wrong states on an H200, jax 0.11.2; interpreted, any power of 2 runs), and the block at up to
# SPLIT_MAX_REQUESTS requests, where more programs read the state sooner (one Kimi-Linear layer,
# 2 rows: 7.2 us against 10.1 whole; at 8 rows whole heads are faster, 15.0 against 17.6).
MIN_BLOCK_V = 32
SPLIT_MAX_REQUESTS = 2

# Past this many requests a step is throughput-bound and each program's re-read of the two
# low-rank gate slabs costs more than the XLA kernels it replaces (H200, 32 heads of 128).
MAX_REQUESTS = 32


@dataclasses.dataclass(frozen=True)
class StepKernel:
    """Which implementation runs (``PALLAS`` or ``REFERENCE``) and for up to how many requests
    a step; the kernel's warps; and ``interpret`` (None: interpret on the CPU)."""

    backend: str = REFERENCE
    max_requests: int = MAX_REQUESTS
    num_warps: int = 4
    interpret: bool | None = None

    def __post_init__(self) -> None:
        check_pallas_or_reference(self.backend)
        if self.max_requests < 0:
            raise ValueError(f"max_requests={self.max_requests} must be >= 0")

    def takes(self, requests: int) -> bool:
        """Whether a step of ``requests`` requests runs the kernel."""
        return self.backend == PALLAS and requests <= self.max_requests


REFERENCE_STEP = StepKernel()


def value_block(requests: int, head_dim: int) -> int:
    """Value rows per program for a step of ``requests`` requests: ``MIN_BLOCK_V`` up to
    ``SPLIT_MAX_REQUESTS`` requests, the whole head beyond (each program re-reads the decay
    gate's slab, which outweighs the earlier start at larger batches)."""
    return min(MIN_BLOCK_V, head_dim) if requests <= SPLIT_MAX_REQUESTS else head_dim


def block_problem(block_v: int, head_dim: int, *, compiled: bool) -> str | None:
    """Why ``block_v`` value rows per program cannot run, or None: a power of 2 dividing the
    head, and compiled at least ``MIN_BLOCK_V`` (or the whole head)."""
    least = min(MIN_BLOCK_V, head_dim) if compiled else 1
    if not (is_power_of_2(block_v) and least <= block_v <= head_dim):
        return f"block_v={block_v} must be a power of 2 from {least} to {head_dim}"
    return None


def step_problem(*, head_dim: int, rank: int) -> str | None:
    """Why the kernel cannot run this shape, or None when it can (every block a power of 2)."""
    if not (is_power_of_2(head_dim) and is_power_of_2(rank)):
        return f"head_dim={head_dim} and the gate rank {rank} must be powers of 2"
    return None


def choose_step_kernel(*, head_dim: int, rank: int, platform: str | None = None) -> StepKernel:
    """The Pallas kernel on a GPU for a shape it takes; the reference elsewhere."""
    if not on_gpu(platform) or step_problem(head_dim=head_dim, rank=rank) is not None:
        return REFERENCE_STEP
    return StepKernel(PALLAS)


def _check(mixed, low, weights: StepWeights, conv_pool, state_pool, slots) -> tuple[int, ...]:
    """Checks the operands (module contract); returns (N, H, K, R, W)."""
    if mixed.ndim != 4 or mixed.shape[1] != 3:
        raise ValueError(f"mixed must be [N, 3, H, K], got {mixed.shape}")
    n, _, h, k = mixed.shape
    rank = weights.f_b_proj.shape[0]
    width = weights.q_conv.shape[-1]
    expected = {
        "low": (low.shape, (n, 2 * rank + h)), "slots": (slots.shape, (n,)),
        "f_b_proj": (weights.f_b_proj.shape, (rank, h, k)),
        "g_b_proj": (weights.g_b_proj.shape, (rank, h, k)),
        "A_log": (weights.A_log.shape, (h,)), "dt_bias": (weights.dt_bias.shape, (h, k)),
        "o_norm": (weights.o_norm.shape, (k,)),
        "state_pool": (state_pool.shape[1:], (h, k, k)),
        "conv_pool": (conv_pool.shape[1:], (width - 1, 3 * h * k)),
        **{f"{c}_conv": (getattr(weights, f"{c}_conv").shape, (h * k, width)) for c in "qkv"},
    }
    wrong = [f"{name} {got} (expected {want})" for name, (got, want) in expected.items()
             if tuple(got) != want]
    if wrong:
        raise ValueError("KDA decode step operands have the wrong shapes: " + "; ".join(wrong))
    if width < 2:
        raise ValueError(f"the conv width must be at least 2, got {width}")
    if jnp.dtype(state_pool.dtype) not in STATE_DTYPES:
        raise ValueError(f"state_pool must be one of {STATE_DTYPES}, got {state_pool.dtype}")
    if conv_pool.shape[0] != state_pool.shape[0]:
        raise ValueError(f"the pools have {conv_pool.shape[0]} and {state_pool.shape[0]} rows")
    return n, h, k, rank, width


def _step_kernel(slots_ref, mixed_ref, low_ref, qw_ref, kw_ref, vw_ref, fb_ref, gb_ref, alog_ref,
                 dtb_ref, onorm_ref, conv_ref, pool_ref, _arrivals_in, out_ref, conv_out_ref,
                 pool_out_ref, o_ref, gate_ref, arrivals_ref, *, width: int, scale: float,
                 eps: float, block_v: int, compiled: bool):
    f32, dtype = jnp.float32, out_ref.dtype
    head, n, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = slots_ref[n]
    live = slot >= 0
    row = jnp.maximum(slot, 0)
    values = pl.ds(block * block_v, block_v)
    every = pl.ds(0, fb_ref.shape[2])
    rounded = functools.partial(rounded_to, dtype=dtype)

    def conv(channel: int, weight_ref, columns):
        """The channel's conv output (rounded) and its conv-state rows after this token."""
        token = mixed_ref[n, channel, head, columns]
        history = [jnp.where(live, conv_ref[row, i, head, channel, columns], 0)
                   for i in range(width - 1)]
        taps = [*history, token]
        acc = jnp.zeros(token.shape, f32)
        for i, tap in enumerate(taps):
            acc = acc + tap.astype(f32) * weight_ref[head, columns, i].astype(f32)
        return rounded(jax.nn.silu(acc)), taps[1:]

    (q, q_state), (k, k_state), (v, v_state) = (
        conv(0, qw_ref, every), conv(1, kw_ref, every), conv(2, vw_ref, values))

    rank = fb_ref.shape[0]

    def low_rank(first: int, up):  # round(low [R] @ up [R, columns])
        low = low_ref[n, pl.ds(first, rank)].astype(f32)
        return rounded(jnp.sum(low[:, None] * up.astype(f32), axis=0))

    g = -jnp.exp(alog_ref[head]) * softplus(low_rank(0, fb_ref[:, head, :]) + dtb_ref[head, :])
    beta = rounded(jax.nn.sigmoid(low_ref[n, 2 * rank + head].astype(f32)))
    q = q * lax.rsqrt(jnp.sum(q * q) + L2NORM_EPS)
    k = k * lax.rsqrt(jnp.sum(k * k) + L2NORM_EPS)

    state = jnp.where(live, pool_ref[row, head, values, :].astype(f32), 0.0)  # [block_v, K]
    decayed = state * jnp.exp(g)[None, :]
    error = beta * (v - jnp.sum(decayed * k[None, :], axis=1))
    o_ref[n, head, values] = rounded(
        scale * (jnp.sum(decayed * q[None, :], axis=1) + jnp.sum(q * k) * error))
    gate_ref[n, head, values] = jax.nn.sigmoid(low_rank(rank, gb_ref[:, head, values]))

    @pl.when(live)
    def _():
        pool_out_ref[row, head, values, :] = (decayed + error[:, None] * k[None, :]).astype(
            pool_out_ref.dtype)
        for i, value in enumerate(v_state):
            conv_out_ref[row, i, head, 2, values] = value.astype(conv_out_ref.dtype)

    arrived = count_in(arrivals_ref, n * pl.num_programs(0) + head, compiled=compiled)

    # the (request, head)'s last program: every program has written its rows of o and read the
    # old q and k conv rows (each computes q and k whole; the pool is updated in place)
    @pl.when(arrived == pl.num_programs(2) - 1)
    def _():
        load = shared_load(compiled=compiled)
        o, gate = load(o_ref.at[n, head, :]), load(gate_ref.at[n, head, :])
        normed = o * lax.rsqrt(jnp.mean(o * o) + eps)
        out_ref[n, head, :] = (normed * onorm_ref[...].astype(f32) * gate).astype(dtype)

        @pl.when(live)
        def _():
            for channel, rows in ((0, q_state), (1, k_state)):
                for i, value in enumerate(rows):
                    conv_out_ref[row, i, head, channel, every] = value.astype(
                        conv_out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "scale", "block_v", "num_warps", "interpret"),
                   donate_argnames=("conv_pool", "state_pool"))
def kda_decode_step_pallas(mixed, low, weights: StepWeights, conv_pool, state_pool, slots, *,
                           eps: float, scale: float | None = None, block_v: int | None = None,
                           num_warps: int = 4, interpret: bool | None = None) -> tuple:
    """The step as one Pallas call (module docstring); returns (out, conv pool, state pool).
    ``block_v``: value rows per program (None: ``value_block``'s choice for N requests)."""
    interpret = pallas_backend.resolve_interpret(interpret)
    n, h, k, rank, width = _check(mixed, low, weights, conv_pool, state_pool, slots)
    problem = step_problem(head_dim=k, rank=rank)
    block_v = value_block(n, k) if block_v is None else block_v
    if problem is None:
        problem = block_problem(block_v, k, compiled=not interpret)
    if problem is not None:
        raise ValueError(f"the KDA decode step kernel cannot run this shape: {problem}")
    pool_rows = conv_pool.shape[0]
    kernel = functools.partial(_step_kernel, width=width,
                               scale=k**-0.5 if scale is None else float(scale), eps=float(eps),
                               block_v=block_v, compiled=not interpret)
    conv_weights = [getattr(weights, f"{c}_conv").reshape(h, k, width) for c in "qkv"]
    operands = (slots.astype(jnp.int32), mixed, low, *conv_weights,
                weights.f_b_proj, weights.g_b_proj, weights.A_log.astype(jnp.float32),
                weights.dt_bias.astype(jnp.float32), weights.o_norm,
                conv_pool.reshape(pool_rows, width - 1, h, 3, k), state_pool,
                fresh_counters(n * h))
    halves = jax.ShapeDtypeStruct((n, h, k), jnp.float32)  # o and the gate, before the norm
    out, conv_pool, state_pool, _, _, _ = pl.pallas_call(
        kernel,
        grid=(h, n, k // block_v),
        out_shape=[jax.ShapeDtypeStruct((n, h, k), mixed.dtype),
                   jax.ShapeDtypeStruct(operands[-3].shape, conv_pool.dtype),
                   jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype), halves, halves,
                   jax.ShapeDtypeStruct((n * h,), jnp.int32)],
        input_output_aliases={len(operands) - 3: 1, len(operands) - 2: 2, len(operands) - 1: 5},
        compiler_params=pallas_backend.compiler_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_decode_step",
    )(*operands)
    return out, conv_pool.reshape(pool_rows, width - 1, 3 * h * k), state_pool


def _up_product(low: jax.Array, up: jax.Array, dtype: Any) -> jax.Array:
    """A gate's low-rank product low [N, R] @ up [R, H, K], rounded to ``dtype``."""
    return jnp.einsum("TR,RHK->THK", low, up.astype(dtype),
                      preferred_element_type=jnp.float32).astype(dtype)


def kda_decode_step_reference(mixed, low, weights: StepWeights, conv_pool, state_pool, slots, *,
                              eps: float, scale: float | None = None) -> tuple:
    """The step in plain JAX (module docstring); returns (out, conv pool, state pool)."""
    n, h, k, rank, _ = _check(mixed, low, weights, conv_pool, state_pool, slots)
    f_low, gate_low, beta_logits = jnp.split(low, [rank, 2 * rank], axis=1)
    dtype = mixed.dtype
    slots = slots.astype(jnp.int32)
    head_major = jnp.swapaxes(mixed, 1, 2).reshape(n, 3 * h * k)
    conv_weight = head_major_weight([getattr(weights, f"{c}_conv") for c in "qkv"], h)
    conv_out, conv_pool = short_conv_pool(head_major, conv_weight, conv_pool, slots,
                                          jnp.arange(n + 1, dtype=jnp.int32), activation="silu")
    q, k_, v = (conv_out.reshape(n, h, 3, k)[:, :, i] for i in range(3))
    g = kda_gate(_up_product(f_low, weights.f_b_proj, dtype), weights.A_log, weights.dt_bias)
    beta = jax.nn.sigmoid(beta_logits)
    live = (slots >= 0)[:, None, None, None]
    states = jnp.where(live, jnp.take(state_pool, jnp.maximum(slots, 0), axis=0), 0)
    o, final = recurrent_kda_reference(
        *(x[:, None] for x in (q, k_, v, g, beta)), scale=scale,
        initial_state=pool_layout(states.astype(jnp.float32)), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    target = jnp.where(slots >= 0, slots, state_pool.shape[0])
    state_pool = state_pool.at[target].set(pool_layout(final).astype(state_pool.dtype),
                                           mode="drop")
    gate = _up_product(gate_low, weights.g_b_proj, dtype)
    out = gated_rms_norm(o[:, 0].astype(dtype), gate, weights.o_norm, eps).astype(dtype)
    return out, conv_pool, state_pool
