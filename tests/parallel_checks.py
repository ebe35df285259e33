"""Checks shared by the tensor-parallel tests (imported lazily: jax must not load early)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORKER_DEVICES = 4


def run_on_cpu_devices(script: str, *args: str, timeout: int = 600) -> dict:
    """Run ``script`` (a test file that is its own worker) in a process that sees
    ``WORKER_DEVICES`` CPU devices (set before jax is imported there, beside this process's
    ``XLA_FLAGS``); its last stdout line, parsed as JSON."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} " \
            f"--xla_force_host_platform_device_count={WORKER_DEVICES}"
    env = {**os.environ, "XLA_FLAGS": flags.strip(), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, script, *args], check=False, env=env,
                          capture_output=True, text=True, timeout=timeout,
                          cwd=Path(script).parent)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def splits_by_name(state: Any, spec_of: Callable[[str], tuple], tp: int) -> dict[str, bool]:
    """Whether ``spec_of(name)`` splits each parameter leaf of ``state`` over the mesh axis;
    asserts each spec fits its leaf's rank and that every split dimension divides by ``tp``."""
    import jax

    from tokenspeed_jax.parallel import AXIS

    split = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        name = [k.key for k in path if isinstance(getattr(k, "key", None), str)][-1]
        spec = spec_of(name)
        assert len(spec) <= leaf.ndim, name
        axes = [i for i, axis in enumerate(spec) if axis == AXIS]
        assert all(leaf.shape[i] % tp == 0 for i in axes), (name, leaf.shape, spec)
        split[name] = bool(axes)
    return split
