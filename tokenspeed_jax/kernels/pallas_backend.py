"""The one place that chooses how Pallas GPU kernels are lowered.

Every KDA kernel asks this module for its compiler parameters and for whether to interpret, so a
change of backend touches this file alone. Today the kernels lower through Triton
(`jax.experimental.pallas.triton`); jax 0.11 deprecates that lowering in favour of Mosaic GPU, and
moving to it means replacing `compiler_params` here and revisiting the masked loads the kernels
avoid on purpose (they use static blocks and whole-array refs with dynamic indices only).

Invariant: `interpret=None` means "interpret on the CPU, compile on the GPU", decided from the
default backend at trace time; an explicit bool always wins.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import triton as pallas_triton

BACKEND = "triton"


def compiler_params(*, num_warps: int, num_stages: int) -> pallas_triton.CompilerParams:
    """Compiler parameters for a kernel of this backend."""
    return pallas_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def resolve_interpret(interpret: bool | None) -> bool:
    """`None` interprets on the CPU and compiles elsewhere; a bool is taken as given."""
    if interpret is None:
        return jax.default_backend() == "cpu"
    if not isinstance(interpret, bool):
        raise TypeError(f"interpret must be None or a bool, got {interpret!r}")
    return interpret
