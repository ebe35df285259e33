"""Rotary position embedding (RoPE) in HF's rotate-half layout, as tables a kernel can apply.

Feature ``i`` pairs with ``i + Dh/2``. For a position whose pair angles are ``a [Dh/2]``, the
tables are ``cos = [cos a, cos a]`` and ``sin = [-sin a, sin a]`` (``[..., Dh]`` float32), and a
rotated row is ``x * cos + swap(x) * sin``, where ``swap`` exchanges the two halves (feature
``i`` reads feature ``(i + Dh/2) mod Dh``). That is ``(x1 cos - x2 sin, x2 cos + x1 sin)``
operation for operation (adding a negated product is subtracting it), so a kernel that applies
the tables and XLA's ``rotate`` round alike.

Invariants: tables are float32 and computed once per step (they depend on positions only);
rotation computes in float32 and returns the input's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def rotary_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) ``[..., T, Dh]`` float32 for ``positions [..., T]`` and the pair frequencies
    ``inv_freq [Dh/2]``."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([-sin, sin], axis=-1)


def rotate_with(x: jax.Array, swapped: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """``x`` rotated, given ``swapped`` (``x`` with its halves exchanged) and tables that
    broadcast against it."""
    return (x.astype(jnp.float32) * cos + swapped.astype(jnp.float32) * sin).astype(x.dtype)


def swapped_features(head_dim: int) -> jax.Array:
    """i32[Dh]: the feature each feature's partner is read from, ``(i + Dh/2) mod Dh`` (a
    kernel loads ``swap(x)`` through it)."""
    return (lax.iota(jnp.int32, head_dim) + head_dim // 2) % head_dim


def rotate(x: jax.Array, tables: tuple[jax.Array, jax.Array]) -> jax.Array:
    """``x [..., T, N, Dh]`` rotated by ``tables`` (``rotary_tables``, ``[..., T, Dh]``)."""
    cos, sin = (table[..., None, :] for table in tables)
    return rotate_with(x, jnp.roll(x, x.shape[-1] // 2, axis=-1), cos, sin)
