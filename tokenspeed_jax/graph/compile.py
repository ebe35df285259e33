"""Ahead-of-time compile of every (segment, bucket) a plan can reach, before serving.

``PlanCompiler.add(label, plan, input_specs, meta_specs)`` registers one bucket's plan with
abstract inputs (``jax.ShapeDtypeStruct``: no device memory is allocated for dummies);
``compile_all()`` traces every call, deduplicates identical executables, compiles them with a
progress bar and returns the compiled plans and a per-bucket timing summary; deferred buckets
(below) can be compiled later. With an
``ExecutableCache`` each executable is first looked up on disk (``graph/cache.py``): a hit is
loaded without tracing, lowering or compiling; a miss is compiled and written back. Invariants:

* An executable is keyed by (stage, parameter/metadata tree structure, every argument's shape and
  dtype): calls of identical layers in one bucket, or of a stage shared by several plans, compile
  once.
* Any failure while tracing, lowering or compiling is fatal: ``CompileError`` names the segment
  and the bucket label; nothing degrades silently.
* Output shapes come from tracing (or from the cache entry, which recorded them when it was
  traced), so a plan's later calls are compiled for exactly what earlier calls produce.
* A cache entry that cannot be used (corrupt, forged, incompatible) is logged, recompiled and
  replaced, a forged one without being deserialized; the summary counts executables loaded and
  compiled, and the seconds each took.
* Cache hits load on ``LOAD_THREADS`` threads; misses compile on ``threads`` threads (one unless
  told: see ``PlanCompiler``). Both run outside the GIL. Jobs are traced by ``add`` on the
  calling thread (a cache entry that cannot be loaded: on its compile's thread), so what is
  compiled does not depend on the thread count; a failure on any thread cancels the compiles not
  yet started and is raised as the same ``CompileError``. Load seconds are the wall time of the
  whole load; a bucket's compile seconds sum its executables' own compile times (threads
  overlap), and ``compile_wall_seconds`` is the wall time of them all.
* Every argument is kept (``keep_unused``), so an executable, sharded or not, can be called
  directly with the flat argument list (``CompiledCall.direct``), skipping
  ``Compiled.__call__``'s pytree and signature handling, its outputs wrapped by the
  executable's own result handlers; XLA still checks every buffer's size at each call.
* **Deferred buckets** (``add(..., deferred=True)``): ``compile_all`` loads a deferred bucket
  only when every one of its executables is in the cache (only those its ``load_deferred``
  names, when given), without tracing it; ``compile_deferred(on_ready)`` loads the other cached
  ones first, then traces and compiles the rest, on the calling thread (a server's background
  thread), and hands each bucket's compiled plan to ``on_ready`` once all its executables are
  there. Its compiles are
  start-up work for the compile guard (``guard.startup`` is per thread) and a failure is the
  same fatal ``CompileError`` as in ``compile_all``, raised to its caller. A compiler serves
  one ``compile_deferred`` call at a time; after ``compile_all``, nothing else touches it.
* ``compiler_options`` (XLA options, as ``jax.stages.Lowered.compile`` takes them) apply to
  every executable of the compiler and are part of its cache key; XLA rejecting one is a
  ``CompileError`` like any other. ``autotune_cache_dir`` (GPU) is where XLA keeps the kernel
  choices its autotuner measured, one file per fused computation, read back by any later compile
  of the same computation on the same device kind; it changes how long a compile takes, not what
  it may produce, so it is not part of the cache key.
* ``add(..., copies=n)`` asks for n loaded copies of the bucket's executables, loaded again
  from the cache entry or from the fresh compile's serialized form (no second compile; a CPU
  executable that was itself deserialized does not serialize into a loadable one, so copies
  never come from a copy), bound to the same parameter arrays: the same programs and outputs,
  each copy with its own runtime state, in ``CompiledPlan.copies``. On a GPU that state
  includes the command buffers (CUDA graphs) XLA records with the addresses of an executable's
  buffers; when any address differs from the last run's, XLA re-records the graph before
  launching it, at a cost in host time, and the launch then appears to wait for the previous
  run. A step that alternates two copies shows each copy fixed addresses when its other
  buffers are donated or come from a two-deep cycle (as metadata sent while the previous
  step's is still in use did, measured); an output held past the next launch did not, and is
  better written into a donated buffer of each copy's own (``engine/decode_turns.py``).
* With a ``mesh`` (tensor parallelism, ``tokenspeed_jax/parallel.py``) every executable is
  compiled with explicit input and output shardings: an input spec or parameter array keeps its
  own multi-device sharding, a plan value gets the sharding ``add(shardings=...)`` names for it,
  and everything else (unnamed values, break metadata) is replicated over the mesh. So the
  sharding each call produces is the one the next call was compiled for, and the cache key
  covers the shardings. Without a mesh, programs are compiled exactly as on one device.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

import jax
from jax.experimental import serialize_executable
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding
from tqdm.auto import tqdm

from tokenspeed_jax.graph import guard
from tokenspeed_jax.graph.cache import (
    CacheEntryError,
    Entry,
    ExecutableCache,
    ExecutableKey,
    executable_key,
    function_identity,
)
from tokenspeed_jax.graph.plan import Break, Call, Plan
from tokenspeed_jax.graph.runner import CompiledCall, CompiledPlan

# Cache hits are deserialized on several threads: the load runs outside the GIL, so threads
# shorten a warm start.
LOAD_THREADS = min(8, os.cpu_count() or 1)
# XLA's option naming the directory of its per-fusion autotune results (GPU).
AUTOTUNE_CACHE_OPTION = "xla_gpu_per_fusion_autotune_cache_dir"


class CompileError(RuntimeError):
    """A segment failed to compile at start-up; the message names the segment and the bucket."""


def multi_device_sharding(x: Any) -> Sharding | None:
    """``x``'s sharding when it spans several devices, else None (single-device: unconstrained)."""
    sharding = getattr(x, "sharding", None)
    return sharding if sharding is not None and len(sharding.device_set) > 1 else None


def abstract(tree: Any) -> Any:
    """The ``ShapeDtypeStruct`` pytree of ``tree`` (arrays or specs); a sharding over several
    devices is kept, so abstract inputs of a sharded program carry it."""
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=multi_device_sharding(x)),
        tree)


def _signature(leaves: list[Any]) -> tuple:
    return tuple((tuple(x.shape), str(x.dtype), multi_device_sharding(x)) for x in leaves)


def _with_sharding(spec: Any, sharding: Sharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding,
                                weak_type=getattr(spec, "weak_type", False))


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


def direct_call(compiled: Any, num_args: int) -> tuple[Any, tuple[Any, ...]] | None:
    """The loaded executable behind ``compiled`` and its output result handlers, when it can
    be called directly with the flat argument list (every argument kept, no hoisted
    constants), else None.

    The handlers are the ones ``Compiled.__call__`` itself hands its results to (jax's
    ``ExecuteReplicated.out_handler``, a private attribute): they wrap each output buffer, or a
    sharded output's per-device buffers, as one ``jax.Array`` in C++. Taking the results apart
    in Python instead costs more host time per call, and for sharded outputs
    reassembling the shards cost more than ``Compiled.__call__`` saves. A jax that moves the
    attribute fails here, at start-up, by name."""
    raw = compiled.runtime_executable()
    if len(raw.get_parameter_layouts()) != num_args:
        return None
    try:
        handlers = tuple(compiled._executable.unsafe_call.out_handler.handlers)
    except AttributeError as e:
        raise RuntimeError(
            f"jax {jax.__version__}: a compiled executable no longer exposes its result "
            f"handlers where tokenspeed_jax reads them ({e}); graph/compile.py's direct_call "
            "needs updating for this jax") from e
    return raw, handlers


@dataclasses.dataclass
class _Job:
    key: tuple
    name: str
    label: str
    fn: Any
    args: list[Any]
    donate: tuple[int, ...]
    out_shardings: tuple[Sharding, ...] | None = None  # None: no mesh, single-device program
    cache_key: ExecutableKey | None = None
    entry: Entry | None = None  # a cache hit: load instead of compiling
    traced: Any = None
    out_info: tuple[Any, ...] = ()
    executable: Any = None
    direct: tuple[Any, tuple[Any, ...]] | None = None  # `direct_call`'s pair
    seconds: float = 0.0
    loaded: bool = False
    spares_wanted: int = 0  # further loaded copies (``add(copies=...)``)
    spares: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)  # (exe, direct)

    @property
    def num_args(self) -> int:
        return len(self.args)

    def trace(self) -> None:
        """Trace the job's function (fatal ``CompileError`` on failure); sets ``out_info``."""
        shardings = {}
        if self.out_shardings is not None:
            shardings = {"in_shardings": tuple(a.sharding for a in self.args),
                         "out_shardings": self.out_shardings}
        try:
            with guard.startup():
                self.traced = jax.jit(self.fn, donate_argnums=self.donate, keep_unused=True,
                                      **shardings).trace(*self.args)
        except Exception as error:
            raise CompileError(
                f"tracing segment {self.name!r} for bucket {self.label} failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        self.out_info = tuple(self.traced.out_info)


@dataclasses.dataclass
class _Bucket:
    """One added plan: its abstract inputs and, once bound, each call's job."""

    label: str
    plan: Plan
    values: dict[str, Any]  # input specs by name
    meta_specs: dict[str, Any]
    shardings: dict[str, Sharding]
    copies: int
    deferred: bool
    bound: list[tuple[_Job, Call, str | None]] | None = None  # None: not traced yet
    missed: bool = False  # a cache lookup found it incomplete: it is traced when compiled
    ready: bool = False  # its compiled plan was handed out

    @property
    def input_specs(self) -> dict[str, Any]:
        return {n: self.values[n] for n in self.plan.inputs if n in self.values}


@dataclasses.dataclass
class _Pass:
    """What one ``compile_all`` or ``compile_deferred`` call loaded and compiled."""

    jobs: list[_Job] = dataclasses.field(default_factory=list)
    load_seconds: float = 0.0
    compile_wall_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class CompileSummary:
    """Start-up compile statistics: executables built, seconds per bucket label, total; how
    many executables were loaded from the cache and how many compiled, and the seconds each
    took (tracing included in compile seconds); how many are called directly (`direct_call`),
    the others through ``Compiled.__call__``; the deferred buckets still to compile."""

    num_executables: int
    num_calls: int
    seconds_per_label: dict[str, float]
    total_seconds: float
    num_loaded: int = 0
    num_compiled: int = 0
    load_seconds: float = 0.0
    compile_seconds: float = 0.0
    num_direct: int = 0
    compile_wall_seconds: float = 0.0
    threads: int = 1
    num_deferred: int = 0

    def describe(self) -> str:
        """One line: loaded vs compiled executables and their seconds."""
        return (f"{self.num_loaded} executables loaded from cache in {self.load_seconds:.2f}s, "
                f"{self.num_compiled} compiled in {self.compile_wall_seconds:.2f}s on "
                f"{self.threads} thread{'s' if self.threads > 1 else ''} "
                f"({self.compile_seconds:.2f}s of compiling)")

    def merged(self, other: CompileSummary) -> CompileSummary:
        """This summary and ``other``'s (another compiler's pass) as one: counts and seconds
        added, the per-label seconds of both, the larger thread count."""
        values = {}
        for field in dataclasses.fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if field.name == "threads":
                values[field.name] = max(mine, theirs)
            elif isinstance(mine, dict):
                values[field.name] = {**mine, **theirs}
            else:
                values[field.name] = mine + theirs
        return CompileSummary(**values)

    def table(self) -> str:
        rows = [f"{'bucket':<32} {'seconds':>8}"]
        rows += [f"{label:<32} {sec:8.2f}" for label, sec in self.seconds_per_label.items()]
        rows.append(f"{'total':<32} {self.total_seconds:8.2f}  "
                    f"({self.num_executables} executables for {self.num_calls} calls)")
        rows.append(self.describe())
        if self.num_deferred:
            rows.append(f"{self.num_deferred} deferred buckets left to compile")
        return "\n".join(rows)


class PlanCompiler:
    """Collects bucket plans, then compiles all of them at once (see the module docstring)."""

    def __init__(
        self,
        *,
        progress: bool = True,
        description: str = "compiling",
        cache: ExecutableCache | None = None,
        fingerprint: str | None = None,
        mesh: Mesh | None = None,
        compiler_options: Mapping[str, str | bool] | None = None,
        threads: int = 1,
        autotune_cache_dir: str | None = None,
    ) -> None:
        """``cache``: look executables up there and store new ones. ``fingerprint``: a stable
        description of everything the stage functions read besides their arguments (needed to
        cache bound methods and closures; see ``graph/cache.py``). ``mesh``: compile sharded
        programs over it. ``compiler_options``: XLA options for every executable (module
        docstring). ``threads``: executables compiled at once. One by default: on a GPU,
        compiles at once disturb XLA's autotuner timing kernels on the device, which then
        picks slower ones; on a 2-core CPU they did not shorten the test suite. ``autotune_cache_dir``: XLA's
        autotune results are kept there (module docstring)."""
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self.mesh = mesh
        self.compiler_options = dict(compiler_options or {})
        self._xla_options = dict(self.compiler_options)
        if autotune_cache_dir is not None:
            self._xla_options[AUTOTUNE_CACHE_OPTION] = autotune_cache_dir
        self._replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())
        self._value_shardings: dict[str, Sharding] = {}
        # XLA:CPU's in-process collectives deadlock with several executions in flight.
        self._blocking = mesh is not None and mesh.devices.flat[0].platform == "cpu"
        self.progress = progress
        self.description = description
        self.cache = cache
        self.fingerprint = fingerprint
        self._jobs: dict[tuple, _Job] = {}
        self._buckets: dict[str, _Bucket] = {}
        self._deferred_lock = threading.Lock()

    def add(
        self,
        label: str,
        plan: Plan,
        input_specs: Mapping[str, jax.ShapeDtypeStruct],
        meta_specs: Mapping[str, Any] | None = None,
        shardings: Mapping[str, Sharding] | None = None,
        copies: int = 1,
        deferred: bool = False,
    ) -> None:
        """Register ``plan`` for one bucket and trace it (a deferred bucket: see the module
        docstring); ``label`` names the bucket in progress and errors. ``shardings``: plan value
        name -> sharding of that value wherever a call outputs it (only with a mesh; unnamed
        values are replicated). ``copies``: loaded copies of the bucket's executables (module
        docstring)."""
        if copies < 1:
            raise ValueError(f"{label}: copies={copies} must be >= 1")
        if label in self._buckets:
            raise ValueError(f"bucket label {label!r} was already added")
        if shardings and self.mesh is None:
            raise ValueError(f"{label}: value shardings need a PlanCompiler mesh")
        meta_specs = {n: self._placed(abstract(m)) for n, m in (meta_specs or {}).items()}
        missing = [n for n in plan.breaks if n not in meta_specs]
        if missing:
            raise ValueError(f"{label}: no metadata specs for breaks {missing}")
        values = {n: self._placed(abstract(s)) for n, s in input_specs.items()}
        unknown = set(plan.inputs) - set(values)
        if unknown:
            raise ValueError(f"{label}: no input specs for {sorted(unknown)}")
        bucket = _Bucket(label, plan, values, meta_specs, dict(shardings or {}), copies, deferred)
        self._buckets[label] = bucket
        if not deferred:
            self._bind(bucket)

    def _bind(self, bucket: _Bucket, *, hits_only: bool = False) -> bool:
        """Give each call of ``bucket`` its job, tracing those that miss the cache; with
        ``hits_only``, stop at the first miss instead (False: the bucket stays unbound)."""
        self._value_shardings = bucket.shardings
        values = dict(bucket.values)
        bound = []
        for call in bucket.plan.calls:
            job = self._trace(bucket.label, call, values, bucket.meta_specs, hits_only=hits_only)
            if job is None:
                bucket.missed = True
                return False
            values.update(zip(call.outputs, job.out_info))
            bound.append((job, call, call.stage.name if isinstance(call.stage, Break) else None))
        for job, _, _ in bound:
            job.spares_wanted = max(job.spares_wanted, bucket.copies - 1)
        bucket.bound = bound
        return True

    def _placed(self, tree: Any) -> Any:
        """With a mesh: ``tree``'s specs, those without a multi-device sharding replicated."""
        if self.mesh is None:
            return tree
        return jax.tree_util.tree_map(
            lambda s: s if s.sharding is not None else _with_sharding(s, self._replicated), tree)

    def _trace(self, label: str, call: Call, values: dict, meta_specs: dict, *,
               hits_only: bool = False) -> _Job | None:
        stage = call.stage
        inputs = [values[n] for n in call.inputs]
        meta_leaves, meta_tree = jax.tree_util.tree_flatten(
            meta_specs[stage.name] if isinstance(stage, Break) else ())
        param_leaves, param_tree = jax.tree_util.tree_flatten(call.params)
        args = [*inputs, *meta_leaves, *self._placed(abstract(param_leaves))]
        out_shardings = None
        if self.mesh is not None:
            out_shardings = tuple(self._value_shardings.get(n, self._replicated)
                                  for n in call.outputs)
        key = (stage, meta_tree, param_tree, _signature(args), out_shardings)
        if key in self._jobs:
            return self._jobs[key]
        donate = tuple(i for i, n in enumerate(stage.inputs) if n in stage.donate)
        fn = _flat_function(call, len(inputs), meta_tree, len(meta_leaves), param_tree)
        job = _Job(key=key, name=stage.name, label=label, fn=fn, args=args, donate=donate,
                   out_shardings=out_shardings)
        start = time.perf_counter()
        if self.cache is not None:
            job.cache_key = executable_key(
                stage_name=stage.name, identity=function_identity(stage.fn, self.fingerprint),
                trees=(meta_tree, param_tree), args=args, donate=donate,
                out_shardings=out_shardings, compiler_options=self.compiler_options)
            job.entry = self.cache.get(job.cache_key, label=label) if job.cache_key else None
        if job.entry is None and hits_only:
            return None
        if job.entry is not None:
            job.out_info = job.entry.out_specs
        else:
            job.trace()
        if out_shardings is not None:  # cache entries record shapes only
            job.out_info = tuple(map(_with_sharding, job.out_info, out_shardings))
        job.seconds = time.perf_counter() - start  # lookup or tracing: part of this job's time
        self._jobs[key] = job
        return job

    @staticmethod
    def _timed(step: Callable[[_Job], Any], job: _Job) -> _Job:
        """Run ``step(job)``, adding its seconds to the job's."""
        t0 = time.perf_counter()
        step(job)
        job.seconds += time.perf_counter() - t0
        return job

    def _load(self, job: _Job) -> bool:
        """Load a cache hit; False (the entry was logged as unusable) means compile instead."""
        try:
            with guard.startup():
                job.executable = self.cache.load(job.entry)
        except CacheEntryError:
            return False
        job.loaded = True
        return True

    def _load_spares(self, job: _Job) -> None:
        """Load the job's further copies from its cache entry or its compile's serialized form."""
        t0 = time.perf_counter()
        with guard.startup():
            if not job.loaded:
                payload, in_tree, out_tree = serialize_executable.serialize(job.executable)
                devices = job.executable.runtime_executable().local_devices()
            while len(job.spares) < job.spares_wanted:
                spare = (self.cache.load(job.entry) if job.loaded else
                         serialize_executable.deserialize_and_load(
                             payload, in_tree, out_tree, execution_devices=devices))
                job.spares.append((spare, direct_call(spare, job.num_args)))
        job.seconds += time.perf_counter() - t0

    def _compile_pending(self, jobs: list[_Job], bar: Any) -> None:
        """Compile ``jobs`` on ``self.threads`` threads; the first failure cancels the rest.
        The bar names the job compiling (the latest started) and counts those done."""

        def compile_one(job: _Job) -> _Job:
            bar.set_postfix_str(f"{job.name} @ {job.label}")
            return self._timed(self._compile, job)

        with concurrent.futures.ThreadPoolExecutor(self.threads) as pool:
            futures = [pool.submit(compile_one, job) for job in jobs]
            try:
                for future in concurrent.futures.as_completed(futures):
                    future.result()
                    bar.update()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise

    def _compile(self, job: _Job) -> None:
        start = time.perf_counter()
        if job.traced is None:  # a cache hit that could not be loaded
            planned = job.out_info
            job.trace()
            if [(s.shape, s.dtype) for s in job.out_info] != [(s.shape, s.dtype) for s in planned]:
                raise CompileError(
                    f"segment {job.name!r} for bucket {job.label}: the cache entry promised "
                    f"outputs {planned}, tracing gives {job.out_info}; the cache key missed "
                    f"something that changes the program: clear the cache"
                )
        try:
            with guard.startup():
                job.executable = job.traced.lower().compile(
                    compiler_options=self._xla_options or None)
        except Exception as error:
            raise CompileError(
                f"compiling segment {job.name!r} for bucket {job.label} failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        if job.cache_key is not None:
            self.cache.put(job.cache_key, job.executable, segment=job.name, bucket=job.label,
                           out_specs=job.out_info,
                           compile_seconds=time.perf_counter() - start)

    def _bound_leaves(self, job: _Job, call: Call) -> tuple[Any, ...]:
        """The call's parameter leaves; with a mesh, a leaf not yet on the sharding its
        executable was compiled for (a single-device array: replicated) is placed there once."""
        leaves = jax.tree_util.tree_leaves(call.params)
        if self.mesh is None:
            return tuple(leaves)
        specs = job.args[len(job.args) - len(leaves):]
        return tuple(leaf if getattr(leaf, "sharding", None) == spec.sharding
                     else jax.device_put(leaf, spec.sharding)
                     for leaf, spec in zip(leaves, specs))

    def _compiled_plan(self, bucket: _Bucket, leaves: list[tuple[Any, ...]],
                       copy: int) -> CompiledPlan:
        """The bucket's plan bound to its executables' loaded copy ``copy`` (0: the first) and
        to each call's parameter ``leaves``."""
        calls = []
        for (job, call, meta), call_leaves in zip(bucket.bound, leaves):
            executable, direct = (job.executable, job.direct) if copy == 0 else job.spares[copy - 1]
            calls.append(CompiledCall(name=call.stage.name, executable=executable, direct=direct,
                                      inputs=call.inputs, outputs=call.outputs, meta=meta,
                                      param_leaves=call_leaves))
        return CompiledPlan(plan=bucket.plan, label=bucket.label, calls=tuple(calls),
                            input_specs=bucket.input_specs, meta_specs=bucket.meta_specs,
                            meta_sharding=self._replicated, blocking=self._blocking)

    @property
    def labels(self) -> list[str]:
        """The bucket labels added, in order."""
        return list(self._buckets)

    @property
    def num_deferred(self) -> int:
        """Deferred buckets whose plans are not compiled yet."""
        return sum(bucket.deferred and not bucket.ready for bucket in self._buckets.values())

    def compile_all(self, *, load_deferred: Collection[str] | None = None
                    ) -> tuple[dict[str, CompiledPlan], CompileSummary]:
        """Compile (or load) every bucket that is not deferred, and load every deferred bucket
        whose executables are all in the cache (with ``load_deferred``, only those it names);
        fatal on the first failure. The other deferred buckets are ``compile_deferred``'s."""
        start = time.perf_counter()
        for bucket in self._buckets.values():
            if bucket.bound is None and (not bucket.deferred or load_deferred is None
                                         or bucket.label in load_deferred):
                self._bind(bucket, hits_only=True)
        buckets = [bucket for bucket in self._buckets.values() if bucket.bound is not None]
        pass_ = _Pass()
        with tqdm(total=len(self._pending(buckets)), desc=self.description, unit="exe",
                  disable=not self.progress) as bar:
            compiled = self._make_ready(buckets, bar, pass_)
        return compiled, self._summary(buckets, pass_, start)

    def compile_deferred(self, on_ready: Callable[[str, CompiledPlan], None], *,
                         limit: int | None = None,
                         first: Collection[str] = ()) -> CompileSummary:
        """Load or compile the deferred buckets ``compile_all`` left: those the cache holds
        whole first, then the labels in ``first``, then the others in the order they were added
        (at most ``limit`` of them), ``threads`` buckets at a time (their executables side by
        side on the compile threads), handing each bucket's compiled plan to
        ``on_ready(label, plan)`` as soon as its group is complete. Every compile here
        is start-up work for the compile guard (``guard.startup``), whatever the thread. Fatal
        on the first failure, as ``compile_all``: that bucket and the ones after it stay
        deferred. The summary covers the buckets compiled by this call."""
        if not self._deferred_lock.acquire(blocking=False):
            raise RuntimeError("compile_deferred is already running on another thread")
        try:
            start = time.perf_counter()
            waiting = [b for b in self._buckets.values() if b.deferred and not b.ready]
            for bucket in waiting:
                if bucket.bound is None and not bucket.missed:
                    self._bind(bucket, hits_only=True)  # a lookup: nothing is traced
            waiting.sort(key=lambda bucket: (bucket.bound is None, bucket.label not in first))
            done: list[_Bucket] = []
            pass_ = _Pass()
            waiting = waiting[:limit]
            with guard.startup(), tqdm(disable=True) as bar:
                for start_index in range(0, len(waiting), self.threads):
                    group = waiting[start_index:start_index + self.threads]
                    for bucket in group:
                        if bucket.bound is None:
                            self._bind(bucket)
                    plans = self._make_ready(group, bar, pass_)
                    for bucket in group:
                        done.append(bucket)
                        on_ready(bucket.label, plans[bucket.label])
            return self._summary(done, pass_, start)
        finally:
            self._deferred_lock.release()

    @staticmethod
    def _jobs_of(buckets: list[_Bucket]) -> list[_Job]:
        """The distinct jobs of bound ``buckets``, in call order."""
        return list({id(job): job for bucket in buckets for job, _, _ in bucket.bound}.values())

    def _pending(self, buckets: list[_Bucket]) -> list[_Job]:
        """The jobs of ``buckets`` that have no executable yet."""
        return [job for job in self._jobs_of(buckets) if job.executable is None]

    def _make_ready(self, buckets: list[_Bucket], bar: Any, pass_: _Pass
                    ) -> dict[str, CompiledPlan]:
        """Load or compile every executable ``buckets`` still lack (recorded in ``pass_``) and
        return their compiled plans."""
        pending = self._pending(buckets)
        hits = [job for job in pending if job.entry is not None]
        if hits:
            load_start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(LOAD_THREADS) as pool:
                for job in pool.map(functools.partial(self._timed, self._load), hits):
                    if job.loaded:
                        bar.set_postfix_str(f"{job.name} @ {job.label} (cached)", refresh=False)
                        bar.update()
            if any(job.loaded for job in hits):
                pass_.load_seconds += time.perf_counter() - load_start
        compile_start = time.perf_counter()
        self._compile_pending([job for job in pending if not job.loaded], bar)
        pass_.compile_wall_seconds += time.perf_counter() - compile_start
        for job in pending:
            job.direct = direct_call(job.executable, job.num_args)
        pass_.jobs += pending
        for job in self._jobs_of(buckets):
            if len(job.spares) < job.spares_wanted:
                self._load_spares(job)
        compiled = {}
        for bucket in buckets:
            leaves = [self._bound_leaves(job, call) for job, call, _ in bucket.bound]
            versions = [self._compiled_plan(bucket, leaves, copy)
                        for copy in range(bucket.copies)]
            compiled[bucket.label] = dataclasses.replace(versions[0], copies=tuple(versions[1:]))
            bucket.ready = True
        return compiled

    def _summary(self, buckets: list[_Bucket], pass_: _Pass, start: float) -> CompileSummary:
        """The summary of one pass that made ``buckets`` ready."""
        per_label = {bucket.label: 0.0 for bucket in buckets}
        for job in pass_.jobs:
            per_label[job.label] = per_label.get(job.label, 0.0) + job.seconds
        used = self._jobs_of(buckets)
        return CompileSummary(
            num_executables=len(used),
            num_calls=sum(len(bucket.bound) for bucket in buckets),
            seconds_per_label=per_label,
            total_seconds=time.perf_counter() - start,
            num_loaded=sum(job.loaded for job in pass_.jobs),
            num_compiled=sum(not job.loaded for job in pass_.jobs),
            load_seconds=pass_.load_seconds,
            compile_seconds=sum(job.seconds for job in pass_.jobs if not job.loaded),
            num_direct=sum(job.direct is not None for job in used),
            compile_wall_seconds=pass_.compile_wall_seconds,
            threads=self.threads,
            num_deferred=self.num_deferred,
        )
