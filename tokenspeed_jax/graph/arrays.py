"""Start-up device arrays made by executables of a ``PlanCompiler``: zero-filled buffers and
stacked trees.

``jnp.zeros`` or ``jnp.stack`` at start-up is a small XLA program that jax compiles in every
process (its in-memory cache does not survive a restart), so a start that loads every plan
from the executable cache would still compile these. Here each such array is the output of a
one-call plan compiled by the caller's ``PlanCompiler``: with a cache, a warm start loads the
executable like any other. Invariants:

* ``zeros`` gives every name its own zero-filled buffer, made on the device (no host array of
  its size): one executable with one output per distinct (shape, dtype, sharding), run once per
  name, so the buffers can be donated one by one and no step of the allocation holds more than
  the arrays themselves. Each array has its spec's sharding (a spec without one: the default
  device).
* ``stack`` gives the tree whose every leaf stacks that leaf of each tree along a new leading
  axis; a leaf split over a mesh (a ``NamedSharding``) is stacked with the same split and the
  new axis whole; other leaves are replicated over the compiler's mesh, if any.
* The executables' cache keys name everything they build: the stage functions are module-level,
  ``zeros``' closes over its shape and dtype name only, ``stack``'s reads only its arguments.
* Each call compiles (or loads) with the compiler it is given and uses it up: pass a fresh one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from tokenspeed_jax.graph.compile import PlanCompiler, multi_device_sharding
from tokenspeed_jax.graph.plan import Call, Plan, Segment


def _zeros_function(shape: tuple[int, ...], dtype: str):
    def zeros(params: Any) -> jax.Array:
        del params
        return jnp.zeros(shape, dtype)

    return zeros


def zeros(compiler: PlanCompiler, specs: Mapping[str, jax.ShapeDtypeStruct]
          ) -> dict[str, jax.Array]:
    """A zero-filled device array per name of ``specs``, in their order (module docstring)."""
    groups: dict[tuple, list[str]] = {}
    for name, spec in specs.items():
        key = (tuple(spec.shape), str(jnp.dtype(spec.dtype)), multi_device_sharding(spec))
        groups.setdefault(key, []).append(name)
    labels = []
    for index, (shape, dtype, sharding) in enumerate(groups):
        labels.append(f"zeros {index}: {dtype}{list(shape)}")
        segment = Segment("zeros", _zeros_function(shape, dtype), (), ("zeros",))
        compiler.add(labels[-1], Plan([Call(segment)], (), ("zeros",)), {},
                     shardings=None if sharding is None else {"zeros": sharding})
    plans, _ = compiler.compile_all()
    made = {name: plans[label].run({})["zeros"]
            for label, names in zip(labels, groups.values()) for name in names}
    return {name: made[name] for name in specs}


def _stack(params: Sequence[Any]) -> tuple[jax.Array, ...]:
    return tuple(jnp.stack(leaves) for leaves in zip(*map(jax.tree_util.tree_leaves, params)))


def _stacked_sharding(leaf: Any) -> NamedSharding | None:
    sharding = multi_device_sharding(leaf)
    if not isinstance(sharding, NamedSharding):
        return None
    return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))


def stack(compiler: PlanCompiler, trees: Sequence[Any]) -> Any:
    """One tree (of ``trees``' common structure) whose every leaf stacks that leaf of each tree
    along a new leading axis (module docstring)."""
    if not trees:
        raise ValueError("stack needs at least one tree")
    leaves, structure = jax.tree_util.tree_flatten(trees[0])
    names = tuple(f"stacked.{i}" for i in range(len(leaves)))
    shardings = {name: sharding for name, leaf in zip(names, leaves)
                 if (sharding := _stacked_sharding(leaf)) is not None}
    segment = Segment("stack", _stack, (), names)
    compiler.add("stack", Plan([Call(segment, tuple(trees))], (), names), {},
                 shardings=shardings or None)
    plans, _ = compiler.compile_all()
    out = plans["stack"].run({})
    return jax.tree_util.tree_unflatten(structure, [out[name] for name in names])
