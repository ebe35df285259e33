"""The one place that chooses how Pallas GPU kernels are lowered.

Every Pallas kernel asks this module for its compiler parameters, for whether to interpret and
for masked stores, so a change of backend touches this file alone. Today the kernels lower
through Triton (`jax.experimental.pallas.triton`); jax 0.11 deprecates that lowering in favour of
Mosaic GPU, and moving to it means replacing `compiler_params` and `masked_store` here and
revisiting the masked loads the kernels avoid on purpose (they use static blocks and whole-array
refs with dynamic indices only; the prefill attention kernel stores its rows with a mask).

Invariant: `interpret=None` means "interpret on the CPU, compile on the GPU", decided from the
default backend at trace time; an explicit bool always wins.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental.pallas import triton as pallas_triton

BACKEND = "triton"


def compiler_params(*, num_warps: int, num_stages: int) -> pallas_triton.CompilerParams:
    """Compiler parameters for a kernel of this backend."""
    return pallas_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def masked_store(ref: Any, value: jax.Array, mask: jax.Array) -> None:
    """Store ``value`` into ``ref`` (same shape) where ``mask`` is true; elsewhere ``ref`` keeps
    what it holds."""
    pallas_triton.store(ref, value, mask=mask)


def resolve_interpret(interpret: bool | None) -> bool:
    """`None` interprets on the CPU and compiles elsewhere; a bool is taken as given."""
    if interpret is None:
        return jax.default_backend() == "cpu"
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be None or a bool, got {interpret!r}")
    return interpret
