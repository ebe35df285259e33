"""Serving before the bucket ladders are complete: a skeleton at start-up, the rest in the
background.

A runner registers each bucket plan with a ``LadderCompiler``, naming the *rungs* (a
``Buckets`` field and one of its sizes, e.g. ``("tokens", 512)``) that need the plan, and how to
store the compiled plan in its tables. Plans that a rung of the skeleton (``Buckets.skeleton``)
needs are compiled (or loaded) at start-up; the others are deferred
(``PlanCompiler.add(deferred=True)``). With background compile on, ``compile_all`` then starts a
daemon thread per compiler that loads the deferred plans the executable cache holds whole, then
compiles the others, as many buckets at a time as its compiler has threads
(``PlanCompiler.compile_deferred``): a warm start is ready once the skeleton is loaded.
``ready`` is the ``Buckets`` of the rungs whose plans are all stored; runners choose buckets from
it, so a request never waits on a compile or causes one: it takes the smallest ready bucket that
fits, padding more until the rung it would have taken is ready. Results do not depend on the bucket (padding never changes real rows).

Invariants:

* ``ready`` only grows, and every rung in it has every plan it needs in the runner's tables: a
  plan is stored before ``ready`` is replaced, by one assignment of a new frozen ``Buckets``, so
  the engine thread reads a consistent snapshot with no lock. The background threads only add
  entries to the runner's tables, one thread at a time (a lock); the engine thread only reads
  them.
* Each skeleton ladder keeps its full ladder's largest rung, so ``ready`` fits every size the
  full ladders fit and the routes and splits do not change, only the padding.
* Background compiles are start-up work (``graph.guard.startup`` on that thread): they never
  count as runtime compiles, and the engine thread's compiles still do.
* A failure in the background is fatal, as one at start-up is: it is logged when it happens and
  ``check()`` (called by the runner at every step) raises it as a ``CompileError``, which the
  engine loop treats as an engine failure (the server then exits 1). An idle server notices it
  at its next step.
* **Quick skeleton** (a ``quick`` compiler, XLA's autotuning off and several threads): the
  skeleton's plans the cache does not hold whole are compiled by it before serving (each with
  the ``quick_plan`` its ``add`` names, else the same plan), then compiled again by the main
  compiler in the background, first of all, and each autotuned plan replaces its quick one in
  the runner's tables as it lands (a table entry is replaced by one assignment). Results do not
  depend on the tier; only their speed does. ``stats()["plans_untuned"]`` counts the quick
  plans still serving. Quick executables are cached under their own key, so a restart before
  the autotuned ones landed loads them; once every autotuned plan of the skeleton is in the
  cache, a start loads those and compiles nothing quick.
* **Plans that are not autotuned** (``add(..., autotune=False)``, with ``untuned_plans``): the
  prefill and full-sampler plans, which run as fast without XLA's autotuning, compile on the
  quick compiler (several at once) at start-up for the skeleton and in a background thread of
  their own for the rest, beside the thread of the autotuned plans (one at a time, so the
  autotuner times kernels alone). They are final: never replaced, never counted untuned.
* At interpreter exit, a background compile still running is stopped after its current bucket
  (an ``atexit`` hook), so no XLA compile is cut off by the interpreter's shutdown; once the main
  thread has ended, the thread pools refuse new work, which ends the background compile quietly,
  not as a failure.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from tokenspeed_jax.graph import CompiledPlan, CompileError, CompileSummary, Plan, PlanCompiler

if TYPE_CHECKING:
    from tokenspeed_jax.engine.buckets import Buckets
    from tokenspeed_jax.engine.sampling_plans import Resampler

logger = logging.getLogger(__name__)

Rung = tuple[str, int]  # (a Buckets field, one of its sizes)

_running: set[LadderCompiler] = set()  # background compiles in flight, stopped at exit


@atexit.register
def _stop_running() -> None:
    for ladders in list(_running):
        ladders.stop()


def rungs(buckets: Buckets) -> set[Rung]:
    """Every rung of ``buckets``' ladders."""
    return {(field.name, size) for field in dataclasses.fields(buckets)
            for size in getattr(buckets, field.name)}


class LadderCompiler:
    """A runner's bucket plans on a ``PlanCompiler``: the skeleton's at start-up, the others in
    the background (module docstring)."""

    def __init__(self, compiler: PlanCompiler, full: Buckets, skeleton: Buckets, *,
                 quick: PlanCompiler | None = None, quick_skeleton: bool = False,
                 untuned_plans: bool = False) -> None:
        """``quick``: a compiler without autotuning, of the quick skeleton when
        ``quick_skeleton`` and of the plans added with ``autotune=False`` when
        ``untuned_plans`` (module docstring); otherwise every plan is ``compiler``'s."""
        if (quick_skeleton or untuned_plans) and quick is None:
            raise ValueError("a quick skeleton or untuned plans need a quick compiler")
        self.compiler = compiler
        self.quick = quick
        self._quick_skeleton = quick_skeleton
        self._untuned_plans = untuned_plans
        self._quick_plans: dict[str, tuple[Plan, Mapping[str, Any], Any, dict]] = {}
        self._untuned: set[str] = set()
        self.full = full
        self.skeleton = skeleton
        self._skeleton = rungs(skeleton)
        tops = [(getattr(full, f.name)[-1:], getattr(skeleton, f.name)[-1:])
                for f in dataclasses.fields(full)]
        if not self._skeleton <= rungs(full) or any(a != b for a, b in tops):
            raise ValueError(f"skeleton {skeleton} must be part of the ladders {full} and keep "
                             f"each one's largest rung")
        self._missing: dict[Rung, set[str]] = {rung: set() for rung in rungs(full)}
        self._needed_by: dict[str, list[Rung]] = {}
        self._stores: dict[str, Callable[[CompiledPlan], None]] = {}
        self.ready = dataclasses.replace(full, **{f.name: () for f in dataclasses.fields(full)})
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._live_threads = 0
        self._adopting = threading.Lock()

    # ----------------------------------------------------------------- registration

    def add(self, needed_by: Iterable[Rung], label: str, store: Callable[[CompiledPlan], None],
            plan: Plan, input_specs: Mapping[str, Any], meta_specs: Mapping[str, Any] | None = None,
            *, quick_plan: Plan | None = None, autotune: bool = True, **options: Any) -> None:
        """Add the bucket plan ``label`` that each rung of ``needed_by`` needs; ``store`` puts
        its compiled plan in the runner's tables. Deferred unless a skeleton rung needs it.
        ``quick_plan``: the plan the quick skeleton compiles instead of ``plan`` (the same
        inputs, outputs and results; cheaper to compile). ``autotune=False``: a plan that
        runs as fast without XLA's autotuning, the quick compiler's with ``untuned_plans``.
        ``options``: further ``PlanCompiler.add`` arguments."""
        needed_by = list(needed_by)
        unknown = [rung for rung in needed_by if rung not in self._missing]
        if not needed_by or unknown:
            raise ValueError(f"{label}: needed by {needed_by}, which must be rungs of the "
                             f"ladders {self.full} (unknown: {unknown})")
        deferred = self._skeleton.isdisjoint(needed_by)
        compiler = self.compiler
        if not autotune and self._untuned_plans:
            compiler = self.quick
        elif not deferred and self._quick_skeleton:
            self._quick_plans[label] = (quick_plan or plan, input_specs, meta_specs, options)
            deferred = True  # autotuned in the background, unless the cache holds it whole
        compiler.add(label, plan, input_specs, meta_specs, deferred=deferred, **options)
        self._needed_by[label] = needed_by
        self._stores[label] = store
        for rung in needed_by:
            self._missing[rung].add(label)

    def decode_rungs(self, rows: int) -> list[Rung]:
        """The decode rungs whose steps run on the ``rows``-row decode executable."""
        return [("decode_requests", count) for count in self.full.decode_requests
                if self.full.decode_rows(count) == rows]

    def add_resampler(self, resampler: Resampler, rows: int) -> None:
        """Add the full-sampler plans of ``rows`` rows (once): every rung whose head or decode
        step has ``rows`` rows needs them."""
        needed_by = self.decode_rungs(rows)
        if rows in self.full.prefill_requests:
            needed_by.append(("prefill_requests", rows))
        for label, key, plan, inputs, meta in resampler.plans_for(rows):
            if label not in self._needed_by:
                self.add(needed_by, label, resampler.store(key), plan, inputs, meta,
                         autotune=False)

    # ----------------------------------------------------------------- compiling

    def compile_all(self, *, background: bool = True) -> CompileSummary:
        """Compile the skeleton's plans, store them, and with ``background`` start the threads
        that load and compile the rest; without it, the deferred plans the cache holds whole
        are loaded here."""
        plans, summary = self.compiler.compile_all(
            load_deferred=set(self._quick_plans) if background else None)
        for label, plan in plans.items():
            self._store(label, plan)
        untuned = [label for label in self._quick_plans if label not in plans]
        for label in untuned:
            plan, input_specs, meta_specs, options = self._quick_plans[label]
            self.quick.add(label, plan, input_specs, meta_specs, **options)
        if self.quick is not None and self.quick.labels:
            quick_plans, quick_summary = self.quick.compile_all(
                load_deferred=set() if background else None)
            for label, plan in quick_plans.items():
                self._store(label, plan)
            self._untuned.update(label for label in untuned if label in quick_plans)
            summary = summary.merged(quick_summary)
        self._publish()
        if background:
            for compiler in self._compilers():
                if compiler.num_deferred:
                    self._threads.append(threading.Thread(
                        target=self._run, args=(compiler,), name="ladder-compile", daemon=True))
            self._live_threads = len(self._threads)
            if self._threads:
                _running.add(self)
            for thread in self._threads:
                thread.start()
        return summary

    def _compilers(self) -> list[PlanCompiler]:
        """The compilers that own deferred plans: the autotuned one, and the quick one when it
        has plans of its own (``untuned_plans``)."""
        return [self.compiler] + ([self.quick] if self._untuned_plans else [])

    def compile_deferred(self, limit: int | None = None) -> CompileSummary:
        """Compile up to ``limit`` deferred bucket plans (all: None) on the calling thread,
        the autotuned compiler's first, publishing each rung they complete."""
        summaries: list[CompileSummary] = []
        for compiler in self._compilers():
            left = None if limit is None else limit - sum(len(s.seconds_per_label)
                                                          for s in summaries)
            if left is not None and left <= 0:
                break
            summaries.append(self._compile_deferred(compiler, left))
        return functools.reduce(CompileSummary.merged, summaries)

    def _compile_deferred(self, compiler: PlanCompiler, limit: int | None) -> CompileSummary:
        first = set(self._untuned) if compiler is self.compiler else ()
        return compiler.compile_deferred(self._adopt, limit=limit, first=first)

    def _store(self, label: str, plan: CompiledPlan) -> None:
        self._stores[label](plan)
        self._untuned.discard(label)
        for rung in self._needed_by[label]:
            self._missing[rung].discard(label)

    def _adopt(self, label: str, plan: CompiledPlan) -> None:
        with self._adopting:
            self._store(label, plan)
            self._publish()

    def _publish(self) -> None:
        sizes: dict[str, list[int]] = {field.name: [] for field in dataclasses.fields(self.full)}
        for (name, size), missing in self._missing.items():
            if not missing:
                sizes[name].append(size)
        self.ready = dataclasses.replace(
            self.full, **{name: tuple(sorted(values)) for name, values in sizes.items()})

    def _run(self, compiler: PlanCompiler) -> None:
        start = time.perf_counter()
        compiled = loaded = 0
        try:
            while (compiler.num_deferred and not self._stop.is_set()
                   and threading.main_thread().is_alive()):
                summary = self._compile_deferred(compiler, compiler.threads)
                compiled += summary.num_compiled
                loaded += summary.num_loaded
                logger.debug("background compile: %s", ", ".join(summary.seconds_per_label))
        except BaseException as error:  # recorded: the next step raises it
            if not threading.main_thread().is_alive():
                # the interpreter is exiting: its thread pools refuse new work; not a failure
                logger.debug("background compile stopped at exit: %r", error)
                return
            self.error = error
            logger.critical("the background compile failed; the next step raises it",
                            exc_info=error)
        else:
            logger.info("background compile: %d executables compiled and %d loaded in %.1fs "
                        "(%s); %d of %d buckets ready", compiled, loaded,
                        time.perf_counter() - start, compiler.description, *self.counts())
        finally:
            with self._adopting:
                self._live_threads -= 1
                if not self._live_threads:
                    _running.discard(self)

    # ----------------------------------------------------------------- state

    def check(self) -> None:
        """Raise the background compile's failure, if there was one."""
        if self.error is not None:
            raise CompileError(f"the background compile failed: {self.error}") from self.error

    @property
    def complete(self) -> bool:
        """Whether every rung of the full ladders is ready."""
        ready, total = self.counts()
        return ready == total

    def counts(self) -> tuple[int, int]:
        """(ready rungs, all rungs) over every ladder, from one snapshot of ``ready``."""
        return len(rungs(self.ready)), len(self._missing)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background compile to end (at most ``timeout`` seconds); whether every
        rung is ready. Raises the background compile's failure."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.check()
        return self.complete

    def stop(self) -> None:
        """Stop the background compile after its current bucket and wait for it."""
        self._stop.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    def stats(self) -> dict[str, int]:
        ready, total = self.counts()
        return {"buckets_ready": ready, "buckets_total": total,
                "plans_untuned": len(self._untuned)}
