"""``LLM``: the offline entry point. Load a model, then generate, score or chat.

``LLM(model, **options)`` builds the same engine the server runs (segmented plans compiled at
start-up, continuous batching over a paged KV cache); ``options`` are ``EngineConfig`` fields.
``generate`` and ``chat`` run that engine; ``logits`` does not: it runs ``llm.reference``, the
plain dense-cache forward every fast path is tested against (the engine computes logits only
where it samples; its own log-probabilities come with ``SamplingParams(logprobs=k)``).
With background compile (``background_compile``) it returns once a skeleton of the buckets is
compiled, the others compiling in a background thread (``llm.runner.ladders.wait()`` waits for
them); results do not depend on which buckets are ready.
``llm.config`` is the configuration as run (``build_engine`` may clamp or turn off settings).

Invariants: ``LLM(None)`` is the embedded default model (SmolLM2-135M-Instruct); a prompt is a
string (tokenized without extra special tokens, as the model's own tokenizer would) or a list of
token ids; results come back in the order of the prompts, ``n`` completions per prompt adjacent.
Bad input (an empty prompt, ids outside the vocabulary, a prompt over the context length) raises a
ValueError before any work starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.startup import build_engine
from tokenspeed_jax.outputs import Completion
from tokenspeed_jax.sampling_params import SamplingParams

Prompt = str | Sequence[int]
Message = Mapping[str, Any]


class LLM:
    """A loaded model with its tokenizer and a ready engine."""

    def __init__(self, model: str | os.PathLike | None = None, **options: Any) -> None:
        self.config = EngineConfig(model=None if model is None else os.fspath(model), **options)
        bundle = build_engine(self.config)
        self.config = bundle.config
        self.engine = bundle.engine
        self.runner = bundle.runner
        self.compile_summary = bundle.compile_summary
        self.startup_seconds = bundle.seconds
        self.model = bundle.loaded.model
        self.tokenizer = bundle.loaded.tokenizer
        self.model_path = bundle.loaded.path
        self.reference = bundle.loaded.family.reference_generator()(self.model, self.tokenizer)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Complete each prompt; ``params`` is one for all or one per prompt."""
        prompt_ids = [self._encode(p) for p in _as_prompt_list(prompts)]
        per_prompt = _per_prompt_params(params, len(prompt_ids))
        groups = self.engine.generate(list(zip(prompt_ids, per_prompt)))
        return [completion for group in groups for completion in group]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        return self.generate(self.chat_prompts(messages), params)

    def chat_prompts(self, messages: Sequence[Message] | Sequence[Sequence[Message]]) -> list[str]:
        """The rendered prompt of each conversation (one conversation or a list of them)."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        return [self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True)
                for c in conversations]

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """float32 [len(token_ids), vocab]: next-token logits after each prefix of ``token_ids``,
        from the reference forward (the model's plain jitted forward over a dense cache, on the
        same weights and mesh), not from the engine's compiled plans. That forward is jitted
        per prompt length rounded up to 16 tokens: the first call at such a length compiles it
        (not one of the engine's cached executables; a declared compile, counted in
        ``eager_compiles``, never in ``runtime_compiles``)."""
        ids = self._encode(token_ids)
        self.engine.check_prompt(ids)
        return self.reference.logits(ids)

    def stats(self) -> dict[str, float]:
        """Engine and runner counters: runtime_compiles, routes taken, padding waste, KV use."""
        return {**self.runner.stats(), **self.engine.stats()}

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]


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
