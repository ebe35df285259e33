"""Causal depthwise short convolution over packed sequences, with per-request state.

Used on KDA's q/k/v projections. For channel d of the token at position t of a sequence,

    y[t, d] = act(sum_i weight[d, i] * x[t - (W - 1) + i, d] + bias[d])

where positions before the sequence's first token read that request's conv state: the last W - 1
inputs seen before this call, oldest first ([N, W - 1, D]; zeros for a fresh request). The
convolution restarts at every boundary of `cu_seqlens`, so packed requests never see each other.
The new state is the last W - 1 inputs of each request (reaching back into the old state for
requests shorter than W - 1 tokens), which is what the next prefill chunk or decode step needs.
Decode is the case of one token per request. Written in plain JAX: it is elementwise work that XLA
fuses with its neighbours.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tokenspeed_jax.kernels.kernel_math import count_at_most

__all__ = ["head_major_weight", "short_conv", "short_conv_pool"]

ACTIVATIONS = {"silu": jax.nn.silu, None: lambda x: x}



def head_major_weight(weights, num_heads: int) -> jax.Array:
    """Per-channel weights ``[H K, W]`` of several projections (KDA's q, k, v) as one weight
    over their channels interleaved by head, ``[H, len(weights), K]`` flattened: the layout in
    which splitting the channels into equal parts splits them by head."""
    width = weights[0].shape[-1]
    stacked = jnp.stack([w.reshape(num_heads, -1, width) for w in weights], axis=1)
    return stacked.reshape(-1, width)

def short_conv(
    x: jax.Array,
    weight: jax.Array,
    conv_state: jax.Array,
    cu_seqlens: jax.Array,
    *,
    bias: jax.Array | None = None,
    activation: str | None = "silu",
) -> tuple[jax.Array, jax.Array]:
    """x [T, D]; weight [D, W]; conv_state [N, W - 1, D]; cu_seqlens [N + 1].

    Returns (y [T, D] in x's dtype, new conv_state [N, W - 1, D]). Tokens past cu_seqlens[-1]
    give zeros.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    if x.ndim != 2 or weight.ndim != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"x must be [T, D] and weight [D, W], got {x.shape=} {weight.shape=}")
    T, D = x.shape
    width = weight.shape[1]
    num_requests = cu_seqlens.shape[0] - 1
    if conv_state.shape != (num_requests, width - 1, D):
        raise ValueError(f"conv_state must be [N, W - 1, D]={(num_requests, width - 1, D)}, "
                         f"got {conv_state.shape}")
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    token = jnp.arange(T, dtype=jnp.int32)
    request = jnp.minimum(count_at_most(cu_seqlens[1:], token), num_requests - 1)
    position = token - cu_seqlens[request]
    f32 = jnp.float32
    acc = jnp.zeros((T, D), f32)
    for i in range(width):
        back = width - 1 - i  # how many tokens before t this tap reads
        from_x = jnp.take(x, token - back, axis=0, mode="clip").astype(f32)
        state_row = jnp.clip(width - 1 - back + position, 0, width - 2)
        from_state = conv_state[request, state_row].astype(f32)
        tap = jnp.where((position >= back)[:, None], from_x, from_state)
        acc = acc + tap * weight[:, i].astype(f32)[None, :]
    if bias is not None:
        acc = acc + bias.astype(f32)[None, :]
    y = ACTIVATIONS[activation](acc)
    y = jnp.where((token < cu_seqlens[-1])[:, None], y, 0).astype(x.dtype)

    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    tail = lengths[:, None] - (width - 1) + jnp.arange(width - 1)[None, :]  # [N, W - 1]
    from_x = jnp.take(x, cu_seqlens[:-1, None] + jnp.maximum(tail, 0), axis=0, mode="clip")
    from_state = jnp.take_along_axis(
        conv_state, jnp.clip(width - 1 + tail, 0, width - 2)[..., None], axis=1
    )
    new_state = jnp.where((tail >= 0)[..., None], from_x, from_state).astype(conv_state.dtype)
    return y, new_state


def short_conv_pool(
    x: jax.Array,
    weight: jax.Array,
    conv_pool: jax.Array,
    slots: jax.Array,
    cu_seqlens: jax.Array,
    *,
    bias: jax.Array | None = None,
    activation: str | None = "silu",
) -> tuple[jax.Array, jax.Array]:
    """`short_conv` with states in a pool [P, W - 1, D] at rows `slots` [N].

    A request with a negative slot is padding: it reads a zero state and writes nothing. Donate
    the pool at the enclosing jit for an in-place update.
    """
    pool_size = conv_pool.shape[0]
    state = jnp.take(conv_pool, slots, axis=0, mode="fill", fill_value=0)
    state = jnp.where((slots >= 0)[:, None, None], state, 0)
    y, new_state = short_conv(x, weight, state, cu_seqlens, bias=bias, activation=activation)
    target = jnp.where(slots >= 0, slots, pool_size)
    return y, conv_pool.at[target].set(new_state, mode="drop")
