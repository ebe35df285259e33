"""Tiny random-weight Kimi-Linear checkpoints and transformers' logits and greedy tokens for them.

Writes, under the golden directory, for each tiny config (``tiny_kimi``: ``q_lora_rank`` null as in
Kimi-Linear-48B-A3B; ``tiny_kimi_qlora``: a low-rank query path):

- ``<name>/``: config.json in the checkpoint's own format (``model_type: kimi_linear``,
  ``linear_attn_config`` with 1-indexed ``kda_layers`` / ``full_attn_layers``,
  ``first_k_dense_replace``, ``num_experts``, ...) and model.safetensors with the checkpoint's
  tensor names (``self_attn.q_conv1d``, ``self_attn.f_a_proj``, ``self_attn.A_log``,
  ``block_sparse_moe.experts.<e>.w1``, ``block_sparse_moe.gate.e_score_correction_bias``, ...).
  transformers renames these on load (its ``conversion_mapping``); the script writes the names by
  hand and checks that ``from_pretrained`` fills every parameter with exactly the saved values.
- ``tiny_kimi_hf/``: a checkpoint as transformers itself writes one: ``save_pretrained`` of a
  model built from ``KimiLinearConfig``'s own arguments. Its config.json has ``layer_types``,
  ``linear_*`` and ``mlp_layer_types`` and no ``linear_attn_config``, ``first_k_dense_replace``
  or ``mla_use_nope``; its tensors are named as above except a dense layer's MLP
  (``block_sparse_moe.gate_proj`` where the checkpoint format has ``mlp.gate_proj``).
- ``<name>.npz``: ``prompt_ids`` int32 [B, T] (two rows, no padding), ``logits`` float32 [B, T, V]
  of one fp32 forward of the prompts; ``greedy_ids`` int32 [B, N], the tokens
  ``generate(do_sample=False)`` appends (transformers' own cache: chunked KDA prefill, then the
  recurrent KDA step and the conv update per token); ``greedy_logits`` float32 [B, N, V], the
  logits each greedy token was picked from (``generate``'s ``output_logits``); ``greedy_margin``
  float32 [B, N], top-1 minus top-2 logit at each greedy step (seeds with a margin under
  ``MIN_GREEDY_MARGIN`` are rejected).

The torch-only path: transformers picks fla's Triton kernels when the ``fla`` package imports, and
fla-core imports even without triton here. The script blocks the ``fla`` and ``causal_conv1d``
imports before transformers is imported, so KimiLinear runs its pure-torch chunked and recurrent
KDA and its ``F.conv1d`` short convolution, on the CPU, in fp32. Run with the golden venv
(``scripts/make_golden.py kimi``, or ``kimi_hf`` for ``tiny_kimi_hf`` alone).
"""

import json
import pathlib
import shutil
import sys
from collections.abc import Callable
from typing import Any

for _blocked in ("fla", "causal_conv1d"):
    sys.modules[_blocked] = None  # an import of these now raises ImportError: torch path only

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, KimiLinearConfig, KimiLinearForCausalLM

VOCAB_SIZE = 256
BATCH = 2
PROMPT_LENGTH = 70  # more than one 64-token KDA chunk
NEW_TOKENS = 12
MIN_GREEDY_MARGIN = 1e-2
MAX_SEED_TRIES = 50
LINEAR_STD = 0.1
NORM_JITTER = 0.1

BASE_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 7,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "mla_use_nope": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "model_max_length": 512,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_shared_experts": 1,
    "num_expert_group": 2,
    "topk_group": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "linear_attn_config": {
        "kda_layers": [1, 2, 4, 5, 7],
        "full_attn_layers": [3, 6],
        "num_heads": 2,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
    },
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}

CONFIGS = {
    "tiny_kimi": BASE_CONFIG,
    "tiny_kimi_qlora": {**BASE_CONFIG, "q_lora_rank": 24, "num_hidden_layers": 4,
                        "linear_attn_config": {**BASE_CONFIG["linear_attn_config"],
                                               "kda_layers": [1, 3, 4], "full_attn_layers": [2]}},
}

# Built from KimiLinearConfig's own arguments and written by save_pretrained: its config.json has
# layer_types, linear_* and mlp_layer_types where the checkpoint's own has linear_attn_config,
# first_k_dense_replace and mla_use_nope, and it names a dense layer's MLP block_sparse_moe.*.
HF_CONFIGS = {
    "tiny_kimi_hf": {
        "vocab_size": VOCAB_SIZE, "hidden_size": 32, "intermediate_size": 64,
        "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 2,
        "num_key_value_heads": 2, "kv_lora_rank": 16, "q_lora_rank": None,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
        "num_local_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2,
        "topk_group": 1, "routed_scaling_factor": 2.446, "linear_num_heads": 2,
        "linear_head_dim": 16,
        "layer_types": ["linear_attention", "full_attention", "linear_attention",
                        "full_attention"],
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "dtype": "float32",
    },
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere (norm weights near one, a nonzero router correction bias)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("A_log"):
                param.copy_(torch.log(torch.empty(param.shape).uniform_(1.0, 16.0,
                                                                         generator=generator)))
            elif name.endswith("dt_bias"):
                param.copy_(0.5 * noise - 2.0)
            elif "norm" in name:
                param.copy_(1.0 + NORM_JITTER * noise)
            else:
                param.copy_(LINEAR_STD * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))


def checkpoint_tensors(model: torch.nn.Module, config: dict) -> dict[str, torch.Tensor]:
    """The model's weights under the checkpoint's own names and layouts."""
    sparse_from = config["first_k_dense_replace"]
    out: dict[str, torch.Tensor] = {}
    state = model.state_dict()
    for name, tensor in state.items():
        tensor = tensor.detach().clone().contiguous()
        parts = name.split(".")
        if name.startswith("model.layers."):
            layer = int(parts[2])
            prefix = f"model.layers.{layer}."
            rest = name[len(prefix):]
            if rest.startswith("self_attn.forget_gate."):
                out[prefix + "self_attn." + rest[len("self_attn.forget_gate."):]] = tensor
                continue
            if rest == "self_attn.conv1d.weight":
                for part, piece in zip("qkv", tensor.chunk(3, dim=0)):
                    out[prefix + f"self_attn.{part}_conv1d.weight"] = piece.contiguous()
                continue
            if rest.startswith("mlp.") and layer >= sparse_from:
                moe = prefix + "block_sparse_moe."
                rest = rest[len("mlp."):]
                if rest == "experts.gate_up_proj":
                    w1, w3 = tensor.chunk(2, dim=1)
                    for e in range(tensor.shape[0]):
                        out[moe + f"experts.{e}.w1.weight"] = w1[e].contiguous()
                        out[moe + f"experts.{e}.w3.weight"] = w3[e].contiguous()
                elif rest == "experts.down_proj":
                    for e in range(tensor.shape[0]):
                        out[moe + f"experts.{e}.w2.weight"] = tensor[e].contiguous()
                else:
                    out[moe + rest] = tensor
                continue
        out[name] = tensor
    return out


def _write_config(directory: pathlib.Path, config: dict) -> None:
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _check_reload(directory: pathlib.Path, original: torch.nn.Module) -> torch.nn.Module:
    """Load with transformers' own loader and require every weight to equal the original's."""
    model, info = KimiLinearForCausalLM.from_pretrained(
        directory, dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"}
    if problems or info.get("error_msgs"):
        raise RuntimeError(f"{directory}: transformers did not load it cleanly: {info}")
    reloaded = dict(model.state_dict())
    for name, tensor in original.state_dict().items():
        if not torch.equal(reloaded[name], tensor):
            raise RuntimeError(f"{directory}: {name} differs after reload")
    return model.eval()


def _greedy(model: torch.nn.Module, prompt: torch.Tensor) -> dict[str, np.ndarray]:
    """The greedy tokens, the logits each was picked from and the top-1 minus top-2 margins."""
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                         max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         output_scores=True, output_logits=True, return_dict_in_generate=True,
                         pad_token_id=0)
    scores = torch.stack(out.scores, dim=1)  # [B, N, V]
    top2 = scores.topk(2, dim=-1).values
    return {"greedy_ids": out.sequences[:, prompt.shape[1]:].numpy().astype(np.int32),
            "greedy_logits": torch.stack(out.logits, dim=1).numpy().astype(np.float32),
            "greedy_margin": (top2[..., 0] - top2[..., 1]).numpy().astype(np.float32)}


def own_format(config: dict) -> tuple[Callable, Callable]:
    """How to make the config and save the weights of a checkpoint in its own format."""
    def new_config(directory: pathlib.Path) -> Any:
        _write_config(directory, config)
        return AutoConfig.from_pretrained(directory)

    def save(model: torch.nn.Module, directory: pathlib.Path) -> None:
        save_file(checkpoint_tensors(model, config), str(directory / "model.safetensors"),
                  metadata={"format": "pt"})

    return new_config, save


def transformers_format(arguments: dict) -> tuple[Callable, Callable]:
    """How to make the config and save the weights of a checkpoint that transformers writes:
    ``KimiLinearConfig(**arguments)`` and ``save_pretrained``."""
    def new_config(directory: pathlib.Path) -> Any:
        shutil.rmtree(directory, ignore_errors=True)
        return KimiLinearConfig(**arguments)

    def save(model: torch.nn.Module, directory: pathlib.Path) -> None:
        model.save_pretrained(directory)

    return new_config, save


def write_model(name: str, form: tuple[Callable, Callable], golden_dir: pathlib.Path) -> None:
    directory = golden_dir / name
    new_config, save = form
    for seed in range(MAX_SEED_TRIES):
        torch.manual_seed(seed)
        original = KimiLinearForCausalLM(new_config(directory)).eval()
        _randomize(original, seed)
        save(original, directory)
        model = _check_reload(directory, original)
        generator = torch.Generator().manual_seed(seed)
        prompt = torch.randint(3, VOCAB_SIZE, (BATCH, PROMPT_LENGTH), generator=generator)
        with torch.no_grad():
            logits = model(prompt).logits.numpy().astype(np.float32)
        greedy = _greedy(model, prompt)
        margin = greedy["greedy_margin"]
        if margin.min() >= MIN_GREEDY_MARGIN:
            np.savez(golden_dir / f"{name}.npz", prompt_ids=prompt.numpy().astype(np.int32),
                     logits=logits, **greedy)
            print(f"{name}: seed {seed}, min greedy margin {margin.min():.3g}")
            return
    raise RuntimeError(f"{name}: no seed in {MAX_SEED_TRIES} gives a clear greedy path")


def check_model(name: str, golden_dir: pathlib.Path) -> None:
    """Re-run the saved checkpoint and compare with the saved golden arrays."""
    data = np.load(golden_dir / f"{name}.npz")
    model = KimiLinearForCausalLM.from_pretrained(golden_dir / name, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(data["prompt_ids"]).long()).logits.numpy()
    if not np.allclose(logits, data["logits"], atol=1e-5, rtol=1e-5):
        raise RuntimeError(f"{name}: logits do not reproduce")
    greedy_logits = data["greedy_logits"]
    if (greedy_logits.shape != (*data["greedy_ids"].shape, VOCAB_SIZE)
            or not np.array_equal(greedy_logits.argmax(-1), data["greedy_ids"])):
        raise RuntimeError(f"{name}: greedy_logits do not pick greedy_ids")


def write_all(golden_dir: pathlib.Path, names: tuple[str, ...] | None = None) -> None:
    """Write (and check) the checkpoints and goldens ``names`` (default: every one)."""
    forms = {**{name: own_format(config) for name, config in CONFIGS.items()},
             **{name: transformers_format(arguments) for name, arguments in HF_CONFIGS.items()}}
    for name in names or tuple(forms):
        write_model(name, forms[name], golden_dir)
        check_model(name, golden_dir)


if __name__ == "__main__":
    write_all(pathlib.Path(__file__).resolve().parent.parent / "tests" / "golden")
