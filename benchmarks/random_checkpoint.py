"""Random-weight Llama checkpoints in HF layout, written on the host, for benchmarks.

``write_random_checkpoint(model_dir, shape, tokenizer_dir)`` writes ``config.json``,
``generation_config.json``, the tokenizer files of ``tokenizer_dir`` and the weights of a Llama
of ``shape`` (a ``LlamaConfig``; ``shape_config(name, num_layers)`` gives one of
``bench_graph.SHAPES``) into ``model_dir``, which then loads both through
``tokenspeed_jax.models.loader.load_model`` (the server's path) and through transformers.

Invariants:

* Nothing runs through JAX: the weights come from numpy's generator on the host, so writing a
  checkpoint compiles nothing. The tensor names and HF-layout shapes are the loader's own
  (``LlamaForCausalLM.hf_weight_map``), so every tensor written is one the loader fills.
* Deterministic: the same shape, tokenizer, seed and dtype give the same weights. Each tensor
  draws from its own generator, seeded by (seed, its position in the weight map), so the
  threads that fill tensors in parallel change nothing.
* Norm weights are ones; every other tensor is N(0, 0.02), stored as float32 or bfloat16.
* A tokenizer directory is required: the loader reads ``tokenizer.json`` from the model
  directory and fails without it. Its vocabulary may be smaller than the model's (a 49152-token
  tokenizer with the 128256-row 8B shape), never larger.
* The embedding rows (and ``lm_head`` rows when untied) of every id greedy decoding must never
  pick are zero: special tokens, tokens whose lone decoding is empty or not whole UTF-8, and the
  ids past the tokenizer's vocabulary. Their logits are exactly 0 while the largest of the
  others is positive, so greedy decoding never stops at EOS and every token it picks decodes to
  text.
* Weights go into shards of at most ``max_shard_bytes`` (a tensor larger than that gets a shard
  of its own): one ``model.safetensors`` when they all fit, else ``model-0000i-of-0000N``
  files with ``model.safetensors.index.json``. Host memory holds one shard at a time.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
from bench_graph import SHAPES  # a sibling script

from tokenspeed_jax.models.hf_checkpoint import INDEX_FILE
from tokenspeed_jax.models.llama import LlamaConfig, LlamaForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
OPTIONAL_TOKENIZER_FILES = ("chat_template.jinja",)
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
INIT_STD = 0.02


def shape_config(name: str, num_layers: int | None = None) -> LlamaConfig:
    """``bench_graph.SHAPES[name]``, with ``num_layers`` decoder layers when given."""
    shape = SHAPES[name]
    if num_layers is None:
        return shape
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    return dataclasses.replace(shape, num_hidden_layers=num_layers)


def load_tokenizer(tokenizer_dir: Path):
    """The ``tokenizers.Tokenizer`` of ``tokenizer_dir/tokenizer.json``."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))


def never_picked_token_ids(tokenizer, vocab_size: int) -> list[int]:
    """Ids below ``vocab_size`` that must never be sampled: the tokenizer's special tokens, its
    tokens whose lone decoding is empty or not whole UTF-8 (U+FFFD), and every id past its
    vocabulary."""
    special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    known = range(tokenizer.get_vocab_size())
    texts = tokenizer.decode_batch([[i] for i in known], skip_special_tokens=False)
    return [i for i, text in zip(known, texts, strict=True)
            if i in special or not text or "\ufffd" in text] + list(range(len(known), vocab_size))


def random_tensor(name: str, dims: tuple[int, ...], zero_rows: list[int], seed: int,
                  index: int, dtype: np.dtype) -> np.ndarray:
    """One tensor: ones for a norm, else N(0, INIT_STD) from generator (seed, index); the
    ``zero_rows`` of a vocabulary tensor are zero."""
    if name.endswith("norm.weight"):
        return np.ones(dims, dtype)
    values = np.random.default_rng([seed, index]).standard_normal(dims, dtype=np.float32)
    values *= np.float32(INIT_STD)
    if name in VOCAB_TENSORS:
        values[zero_rows] = 0.0
    return values.astype(dtype, copy=False)


def shard_names(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped in order into shards of at most ``max_shard_bytes`` each."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_weights(model_dir: Path, shape: LlamaConfig, zero_rows: list[int], seed: int,
                  dtype: np.dtype, max_shard_bytes: int) -> None:
    """Every tensor of ``shape``'s weight map, in shards (see the module invariants)."""
    from safetensors.numpy import save_file

    dims = {name: entry.hf_shape for name, entry in LlamaForCausalLM.hf_weight_map(shape).items()}
    index = {name: i for i, name in enumerate(dims)}
    sizes = {name: int(np.prod(d)) * dtype.itemsize for name, d in dims.items()}
    shards = shard_names(sizes, max_shard_bytes)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])

    def make(name: str) -> np.ndarray:
        return random_tensor(name, dims[name], zero_rows, seed, index[name], dtype)

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        for names, file in zip(shards, files, strict=True):
            save_file(dict(zip(names, pool.map(make, names), strict=True)), str(model_dir / file))
    if len(shards) > 1:
        weight_map = {name: file for names, file in zip(shards, files) for name in names}
        (model_dir / INDEX_FILE).write_text(json.dumps(
            {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map},
            indent=1), encoding="utf-8")


def write_shape_checkpoint(model_dir: Path, name: str, tokenizer_dir: Path, *,
                           num_layers: int | None = None, dtype: str = "float32") -> None:
    """A random checkpoint of ``shape_config(name, num_layers)``, its vocabulary widened to
    the tokenizer's where that is larger (the tiny shape's 256 rows)."""
    shape = shape_config(name, num_layers)
    vocab_size = max(shape.vocab_size, load_tokenizer(tokenizer_dir).get_vocab_size())
    write_random_checkpoint(model_dir, dataclasses.replace(shape, vocab_size=vocab_size),
                            tokenizer_dir, dtype=dtype)


def write_random_checkpoint(model_dir: Path, shape: LlamaConfig, tokenizer_dir: Path, *,
                            seed: int = 0, dtype: str = "float32",
                            max_shard_bytes: int = 4 << 30) -> None:
    """A random Llama of ``shape`` in HF layout with ``tokenizer_dir``'s tokenizer files; see the
    module invariants."""
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text("utf-8"))
    tokenizer = load_tokenizer(tokenizer_dir)
    if tokenizer.get_vocab_size() > shape.vocab_size:
        raise ValueError(f"the tokenizer in {tokenizer_dir} has {tokenizer.get_vocab_size()} "
                         f"tokens, more than the model's vocabulary of {shape.vocab_size}")
    ids = {f"{role}_token_id": tokenizer.token_to_id(tokenizer_config[f"{role}_token"])
           for role in ("bos", "eos", "pad") if tokenizer_config.get(f"{role}_token")}

    model_dir.mkdir(parents=True, exist_ok=True)
    config = shape.to_hf() | ids | {"architectures": ["LlamaForCausalLM"], "dtype": dtype}
    (model_dir / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    (model_dir / "generation_config.json").write_text(json.dumps(ids, indent=1), encoding="utf-8")
    for name in TOKENIZER_FILES + OPTIONAL_TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, model_dir / name)
    write_weights(model_dir, shape, never_picked_token_ids(tokenizer, shape.vocab_size), seed,
                  DTYPES[dtype], max_shard_bytes)
