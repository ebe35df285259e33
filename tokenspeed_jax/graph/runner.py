"""Replay a plan: compiled segments and breaks in order, values handed off through donation.

``CompiledPlan.run`` walks the calls of one bucket's plan. Invariants:

* Each call is one executable invocation with a pre-flattened argument list (inputs, then the
  break's metadata, then the call's bound parameter leaves), so replay does no pytree work and
  no tracing: a shape that does not match the bucket is an error, never a compile. Executables
  are invoked through the loaded executable directly, their outputs wrapped by the executable's
  own result handlers (about half the host cost of ``Compiled.__call__`` at 20 arguments on the
  CPU), sharded ones included: the handlers assemble a sharded output in C++.
* A sharded plan (``meta_sharding`` set) places its metadata with that (replicated) sharding and
  moves any input not already on its compiled sharding there (a host array, or a single-device
  array such as freshly transferred token ids), so every executable sees the shardings it was
  compiled for.
* ``blocking`` plans wait for each call's outputs before the next call. The compiler sets it for
  sharded plans on the CPU, whose in-process collectives deadlock (a rendezvous that never
  completes) when several multi-device executions are in flight at once; on accelerators calls
  stay asynchronous.
* Each break's metadata is transferred to the device once per run, however many calls use it,
  all breaks' metadata in one runtime call (``graph/transfer.py``; pack it into few arrays:
  each array is one host->device copy).
* ``run_positional`` replays a one-call plan on a list of inputs in the call's order and
  returns its outputs in order: what a step that carries its outputs into the next run (a
  decode step's caches) uses, with no name lookups or dicts on the way.
* Donated inputs are consumed (their buffers become the outputs); the caller must not reuse
  arrays it passed as donated plan inputs.
* ``copies`` (``PlanCompiler.add(copies=n)``) are the same plan bound to further loaded
  copies of its executables: same programs and results, each with its own runtime state (on a
  GPU, its command buffers; see ``graph/compile.py``).
* ``run_eager`` executes the same plan op by op with no compile of the plan (plain JAX): it is
  the reference the compiled replay must match, and the fallback for shapes with no bucket.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from tokenspeed_jax.graph.plan import Break, Call, Plan
from tokenspeed_jax.graph.transfer import default_sharding, put_host_leaves


def call_stage(call: Call, meta: Mapping[str, Any], values: Mapping[str, Any],
               params: Any) -> tuple:
    """Run one call's function directly on ``values``; outputs always as a tuple."""
    stage = call.stage
    inputs = [values[n] for n in call.inputs]
    if isinstance(stage, Break):
        out = stage.fn(params, meta[stage.name], *inputs)
    else:
        out = stage.fn(params, *inputs)
    out = out if isinstance(out, tuple) else (out,)
    if len(out) != len(stage.outputs):
        raise ValueError(
            f"{stage.name} returned {len(out)} values for outputs {stage.outputs}"
        )
    return out


def run_eager(
    plan: Plan,
    inputs: Mapping[str, Any],
    meta: Mapping[str, Any],
    params: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """The plan as plain JAX, call by call.

    ``params`` (one entry per call) replaces the calls' bound parameters: pass them as
    arguments to trace the whole plan as one ``jax.jit`` without baking weights in as constants
    (see ``whole_forward``).
    """
    params = [c.params for c in plan.calls] if params is None else params
    if len(params) != len(plan.calls):
        raise ValueError(f"{len(params)} parameter entries for {len(plan.calls)} calls")
    values = dict(inputs)
    for call, call_params in zip(plan.calls, params):
        values.update(zip(call.outputs, call_stage(call, meta, values, call_params)))
    return {n: values[n] for n in plan.outputs}


def whole_forward(plan: Plan, donate: Sequence[str] = ()) -> tuple[Callable, list[Any]]:
    """The whole plan as one ``jax.jit``: ``(fn, params)``, call ``fn(params, inputs, meta)``.

    The baseline a segmented plan is measured against: one executable per shape, compiled on
    first call, with the plan inputs named in ``donate`` donated.
    """

    def forward(params: list[Any], donated: dict, kept: dict, meta: dict) -> dict[str, Any]:
        return run_eager(plan, {**donated, **kept}, meta, params)

    jitted = jax.jit(forward, donate_argnums=(1,))

    def fn(params: list[Any], inputs: Mapping[str, Any], meta: Mapping[str, Any]):
        donated = {n: v for n, v in inputs.items() if n in donate}
        kept = {n: v for n, v in inputs.items() if n not in donate}
        return jitted(params, donated, kept, dict(meta))

    return fn, [c.params for c in plan.calls]


@dataclasses.dataclass(frozen=True)
class CompiledCall:
    """One call of a plan, bound to its executable and its flattened parameter leaves."""

    name: str
    executable: Callable[..., tuple]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    meta: str | None
    param_leaves: tuple[Any, ...]
    direct: tuple[Any, tuple[Any, ...]] | None = None  # (loaded executable, result handlers)


@dataclasses.dataclass(frozen=True)
class CompiledPlan:
    """One bucket's plan with every call bound to a compiled executable."""

    plan: Plan
    label: str
    calls: tuple[CompiledCall, ...]
    input_specs: Mapping[str, Any]  # name -> ShapeDtypeStruct of each plan input
    meta_specs: Mapping[str, Any]  # break name -> ShapeDtypeStruct pytree
    meta_sharding: Any = None  # sharded plans: where metadata (and unplaced inputs) go
    blocking: bool = False  # wait for each call (sharded plans on the CPU; module docstring)
    copies: tuple[CompiledPlan, ...] = ()  # the same plan on further loaded executables

    def _placed(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        placed = dict(inputs)
        for name, spec in self.input_specs.items():
            value = placed[name]
            if getattr(value, "sharding", None) != spec.sharding:
                placed[name] = jax.device_put(value, spec.sharding)
        return placed

    def _check(self, what: str, value: Any, spec: Any) -> None:
        if value.shape != spec.shape or value.dtype != spec.dtype:
            raise TypeError(
                f"{self.label}: {what} is {value.dtype}{list(value.shape)}, the bucket was "
                f"compiled for {spec.dtype}{list(spec.shape)}"
            )

    @functools.cached_property
    def _meta_leaf_specs(self) -> tuple[tuple[str, tuple[Any, ...]], ...]:
        """(break name, its metadata leaf specs) per break, flattened once."""
        return tuple((name, tuple(jax.tree_util.tree_leaves(self.meta_specs[name])))
                     for name in self.plan.breaks)

    @functools.cached_property
    def _meta_target(self) -> Any:
        """Where metadata goes: the plan's replicated sharding, else the default device."""
        return self.meta_sharding if self.meta_sharding is not None else default_sharding()

    def _device_meta(self, meta: Mapping[str, Any] | None) -> dict[str, list[Any]]:
        """Each break's metadata leaves, checked against the bucket and transferred in one call."""
        meta = meta or {}
        missing = [n for n in self.plan.breaks if n not in meta]
        if missing:
            raise ValueError(f"{self.label}: no metadata for breaks {missing}")
        host_leaves, counts = [], []
        for name, specs in self._meta_leaf_specs:
            leaves = jax.tree_util.tree_leaves(meta[name])
            if len(leaves) != len(specs):
                raise TypeError(f"{self.label}: metadata of {name!r} has {len(leaves)} arrays, "
                                f"expected {len(specs)}")
            for leaf, spec in zip(leaves, specs):
                self._check(f"metadata of {name!r}", leaf, spec)
            host_leaves += leaves
            counts.append((name, len(leaves)))
        placed = put_host_leaves(host_leaves, self._meta_target)
        device_meta, start = {}, 0
        for name, count in counts:
            device_meta[name] = placed[start:start + count]
            start += count
        return device_meta

    def _invoke(self, call: CompiledCall, args: list[Any]) -> Sequence[Any]:
        if call.direct is not None:
            raw, handlers = call.direct
            outs = raw.execute_sharded(args).consume_with_handlers(handlers)
        else:
            outs = call.executable(*args)
        if self.blocking:
            jax.block_until_ready(outs)
        return outs

    def run(self, inputs: Mapping[str, Any], meta: Mapping[str, Any] | None = None
            ) -> dict[str, Any]:
        """Replay the plan; ``meta`` maps each break name to its host-built (numpy) pytree."""
        for name, spec in self.input_specs.items():
            self._check(f"input {name!r}", inputs[name], spec)
        if self.meta_sharding is not None:
            inputs = self._placed(inputs)
        device_meta = self._device_meta(meta)
        values = dict(inputs)
        for call in self.calls:
            args = [values[n] for n in call.inputs]
            if call.meta is not None:
                args += device_meta[call.meta]
            args += call.param_leaves
            values.update(zip(call.outputs, self._invoke(call, args)))
        return {n: values[n] for n in self.plan.outputs}

    def run_positional(self, inputs: Sequence[Any], meta: Mapping[str, Any] | None = None
                       ) -> list[Any]:
        """Replay a one-call plan on its call's inputs in the call's order; its outputs in the
        call's order. For a step that carries values from run to run (a decode step's caches):
        no names, no dicts. Inputs are meant to be an earlier run's outputs, which have the
        bucket's shapes, so they are not checked here (XLA still checks every buffer's size);
        metadata is."""
        if len(self.calls) != 1:
            raise ValueError(f"{self.label}: positional replay needs a one-call plan, not "
                             f"{len(self.calls)} calls")
        (call,) = self.calls
        if len(inputs) != len(call.inputs):
            raise ValueError(f"{self.label}: {len(inputs)} inputs for {call.inputs}")
        args = list(inputs)
        if self.meta_sharding is not None:
            placed = self._placed(dict(zip(call.inputs, args)))
            args = [placed[n] for n in call.inputs]
        if call.meta is not None:
            args += self._device_meta(meta)[call.meta]
        args += call.param_leaves
        return list(self._invoke(call, args))
