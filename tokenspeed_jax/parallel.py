"""Tensor parallelism: the device mesh and the helpers every family's sharding rules build on.

Invariants: one mesh axis, ``AXIS`` (``"tp"``), over the first ``tensor_parallel_size`` devices;
``make_mesh(1)`` is None and nothing is sharded (single-device programs unchanged); ``make_mesh``
raises ValueError naming the values for more devices than jax sees. jax's SPMD partitioner
(GSPMD) does the rest: every segment and break is compiled with the shardings its family names
(``models/<family>/sharding.py``), and XLA inserts the collectives. Pallas kernels cannot be
partitioned by XLA: a stage that calls one runs it per shard through ``jax.shard_map`` over
``AXIS`` with the specs of ``head_spec``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS = "tp"


def make_mesh(tensor_parallel_size: int, devices: Sequence[Any] | None = None) -> Mesh | None:
    """A one-axis mesh over the first ``tensor_parallel_size`` devices; None for size 1."""
    devices = list(jax.devices() if devices is None else devices)
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size > len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} exceeds the {len(devices)} "
            f"{devices[0].platform} device(s) jax sees (on the CPU, set XLA_FLAGS="
            f"--xla_force_host_platform_device_count=N before jax is imported)")
    if tensor_parallel_size == 1:
        return None
    return Mesh(np.array(devices[:tensor_parallel_size]), (AXIS,))


def mesh_size(mesh: Mesh | None) -> int:
    return 1 if mesh is None else mesh.size


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def head_spec(ndim: int, axis: int = 1) -> PartitionSpec:
    """A spec splitting dimension ``axis`` of an ``ndim``-d array over ``AXIS`` (the head axis of
    ``[T, H, ...]`` activations by default)."""
    return PartitionSpec(*(AXIS if i == axis else None for i in range(ndim)))


def vocab_specs(vocab_size: int, size: int) -> dict[str, PartitionSpec]:
    """The specs of ``embed_tokens [V, D]`` and ``lm_head [D, V]``: split over the vocabulary
    when ``size`` divides it, else replicated."""
    if vocab_size % size:
        return {"embed_tokens": PartitionSpec(), "lm_head": PartitionSpec()}
    return {"embed_tokens": PartitionSpec(AXIS, None), "lm_head": PartitionSpec(None, AXIS)}


# The SwiGLU feed-forward of every family: gate and up column parallel, down row parallel.
SWIGLU_SPECS = {"gate_proj": PartitionSpec(None, AXIS), "up_proj": PartitionSpec(None, AXIS),
                "down_proj": PartitionSpec(AXIS, None)}


def param_name(path: Sequence[Any]) -> str:
    """The last string key of a state path (``('layers', 0, 'q_proj', 'value')`` -> q_proj)."""
    keys = [getattr(k, "key", getattr(k, "name", k)) for k in path]
    names = [k for k in keys if isinstance(k, str) and k != "value"]
    if not names:
        raise ValueError(f"state path {path} names no parameter")
    return names[-1]


def place_array(value: Any, dtype: Any, sharding: NamedSharding | None) -> jax.Array:
    """A host array as a device array of ``dtype``: on the default device without a sharding,
    else straight from the host onto it. A dtype change is made on the host: on the device it
    would compile a conversion per weight shape at every start."""
    return jax.device_put(np.asarray(value).astype(dtype, copy=False), sharding)
