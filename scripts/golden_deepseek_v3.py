"""Tiny random-weight DeepSeek-V3 checkpoints and transformers' logits and greedy tokens for them.

Writes, under the golden directory, for each tiny config (``CONFIGS``):

- ``<name>/``: config.json in the published checkpoints' own format (``rope_theta`` at
  the top level, yarn in ``rope_scaling``), model.safetensors under the published tensor names
  (``self_attn.kv_a_proj_with_mqa``, ``mlp.experts.<e>.gate_proj``, ``mlp.gate.weight``,
  ``mlp.gate.e_score_correction_bias``, ...), and ``tiny_llama``'s tokenizer files. transformers
  fuses the per-expert tensors on load; the script checks that ``from_pretrained`` fills every
  parameter with exactly the saved values.
- ``<name>.npz``: for each prompt ``i`` of ``PROMPTS`` (different lengths, each run
  alone, no padding): ``prompt_ids_<i>`` int32 [T] (BOS first), ``logits_<i>`` float32 [T, V] of
  one fp32 eager forward, ``greedy_ids_<i>`` int32 [N], the tokens ``generate(do_sample=False)``
  appends through transformers' own cache, ``greedy_logits_<i>`` float32 [N, V], the logits each
  was picked from, and ``greedy_margin_<i>`` float32 [N], top-1 minus top-2 at each step (a seed
  with a margin under ``MIN_GREEDY_MARGIN``, or a greedy path with EOS, is rejected).

``tiny_deepseek_v3`` exercises what the family must get right: three layers (one dense, two MoE), q-LoRA,
``rope_interleave``, yarn with ``mscale != mscale_all_dim`` (so both the cos/sin attention factor
and the softmax-scale mscale differ from one) and positions past ``original_max_position_
embeddings``, ``n_group=4`` with ``topk_group=2``, a nonzero ``e_score_correction_bias``,
``v_head_dim != qk_nope_head_dim``; ``tiny_deepseek_v3_plain`` the other branches. Run with the golden venv (``scripts/make_golden.py
deepseek_v3``).
"""

import json
import pathlib
import shutil

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, DeepseekV3ForCausalLM, PreTrainedTokenizerFast

TOKENIZER_FROM = "tiny_llama"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PROMPTS = (
    "The keeper wrote the weather in his book",
    ("Farmers sold honey and bread in the spring market; the river carried sand downstream and "
     "built wide plains of soil"),
    "They waited on the cold platform, sharing tea",
)
NEW_TOKENS = 8
MIN_GREEDY_MARGIN = 1e-2
MAX_SEED_TRIES = 50
MAX_GOLDEN_BYTES = 1 << 20
LINEAR_STD = 0.12
NORM_JITTER = 0.1
BIAS_STD = 0.1

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 24,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 16,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "num_experts_per_tok": 3,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
    "rope_interleave": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "torch_dtype": "float32",
}

CONFIGS = {
    "tiny_deepseek_v3": CONFIG,
    # The other branches: a plain query projection, rope without scaling or interleaving, MoE from
    # the first layer, one expert group, weights not renormalised.
    "tiny_deepseek_v3_plain": {
        **{k: v for k, v in CONFIG.items() if k != "rope_scaling"},
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 2, "q_lora_rank": None, "n_routed_experts": 4,
        "moe_intermediate_size": 16, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
        "n_shared_experts": 2, "norm_topk_prob": False, "routed_scaling_factor": 1.5,
        "first_k_dense_replace": 0, "rope_interleave": False},
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere: norm weights near one, a nonzero router correction bias."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + NORM_JITTER * noise if "norm" in name else LINEAR_STD * noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(BIAS_STD * torch.randn(buffer.shape, generator=generator))


def checkpoint_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights under the published checkpoints' names: one tensor per expert."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().clone()
        prefix, _, rest = name.rpartition("mlp.experts.")
        if rest == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up[e].contiguous()
        elif rest == "down_proj":
            for e in range(tensor.shape[0]):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = tensor[e].contiguous()
        else:
            out[name] = tensor.contiguous()
    return out


def _write_dir(directory: pathlib.Path, config: dict, golden_dir: pathlib.Path) -> None:
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in TOKENIZER_FILES:
        shutil.copy(golden_dir / TOKENIZER_FROM / file, directory / file)


def _check_reload(directory: pathlib.Path, config: dict,
                  original: torch.nn.Module) -> torch.nn.Module:
    """Load with transformers' own loader; every weight must equal the original's and the rope
    settings must come through."""
    model, info = DeepseekV3ForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise RuntimeError(f"{directory}: transformers did not load it cleanly: {problems}")
    reloaded = dict(model.state_dict())
    for name, tensor in original.state_dict().items():
        if not torch.equal(reloaded[name], tensor):
            raise RuntimeError(f"{directory}: {name} differs after reload")
    rope, scaling = model.config.rope_parameters, config.get("rope_scaling") or {}
    if (rope.get("rope_type") != scaling.get("type", "default")
            or rope.get("mscale_all_dim") != scaling.get("mscale_all_dim")):
        raise RuntimeError(f"{directory}: rope reloads as {rope}")
    return model.eval()


def _prompt_ids(directory: pathlib.Path) -> list[np.ndarray]:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    return [np.asarray([tokenizer.bos_token_id] + tokenizer.encode(text, add_special_tokens=False),
                       np.int32) for text in PROMPTS]


def _reference(model: torch.nn.Module, prompt: np.ndarray) -> dict[str, np.ndarray] | None:
    """Prompt logits and the greedy continuation; None when the greedy path is ambiguous."""
    ids = torch.from_numpy(prompt.astype(np.int64))[None]
    with torch.no_grad():
        logits = model(ids).logits[0].numpy().astype(np.float32)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             output_scores=True, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=CONFIG["pad_token_id"])
    greedy = out.sequences[0, len(prompt):].numpy().astype(np.int32)
    top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values.numpy()
    margin = (top2[:, 0] - top2[:, 1]).astype(np.float32)
    if CONFIG["eos_token_id"] in greedy or margin.min() < MIN_GREEDY_MARGIN:
        return None
    return {"logits": logits, "greedy_ids": greedy,
            "greedy_logits": torch.stack(out.logits)[:, 0].numpy().astype(np.float32),
            "greedy_margin": margin}


def write(golden_dir: pathlib.Path) -> None:
    for name, config in CONFIGS.items():
        write_model(name, config, golden_dir)


def write_model(name: str, config: dict, golden_dir: pathlib.Path) -> None:
    directory = golden_dir / name
    for seed in range(MAX_SEED_TRIES):
        torch.manual_seed(seed)
        _write_dir(directory, config, golden_dir)
        original = DeepseekV3ForCausalLM(AutoConfig.from_pretrained(directory)).eval()
        _randomize(original, seed)
        save_file(checkpoint_tensors(original), str(directory / "model.safetensors"),
                  metadata={"format": "pt"})
        model = _check_reload(directory, config, original)
        prompts = _prompt_ids(directory)
        results = [_reference(model, prompt) for prompt in prompts]
        if all(result is not None for result in results):
            break
    else:
        raise RuntimeError(f"{name}: no seed in {MAX_SEED_TRIES} gives clean greedy paths")
    arrays = {}
    for i, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
        arrays[f"prompt_ids_{i}"] = prompt
        arrays.update({f"{key}_{i}": value for key, value in result.items()})
    np.savez(golden_dir / f"{name}.npz", **arrays)
    size = sum(p.stat().st_size for p in directory.rglob("*")) + (
        golden_dir / f"{name}.npz").stat().st_size
    if size > MAX_GOLDEN_BYTES:
        raise RuntimeError(f"{name}: golden files take {size} bytes, over {MAX_GOLDEN_BYTES}")
    print(f"{name}: seed {seed}, {size} bytes, prompt lengths {[len(p) for p in prompts]}")
    check(name, golden_dir)


def check(name: str, golden_dir: pathlib.Path) -> None:
    """Re-run the saved checkpoint and compare with the saved golden arrays."""
    data = np.load(golden_dir / f"{name}.npz")
    model = DeepseekV3ForCausalLM.from_pretrained(
        golden_dir / name, dtype=torch.float32, attn_implementation="eager").eval()
    for i in range(len(PROMPTS)):
        with torch.no_grad():
            logits = model(torch.from_numpy(data[f"prompt_ids_{i}"]).long()[None]).logits[0]
        if not np.allclose(logits.numpy(), data[f"logits_{i}"], atol=1e-5, rtol=1e-5):
            raise RuntimeError(f"{name}: logits of prompt {i} do not reproduce")
        if not np.array_equal(data[f"greedy_logits_{i}"].argmax(-1), data[f"greedy_ids_{i}"]):
            raise RuntimeError(f"{name}: greedy_logits_{i} do not pick greedy_ids_{i}")


if __name__ == "__main__":
    write(pathlib.Path(__file__).resolve().parent.parent / "tests" / "golden")
