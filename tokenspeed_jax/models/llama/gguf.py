"""The Llama family's GGUF files (llama.cpp): architecture metadata and tensors, renamed to HF
names.

``gguf_file`` parses the header; this module turns it into a LlamaConfig and HF tensors. Renaming
and value transforms are separate steps: ``hf_name`` maps a GGUF tensor name to the HF name,
``iter_gguf_tensors`` dequantizes to float32 in HF layout and undoes llama.cpp's Q/K row
permutation. From there on a GGUF checkpoint is indistinguishable from an HF one.

Invariants:

* ``GGUFFile.tensor_bytes`` is in numpy order (``[out, in_bytes]``), the reverse of GGUF's ``ne``
  order; ``gguf.quants.dequantize`` returns ``[out, in]``, HF's Linear layout.
* llama.cpp's converter reorders the rows of each head of llama ``attn_q`` / ``attn_k`` from
  rotate-half order (``[2, Dh/2]``) to interleaved pairs (``[Dh/2, 2]``); ``unpermute_qk``
  reverses exactly that. Qwen2/Qwen3 GGUFs are written unpermuted.
* A truncated or corrupt file is a ValueError naming the file (see ``gguf_file``), raised when it
  is opened, before any tensor is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import gguf
import numpy as np

from tokenspeed_jax.models.gguf_file import GGUFFile
from tokenspeed_jax.models.llama.model import SUPPORTED_MODEL_TYPES, LlamaConfig

SUPPORTED_QUANTS = frozenset({
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
    gguf.GGMLQuantizationType.Q8_0,
    gguf.GGMLQuantizationType.Q4_0,
    gguf.GGMLQuantizationType.Q4_1,
})

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp permutes the Q/K rows of these architectures only (module docstring)
PERMUTED_QK_ARCHITECTURES = ("llama",)


def _float32_value(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def config_from_gguf(gguf_file: GGUFFile) -> LlamaConfig:
    """Build a LlamaConfig from ``{arch}.*`` metadata; the vocab is the tokenizer's list."""
    field = gguf_file.field
    arch = gguf_file.architecture
    if arch not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; expected one of "
                         f"{SUPPORTED_MODEL_TYPES}")
    scaling_type = field(f"{arch}.rope.scaling.type", "none")
    tensor_names = {t.name for t in gguf_file.tensors}
    if scaling_type != "none" or "rope_freqs.weight" in tensor_names:
        raise ValueError(f"GGUF rope scaling ({scaling_type=}, rope_freqs) is not supported")
    hidden = int(field(f"{arch}.embedding_length"))
    heads = int(field(f"{arch}.attention.head_count"))
    if "tokenizer.ggml.tokens" in gguf_file.metadata:
        vocab = len(gguf_file.metadata["tokenizer.ggml.tokens"])
    else:
        vocab = int(field(f"{arch}.vocab_size"))
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(field(f"{arch}.feed_forward_length")),
        num_hidden_layers=int(field(f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=_float32_value(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=_float32_value(field(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(field(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        qk_norm=arch == "qwen3",
        attention_bias=arch == "qwen2",
        model_type=arch,
    )


def hf_name(gguf_name: str) -> str:
    """The HF tensor name for a GGUF tensor name; an unknown name is a ValueError."""
    block = _BLOCK_TENSOR.fullmatch(gguf_name)
    if block:
        layer, part, suffix = block.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{suffix}"
    else:
        stem, _, suffix = gguf_name.rpartition(".")
        if stem in _GLOBAL_NAMES and suffix in ("weight", "bias"):
            return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no HF counterpart")


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Rows per head from llama.cpp's interleaved-pair order back to rotate-half order."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"Q/K weight with {rows=} rows does not split into {num_heads=} heads")
    head_dim = rows // num_heads
    per_head = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return per_head.swapaxes(1, 2).reshape(weight.shape)


def iter_gguf_tensors(
    gguf_file: GGUFFile, config: LlamaConfig
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, float32 array in HF layout) for every tensor, one at a time."""
    permuted_heads = {}
    if config.model_type in PERMUTED_QK_ARCHITECTURES:
        permuted_heads = {"attn_q": config.num_attention_heads,
                          "attn_k": config.num_key_value_heads}
    for tensor in gguf_file.tensors:
        if tensor.ggml_type not in SUPPORTED_QUANTS:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has unsupported type {tensor.ggml_type.name}"
            )
        name = hf_name(tensor.name)
        raw = gguf_file.tensor_bytes(tensor)
        values = gguf.quants.dequantize(raw, tensor.ggml_type).astype(np.float32)
        block = _BLOCK_TENSOR.fullmatch(tensor.name)
        if block and block.group(2) in permuted_heads and block.group(3) == "weight":
            values = unpermute_qk(values, permuted_heads[block.group(2)])
        yield name, values
