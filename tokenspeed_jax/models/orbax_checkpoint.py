"""Converted checkpoints: an NNX state saved with orbax beside config.json and tokenizer files.

Layout of a converted directory::

    config.json       the model config's to_hf() (its model_type names the family)
    nnx_state/        orbax StandardCheckpointer save of nnx.state(model)
    tokenizer.json, tokenizer_config.json

Invariants:

* Restore goes straight into the abstract state of ``nnx.eval_shape``: no random init, no second
  copy; orbax casts to the abstract state's dtype, so any saved dtype loads as any requested one.
* With ``shardings`` (tensor parallelism: the family's ``state_shardings`` over a mesh), every
  leaf of the abstract state carries its ``NamedSharding``, so orbax reads each device's shard
  straight into place.
* The saved tree must match the model's tree exactly (same paths and shapes); otherwise the
  restore fails with a ValueError naming the directory.
* orbax is imported by the first save or restore: a start from an HF directory or a GGUF file
  never pays for its import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from flax import nnx

STATE_DIR = "nnx_state"


def is_orbax_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / STATE_DIR).is_dir()


def save_orbax(model: Any, dst: str | os.PathLike) -> None:
    """Write config.json and the model's NNX state under ``dst`` (which must not hold a state)."""
    root = Path(dst)
    if (root / STATE_DIR).exists():
        raise ValueError(f"{root / STATE_DIR} already exists; refusing to overwrite")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "config.json", "w", encoding="utf-8") as f:
        json.dump(model.config.to_hf(), f, indent=2)
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((root / STATE_DIR).absolute(), nnx.state(model))
    checkpointer.wait_until_finished()


def restore_orbax(model_abstract: Any, src: str | os.PathLike,
                  shardings: Callable[[Any], Any] | None = None) -> Any:
    """Fill an abstract model (from ``nnx.eval_shape``) with the state saved under ``src``;
    ``shardings``: abstract state -> a tree like it of the shardings to restore into."""
    import orbax.checkpoint as ocp

    graphdef, abstract_state = nnx.split(model_abstract)
    if shardings is not None:
        abstract_state = jax.tree_util.tree_map(
            lambda spec, sharding: jax.ShapeDtypeStruct(spec.shape, spec.dtype,
                                                        sharding=sharding),
            abstract_state, shardings(abstract_state))
    state_dir = (Path(src) / STATE_DIR).absolute()
    try:
        state = ocp.StandardCheckpointer().restore(state_dir, abstract_state)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise ValueError(f"{state_dir}: cannot restore the model state ({e})") from e
    return nnx.merge(graphdef, state)
