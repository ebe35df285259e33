"""HF model directories: config.json and safetensors weights, read one tensor at a time.

Invariants:

* Weights are read lazily with the safetensors numpy API; at most one tensor is materialised
  on the host at a time by ``iter_hf_tensors``.
* A sharded checkpoint is read through ``model.safetensors.index.json``; every shard it names
  must exist. Without an index, every ``*.safetensors`` file in the directory is read.
* Unreadable input (config.json not JSON, a corrupt safetensors header, a missing shard) is a
  ValueError naming the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"


class WeightEntry(NamedTuple):
    """Where one checkpoint tensor goes: state path, checkpoint shape, layout change, and for a
    tensor that fills only part of its parameter the index of that part (numpy-style: a
    per-expert tensor's row ``e`` of a stacked ``[E, ...]`` parameter, or a column range
    ``np.s_[:, a:b]`` of parameters stored side by side; a ``fill_state`` entry)."""

    path: tuple[str | int, ...]
    hf_shape: tuple[int, ...]
    transform: Any
    part: Any = None


def read_json(path: Path) -> Any:
    """Parse a JSON file; a missing or malformed file is a ValueError naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError as e:
        raise ValueError(f"{path}: file not found") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def check_tensor(source: str, name: str, shape: tuple[int, ...], expected: tuple[int, ...],
                 filled: set[str]) -> None:
    """A checkpoint tensor must come once and have the HF-layout shape its weight map expects."""
    if name in filled:
        raise ValueError(f"{source}: tensor {name!r} appears more than once")
    if tuple(shape) != expected:
        raise ValueError(f"{source}: tensor {name!r} has shape {tuple(shape)}, "
                         f"expected {expected}")


def check_all_used(source: str, model_type: str, unused: list[str], expected: Iterable[str],
                   filled: set[str]) -> None:
    """Every checkpoint tensor was used and every expected name was filled."""
    if unused:
        raise ValueError(f"{source}: tensors not used by the {model_type} model: {unused}")
    missing = sorted(set(expected) - filled)
    if missing:
        raise ValueError(f"{source}: tensors missing from the checkpoint: {missing}")


def leaf_holder(values: dict, path: tuple) -> tuple[dict, Any]:
    """The nested dict of a pure state dict that holds `path`'s leaf, and the leaf's key."""
    *parents, leaf = path
    node = values
    for key in parents:
        node = node[key]
    return node, leaf


def fill_state(
    state: Any,
    weight_map: Mapping[str, Any],
    tensors: Iterable[tuple[str, np.ndarray]],
    *,
    source: str,
    model_type: str,
    ignored: Callable[[str], bool],
    place: Callable[[tuple, np.ndarray, Any], Any],
) -> None:
    """Fill an abstract NNX ``state`` in place from (checkpoint name, array) pairs.

    ``weight_map`` maps a checkpoint name to an entry with ``path``, ``hf_shape``, ``transform``
    and, for a tensor filling part of its parameter, ``part`` (the part's index; None
    otherwise): the parts are gathered on the host and the parameter placed once.
    ``place(path, value, dtype)`` makes the device array (on the parameter's sharding). Shapes,
    duplicates, unused tensors (unless ``ignored``) and unfilled parameters are errors naming
    the tensor (``check_tensor``, ``check_all_used``).
    """
    values = state.to_pure_dict()
    filled: set[str] = set()
    unused: list[str] = []
    gathered: dict[tuple, np.ndarray] = {}  # parameters filled part by part, on the host
    for name, array in tensors:
        entry = weight_map.get(name)
        if entry is None:
            if not ignored(name):
                unused.append(name)
            continue
        check_tensor(source, name, array.shape, entry.hf_shape, filled)
        node, leaf = leaf_holder(values, entry.path)
        value = entry.transform(np.asarray(array))
        if entry.part is None:
            node[leaf] = place(entry.path, value, node[leaf].dtype)
        else:
            if entry.path not in gathered:
                gathered[entry.path] = np.empty(node[leaf].shape, value.dtype)
            gathered[entry.path][entry.part] = value
        filled.add(name)
    check_all_used(source, model_type, unused, weight_map, filled)
    for path, whole in gathered.items():
        node, leaf = leaf_holder(values, path)
        node[leaf] = place(path, whole, node[leaf].dtype)
    state.replace_by_pure_dict(values)


def is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The config.json of an HF (or converted) directory, as a dict."""
    config = read_json(Path(path) / "config.json")
    if not isinstance(config, dict):
        raise TypeError(f"{Path(path) / 'config.json'}: expected a JSON object")
    return config


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The weight files of an HF directory, in a stable order."""
    root = Path(path)
    index_path = root / INDEX_FILE
    if index_path.is_file():
        index = read_json(index_path)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path}: missing a 'weight_map' object")
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index_path}: shards listed but not found: {missing}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{root}: no *.safetensors files")
    return files


def iter_hf_tensors(path: str | os.PathLike) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF tensor name, numpy array) for every tensor of every shard."""
    for file in safetensors_files(path):
        try:
            handle = safe_open(file, framework="numpy")
        except Exception as e:  # safetensors raises its own error type for bad headers
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
        with handle as f:
            names = list(f.keys())
            for name in names:
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise ValueError(f"{file}: cannot read tensor {name!r} ({e})") from e
                yield name, tensor
