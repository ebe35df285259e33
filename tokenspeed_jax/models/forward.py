"""A family's forward in segments: what ``engine/runner.py`` asks of a model family to serve it.

Each family folder declares one ``Forward`` subclass (named by ``Family.forward``) that says, for
its model: how the prefill forward of each route splits into pieces (``graph.pieces``: which are
breaks), the whole-step decode body, the host arrays its pieces read besides the common ones, and
its settings that depend on the platform. The runner owns everything else: the cache pools (from
the family's ``cache_pools``), buckets, page tables, the compile loop, the head and sampler, the
token board, routes, state-row restores and counters.

Invariants:

* Every prefill plan (``prefill_plan(route, pools)``) reads ``("token_ids", "positions", "rows",
  *prefill_inputs, *pools)`` and returns ``("rows_hidden", *pools)``: the hidden rows of the
  sampled requests' last tokens, gathered by the plan itself (``rows``), and every pool
  (donated where a break writes it). Its metadata is what ``prefill_arrays`` returns.
* ``decode_layers(params, meta, token_ids, pools)`` embeds one token per row and runs every layer
  on it with attention inside, writing each row's cache entries: (hidden, pools). ``params`` is
  ``(outer_state, layer states)``, the layer states a tuple or, when the runner stacks them
  (``stacks_decode_weights``), one stacked state.
* Host-array hooks never touch the device; their padding rows hold -1 slots and requests, so a
  padding row never writes a page or a state row.
* Models sit below the engine: a forward imports no engine module. Everything a forward's stage
  functions read besides their arguments is in ``fingerprint_parts`` or in the model's graph
  definition (both go into the executable cache key). A graph definition enters the key as
  ``structure_key``: its structure alone, so a model drawn at random and the same model filled
  from a checkpoint share their executables.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.typing import HashableMapping

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.graph import Piece, Plan, abstract


def alternates_decode_executables(config: EngineConfig, platform: str) -> bool:
    """Whether decode steps take turns between two loaded copies of each decode executable: an
    explicit setting, else on one GPU (command buffers are a GPU runtime's)."""
    if config.alternate_decode_executables is not None:
        return config.alternate_decode_executables
    return platform == "gpu" and config.tensor_parallel_size == 1


def sampled_rows(params: Any, hidden: jax.Array, rows: jax.Array) -> tuple:
    """The hidden rows ``rows`` (each sampled request's last token), for the head."""
    del params
    return (jnp.take(hidden, rows, axis=0),)


ROWS_PIECE = Piece(("rows",), sampled_rows, ("hidden", "rows"), ("rows_hidden",))


def structure_key(graphdef: Any) -> str:
    """An NNX graph definition's ``repr`` with each node's metadata in sorted key order: flax
    compares definitions regardless of that order but prints it as built, and a model drawn at
    random lists its variables' metadata in another order than one filled from a checkpoint."""
    def canonical(node: Any) -> Any:
        metadata = getattr(node, "metadata", None)
        if not dataclasses.is_dataclass(node) or not isinstance(metadata, Mapping):
            return node
        return dataclasses.replace(node, metadata=HashableMapping(
            dict(sorted(metadata.items(), key=lambda item: str(item[0])))))

    nodes = type(graphdef.nodes)(map(canonical, graphdef.nodes))
    return repr(dataclasses.replace(graphdef, nodes=nodes))


class Forward(abc.ABC):
    """One family's forward over a model (module docstring). Subclasses set, besides what
    ``_split`` sets: ``prefill_routes`` (the compiled prefill routes, the first the default),
    ``eager_route`` (the plan a step too large for the buckets runs op by op),
    ``alternate_decode`` and ``scale``."""

    # Prefill plans per (token bucket, request bucket) when the pieces' inputs are sized by the
    # request count; otherwise per token bucket, with ``table_rows`` rows of requests.
    plans_per_request_bucket = False
    # Whether a step larger than the largest buckets may cut a request at a token boundary
    # (chunked prefill); otherwise its groups hold whole requests, and a request larger than the
    # largest token bucket runs ``eager_route`` at its exact size.
    splits_prefill = True
    supports_prefill_graph = True
    supports_decode_graph = True
    prefill_routes: tuple[str, ...]
    eager_route: str
    alternate_decode: bool
    scale: float

    def _split(self, model: Any, config: EngineConfig, mesh: Any) -> None:
        """The model apart: its graph definition, the layers' states (``layer_states``) and the
        rest (``outer_state``: embedding, final norm, head)."""
        self.config = config
        self.model_config = model.config
        self.mesh = mesh
        self.dtype = getattr(model, "dtype", jnp.float32)
        self.model_classes = {type(m) for _, m in nnx.iter_modules(model)}
        self.layer_states = [nnx.state(layer) for layer in model.layers]
        self.model_def, layers_state, self.outer_state = nnx.split(
            model, nnx.PathContains("layers"), ...)
        self._layers_placeholder = abstract(layers_state)

    def outer(self, outer_state: Any) -> Any:
        """The model without its layers: ``embed`` and ``head``."""
        return nnx.merge(self.model_def, self._layers_placeholder, outer_state)

    def embed(self, params: Any, token_ids: jax.Array) -> tuple:
        return (self.outer(params).embed(token_ids),)

    def embed_piece(self) -> Piece:
        return Piece(("embed",), self.embed, ("token_ids",), ("hidden",), self.outer_state)

    def prefill_route(self, requests: Sequence[Any]) -> str:
        """The compiled prefill route of a step of ``requests``: the first by default."""
        del requests
        return self.prefill_routes[0]

    @abc.abstractmethod
    def prefill_plan(self, route: str, pools: Sequence[str]) -> Plan:
        """The prefill plan of ``route`` over the pools named ``pools`` (module docstring)."""

    @abc.abstractmethod
    def prefill_arrays(self, requests: Sequence[Any], packed: Any, num_rows: int
                       ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """(the family's plan inputs, the plan's metadata) of one packed group of ``requests``
        (``engine.runner.PackedTokens``) with ``num_rows`` request rows."""

    @abc.abstractmethod
    def decode_layers(self, params: Any, meta: Mapping[str, jax.Array], token_ids: jax.Array,
                      pools: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        """One decode step's body (module docstring)."""

    @abc.abstractmethod
    def decode_field_defaults(self, rows: int) -> dict[str, np.ndarray]:
        """The family's own decode metadata fields of ``rows`` padding rows."""

    @abc.abstractmethod
    def write_decode_fields(self, fields: dict[str, np.ndarray],
                            requests: Sequence[Any]) -> None:
        """Write the family's own decode fields of ``requests`` (the common ones written)."""

    @abc.abstractmethod
    def fingerprint_parts(self) -> list[str]:
        """What the stage functions read besides their arguments (module docstring)."""

    @staticmethod
    def extra_device_bytes(config: EngineConfig, model: Any) -> int:
        """Device bytes a runner of ``model`` adds besides its caches (none by default)."""
        del config, model
        return 0

    def stacks_decode_weights(self) -> bool:
        """Whether the small decode buckets take the layer weights stacked (none by default)."""
        return False
