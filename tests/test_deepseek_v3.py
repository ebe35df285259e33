"""DeepSeek-V3 model numerics against HF transformers' DeepseekV3ForCausalLM (golden files from
``scripts/golden_deepseek_v3.py``: ``tiny_deepseek_v3`` with yarn rope on interleaved rotary
features, q-LoRA, grouped top-k routing, one dense and two MoE layers; ``tiny_deepseek_v3_plain``
with the other branches): each prompt alone, prompts batched with padding in the
reference forward, and packed into one paged prefill followed by batched paged decode. Also the
config's refusals and the checkpoint checks (a missing tensor; multi-token prediction layers)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tokenspeed_jax.models.deepseek_v3 import (
    DeepseekV3Config,
    dense_caches,
    latent_pages,
    load_hf,
)
from tokenspeed_jax.models.mla import deinterleave

GOLDEN = Path(__file__).parent / "golden"
NAMES = ("tiny_deepseek_v3", "tiny_deepseek_v3_plain")
CHECKPOINT = GOLDEN / NAMES[0]
MAX_REL_ERR = 1e-4  # fp32 end to end; the absorbed MLA and grouped experts only reorder sums
PAGE = 4
CACHE_SLOTS = 96


def rel_err(got, want) -> float:
    return float(np.abs(np.asarray(got) - want).max() / np.abs(want).max())


def jitted(model, method: str):
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, *args):
        return getattr(nnx.merge(graphdef, state), method)(*args)

    return lambda *args: run(state, *args)


@pytest.fixture(scope="module", params=NAMES)
def golden(request):
    config, model = load_hf(GOLDEN / request.param)
    data = dict(np.load(GOLDEN / f"{request.param}.npz"))
    prompts = [data[f"prompt_ids_{i}"] for i in range(3)]
    return config, model, data, prompts


def test_each_prompt_alone_matches_transformers(golden):
    """Prefill each prompt alone, then greedy decode one token at a time (dense cache)."""
    config, model, data, prompts = golden
    forward = jitted(model, "__call__")
    for i, prompt in enumerate(prompts):
        caches = dense_caches(config, 1, CACHE_SLOTS, jnp.float32)
        positions = jnp.arange(len(prompt), dtype=jnp.int32)[None]
        logits, caches = forward(jnp.asarray(prompt)[None], positions, caches)
        assert rel_err(logits[0], data[f"logits_{i}"]) < MAX_REL_ERR, i
        step_logits, tokens = [], []
        last = logits[:, -1]
        for step in range(data[f"greedy_ids_{i}"].shape[0]):
            step_logits.append(np.asarray(last[0]))
            token = jnp.argmax(last, axis=-1).astype(jnp.int32)
            tokens.append(int(token[0]))
            position = jnp.full((1, 1), len(prompt) + step, jnp.int32)
            logits, caches = forward(token[:, None], position, caches)
            last = logits[:, -1]
        np.testing.assert_array_equal(tokens, data[f"greedy_ids_{i}"])
        assert rel_err(np.stack(step_logits), data[f"greedy_logits_{i}"]) < MAX_REL_ERR, i


def test_prompts_batched_with_padding_match_transformers(golden):
    config, model, data, prompts = golden
    longest = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), longest), np.int32)
    positions = np.full((len(prompts), longest), -1, np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = prompt
        positions[row, :len(prompt)] = np.arange(len(prompt))
    caches = dense_caches(config, len(prompts), CACHE_SLOTS, jnp.float32)
    logits, caches = jitted(model, "__call__")(jnp.asarray(ids), jnp.asarray(positions), caches)
    for row, prompt in enumerate(prompts):
        assert rel_err(logits[row, :len(prompt)], data[f"logits_{row}"]) < MAX_REL_ERR, row
        assert not np.asarray(caches[0][row, len(prompt):]).any(), "padding wrote a cache row"


class PagedPool:
    """Latent pages for the golden prompts, each with room for ``extra`` more tokens; each
    request's pages shuffled over the pool, the last page nobody's (it must stay zero)."""

    def __init__(self, config, lengths: list[int], extra: int, seed: int = 0) -> None:
        counts = [-(-(n + extra) // PAGE) for n in lengths]
        self.num_pages = sum(counts) + 1
        free = self.num_pages - 1
        self.tables = np.full((len(lengths) + 1, max(counts)), free, np.int32)  # + a padding row
        order = np.random.default_rng(seed).permutation(free)
        for row, first in enumerate(np.cumsum(counts) - counts):
            self.tables[row, :counts[row]] = order[first:first + counts[row]]
        self.pages = latent_pages(config, self.num_pages, PAGE, jnp.float32)

    def slots(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """i32 slot of each (row, position); -1 for padding."""
        real = (rows >= 0) & (positions >= 0)
        pos = np.maximum(positions, 0)
        slot = self.tables[np.maximum(rows, 0), pos // PAGE] * PAGE + pos % PAGE
        return np.where(real, slot, -1).astype(np.int32)

    def free_page_untouched(self) -> bool:
        return all(not np.asarray(layer[self.num_pages - 1]).any() for layer in self.pages)


def packed_prefill(model_prefill, pool: PagedPool, prompts, chunks, pad: int) -> list:
    """One prefill step of ``chunks`` (request row, first, end) packed, then ``pad`` padding
    tokens; the logits of each chunk."""
    ids = np.concatenate([prompts[r][a:b] for r, a, b in chunks] + [np.zeros(pad, np.int32)])
    rows = np.concatenate([np.full(b - a, r) for r, a, b in chunks] + [np.full(pad, -1)])
    positions = np.concatenate([np.arange(a, b) for _, a, b in chunks] + [np.full(pad, -1)])
    rows, positions = rows.astype(np.int32), positions.astype(np.int32)
    logits, pool.pages = model_prefill(
        jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(rows),
        jnp.asarray(pool.slots(rows, positions)), pool.pages, jnp.asarray(pool.tables))
    ends = np.cumsum([b - a for _, a, b in chunks])
    return [logits[end - (b - a):end] for (_, a, b), end in zip(chunks, ends)]


def test_packed_prefill_then_batched_decode_matches_transformers(golden):
    """All prompts packed into one paged prefill (with padding tokens), then greedy decode of all
    requests together (with a padding row); the free page is never written."""
    config, model, data, prompts = golden
    new_tokens = data["greedy_ids_0"].shape[0]
    lengths = [len(p) for p in prompts]
    pool = PagedPool(config, lengths, new_tokens)
    chunks = [(r, 0, n) for r, n in enumerate(lengths)]
    logits = packed_prefill(jitted(model, "prefill"), pool, prompts, chunks, pad=3)
    for r in range(len(prompts)):
        assert rel_err(logits[r], data[f"logits_{r}"]) < MAX_REL_ERR, r

    decode = jitted(model, "decode")
    batch_rows = np.array([0, 1, 2, -1], np.int32)  # the last row is padding
    last = jnp.stack([chunk[-1] for chunk in logits])
    tokens, step_logits = [], []
    for step in range(new_tokens):
        step_logits.append(np.asarray(last))
        token = np.asarray(jnp.argmax(last, axis=-1), np.int32)
        tokens.append(token)
        positions = np.where(batch_rows >= 0, np.array(lengths + [0]) + step, -1)
        positions = positions.astype(np.int32)
        out, pool.pages = decode(jnp.asarray(np.r_[token, 0]), jnp.asarray(positions),
                                 jnp.asarray(pool.slots(batch_rows, positions)), pool.pages,
                                 jnp.asarray(pool.tables))
        last = out[:3]
    for r in range(len(prompts)):
        np.testing.assert_array_equal([t[r] for t in tokens], data[f"greedy_ids_{r}"])
        assert rel_err(np.stack([s[r] for s in step_logits]),
                       data[f"greedy_logits_{r}"]) < MAX_REL_ERR, r
    assert pool.free_page_untouched()


def test_chunked_prefill_over_cached_prefix_pages_matches_transformers(golden):
    """Two prefill steps: the second continues two requests from the pages the first wrote (their
    cached prefixes) packed with a new request, as prefix caching and chunked prefill run."""
    config, model, data, prompts = golden
    lengths = [len(p) for p in prompts]
    pool = PagedPool(config, lengths, extra=0, seed=1)
    prefill = jitted(model, "prefill")
    first = [(0, 0, 10), (1, 0, 40)]
    second = [(0, 10, lengths[0]), (1, 40, lengths[1]), (2, 0, lengths[2])]
    logits = packed_prefill(prefill, pool, prompts, first, pad=2)
    logits += packed_prefill(prefill, pool, prompts, second, pad=1)
    for (r, a, b), got in zip(first + second, logits):
        assert rel_err(got, data[f"logits_{r}"][a:b]) < MAX_REL_ERR, (r, a, b)
    assert pool.free_page_untouched()


def raw_config() -> dict:
    return json.loads((CHECKPOINT / "config.json").read_text())


def test_config_reads_both_rope_spellings_and_round_trips():
    raw = raw_config()
    config = DeepseekV3Config.from_hf(raw)
    assert config.rope_scaling.mscale_all_dim == 0.8 and config.rope_interleave
    assert config.first_k_dense_replace == 1 and config.n_group == 4
    modern = {k: v for k, v in raw.items() if k not in ("rope_theta", "rope_scaling")}
    modern["rope_parameters"] = {**raw["rope_scaling"], "rope_type": "yarn",
                                 "rope_theta": raw["rope_theta"]}
    assert DeepseekV3Config.from_hf(modern) == config
    assert DeepseekV3Config.from_hf(config.to_hf()) == config
    kimi_k2 = DeepseekV3Config.from_hf({**raw, "model_type": "kimi_k2"})
    assert kimi_k2.model_type == "kimi_k2"


@pytest.mark.parametrize("change, message", [
    ({"model_type": "deepseek_v2"}, "model_type"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope type 'linear'"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 5}, "topk_group"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"n_shared_experts": 0}, "n_shared_experts"),
])
def test_config_rejects_unsupported_variants(change, message):
    with pytest.raises(ValueError, match=message):
        DeepseekV3Config.from_hf({**raw_config(), **change})


def copy_checkpoint(directory: Path, config_change: dict, tensors: dict[str, np.ndarray]) -> None:
    (directory / "config.json").write_text(json.dumps({**raw_config(), **config_change}))
    save_file(tensors, directory / "model.safetensors")


def prompt_logits(model, config, prompt: np.ndarray) -> np.ndarray:
    positions = jnp.arange(len(prompt), dtype=jnp.int32)[None]
    logits, _ = model(jnp.asarray(prompt)[None], positions,
                      dense_caches(config, 1, len(prompt), jnp.float32))
    return np.asarray(logits[0])


def test_rope_interleave_false_reads_rotate_half_features(tmp_path):
    """The same checkpoint with its rope rows stored evens-then-odds and ``rope_interleave:
    false`` is the same model: it must give transformers' logits too."""
    data = np.load(GOLDEN / f"{NAMES[0]}.npz")
    raw = raw_config()
    rope, nope, rank = raw["qk_rope_head_dim"], raw["qk_nope_head_dim"], raw["kv_lora_rank"]
    qk = nope + rope
    tensors = load_file(CHECKPOINT / "model.safetensors")
    for name in list(tensors):
        if name.endswith("q_b_proj.weight"):
            w = tensors[name].reshape(-1, qk, tensors[name].shape[-1])
            w = np.concatenate([w[:, :nope], w[:, nope:][:, deinterleave(rope)]], axis=1)
            tensors[name] = np.ascontiguousarray(w.reshape(tensors[name].shape))
        elif name.endswith("kv_a_proj_with_mqa.weight"):
            w = tensors[name]
            tensors[name] = np.ascontiguousarray(
                np.concatenate([w[:rank], w[rank:][deinterleave(rope)]]))
    copy_checkpoint(tmp_path, {"rope_interleave": False}, tensors)
    config, model = load_hf(tmp_path)
    assert rel_err(prompt_logits(model, config, data["prompt_ids_0"]),
                   data["logits_0"]) < MAX_REL_ERR


def test_checkpoint_with_a_missing_tensor_is_rejected(tmp_path):
    tensors = load_file(CHECKPOINT / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    copy_checkpoint(tmp_path, {}, tensors)
    with pytest.raises(ValueError, match=r"missing from the checkpoint.*experts\.5\.up_proj"):
        load_hf(tmp_path)


def with_mtp_layer(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors plus a multi-token prediction layer 3 as published checkpoints store it: a
    decoder layer with its own norms, input projection and head."""
    mtp = {name.replace("model.layers.2.", "model.layers.3."): value
           for name, value in tensors.items() if name.startswith("model.layers.2.")}
    d = tensors["model.norm.weight"].shape[0]
    mtp.update({
        "model.layers.3.enorm.weight": np.ones(d, np.float32),
        "model.layers.3.hnorm.weight": np.ones(d, np.float32),
        "model.layers.3.eh_proj.weight": np.zeros((d, 2 * d), np.float32),
        "model.layers.3.shared_head.norm.weight": np.ones(d, np.float32),
        "model.layers.3.shared_head.head.weight": tensors["lm_head.weight"],
    })
    return {**tensors, **mtp}


def assert_same_weights(loaded, model) -> None:
    for mine, plain in zip(jax.tree_util.tree_leaves(nnx.state(loaded)),
                           jax.tree_util.tree_leaves(nnx.state(model)), strict=True):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(plain))


def test_multi_token_prediction_layers_are_skipped_with_a_log_line(tmp_path, caplog):
    _, model = load_hf(CHECKPOINT)
    tensors = with_mtp_layer(load_file(CHECKPOINT / "model.safetensors"))
    copy_checkpoint(tmp_path, {"num_nextn_predict_layers": 1}, tensors)
    with caplog.at_level(logging.INFO, logger="tokenspeed_jax.models.deepseek_v3.weights"):
        _, loaded = load_hf(tmp_path)
    skipped = sum(name.startswith("model.layers.3.") for name in tensors)
    assert f"skipped {skipped} tensors of 1 multi-token prediction layer" in caplog.text
    assert_same_weights(loaded, model)


def test_the_family_loader_skips_multi_token_prediction_layers_with_a_log_line(tmp_path, caplog):
    """The engine's loader (``models.loader``, through the registry's family) as ``load_hf``."""
    from tokenspeed_jax.models.loader import load_checkpoint

    _, model = load_hf(CHECKPOINT)
    copy_checkpoint(tmp_path, {"num_nextn_predict_layers": 1},
                    with_mtp_layer(load_file(CHECKPOINT / "model.safetensors")))
    with caplog.at_level(logging.INFO, logger="tokenspeed_jax.models.deepseek_v3.family"):
        loaded = load_checkpoint(tmp_path, dtype="float32").model
    assert "skipping the 1 multi-token prediction layer(s)" in caplog.text
    assert_same_weights(loaded, model)


def test_layers_past_the_model_are_refused_without_num_nextn_predict_layers(tmp_path):
    copy_checkpoint(tmp_path, {}, with_mtp_layer(load_file(CHECKPOINT / "model.safetensors")))
    with pytest.raises(ValueError, match=r"not used by the deepseek_v3 model.*model\.layers\.3\."):
        load_hf(tmp_path)
