"""graph/ on plain JAX functions: compiled replay == eager, shared executables, donation, the
compile guard, fatal start-up failures, plan validation, and the docs example."""

from __future__ import annotations

import concurrent.futures
import re
import runpy
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.graph import (
    Break,
    Call,
    CompileError,
    CompileGuard,
    ExecutableCache,
    Plan,
    PlanCompiler,
    RuntimeCompileError,
    Segment,
    run_eager,
    whole_forward,
)
from tokenspeed_jax.graph.trust import load_mac_key

WIDTH = 8
BUCKETS = (16, 32)


def block(weight, x):
    return x + jnp.tanh(x @ weight)


def scale_rows(params, meta, x):  # a break: rows scaled by host-provided live factors
    return x * meta["factor"][:, None]


BLOCK = Segment("block", block, ("x",), ("x",), donate=("x",))
SCALE = Break("scale", scale_rows, ("x",), ("x",), donate=("x",))
WEIGHTS = [jnp.asarray(np.random.default_rng(i).normal(size=(WIDTH, WIDTH)) / WIDTH, jnp.float32)
           for i in range(3)]
PLAN = Plan([Call(BLOCK, WEIGHTS[0]), Call(SCALE), Call(BLOCK, WEIGHTS[1]),
             Call(BLOCK, WEIGHTS[2])], ("x",), ("x",))


def compile_plan(plan=PLAN, buckets=BUCKETS, threads=1):
    compiler = PlanCompiler(progress=False, threads=threads)
    for size in buckets:
        compiler.add(f"rows={size}", plan, {"x": jax.ShapeDtypeStruct((size, WIDTH), jnp.float32)},
                     {"scale": {"factor": jax.ShapeDtypeStruct((size,), jnp.float32)}})
    return compiler.compile_all()


@pytest.fixture(scope="module")
def compiled():
    return compile_plan()


def numpy_reference(x, factor):
    """The plan's math in numpy, independent of graph/."""
    w = [np.asarray(a, np.float64) for a in WEIGHTS]
    x = x.astype(np.float64)
    x = x + np.tanh(x @ w[0])
    x = x * factor[:, None]
    for weight in w[1:]:
        x = x + np.tanh(x @ weight)
    return x


@pytest.mark.parametrize("size", BUCKETS)
def test_compiled_matches_eager_and_numpy_in_every_bucket(compiled, size):
    plans, _ = compiled
    rng = np.random.default_rng(size)
    x = rng.normal(size=(size, WIDTH)).astype(np.float32)
    factor = rng.uniform(0.5, 2.0, size).astype(np.float32)
    out = plans[f"rows={size}"].run({"x": jax.device_put(x)}, {"scale": {"factor": factor}})
    eager = run_eager(PLAN, {"x": jnp.asarray(x)}, {"scale": {"factor": jnp.asarray(factor)}})
    np.testing.assert_allclose(np.asarray(out["x"]), np.asarray(eager["x"]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out["x"]), numpy_reference(x, factor), rtol=1e-4,
                               atol=1e-5)


def test_identical_calls_share_one_executable(compiled):
    plans, summary = compiled
    # per bucket: one "block" executable for three calls, one "scale"
    assert summary.num_executables == 2 * len(BUCKETS)
    assert summary.num_calls == 4 * len(BUCKETS)
    calls = plans["rows=16"].calls
    assert calls[0].executable is calls[2].executable is calls[3].executable
    assert set(summary.seconds_per_label) == {"rows=16", "rows=32"}


def test_donated_input_is_consumed_and_aliased(compiled):
    plans, _ = compiled
    call = plans["rows=16"].calls[0]
    alias = call.executable.memory_analysis().alias_size_in_bytes
    assert alias == 16 * WIDTH * 4  # the x buffer is reused for the output
    x = jax.device_put(np.ones((16, WIDTH), np.float32))
    plans["rows=16"].run({"x": x}, {"scale": {"factor": np.ones(16, np.float32)}})
    assert x.is_deleted()


@pytest.mark.parametrize("cached", [False, True], ids=["compiled", "from-cache"])
def test_copies_of_a_plan_have_their_own_executables_and_the_same_results(tmp_path, cached):
    """``add(copies=3)`` gives a bucket's plan two more loaded copies of its executables (calls
    that shared one share its copy) on the same weights, called directly like the first, with
    bit-equal results, whether the first was compiled or loaded from the cache; other buckets
    get none."""
    def compile_with_copies():
        compiler = PlanCompiler(progress=False, cache=ExecutableCache(tmp_path, load_mac_key()))
        for size, copies in ((16, 3), (32, 1)):
            compiler.add(f"rows={size}", PLAN,
                         {"x": jax.ShapeDtypeStruct((size, WIDTH), jnp.float32)},
                         {"scale": {"factor": jax.ShapeDtypeStruct((size,), jnp.float32)}},
                         copies=copies)
        return compiler.compile_all()

    plans, summary = compile_with_copies()
    if cached:
        plans, summary = compile_with_copies()
        assert summary.num_loaded == summary.num_executables
    plan = plans["rows=16"]
    assert len(plan.copies) == 2 and plans["rows=32"].copies == ()
    versions = [plan, *plan.copies]
    ids = [{id(c.executable) for c in version.calls} for version in versions]
    assert all(len(i) == 2 for i in ids) and len(set.union(*ids)) == 6
    for version in versions:
        calls = version.calls
        assert calls[0].executable is calls[2].executable is calls[3].executable
        assert [(c.name, c.inputs, c.meta, c.direct is None) for c in calls] == \
            [(c.name, c.inputs, c.meta, c.direct is None) for c in plan.calls]
        assert all(c.param_leaves is p.param_leaves for c, p in zip(calls, plan.calls))
    rng = np.random.default_rng(3)
    x = rng.normal(size=(16, WIDTH)).astype(np.float32)
    meta = {"scale": {"factor": rng.uniform(0.5, 2.0, 16).astype(np.float32)}}
    results = [np.asarray(v.run({"x": jax.device_put(x)}, meta)["x"]) for v in versions]
    np.testing.assert_allclose(results[0], numpy_reference(x, meta["scale"]["factor"]),
                               rtol=1e-4, atol=1e-5)
    for result in results[1:]:
        np.testing.assert_array_equal(result, results[0])
    with pytest.raises(ValueError, match="copies"):
        PlanCompiler(progress=False).add("rows=16", PLAN, {}, copies=0)


def fresh_compile(*shape: int) -> jax.Array:
    """Always an XLA compile: a new function object misses jax's in-memory caches, whatever
    earlier tests of the process compiled."""
    return jax.jit(lambda v: v * 3 + 1)(np.zeros(shape, np.float32))


def test_guard_counts_and_strict_raises_after_arming(compiled):
    plans, _ = compiled
    guard = CompileGuard(strict=True)
    fresh_compile(3)  # before arming: not counted
    guard.arm()
    try:
        x = jax.device_put(np.ones((32, WIDTH), np.float32))
        plans["rows=32"].run({"x": x}, {"scale": {"factor": np.ones(32, np.float32)}})
        assert guard.runtime_compiles == 0
        with pytest.raises(RuntimeCompileError, match="shapes"):
            fresh_compile(7)
        assert guard.runtime_compiles >= 1
        with guard.allowed("test fallback"):
            fresh_compile(11)
        assert guard.allowed_compiles >= 1
    finally:
        guard.disarm()


def test_non_strict_guard_logs_function_and_shape(caplog):
    guard = CompileGuard(strict=False)
    guard.arm()
    try:
        fresh_compile(3, 13)
    finally:
        guard.disarm()
    assert guard.runtime_compiles >= 1
    assert any("13" in e.shapes for e in guard.events)
    assert "runtime compile" in caplog.text


def test_wrong_shape_at_replay_is_an_error_not_a_compile(compiled):
    plans, _ = compiled
    guard = CompileGuard(strict=True)
    guard.arm()
    x = jax.device_put(np.ones((17, WIDTH), np.float32))
    with pytest.raises(TypeError, match=r"float32\[17, 8\].*float32\[16, 8\]"):
        plans["rows=16"].run({"x": x}, {"scale": {"factor": np.ones(16, np.float32)}})
    x = jax.device_put(np.ones((16, WIDTH), np.float32))
    with pytest.raises(TypeError, match="metadata"):
        plans["rows=16"].run({"x": x}, {"scale": {"factor": np.ones(16, np.int32)}})
    guard.disarm()
    assert guard.runtime_compiles == 0


def test_whole_forward_jit_matches_compiled_plan(compiled):
    plans, _ = compiled
    x = np.random.default_rng(5).normal(size=(16, WIDTH)).astype(np.float32)
    meta = {"scale": {"factor": np.full(16, 0.5, np.float32)}}
    fn, params = whole_forward(PLAN, donate=("x",))
    whole = fn(params, {"x": jnp.asarray(x)}, meta)["x"]
    segmented = plans["rows=16"].run({"x": jax.device_put(x)}, meta)["x"]
    np.testing.assert_allclose(np.asarray(whole), np.asarray(segmented), rtol=1e-5, atol=1e-6)


def test_start_up_failure_names_segment_and_bucket():
    def fragile(weight, x):
        if x.shape[0] == 32:
            raise ValueError("unsupported row count")
        return block(weight, x)

    broken = Segment("fragile_block", fragile, ("x",), ("x",))
    plan = Plan([Call(broken, WEIGHTS[0])], ("x",), ("x",))
    with pytest.raises(CompileError, match=r"'fragile_block'.*rows=32"):
        compile_plan(plan)


def test_compiles_run_on_several_threads_at_once(monkeypatch):
    """With two threads, two executables compile at the same time (each compile waits for the
    other at a barrier; one at a time, the barrier breaks) and the plans compute the same."""
    meeting = threading.Barrier(2, timeout=10)
    compile_one = PlanCompiler._compile

    def compile_in_pairs(self, job):
        meeting.wait()
        compile_one(self, job)

    monkeypatch.setattr(PlanCompiler, "_compile", compile_in_pairs)
    plans, summary = compile_plan(threads=2)
    assert (summary.num_compiled, summary.threads) == (4, 2)
    assert summary.compile_wall_seconds <= summary.compile_seconds
    x = np.random.default_rng(3).normal(size=(16, WIDTH)).astype(np.float32)
    factor = np.linspace(0.5, 1.5, 16).astype(np.float32)
    out = plans["rows=16"].run({"x": jax.device_put(x)}, {"scale": {"factor": factor}})["x"]
    np.testing.assert_allclose(np.asarray(out), numpy_reference(x, factor), rtol=1e-5, atol=1e-5)


def test_compile_failure_on_a_thread_is_fatal_and_skips_the_rest(monkeypatch):
    """A compile failing on a worker thread stops start-up with the segment and the bucket in
    the message, and the compiles still queued never start."""
    started = []
    compile_one = PlanCompiler._compile

    def fail_on_rows_16(self, job):
        started.append(job.label)
        if job.label == "rows=16":
            raise CompileError(f"compiling segment {job.name!r} for bucket {job.label} failed")
        compile_one(self, job)

    monkeypatch.setattr(PlanCompiler, "_compile", fail_on_rows_16)
    with pytest.raises(CompileError, match=r"'block'.*rows=16"):
        compile_plan(threads=1)
    assert started == ["rows=16"]
    with pytest.raises(ValueError, match="threads must be >= 1"):
        PlanCompiler(threads=0)


def test_compiler_options_reach_xla():
    """Every executable is compiled with the compiler's XLA options: a value XLA rejects fails
    start-up naming the segment, the bucket and the option."""
    compiler = PlanCompiler(progress=False, compiler_options={
        "xla_gpu_command_buffer_scheduling_mode": "NOT_A_MODE"})
    compiler.add("rows=16", Plan([Call(BLOCK, WEIGHTS[0])], ("x",), ("x",)),
                 {"x": jax.ShapeDtypeStruct((16, WIDTH), jnp.float32)})
    with pytest.raises(CompileError, match=r"'block'.*rows=16.*NOT_A_MODE"):
        compiler.compile_all()
    written = EngineConfig(xla_compiler_options=("xla_gpu_enable_triton_gemm=false",))
    compiler = PlanCompiler(progress=False, compiler_options=written.compiler_options)
    compiler.add("rows=16", Plan([Call(BLOCK, WEIGHTS[0])], ("x",), ("x",)),
                 {"x": jax.ShapeDtypeStruct((16, WIDTH), jnp.float32)})
    assert compiler.compile_all()[1].num_executables == 1


def test_plan_rejects_reading_a_donated_value():
    keep = Segment("keep", lambda p, x: x * 2, ("x",), ("y",), donate=("x",))
    with pytest.raises(ValueError, match="donated"):
        Plan([Call(keep), Call(BLOCK, WEIGHTS[0])], ("x",), ("x",))
    with pytest.raises(ValueError, match="not inputs"):
        Segment("bad", block, ("x",), ("x",), donate=("z",))


def test_docs_example_runs(tmp_path):
    text = (Path(__file__).parents[1] / "docs" / "graph.md").read_text()
    script = tmp_path / "graph_example.py"
    script.write_text(re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1))
    runpy.run_path(str(script), run_name="__main__")


def test_positional_replay_matches_named_replay():
    """A one-call plan carried from run to run: positional replay gives the named replay's
    values, consumes its donated input and checks its metadata."""
    step = Break("step", lambda params, meta, x, n: (x * meta["factor"][:, None], n + 1),
                 ("x", "n"), ("x", "n"), donate=("x",))
    plan = Plan([Call(step)], ("x", "n"), ("x", "n"))
    compiler = PlanCompiler(progress=False)
    compiler.add("rows=16", plan, {"x": jax.ShapeDtypeStruct((16, WIDTH), jnp.float32),
                                   "n": jax.ShapeDtypeStruct((), jnp.int32)},
                 {"step": {"factor": jax.ShapeDtypeStruct((16,), jnp.float32)}})
    compiled = compiler.compile_all()[0]["rows=16"]
    rng = np.random.default_rng(7)
    x = rng.normal(size=(16, WIDTH)).astype(np.float32)
    factors = [rng.uniform(0.5, 2.0, 16).astype(np.float32) for _ in range(3)]
    named = {"x": jax.device_put(x), "n": jax.device_put(np.int32(0))}
    carried = [jax.device_put(x), jax.device_put(np.int32(0))]
    for factor in factors:
        named = compiled.run(named, {"step": {"factor": factor}})
        donated = carried[0]
        carried = compiled.run_positional(carried, {"step": {"factor": factor}})
        assert donated.is_deleted()
    expected = x * np.prod(factors, axis=0)[:, None]
    np.testing.assert_allclose(np.asarray(carried[0]), expected, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(carried[0]), np.asarray(named["x"]))
    assert int(carried[1]) == int(named["n"]) == 3
    with pytest.raises(TypeError, match="metadata"):
        compiled.run_positional(carried, {"step": {"factor": np.ones(16, np.int32)}})
    with pytest.raises(ValueError, match="one-call"):
        compile_plan()[0]["rows=16"].run_positional([jax.device_put(x)], {})


def add_buckets(compiler: PlanCompiler, sizes, *, deferred=()) -> None:
    for size in sizes:
        compiler.add(f"rows={size}", PLAN, {"x": jax.ShapeDtypeStruct((size, WIDTH), jnp.float32)},
                     {"scale": {"factor": jax.ShapeDtypeStruct((size,), jnp.float32)}},
                     deferred=size in deferred)


def check_plan(plan, size: int) -> None:
    rng = np.random.default_rng(size)
    x = rng.normal(size=(size, WIDTH)).astype(np.float32)
    factor = rng.uniform(0.5, 2.0, size).astype(np.float32)
    out = plan.run({"x": jax.device_put(x)}, {"scale": {"factor": factor}})["x"]
    np.testing.assert_allclose(np.asarray(out), numpy_reference(x, factor), rtol=1e-4, atol=1e-5)


def test_deferred_buckets_compile_later_one_bucket_at_a_time():
    """``compile_all`` compiles the buckets that are not deferred; ``compile_deferred`` compiles
    the others one bucket at a time in the order they were added, handing each plan over when
    it is complete; every plan computes the numpy reference."""
    compiler = PlanCompiler(progress=False)
    add_buckets(compiler, (8, 16, 32), deferred=(8, 16))
    plans, summary = compiler.compile_all()
    assert set(plans) == {"rows=32"}
    assert (summary.num_executables, summary.num_compiled, summary.num_deferred) == (2, 2, 2)
    ready = {}
    first = compiler.compile_deferred(ready.__setitem__, limit=1)
    assert list(ready) == ["rows=8"]
    assert (first.num_compiled, first.num_deferred, compiler.num_deferred) == (2, 1, 1)
    rest = compiler.compile_deferred(ready.__setitem__)
    assert list(ready) == ["rows=8", "rows=16"]
    assert (rest.num_compiled, rest.num_deferred, compiler.num_deferred) == (2, 0, 0)
    assert compiler.compile_deferred(ready.__setitem__).num_executables == 0
    for size, plan in ((8, ready["rows=8"]), (16, ready["rows=16"]), (32, plans["rows=32"])):
        check_plan(plan, size)


def test_deferred_buckets_compile_as_many_at_a_time_as_there_are_threads():
    """With two compile threads the deferred buckets compile two at a time: ``limit=2`` makes
    both ready in one group, handed over in the order they were added; a third follows."""
    compiler = PlanCompiler(progress=False, threads=2)
    add_buckets(compiler, (8, 16, 24), deferred=(8, 16, 24))
    compiler.compile_all()
    ready = {}
    group = compiler.compile_deferred(ready.__setitem__, limit=2)
    assert list(ready) == ["rows=8", "rows=16"] and group.num_compiled == 4
    compiler.compile_deferred(ready.__setitem__)
    assert list(ready) == ["rows=8", "rows=16", "rows=24"] and compiler.num_deferred == 0
    for size, plan in ready.items():
        check_plan(plan, int(size.removeprefix("rows=")))


def test_a_deferred_bucket_the_cache_holds_whole_loads_at_start_up(tmp_path):
    """A warm start has no background work: a deferred bucket whose executables are all in the
    cache is loaded by ``compile_all``; one that misses stays deferred."""
    cache = ExecutableCache(tmp_path, load_mac_key())
    warm = PlanCompiler(progress=False, cache=cache)
    add_buckets(warm, (16,))
    warm.compile_all()
    compiler = PlanCompiler(progress=False, cache=cache)
    add_buckets(compiler, (16, 32), deferred=(16, 32))
    plans, summary = compiler.compile_all()
    assert set(plans) == {"rows=16"}
    assert (summary.num_loaded, summary.num_compiled, summary.num_deferred) == (2, 0, 1)
    ready = {}
    later = compiler.compile_deferred(ready.__setitem__)
    assert set(ready) == {"rows=32"} and (later.num_loaded, later.num_compiled) == (0, 2)
    check_plan(plans["rows=16"], 16)
    check_plan(ready["rows=32"], 32)


def test_deferred_buckets_named_first_compile_first(tmp_path):
    compiler = PlanCompiler(progress=False)
    add_buckets(compiler, (16, 32, 48), deferred=(16, 32, 48))
    compiler.compile_all()
    order = []
    compiler.compile_deferred(lambda label, plan: order.append(label), first={"rows=48"})
    assert order == ["rows=48", "rows=16", "rows=32"]


def test_the_autotune_directory_is_not_part_of_the_key_and_clear_removes_it(tmp_path):
    """Executables compiled with XLA's autotune results kept in the cache's ``autotune/``
    (0700) are the ones a compiler without it loads; ``clear`` removes the results too."""
    cache = ExecutableCache(tmp_path, load_mac_key())
    directory = Path(cache.autotune_directory())
    assert directory == tmp_path / "autotune" and directory.stat().st_mode & 0o777 == 0o700
    (directory / "results.textproto").write_text("")
    tuned = PlanCompiler(progress=False, cache=cache, autotune_cache_dir=str(directory))
    add_buckets(tuned, (16,))
    assert tuned.compile_all()[1].num_compiled == 2
    plain = PlanCompiler(progress=False, cache=cache)
    add_buckets(plain, (16,))
    plans, summary = plain.compile_all()
    assert (summary.num_loaded, summary.num_compiled) == (2, 0)
    check_plan(plans["rows=16"], 16)
    assert cache.clear() == 2 and not directory.exists()


def test_deferred_compiles_on_another_thread_are_start_up_work():
    """Serving under a strict guard while another thread compiles the deferred buckets: the
    guard counts none of that thread's compiles, and still raises on this thread's."""
    compiler = PlanCompiler(progress=False)
    add_buckets(compiler, (16, 32), deferred=(32,))
    plans, _ = compiler.compile_all()
    guard = CompileGuard(strict=True)
    guard.arm()
    try:
        ready = {}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            background = pool.submit(compiler.compile_deferred, ready.__setitem__)
            check_plan(plans["rows=16"], 16)
            assert background.result().num_compiled == 2  # raises what the thread raised
        assert set(ready) == {"rows=32"}
        check_plan(ready["rows=32"], 32)
        assert guard.runtime_compiles == 0
        with pytest.raises(RuntimeCompileError):
            fresh_compile(5)
    finally:
        guard.disarm()


def test_a_deferred_compile_failure_is_fatal_and_leaves_the_bucket_deferred():
    def fragile(weight, x):
        if x.shape[0] == 32:
            raise ValueError("unsupported row count")
        return block(weight, x)

    plan = Plan([Call(Segment("fragile_block", fragile, ("x",), ("x",)), WEIGHTS[0])],
                ("x",), ("x",))
    compiler = PlanCompiler(progress=False)
    for size in (16, 32):
        compiler.add(f"rows={size}", plan,
                     {"x": jax.ShapeDtypeStruct((size, WIDTH), jnp.float32)}, deferred=True)
    assert compiler.compile_all()[0] == {}
    ready = []
    with pytest.raises(CompileError, match=r"'fragile_block'.*rows=32"):
        compiler.compile_deferred(lambda label, plan: ready.append(label))
    assert ready == ["rows=16"] and compiler.num_deferred == 1
