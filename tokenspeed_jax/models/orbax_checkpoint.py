"""Converted checkpoints: an NNX state saved with orbax beside config.json and tokenizer files.

Layout of a converted directory::

    config.json       LlamaConfig.to_hf()
    nnx_state/        orbax StandardCheckpointer save of nnx.state(model)
    tokenizer.json, tokenizer_config.json

Invariants:

* Restore goes straight into the abstract state of ``nnx.eval_shape``: no random init, no second
  copy; orbax casts to the abstract state's dtype, so any saved dtype loads as any requested one.
* With a ``mesh``, every leaf of the abstract state carries its tensor-parallel
  ``NamedSharding`` (``parallel.llama_state_shardings``), so orbax reads each device's shard
  straight into place.
* The saved tree must match the model's tree exactly (same paths and shapes); otherwise the
  restore fails with a ValueError naming the directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from tokenspeed_jax import parallel
from tokenspeed_jax.models.llama import LlamaForCausalLM

STATE_DIR = "nnx_state"


def is_orbax_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / STATE_DIR).is_dir()


def save_orbax(model: LlamaForCausalLM, dst: str | os.PathLike) -> None:
    """Write config.json and the model's NNX state under ``dst`` (which must not hold a state)."""
    root = Path(dst)
    if (root / STATE_DIR).exists():
        raise ValueError(f"{root / STATE_DIR} already exists; refusing to overwrite")
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "config.json", "w", encoding="utf-8") as f:
        json.dump(model.config.to_hf(), f, indent=2)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save((root / STATE_DIR).absolute(), nnx.state(model))
    checkpointer.wait_until_finished()


def restore_orbax(model_abstract: LlamaForCausalLM, src: str | os.PathLike,
                  mesh: Mesh | None = None) -> LlamaForCausalLM:
    """Fill an abstract model (from ``nnx.eval_shape``) with the state saved under ``src``;
    ``mesh``: restore each tensor sharded over it."""
    graphdef, abstract_state = nnx.split(model_abstract)
    if mesh is not None:
        shardings = parallel.llama_state_shardings(abstract_state, model_abstract.config, mesh)
        abstract_state = jax.tree_util.tree_map(
            lambda spec, sharding: jax.ShapeDtypeStruct(spec.shape, spec.dtype,
                                                        sharding=sharding),
            abstract_state, shardings)
    state_dir = (Path(src) / STATE_DIR).absolute()
    try:
        state = ocp.StandardCheckpointer().restore(state_dir, abstract_state)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise ValueError(f"{state_dir}: cannot restore the model state ({e})") from e
    return nnx.merge(graphdef, state)
