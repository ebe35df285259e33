"""The engine's outputs on fixed prompts, pinned bit-exactly so a refactor can prove it changed none.

``scripts/pin_outputs.py`` runs :func:`run_family` and saves the result as
``tests/golden/pins/<family>.npz``; ``test_refactor_pins.py`` runs it again and compares every
array exactly. Invariants: a pin file is written only by that script, from the engine as it stood
when the script ran (it is no reference for correctness, which the transformers goldens are; it is
a record that the outputs did not move); the runs are deterministic on the CPU (greedy, fixed
buckets, every bucket compiled before the first request, so no step takes a different bucket
depending on compile timing); each family runs one prompt alone and two prompts batched, with
different output lengths so the decode batch shrinks, one in-step log-probability (``logprobs=0``)
and one with the top ``TOP_LOGPROBS`` resampled from the head's logits.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tiny_checkpoints import GOLDEN, tiny_kimi

from tokenspeed_jax import LLM, SamplingParams

PIN_DIR = GOLDEN / "pins"
TOP_LOGPROBS = 20
# One bucket per route keeps each start-up compile short.
SMALL_BUCKETS = {
    "prefill_graph_max_tokens": 64,
    "prefill_graph_capture_token_sizes": (64,),
    "prefill_graph_capture_batch_sizes": (2,),
    "prefill_graph_max_bs": 2,
    "decode_graph_capture_batch_sizes": (2,),
    "decode_graph_max_bs": 2,
    "max_num_seqs": 2,
    "max_model_len": 128,
    "num_pages": 24,
    "strict_no_compile": True,
    "compile_progress": False,
    "background_compile": False,
}


@dataclasses.dataclass(frozen=True)
class Family:
    """How to load one family's model and which two prompts (token ids) it runs."""

    model: Callable[[Path], Path | None]  # a scratch directory -> the model path (None: embedded)
    prompts: Callable[[], tuple[list[int], list[int]]]
    max_tokens: int
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


def _npz_prompts(name: str, first: str, second: str) -> Callable[[], tuple[list[int], list[int]]]:
    def prompts() -> tuple[list[int], list[int]]:
        data = np.load(GOLDEN / f"{name}.npz")
        return data[first].tolist(), data[second].tolist()
    return prompts


def _smollm2_prompts() -> tuple[list[int], list[int]]:
    prompts = json.loads((GOLDEN / "smollm2.json").read_text())["prompts"]
    return prompts[0]["prompt_ids"], prompts[1]["prompt_ids"]


def _kimi_prompts() -> tuple[list[int], list[int]]:
    # prompts of 70 tokens: more than one 64-token KDA chunk and a chunked prefill (64 + 6)
    first, second = np.load(GOLDEN / "tiny_kimi.npz")["prompt_ids"].tolist()
    return first, second


FAMILIES = {
    "llama": Family(lambda _: GOLDEN / "tiny_llama",
                    _npz_prompts("tiny_llama", "prompt_ids", "prompt_ids_2"), 12),
    "qwen3": Family(lambda _: GOLDEN / "tiny_qwen3",
                    _npz_prompts("tiny_qwen3", "prompt_ids", "prompt_ids_2"), 12),
    "smollm2": Family(lambda _: None, _smollm2_prompts, 6),
    "kimi_linear": Family(lambda scratch: tiny_kimi(scratch / "tiny_kimi"), _kimi_prompts, 10,
                          {"dtype": "float32", "chunked_prefill_size": 64,
                           "max_model_len": 192}),
}


def pin_path(family: str) -> Path:
    return PIN_DIR / f"{family}.npz"


def load_llm(family: str, scratch: Path) -> LLM:
    spec = FAMILIES[family]
    return LLM(spec.model(scratch), **{**SMALL_BUCKETS, **spec.options})


def run_family(family: str, llm: LLM) -> dict[str, np.ndarray]:
    """Every output of the alone and batched runs, one array per field and completion."""
    spec = FAMILIES[family]
    first, second = spec.prompts()

    def params(max_tokens: int, top: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                              logprobs=top)

    runs = {
        "alone": llm.generate([first], params(spec.max_tokens, TOP_LOGPROBS)),
        "batched": llm.generate([first, second], [params(spec.max_tokens, 0),
                                                  params(spec.max_tokens // 2, TOP_LOGPROBS)]),
    }
    arrays = {}
    for run, completions in runs.items():
        for i, completion in enumerate(completions):
            for field, value in _completion_arrays(completion).items():
                arrays[f"{run}_{i}_{field}"] = value
    return arrays


def _completion_arrays(completion: Any) -> dict[str, np.ndarray]:
    steps = completion.logprobs
    shape = (len(steps), len(steps[0].top))
    return {
        "prompt_token_ids": np.array(completion.prompt_token_ids, np.int64),
        "token_ids": np.array(completion.token_ids, np.int64),
        "text": np.array(completion.text),
        "finish_reason": np.array(completion.finish_reason),
        "logprob": np.array([step.logprob for step in steps], np.float64),
        "top_ids": np.array([[t for t, _ in step.top] for step in steps], np.int64).reshape(shape),
        "top_logprobs": np.array([[v for _, v in step.top] for step in steps],
                                 np.float64).reshape(shape),
    }
