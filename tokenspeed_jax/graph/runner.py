"""Replay a plan: compiled segments and breaks in order, values handed off through donation.

``CompiledPlan.run`` walks the calls of one bucket's plan. Invariants:

* Each call is one executable invocation with a pre-flattened argument list (inputs, then the
  break's metadata, then the call's bound parameter leaves), so replay does no pytree work and
  no tracing: a shape that does not match the bucket is a TypeError, never a compile.
* Each break's metadata is transferred to the device once per run, however many calls use it.
* Donated inputs are consumed (their buffers become the outputs); the caller must not reuse
  arrays it passed as donated plan inputs.
* ``run_eager`` executes the same plan op by op with no compile of the plan (plain JAX): it is
  the reference the compiled replay must match, and the fallback for shapes with no bucket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

from tokenspeed_jax.graph.plan import Break, Call, Plan


def call_stage(call: Call, meta: Mapping[str, Any], values: Mapping[str, Any]) -> tuple:
    """Run one call's function directly on ``values``; outputs always as a tuple."""
    stage = call.stage
    inputs = [values[n] for n in call.inputs]
    if isinstance(stage, Break):
        out = stage.fn(call.params, meta[stage.name], *inputs)
    else:
        out = stage.fn(call.params, *inputs)
    out = out if isinstance(out, tuple) else (out,)
    if len(out) != len(stage.outputs):
        raise ValueError(
            f"{stage.name} returned {len(out)} values for outputs {stage.outputs}"
        )
    return out


def run_eager(plan: Plan, inputs: Mapping[str, Any], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The plan as plain JAX, call by call; also traceable as one whole-forward ``jax.jit``."""
    values = dict(inputs)
    for call in plan.calls:
        values.update(zip(call.outputs, call_stage(call, meta, values)))
    return {n: values[n] for n in plan.outputs}


@dataclasses.dataclass(frozen=True)
class CompiledCall:
    """One call of a plan, bound to its executable and its flattened parameter leaves."""

    name: str
    executable: Callable[..., tuple]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    meta: str | None
    param_leaves: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class CompiledPlan:
    """One bucket's plan with every call bound to a compiled executable."""

    plan: Plan
    label: str
    calls: tuple[CompiledCall, ...]

    def run(self, inputs: Mapping[str, Any], meta: Mapping[str, Any] | None = None
            ) -> dict[str, Any]:
        """Replay the plan; ``meta`` maps each break name to its host-built (numpy) pytree."""
        meta = meta or {}
        missing = [n for n in self.plan.breaks if n not in meta]
        if missing:
            raise ValueError(f"{self.label}: no metadata for breaks {missing}")
        device_meta = {n: jax.tree_util.tree_leaves(jax.device_put(meta[n]))
                       for n in self.plan.breaks}
        values = dict(inputs)
        for call in self.calls:
            args = [values[n] for n in call.inputs]
            if call.meta is not None:
                args += device_meta[call.meta]
            args += call.param_leaves
            outs = call.executable(*args)
            for name, out in zip(call.outputs, outs):
                values[name] = out
        return {n: values[n] for n in self.plan.outputs}
