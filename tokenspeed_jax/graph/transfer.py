"""Host -> device transfer of a plan's metadata: every leaf of one run in one runtime call.

``jax.device_put`` of numpy arrays spends most of its host time in Python (pytree flattening,
per-leaf checks, primitive dispatch) before it reaches one C++ call, ``shard_args``, that
makes the device arrays. A replay step transfers its metadata every run, so ``put_host_leaves``
calls that C++ path directly, without that Python front.
Invariants:

* The result is what ``jax.device_put(leaves, sharding)`` returns, value for value: the same
  copy semantics (``REUSE_INPUT``: on the CPU a numpy buffer may be aliased, so callers hand
  over fresh host arrays and never write to them afterwards), every leaf placed with
  ``sharding`` (committed to it).
* ``shard_args`` is a private jax function. ``put_host_leaves`` reads it on first use and a jax
  that moved or changed it fails there, naming the jax version, instead of slowing down unseen.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding, SingleDeviceSharding


@functools.cache
def _runtime() -> tuple[Any, Any, Any]:
    """(shard_args, REUSE_INPUT, the default device) from jax's internals."""
    try:
        from jax._src.interpreters import pxla
        from jax._src.lib import xla_client
        return (pxla.shard_args, xla_client.ArrayCopySemantics.REUSE_INPUT,
                pxla.get_default_device)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(
            f"jax {jax.__version__}: the host->device path tokenspeed_jax uses for step metadata "
            f"(pxla.shard_args) is gone ({e}); graph/transfer.py needs updating for this jax"
        ) from e


def default_sharding() -> Sharding:
    """Where ``jax.device_put(x)`` without a device puts ``x``: the default device."""
    return SingleDeviceSharding(_runtime()[2]())


def put_host_leaves(leaves: Sequence[np.ndarray], sharding: Sharding) -> list[jax.Array]:
    """``leaves`` (numpy arrays) as device arrays placed with ``sharding``, in one call."""
    shard_args, reuse, _ = _runtime()
    count = len(leaves)
    return list(shard_args([sharding] * count, [None] * count, [reuse] * count, leaves))
