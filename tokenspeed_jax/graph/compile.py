"""Ahead-of-time compile of every (segment, bucket) a plan can reach, before serving.

``PlanCompiler.add(label, plan, input_specs, meta_specs)`` registers one bucket's plan with
abstract inputs (``jax.ShapeDtypeStruct``: no device memory is allocated for dummies);
``compile_all()`` traces every call, deduplicates identical executables, compiles them with a
progress bar and returns the compiled plans and a per-bucket timing summary. Invariants:

* An executable is keyed by (stage, parameter/metadata tree structure, every argument's shape and
  dtype): calls of identical layers in one bucket, or of a stage shared by several plans, compile
  once.
* Any failure while tracing, lowering or compiling is fatal: ``CompileError`` names the segment
  and the bucket label; nothing degrades silently.
* Output shapes come from tracing, so a plan's later calls are compiled for exactly what earlier
  calls produce.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import jax
from tqdm.auto import tqdm

from tokenspeed_jax.graph import guard
from tokenspeed_jax.graph.plan import Break, Call, Plan
from tokenspeed_jax.graph.runner import CompiledCall, CompiledPlan


class CompileError(RuntimeError):
    """A segment failed to compile at start-up; the message names the segment and the bucket."""


def abstract(tree: Any) -> Any:
    """The ``ShapeDtypeStruct`` pytree of ``tree`` (arrays or specs)."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _signature(leaves: list[Any]) -> tuple:
    return tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


def _flat_function(call: Call, num_inputs: int, meta_tree: Any, num_meta: int, param_tree: Any):
    """fn(*inputs, *meta_leaves, *param_leaves) -> tuple of outputs, for one stage."""
    stage = call.stage

    def flat(*args: Any) -> tuple:
        inputs = args[:num_inputs]
        meta = jax.tree_util.tree_unflatten(meta_tree, args[num_inputs:num_inputs + num_meta])
        params = jax.tree_util.tree_unflatten(param_tree, args[num_inputs + num_meta:])
        if isinstance(stage, Break):
            out = stage.fn(params, meta, *inputs)
        else:
            out = stage.fn(params, *inputs)
        out = out if isinstance(out, tuple) else (out,)
        if len(out) != len(stage.outputs):
            raise ValueError(f"{stage.name} returned {len(out)} values for {stage.outputs}")
        return out

    flat.__name__ = stage.name
    return flat


@dataclasses.dataclass
class _Job:
    key: tuple
    name: str
    label: str
    traced: Any
    executable: Any = None
    seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class CompileSummary:
    """Start-up compile statistics: executables built, seconds per bucket label, total."""

    num_executables: int
    num_calls: int
    seconds_per_label: dict[str, float]
    total_seconds: float

    def table(self) -> str:
        rows = [f"{'bucket':<32} {'seconds':>8}"]
        rows += [f"{label:<32} {sec:8.2f}" for label, sec in self.seconds_per_label.items()]
        rows.append(f"{'total':<32} {self.total_seconds:8.2f}  "
                    f"({self.num_executables} executables for {self.num_calls} calls)")
        return "\n".join(rows)


class PlanCompiler:
    """Collects bucket plans, then compiles all of them at once (see the module docstring)."""

    def __init__(self, *, progress: bool = True, description: str = "compiling") -> None:
        self.progress = progress
        self.description = description
        self._jobs: dict[tuple, _Job] = {}
        self._plans: list[tuple[str, Plan, list[tuple[_Job, Call, str | None]]]] = []

    def add(
        self,
        label: str,
        plan: Plan,
        input_specs: Mapping[str, jax.ShapeDtypeStruct],
        meta_specs: Mapping[str, Any] | None = None,
    ) -> None:
        """Trace ``plan`` for one bucket; ``label`` names the bucket in progress and errors."""
        if any(existing == label for existing, _, _ in self._plans):
            raise ValueError(f"bucket label {label!r} was already added")
        meta_specs = {n: abstract(m) for n, m in (meta_specs or {}).items()}
        missing = [n for n in plan.breaks if n not in meta_specs]
        if missing:
            raise ValueError(f"{label}: no metadata specs for breaks {missing}")
        values = {n: abstract(s) for n, s in input_specs.items()}
        unknown = set(plan.inputs) - set(values)
        if unknown:
            raise ValueError(f"{label}: no input specs for {sorted(unknown)}")
        bound = []
        for call in plan.calls:
            job = self._trace(label, call, values, meta_specs)
            values.update(zip(call.outputs, job.traced.out_info))
            bound.append((job, call, call.stage.name if isinstance(call.stage, Break) else None))
        self._plans.append((label, plan, bound))

    def _trace(self, label: str, call: Call, values: dict, meta_specs: dict) -> _Job:
        stage = call.stage
        inputs = [values[n] for n in call.inputs]
        meta_leaves, meta_tree = jax.tree_util.tree_flatten(
            meta_specs[stage.name] if isinstance(stage, Break) else ())
        param_leaves, param_tree = jax.tree_util.tree_flatten(call.params)
        args = [*inputs, *meta_leaves, *abstract(param_leaves)]
        key = (stage, meta_tree, param_tree, _signature(args))
        if key in self._jobs:
            return self._jobs[key]
        donate = tuple(i for i, n in enumerate(stage.inputs) if n in stage.donate)
        fn = _flat_function(call, len(inputs), meta_tree, len(meta_leaves), param_tree)
        try:
            with guard.startup():
                traced = jax.jit(fn, donate_argnums=donate).trace(*args)
        except Exception as error:
            raise CompileError(
                f"tracing segment {stage.name!r} for bucket {label} failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        job = _Job(key=key, name=stage.name, label=label, traced=traced)
        self._jobs[key] = job
        return job

    def compile_all(self) -> tuple[dict[str, CompiledPlan], CompileSummary]:
        """Compile every registered executable; fatal on the first failure."""
        start = time.perf_counter()
        pending = [job for job in self._jobs.values() if job.executable is None]
        bar = tqdm(pending, desc=self.description, unit="exe", disable=not self.progress)
        for job in bar:
            bar.set_postfix_str(f"{job.name} @ {job.label}", refresh=False)
            t0 = time.perf_counter()
            try:
                with guard.startup():
                    job.executable = job.traced.lower().compile()
            except Exception as error:
                raise CompileError(
                    f"compiling segment {job.name!r} for bucket {job.label} failed: "
                    f"{type(error).__name__}: {error}"
                ) from error
            job.seconds = time.perf_counter() - t0
        per_label: dict[str, float] = {label: 0.0 for label, _, _ in self._plans}
        for job in pending:
            per_label[job.label] = per_label.get(job.label, 0.0) + job.seconds
        compiled = {}
        for label, plan, bound in self._plans:
            calls = tuple(
                CompiledCall(
                    name=call.stage.name,
                    executable=job.executable,
                    inputs=call.inputs,
                    outputs=call.outputs,
                    meta=meta,
                    param_leaves=tuple(jax.tree_util.tree_leaves(call.params)),
                )
                for job, call, meta in bound
            )
            compiled[label] = CompiledPlan(plan=plan, label=label, calls=calls)
        summary = CompileSummary(
            num_executables=len(self._jobs),
            num_calls=sum(len(bound) for _, _, bound in self._plans),
            seconds_per_label=per_label,
            total_seconds=time.perf_counter() - start,
        )
        return compiled, summary
