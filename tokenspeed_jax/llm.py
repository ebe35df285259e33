"""``LLM``: the offline entry point. Load a model, then generate, score or chat.

Invariants: ``LLM(None)`` is the embedded default model (SmolLM2-135M-Instruct); a prompt is a
string (tokenized without extra special tokens, as the model's own tokenizer would) or a list of
token ids; results come back in the order of the prompts, ``n`` completions per prompt adjacent.
Bad input (an empty prompt, ids outside the vocabulary, a prompt over the context length) raises a
ValueError before any work starts.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tokenspeed_jax.models.loader import load_model
from tokenspeed_jax.outputs import Completion
from tokenspeed_jax.reference import ReferenceGenerator
from tokenspeed_jax.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Message = Mapping[str, Any]


class LLM:
    """A loaded model with its tokenizer, ready to generate."""

    def __init__(self, model: str | os.PathLike | None = None, *, dtype: str = "auto") -> None:
        start = time.perf_counter()
        loaded = load_model(model, dtype=dtype)
        self.model = loaded.model
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_path = loaded.path
        self.load_seconds = time.perf_counter() - start
        self._reference = ReferenceGenerator(self.model, self.tokenizer)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Complete each prompt; ``params`` is one for all or one per prompt."""
        prompt_ids = [self._encode(p) for p in _as_prompt_list(prompts)]
        per_prompt = _per_prompt_params(params, len(prompt_ids))
        expanded_prompts, expanded_params = [], []
        for ids, sp in zip(prompt_ids, per_prompt):
            for i in range(sp.n):
                expanded_prompts.append(ids)
                expanded_params.append(_nth_sample(sp, i))
        return self._reference.generate(expanded_prompts, expanded_params)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | None = None,
    ) -> list[Completion]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts = [
            self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True)
            for c in conversations
        ]
        return self.generate(prompts, params)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [len(token_ids), vocab]: next-token logits after each prefix of ``token_ids``."""
        return self._reference.logits(self._encode(token_ids))

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        return ids


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, (int, np.integer)) for t in prompts):
        return [prompts]
    return prompts


def _per_prompt_params(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"{count} prompts but {len(params)} sampling params")
    return params


def _nth_sample(params: SamplingParams, index: int) -> SamplingParams:
    """The params of the ``index``-th of ``n`` samples: distinct seeds when a seed is given."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)
