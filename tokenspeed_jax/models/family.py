"""The model-family seam: what a family of models declares, in one place.

A family is a folder under ``models/`` (``llama/``, ``kimi_linear/``) whose ``family.py`` fills
one ``Family``: the ``model_type`` values it accepts, how its config is built from a checkpoint's
config.json (and from GGUF metadata where it reads GGUF files), its model class, its checkpoint
weight map, its tensor-parallel rules, its cache pools (``cache_spec``), its forward in segments
(``models/forward.py``: the pieces of each route, which ``engine/runner.py`` serves) and its
reference generator. ``models/registry.py`` maps a config to its family;
no other module tells families apart.

Invariants:

* A family holds only functions of a config: it has no state, and two lookups of one
  ``model_type`` give the same object.
* Its model class takes ``(config, *, dtype, param_dtype, rngs)``; its configs carry
  ``model_type``, one of ``model_types``, and ``to_hf()``, which ``config_from_hf`` reads back
  to an equal config.
* ``param_spec`` knows every parameter of the family's models by its last path name and refuses
  an unknown one (ValueError), so a new parameter cannot silently stay replicated;
  ``check_split`` raises ValueError naming the numbers for a split the config cannot take, before
  any weight is placed.
* The forward and the reference generator are named ``"module:attribute"`` and imported on first
  use: models sit below the engine and never import it.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tokenspeed_jax import parallel
from tokenspeed_jax.models.cache_spec import CachePool
from tokenspeed_jax.models.layers import SHAPE_ONLY

if TYPE_CHECKING:
    from tokenspeed_jax.models.gguf_file import GGUFFile


@dataclasses.dataclass(frozen=True)
class GGUFReader:
    """How a family reads a GGUF file: its config from the metadata, and its tensors as
    (HF name, float32 array in HF layout) pairs."""

    config: Callable[[GGUFFile], Any]
    tensors: Callable[[GGUFFile, Any], Iterator[tuple[str, np.ndarray]]]


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family's declaration (module docstring)."""

    name: str
    model_types: tuple[str, ...]
    config_from_hf: Callable[[Mapping[str, Any]], Any]
    model_class: type
    # config -> {checkpoint tensor name: entry with path, hf_shape, transform (, expert)}
    weight_map: Callable[[Any], Mapping[str, Any]]
    # (tensor name, config) -> whether a checkpoint tensor may go unused
    ignored_tensor: Callable[[str, Any], bool]
    check_split: Callable[[Any, int], None]
    param_spec: Callable[[str, Any, int], PartitionSpec]
    # (config, page_size, dtype, state_dtype, tensor_parallel_size) -> the cache's pools
    # (``cache_spec``): page and state-row bytes and the runner's arrays all come from them
    cache_pools: Callable[[Any, int, Any, Any, int], list[CachePool]]
    # (config, mesh, cache names) -> {plan value name: sharding} of the runner's plans under
    # tensor parallelism: the hand-off values split by head and every named cache
    plan_value_shardings: Callable[[Any, Mesh, Sequence[str]], Mapping[str, NamedSharding]]
    forward: str
    reference: str
    # whether each running request also holds a row of recurrent state (``SLOT`` pools)
    has_recurrent_state: bool = False
    gguf: GGUFReader | None = None
    # (tensor name, config) -> the name ``weight_map`` knows it by, for checkpoints that spell
    # some names their own way (applied before anything else reads them); None: names as they are
    checkpoint_name: Callable[[str, Any], str] | None = None

    def abstract_model(self, config: Any, dtype: Any) -> Any:
        """The model's structure with ShapeDtypeStruct leaves; nothing allocated."""
        return nnx.eval_shape(lambda: self.model_class(config, dtype=dtype, param_dtype=dtype,
                                                       rngs=SHAPE_ONLY))

    def param_sharding(self, path: Any, config: Any, mesh: Mesh) -> NamedSharding:
        """The NamedSharding of the parameter at ``path`` (a loader path or a state path)."""
        return NamedSharding(mesh, self.param_spec(parallel.param_name(path), config, mesh.size))

    def state_shardings(self, state: Any, config: Any, mesh: Mesh) -> Any:
        """A tree like ``state`` (an NNX state of a model or of one layer) of NamedShardings."""
        self.check_split(config, mesh.size)
        return jax.tree_util.tree_map_with_path(
            lambda path, _: self.param_sharding(path, config, mesh), state)

    def placer(self, config: Any, mesh: Mesh | None) -> Callable[[Any, Any, Any], jax.Array]:
        """``place(path, host value, dtype)``: the device array of a loaded parameter, straight
        onto its sharding over ``mesh`` (on the default device without one)."""
        def place(path: Any, value: Any, dtype: Any) -> jax.Array:
            sharding = None if mesh is None else self.param_sharding(path, config, mesh)
            return parallel.place_array(value, dtype, sharding)

        return place

    def place_model(self, model: Any, mesh: Mesh) -> None:
        """Move ``model``'s weights onto their shardings in place (a no-op for weights already
        there, e.g. loaded with this mesh)."""
        state = nnx.state(model)
        nnx.update(model, jax.device_put(state, self.state_shardings(state, model.config, mesh)))

    def forward_class(self) -> type:
        """The family's ``Forward`` class (its forward in segments)."""
        return _resolve(self.forward)

    def reference_generator(self) -> type:
        """The reference generator class (plain forward) of this family."""
        return _resolve(self.reference)


def _resolve(target: str) -> Any:
    """The attribute a ``"module:attribute"`` name points at."""
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)
