"""Decode turns: the two slots a decode bucket's successive steps take in turn.

A slot pairs an executable (its own loaded copy with ``alternate_decode_executables``, else the
bucket's only one) with the device buffer that receives its steps' sampled rows. The buffer is
donated at each of the slot's calls and the step writes its rows into it, so a slot's output
lives at one address for good. With a copy per slot, every buffer a copy is handed (caches and
token board donated, the metadata's two-deep cycle, this buffer) then sits where it sat at the
copy's previous call, and the copy's command buffer is never re-recorded. A fresh output for
the sampled rows broke that: it stays alive while the next step is launched, and from batch 8 up
the allocator cycled it through three addresses.

Invariants:

* Consecutive steps of one bucket take its two slots alternately.
* A slot's buffer is donated again only once the tokens it holds reached the host: ``take``
  fetches the step that last ran in the slot if nobody has (the engine's overlap schedule always
  has, one step behind, so there it costs nothing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from tokenspeed_jax.engine.batch import PendingStep
from tokenspeed_jax.engine.sampling_plans import FAST_SAMPLE_WIDTH
from tokenspeed_jax.engine.token_board import device_zeros
from tokenspeed_jax.graph import CompiledPlan

TURNS = 2


def sampled_buffer_spec(rows: int) -> jax.ShapeDtypeStruct:
    """The shape of a decode bucket's sampled-rows buffer: the in-step sampler's output."""
    return jax.ShapeDtypeStruct((rows, FAST_SAMPLE_WIDTH), np.int32)


@dataclasses.dataclass
class DecodeSlot:
    """One turn of a decode bucket: the executable it runs and the buffer its sampled rows are
    written into (replaced by each call's output, which is the same buffer)."""

    plan: CompiledPlan
    sampled: jax.Array
    pending: PendingStep | None = None  # the launched step whose tokens the buffer holds


class DecodeTurns:
    """A decode bucket's slots, taken in turn (module docstring)."""

    def __init__(self, copies: Sequence[CompiledPlan], rows: int):
        spec = sampled_buffer_spec(rows)
        self.slots = tuple(DecodeSlot(copies[i % len(copies)], device_zeros(spec.shape, spec.dtype))
                           for i in range(TURNS))
        self._turn = 0

    def take(self) -> DecodeSlot:
        """The next slot, its buffer free to donate."""
        slot = self.slots[self._turn]
        self._turn = (self._turn + 1) % TURNS
        if slot.pending is not None:
            slot.pending.result()
            slot.pending = None
        return slot
