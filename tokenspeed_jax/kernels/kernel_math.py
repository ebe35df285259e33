"""Small helpers shared by the Pallas kernels and their wrappers.

Invariant: every dot here accumulates in float32 whatever its operand dtype, so kernels that feed
bf16 operands keep fp32 sums (the arithmetic their references use); ``precision`` is passed
through (``HIGHEST`` keeps fp32 operands exact).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def dot(a, b, precision):
    """a @ b in fp32."""
    return jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)


def dot_nt(a, b, precision):
    """a @ b.T in fp32."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def dot_tn(a, b, precision):
    """a.T @ b in fp32."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def is_power_of_2(value: int) -> bool:
    """Whether ``value`` is 1, 2, 4, ... (Triton blocks must be powers of two)."""
    return value >= 1 and value & (value - 1) == 0
