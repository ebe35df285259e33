"""Programs of one Pallas GPU call that finish a shared piece of work: the last to arrive does it.

A group of programs each store a share of a result, then count themselves in on the group's
arrival counter; the program that sees ``count - 1`` arrivals before it is the group's last and
reads every share back to finish the work (routing's choice, the KDA step's output norm).

Invariants:

* The counters are ``fresh_counters``' zeros, made anew for each call and aliased input to
  output, so every call starts at zero; a group's counter ends the call at the group's size.
* ``count_in`` orders a program's stores before its arrival: a barrier of the program's
  threads, then an acquire-release atomic add at GPU scope (Triton's default for
  ``plgpu.atomic_add``). The last arriver must read the shares with ``shared_load`` (volatile:
  from L2, not from its SM's L1, which other SMs' stores never update).
* Interpreted (the CPU), programs run one at a time: no barrier is needed and plain loads see
  every store.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu


def fresh_counters(groups: int) -> jax.Array:
    """A call's arrival counters, all zero: the operand to alias to the kernel's counter output."""
    return jnp.zeros((groups,), jnp.int32)


def count_in(arrivals_ref, group, *, compiled: bool) -> jax.Array:
    """Count this program in on ``arrivals_ref[group]`` after its stores; how many of the
    group had arrived before it (int32)."""
    if compiled:
        plgpu.debug_barrier()
    return plgpu.atomic_add(arrivals_ref, group, jnp.int32(1))


def shared_load(*, compiled: bool) -> Callable:
    """The load that sees other programs' stores: ``load(ref)`` -> the ref's value."""
    if compiled:
        return functools.partial(plgpu.load, volatile=True)
    return lambda ref: ref[...]
