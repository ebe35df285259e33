"""Host-built step metadata packed into one int32 buffer: one host->device copy per step.

Every small metadata array of a step (token ids, positions, slots, page tables, sampling settings)
would otherwise be its own transfer, and on a GPU each transfer costs tens of microseconds of
host time. ``Packed.of`` lays named arrays end to end in one ``int32`` buffer; inside the compiled
executable ``Packed.unpack`` slices them back out (free: static slices of one buffer).

Invariants:

* Every field is 32-bit (int32, uint32 or float32) and travels bit-exactly: float and unsigned
  words are reinterpreted (``view`` on the host, ``bitcast_convert_type`` on the device), never
  converted.
* ``Packed`` is a pytree whose only leaf is the buffer; its ``Layout`` (names, dtypes, shapes,
  offsets) is static aux data, so it is part of the compiled program's signature and of the
  executable cache key, and a layout change can never reuse a stale executable.
* ``PackedBuilder`` makes buffers of one layout by writing into views of a staging buffer that
  ``reset`` restores to a default ``Packed``: every buffer starts from the defaults, never from
  an earlier one, and ``take`` hands out a copy, so a buffer in flight never changes. A builder
  is used by one thread at a time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

WORD = np.dtype(np.int32)
FIELD_DTYPES = (np.dtype(np.int32), np.dtype(np.uint32), np.dtype(np.float32))


@dataclasses.dataclass(frozen=True)
class Field:
    """One array of a packed buffer: ``size`` words from ``offset``, of ``dtype`` and ``shape``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each named array lies in a packed buffer of ``size`` int32 words."""

    fields: tuple[Field, ...]
    size: int

    def field(self, name: str) -> Field:
        for field in self.fields:
            if field.name == name:
                return field
        raise KeyError(f"no packed field {name!r}; fields: {[f.name for f in self.fields]}")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Packed:
    """Named 32-bit arrays in one int32 buffer (host: numpy; in a program: a traced array)."""

    buffer: Any  # i32[layout.size]
    layout: Layout

    @classmethod
    def of(cls, arrays: Mapping[str, np.ndarray]) -> Packed:
        """Pack ``arrays`` (name -> 32-bit numpy array) in the order given."""
        layout = _layout(tuple((name, a.dtype, a.shape) for name, a in arrays.items()))
        buffer = np.concatenate([a.reshape(-1).view(WORD) for a in arrays.values()])
        return cls(buffer, layout)

    def unpack(self) -> dict[str, jax.Array]:
        """The named arrays back, as JAX values (inside a trace: static slices of the buffer)."""
        buffer = jnp.asarray(self.buffer)
        out = {}
        for field in self.layout.fields:
            words = buffer[field.offset:field.offset + field.size]
            dtype = jnp.dtype(field.dtype)
            value = words if dtype == WORD else jax.lax.bitcast_convert_type(words, dtype)
            out[field.name] = value.reshape(field.shape)
        return out

    def tree_flatten(self) -> tuple[tuple[Any], Layout]:
        return (self.buffer,), self.layout

    @classmethod
    def tree_unflatten(cls, layout: Layout, children: tuple[Any]) -> Packed:
        return cls(children[0], layout)


class PackedBuilder:
    """Buffers of ``defaults``'s layout, built field by field without allocating per field.

    ``reset()`` restores the defaults and returns writable numpy views of every field by name;
    write the entries that differ, then ``take()`` the result.
    """

    def __init__(self, defaults: Packed) -> None:
        self.layout = defaults.layout
        self._defaults = np.asarray(defaults.buffer)
        self._staging = self._defaults.copy()
        self._views = {
            field.name: self._staging[field.offset:field.offset + field.size]
            .view(field.dtype).reshape(field.shape)
            for field in self.layout.fields}

    def reset(self) -> dict[str, np.ndarray]:
        """The staging buffer back at the defaults; its fields as writable views."""
        np.copyto(self._staging, self._defaults)
        return self._views

    def take(self) -> Packed:
        """A ``Packed`` holding a copy of the staging buffer as written since ``reset``."""
        return Packed(self._staging.copy(), self.layout)


@functools.lru_cache(maxsize=256)
def _layout(signature: tuple[tuple[str, np.dtype, tuple[int, ...]], ...]) -> Layout:
    """The layout of fields (name, dtype, shape) laid end to end; checked once per signature."""
    fields, offset = [], 0
    for name, dtype, shape in signature:
        if dtype not in FIELD_DTYPES:
            raise TypeError(f"field {name!r} is {dtype}; packed fields are 32-bit "
                            f"({', '.join(str(d) for d in FIELD_DTYPES)})")
        field = Field(name, str(dtype), tuple(shape), offset)
        fields.append(field)
        offset += field.size
    return Layout(tuple(fields), offset)
