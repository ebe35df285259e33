"""graph/arrays.py: start-up arrays made by executables of a PlanCompiler, so a second compiler
on the same executable cache (a warm start) makes them without an XLA compile.

Compiles are counted by jax's own backend-compile events. The sharded case runs in a worker
process that sees several CPU devices (this file run as a script, ``parallel_checks``).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_window: list[dict] = []  # the open counting window, if any


def _on_event(event: str, duration: float, **kwargs: object) -> None:
    if _window and event == BACKEND_COMPILE:
        _window[0]["count"] += 1


@contextlib.contextmanager
def counting_compiles() -> Iterator[dict]:
    """Counts backend compiles inside; the count is ``["count"]`` of what it yields."""
    _window.append({"count": 0})
    try:
        yield _window[0]
    finally:
        _window.clear()


def compiler(directory: Path, mesh=None):
    from tokenspeed_jax.graph import ExecutableCache, PlanCompiler
    from tokenspeed_jax.graph.trust import load_mac_key

    return PlanCompiler(progress=False, cache=ExecutableCache(directory, load_mac_key()),
                        mesh=mesh)


def test_zeros_gives_each_name_its_own_zero_buffer_and_loads_when_warm(tmp_path):
    import jax
    import jax.numpy as jnp

    from tokenspeed_jax.graph.arrays import zeros

    pages = jax.ShapeDtypeStruct((2, 5, 4), jnp.bfloat16)
    specs = {"k.0": pages, "rows": jax.ShapeDtypeStruct((7,), jnp.int32), "k.1": pages}
    with counting_compiles() as cold:
        made = zeros(compiler(tmp_path), specs)
    with counting_compiles() as warm:
        again = zeros(compiler(tmp_path), specs)
    assert cold["count"] == 2 and warm["count"] == 0  # one executable per distinct spec
    for arrays in (made, again):
        assert list(arrays) == list(specs)
        for name, spec in specs.items():
            assert (arrays[name].shape, arrays[name].dtype) == (spec.shape, spec.dtype)
            np.testing.assert_array_equal(np.asarray(arrays[name], np.float32), 0)
        assert len({a.unsafe_buffer_pointer() for a in arrays.values()}) == len(specs)


def test_stack_matches_numpy_and_loads_when_warm(tmp_path):
    import jax.numpy as jnp

    from tokenspeed_jax.graph.arrays import stack

    rng = np.random.default_rng(0)
    layers = [{"w": rng.standard_normal((3, 4)).astype(np.float32),
               "norm": {"scale": rng.standard_normal(4).astype(np.float32)}} for _ in range(5)]
    trees = [{"w": jnp.asarray(t["w"]), "norm": {"scale": jnp.asarray(t["norm"]["scale"])}}
             for t in layers]
    with counting_compiles() as cold:
        stacked = stack(compiler(tmp_path), trees)
    with counting_compiles() as warm:
        again = stack(compiler(tmp_path), trees)
    assert cold["count"] == 1 and warm["count"] == 0
    for result in (stacked, again):
        np.testing.assert_array_equal(result["w"], np.stack([t["w"] for t in layers]))
        np.testing.assert_array_equal(result["norm"]["scale"],
                                      np.stack([t["norm"]["scale"] for t in layers]))


def test_sharded_arrays_keep_their_split():
    from parallel_checks import run_on_cpu_devices

    result = run_on_cpu_devices(__file__, "mesh")
    assert result["zeros_spec"] == ["tp", None]
    assert result["zeros_shard"] == [4, 6]
    assert result["stacked_spec"] == [None, None, "tp"]
    assert result["stacked_shard"] == [3, 5, 2]
    assert result["stacked_value_ok"]
    assert result["replicated_fully"]
    assert result["warm_compiles"] == 0


def _mesh_worker() -> dict:
    """Zeros split over a 2-device mesh, and stacked leaves split by column or replicated."""
    import tempfile

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from tokenspeed_jax.graph.arrays import stack, zeros
    from tokenspeed_jax.parallel import AXIS, make_mesh

    mesh = make_mesh(2)
    directory = Path(tempfile.mkdtemp())
    split_rows = NamedSharding(mesh, PartitionSpec(AXIS, None))
    made = zeros(compiler(directory, mesh), {
        "pages": jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=split_rows)})["pages"]
    host = [np.arange(20, dtype=np.float32).reshape(5, 4) + i for i in range(3)]
    columns = NamedSharding(mesh, PartitionSpec(None, AXIS))
    trees = [{"w": jax.device_put(h, columns),
              "b": jax.device_put(h[0], NamedSharding(mesh, PartitionSpec()))} for h in host]
    stacked = stack(compiler(directory, mesh), trees)
    with counting_compiles() as warm:
        zeros(compiler(directory, mesh), {
            "pages": jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=split_rows)})
        stack(compiler(directory, mesh), trees)
    return {
        "zeros_spec": list(made.sharding.spec),
        "zeros_shard": list(made.addressable_shards[0].data.shape),
        "stacked_spec": list(stacked["w"].sharding.spec),
        "stacked_shard": list(stacked["w"].addressable_shards[0].data.shape),
        "stacked_value_ok": bool(np.array_equal(stacked["w"], np.stack(host))),
        "replicated_fully": all(s.data.shape == (3, 4) for s in stacked["b"].addressable_shards),
        "warm_compiles": warm["count"],
    }


def _install_listener() -> None:
    from jax import monitoring

    monitoring.register_event_duration_secs_listener(_on_event)


_install_listener()

if __name__ == "__main__":
    print(json.dumps({"mesh": _mesh_worker}[sys.argv[1]]()))
