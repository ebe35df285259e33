"""Checks shared by the tensor-parallel tests (imported lazily: jax must not load early)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def splits_by_name(state: Any, spec_of: Callable[[str], tuple], tp: int) -> dict[str, bool]:
    """Whether ``spec_of(name)`` splits each parameter leaf of ``state`` over the mesh axis;
    asserts each spec fits its leaf's rank and that every split dimension divides by ``tp``."""
    import jax

    from tokenspeed_jax.parallel import AXIS

    split = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        name = [k.key for k in path if isinstance(getattr(k, "key", None), str)][-1]
        spec = spec_of(name)
        assert len(spec) <= leaf.ndim, name
        axes = [i for i, axis in enumerate(spec) if axis == AXIS]
        assert all(leaf.shape[i] % tp == 0 for i in axes), (name, leaf.shape, spec)
        split[name] = bool(axes)
    return split
