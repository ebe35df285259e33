"""Every runner exposes the same statistics whatever the model family it serves, each one a
Prometheus counter or a gauge: the ``ModelRunner`` of a Llama-family model and of Kimi Linear,
each after one eager step of one request, count the same things under the same names."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.batch import StepBatch, StepRequest
from tokenspeed_jax.engine.runner import ModelRunner
from tokenspeed_jax.engine.runner_stats import COUNTERS
from tokenspeed_jax.models.llama import LlamaConfig, LlamaForCausalLM
from tokenspeed_jax.models.loader import load_checkpoint
from tokenspeed_jax.sampling_params import SamplingParams
from tokenspeed_jax.server import metrics

GOLDEN = Path(__file__).parent / "golden"
PAGE = 16
PROMPT = np.array([5, 17, 33, 2, 9, 41, 7], np.int32)
ENGINE = EngineConfig(
    prefill_graph_capture_token_sizes=(16,), prefill_graph_max_tokens=16,
    prefill_graph_capture_batch_sizes=(1,), prefill_graph_max_bs=1,
    decode_graph_capture_batch_sizes=(1,), decode_graph_max_bs=1,
    max_model_len=32, compile_progress=False, strict_no_compile=True, compile_cache=False)


def one_request() -> StepRequest:
    return StepRequest("r", PROMPT, 0, np.arange(2, dtype=np.int32), True,
                       SamplingParams(temperature=0.0), state_slot=0)


def llama_stats_after_one_eager_step() -> dict[str, float]:
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16)
    runner = ModelRunner(LlamaForCausalLM(config, rngs=nnx.Rngs(0)),
                         dataclasses.replace(ENGINE, enforce_eager=True), 4, PAGE)
    runner.step(StepBatch([one_request()]))
    return runner.stats()


def kimi_stats_after_one_eager_step() -> dict[str, float]:
    checkpoint = load_checkpoint(GOLDEN / "tiny_kimi", dtype="float32")
    runner = ModelRunner(checkpoint.model, ENGINE, num_pages=4, num_state_slots=2,
                        page_size=PAGE)
    runner.run_eager([one_request()], plan="reference")
    return runner.stats()


@pytest.fixture(scope="module")
def stats() -> dict[str, dict[str, float]]:
    return {"llama": llama_stats_after_one_eager_step(),
            "kimi_linear": kimi_stats_after_one_eager_step()}


def test_both_runners_expose_the_same_statistics(stats):
    assert set(stats["llama"]) == set(stats["kimi_linear"])
    assert set(COUNTERS) <= set(stats["llama"])


def test_every_runner_statistic_is_a_declared_counter_or_gauge(stats):
    for family, values in stats.items():
        assert set(values) <= metrics.COUNTERS.keys() | metrics.GAUGES.keys(), family
        assert set(COUNTERS) <= metrics.COUNTERS.keys(), family


def test_one_eager_step_counts_the_same_under_either_family(stats):
    expected = {**dict.fromkeys(COUNTERS, 0), "eager_runs": 1, "real_tokens": len(PROMPT)}
    for family, values in stats.items():
        assert {name: values[name] for name in COUNTERS} == expected, family
        assert values["padding_waste"] == 0.0 and values["runtime_compiles"] == 0, family
