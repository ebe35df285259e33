"""Plans: a forward written as an ordered list of segments and breaks over named values.

A *segment* is a pure JAX function ``fn(params, *inputs) -> outputs`` compiled ahead of time per
shape bucket. A *break* is a step where the host hands live request metadata (numpy arrays it
built for this run: lengths, page tables, ...) to a kernel ``fn(params, meta, *inputs)``; the
metadata is never captured at trace time, so one executable serves every request mix of a bucket.

A plan is a list of ``Call``s: a stage, the parameters bound to this call (e.g. one layer's
weights) and a renaming of the stage's value names onto the plan's. Invariants:

* Static: the stage list, value names, parameter pytree structure and every shape (fixed by the
  bucket). Live: the plan's input arrays and each break's metadata.
* Calls of one stage whose parameters have the same structure and shapes share one executable,
  so identical layers compile once per bucket.
* A donated value is consumed: the plan rejects (at construction) any later read of a value that
  an earlier call donated and no call rewrote. Donated buffers are reused for outputs in place.
* Outputs of a call overwrite values of the same name; the plan's result is ``outputs``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def _names(values: Sequence[str]) -> tuple[str, ...]:
    names = tuple(values)
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate value names in {names}")
    return names


@dataclasses.dataclass(frozen=True, eq=False)
class Segment:
    """A pure JAX function ``fn(params, *inputs)`` returning one array or a tuple of them."""

    name: str
    fn: Callable[..., Any]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    donate: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", _names(self.inputs))
        object.__setattr__(self, "outputs", _names(self.outputs))
        object.__setattr__(self, "donate", _names(self.donate))
        unknown = set(self.donate) - set(self.inputs)
        if unknown:
            raise ValueError(f"{self.name}: donated {sorted(unknown)} are not inputs {self.inputs}")
        if not self.outputs:
            raise ValueError(f"{self.name}: a stage needs at least one output")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Break(Segment):
    """A kernel ``fn(params, meta, *inputs)`` that reads host-built live metadata ``meta``.

    ``meta`` is the pytree the caller passes for this break's name when it runs the plan. Every
    call of the break within one run sees the same metadata (it is transferred once per run).
    """


@dataclasses.dataclass(frozen=True)
class Call:
    """One step of a plan: ``stage`` with bound ``params`` and stage-name -> plan-name ``rename``."""

    stage: Segment
    params: Any = ()
    rename: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def value(self, name: str) -> str:
        return self.rename.get(name, name)

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(self.value(n) for n in self.stage.inputs)

    @property
    def outputs(self) -> tuple[str, ...]:
        return tuple(self.value(n) for n in self.stage.outputs)

    @property
    def donated(self) -> tuple[str, ...]:
        return tuple(self.value(n) for n in self.stage.donate)


@dataclasses.dataclass(frozen=True)
class Plan:
    """An ordered list of calls from named ``inputs`` to named ``outputs``."""

    calls: tuple[Call, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "calls", tuple(self.calls))
        object.__setattr__(self, "inputs", _names(self.inputs))
        object.__setattr__(self, "outputs", _names(self.outputs))
        live = set(self.inputs)
        for index, call in enumerate(self.calls):
            missing = [n for n in call.inputs if n not in live]
            if missing:
                raise ValueError(
                    f"call {index} ({call.stage.name}) reads {missing}, which are not plan inputs, "
                    f"earlier outputs, or were donated by an earlier call"
                )
            live -= set(call.donated)
            live |= set(call.outputs)
        missing = [n for n in self.outputs if n not in live]
        if missing:
            raise ValueError(f"plan outputs {missing} are never produced (or were donated)")

    @property
    def breaks(self) -> tuple[str, ...]:
        """Names of the breaks this plan calls, in first-use order."""
        names = [c.stage.name for c in self.calls if isinstance(c.stage, Break)]
        return tuple(dict.fromkeys(names))
