"""Random weights from a config alone (``load_format="dummy"``) and a tokenizer named apart from
the model (``tokenizer=``, ``--tokenizer``).

Every registered family is served from a directory holding only its tiny config.json; its
weights are compared, tree for tree, with the checkpoint-loaded model of the same config. The
sharded case runs in a subprocess that sees 4 CPU devices (this file run as a script is that
worker, as in ``test_tensor_parallel``).
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

GOLDEN = Path(__file__).parent / "golden"
# one tiny checkpoint per registered family (the registry test below keeps this complete)
FAMILY_CHECKPOINTS = {"llama": "tiny_llama", "kimi_linear": "tiny_kimi",
                      "deepseek_v3": "tiny_deepseek_v3"}
ENGINE = {  # one request at a time, a few small buckets: each start compiles in seconds
    "dtype": "float32", "max_model_len": 64, "max_num_seqs": 1, "num_pages": 4,
    "page_size": 16, "prefill_graph_max_tokens": 16, "prefill_graph_capture_token_sizes": (16,),
    "prefill_graph_capture_batch_sizes": (1,), "decode_graph_capture_batch_sizes": (1,),
    "chunked_prefill_size": 16, "compile_progress": False, "strict_no_compile": True,
}
# Kimi-Linear compiles one prefill route, not two: half its start-up (its routes are checked
# with real weights in test_kimi_runner and test_kimi_engine)
FAMILY_ENGINE = {"kimi_linear": {"disable_kda_prefill_graph": True}}


def config_only(directory: Path, checkpoint: str) -> Path:
    """``directory`` (created) holding only the config.json of the golden ``checkpoint``."""
    directory.mkdir(parents=True)
    shutil.copy(GOLDEN / checkpoint / "config.json", directory / "config.json")
    return directory


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory) -> Path:
    """A directory holding only the word-level tokenizer over 256 ids (``w0`` .. ``w255``)."""
    from tiny_checkpoints import save_word_tokenizer

    directory = tmp_path_factory.mktemp("word_tokenizer")
    save_word_tokenizer(directory)
    return directory


def leaves(model) -> list[tuple[str, np.ndarray]]:
    import jax
    from flax import nnx

    return [(jax.tree_util.keystr(path), np.asarray(leaf))
            for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model))]


# ----------------------------------------------------------------------------- the worker


def _sharded_worker() -> dict:
    """The tiny Kimi-Linear model's random weights made over 2 devices against those made on one:
    the largest difference (the same random bits; one jitted program's rounding against op by
    op), and the weights not on the sharding their family gives them."""
    import jax
    from flax import nnx

    from tokenspeed_jax.models.loader import load_checkpoint, random_model
    from tokenspeed_jax.parallel import make_mesh

    mesh = make_mesh(2)
    sharded = load_checkpoint(GOLDEN / "tiny_kimi", dtype="float32", mesh=mesh,
                              load_format="dummy")
    single = random_model(sharded.config)
    placed = jax.tree_util.tree_leaves_with_path(nnx.state(sharded.model))
    misplaced = [jax.tree_util.keystr(path) for path, leaf in placed
                 if leaf.sharding != sharded.family.param_sharding(path, sharded.config, mesh)]
    return {"max_diff": max(float(np.abs(a - b).max()) for (_, a), (_, b)
                            in zip(leaves(sharded.model), leaves(single), strict=True)),
            "misplaced": misplaced,
            "split": sum(not leaf.sharding.is_fully_replicated for _, leaf in placed)}


# ----------------------------------------------------------------------------- tests


def test_every_registered_family_has_a_tiny_checkpoint_here():
    from tokenspeed_jax.models.registry import FAMILIES

    assert sorted(FAMILY_CHECKPOINTS) == sorted(family.name for family in FAMILIES)


@pytest.mark.parametrize("family", sorted(FAMILY_CHECKPOINTS))
def test_a_config_only_dir_serves_with_random_weights(family, tmp_path, word_tokenizer, caplog):
    """Generation through ``LLM`` from config.json alone: the tokenizer named apart, finite
    log-probabilities, finite logits that differ across the vocabulary, and ids the 256-word
    tokenizer can decode only (Llama's and DeepSeek's 320-id vocabularies hold 64 it lacks)."""
    from tokenspeed_jax import LLM, SamplingParams

    model_dir = config_only(tmp_path / "model", FAMILY_CHECKPOINTS[family])
    with caplog.at_level(logging.INFO, logger="tokenspeed_jax.models.loader"):
        llm = LLM(model_dir, load_format="dummy", tokenizer=str(word_tokenizer),
                  **ENGINE, **FAMILY_ENGINE.get(family, {}))
    assert "random weights" in caplog.text
    assert llm.tokenizer.vocab_size == 256 and llm.tokenizer.encode("w5 w7") == [5, 7]
    [completion] = llm.generate("w5 w7 w9 w11", SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2))
    assert len(completion.token_ids) == 8
    assert all(0 <= t < 256 for t in completion.token_ids)
    assert completion.text.split() == [f"w{t}" for t in completion.token_ids]
    assert np.isfinite([lp.logprob for lp in completion.logprobs]).all()
    logits = llm.logits([5, 7, 9, 11])
    assert logits.shape == (4, json.loads((model_dir / "config.json").read_text())["vocab_size"])
    assert np.isfinite(logits).all() and logits[:, :256].std(axis=1).min() > 1e-3
    assert llm.stats()["runtime_compiles"] == 0
    llm.runner.guard.disarm()


@pytest.mark.parametrize("family", sorted(FAMILY_CHECKPOINTS))
def test_random_weights_have_the_checkpoint_models_tree_and_follow_the_seed(family):
    """Tree, shapes and dtypes (bf16 weights beside the fp32 ones a family keeps) equal the
    checkpoint-loaded model's; one seed gives one set of weights; norm weights are ones and
    projections N(0, 0.02^2)."""
    import jax.numpy as jnp

    from tokenspeed_jax.models.loader import load_checkpoint, random_model

    real = load_checkpoint(GOLDEN / FAMILY_CHECKPOINTS[family], dtype="bfloat16")
    first, again = (random_model(real.config, dtype=jnp.bfloat16, seed=3) for _ in range(2))
    expected = [(path, leaf.shape, leaf.dtype) for path, leaf in leaves(real.model)]
    assert [(path, leaf.shape, leaf.dtype) for path, leaf in leaves(first)] == expected
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(leaves(first), leaves(again)))
    assert (np.asarray(first.norm.weight[...]) == 1).all()
    assert (np.asarray(first.layers[0].input_layernorm.weight[...]) == 1).all()
    assert np.std(np.asarray(first.embed_tokens[...], np.float32)) == pytest.approx(0.02, rel=0.1)


@pytest.mark.parametrize("family", sorted(FAMILY_CHECKPOINTS))
def test_random_weights_share_the_checkpoint_models_executables(family):
    """The executable cache key holds the model's structure, not how its weights were made: a
    runner of random weights has the key of one of the checkpoint's (flax lists the two models'
    variable metadata in different orders), so either start loads what the other compiled."""
    import jax.numpy as jnp

    from tokenspeed_jax.config import EngineConfig
    from tokenspeed_jax.engine.runner import ModelRunner
    from tokenspeed_jax.models.loader import load_checkpoint, random_model

    real = load_checkpoint(GOLDEN / FAMILY_CHECKPOINTS[family], dtype="float32")
    config = EngineConfig(max_model_len=64, compile_progress=False)
    keys = [ModelRunner(model, config, num_pages=4, num_state_slots=1,
                        page_size=16).cache_fingerprint()
            for model in (real.model, random_model(real.config, dtype=jnp.float32, seed=3))]
    assert keys[0] == keys[1]


@pytest.mark.parametrize("checkpoint", ["tiny_llama", "tiny_tied"])
def test_the_head_is_silent_past_a_smaller_tokenizer(checkpoint):
    """The head's weights of the ids a 100-id tokenizer lacks are zero (``lm_head`` columns, or
    the embedding rows when tied), the others random, and not those of seed 0."""
    from tokenspeed_jax.models.loader import load_checkpoint, random_model

    checkpoint = load_checkpoint(GOLDEN / checkpoint, dtype="float32", load_format="dummy")
    config = checkpoint.config
    model = random_model(config, seed=1, text_vocab_size=100)
    assert not np.array_equal(np.asarray(model.layers[0].mlp.up_proj[...]),
                              np.asarray(checkpoint.model.layers[0].mlp.up_proj[...]))
    head = (np.asarray(model.embed_tokens[...]).T if config.tie_word_embeddings
            else np.asarray(model.lm_head[...]))
    assert (head[:, 100:] == 0).all() and (head[:, :100] != 0).all()


def test_auto_needs_the_weights_and_the_load_format_is_checked(tmp_path):
    from tokenspeed_jax.config import EngineConfig
    from tokenspeed_jax.models.loader import load_checkpoint

    model_dir = config_only(tmp_path / "model", "tiny_llama")
    with pytest.raises(ValueError, match="not a model directory .expected config.json with "
                                         r"\*.safetensors"):
        load_checkpoint(model_dir)
    for bad in ("Dummy", "random", ""):
        with pytest.raises(ValueError, match=rf"load_format must be one of \('auto', 'dummy'\), "
                                             rf"got {bad!r}"):
            EngineConfig(load_format=bad)
        with pytest.raises(ValueError, match="load_format must be one of"):
            load_checkpoint(model_dir, load_format=bad)
    with pytest.raises(ValueError, match="config.json: file not found"):
        load_checkpoint(tmp_path, load_format="dummy")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path, word_tokenizer):
    """Tiny Kimi-Linear has 256 ids: Llama's 320-token tokenizer directory and the embedded
    49152-token GGUF are refused before any weight is made; the 256-word one is taken; without
    one, a config-only directory says how to name it."""
    from tokenspeed_jax.models.loader import default_model_path, load_model

    model_dir = config_only(tmp_path / "model", "tiny_kimi")
    for tokenizer, tokens in ((GOLDEN / "tiny_llama", 320), (default_model_path(), 49152)):
        with pytest.raises(ValueError, match=rf"the tokenizer {tokenizer} has {tokens} tokens, "
                                             r"more than the model's vocab_size=256"):
            load_model(model_dir, load_format="dummy", tokenizer=tokenizer)
    assert load_model(model_dir, load_format="dummy",
                      tokenizer=word_tokenizer).tokenizer.vocab_size == 256
    with pytest.raises(ValueError, match="no tokenizer.json in .*--tokenizer"):
        load_model(model_dir, load_format="dummy")


def test_random_weights_over_two_devices_are_one_devices_on_their_shardings():
    from parallel_checks import run_on_cpu_devices

    result = run_on_cpu_devices(__file__, "sharded", timeout=600)
    assert result["max_diff"] < 1e-7 and result["misplaced"] == []  # weights of about 0.02
    assert result["split"] > 10  # the projections and experts are split, not all replicated


def test_serve_py_serves_a_config_only_dir_with_dummy_weights(tmp_path):
    """``scripts/serve.py --load-format dummy --tokenizer DIR`` on a directory holding only
    config.json: ready, a completion of the requested length, and the log line that says the
    weights are random."""
    import httpx
    from test_server_cli import serving

    model_dir = config_only(tmp_path / "model", "tiny_llama")
    with serving("--model", str(model_dir), "--load-format", "dummy",
                 "--tokenizer", str(GOLDEN / "tiny_llama")) as (process, url, startup):
        assert "random weights (seed 0)" in startup
        response = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True})
        assert response.json()["usage"]["completion_tokens"] == 6
        process.terminate()
        assert process.wait(timeout=60) == 0


def test_serve_py_refuses_an_unknown_load_format():
    import subprocess

    from test_server_cli import SERVE

    result = subprocess.run([*SERVE, "--load-format", "random"], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 2
    assert "--load-format: invalid choice: 'random'" in result.stderr
    assert "dummy" in result.stderr.splitlines()[-1]


if __name__ == "__main__":
    print(json.dumps({"sharded": _sharded_worker}[sys.argv[1]]()))
