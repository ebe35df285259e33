"""The reference generator for hybrid models (Kimi-Linear): one prompt at a time, no padding.

A hybrid model's plain forward carries recurrent KDA state that every token it sees advances, so
it takes only real tokens (no padding rows or positions). ``HybridReferenceGenerator`` therefore
runs each prompt as a batch of one and trims the padding the base generator adds to shapes; the
sampling, stop rules and detokenization are the base generator's. Invariant: a prompt's tokens
depend only on that prompt and its params, exactly as in ``ReferenceGenerator``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tokenspeed_jax.models.kimi_linear import KimiCache
from tokenspeed_jax.outputs import Completion
from tokenspeed_jax.reference import ReferenceGenerator
from tokenspeed_jax.sampling_params import SamplingParams


class HybridReferenceGenerator(ReferenceGenerator):
    """``ReferenceGenerator`` over a ``KimiCache``, one unpadded prompt per forward."""

    cache_type = KimiCache

    def forward(self, token_ids: np.ndarray, positions: np.ndarray, cache: KimiCache
                ) -> tuple[jax.Array, KimiCache]:
        """The plain forward of one row's real tokens; logits padded back to the input length."""
        if token_ids.shape[0] != 1:
            raise ValueError(f"a hybrid forward runs one row at a time, got {token_ids.shape[0]}")
        real = int(np.sum(np.asarray(positions) >= 0))
        logits, cache = super().forward(token_ids[:, :real], positions[:, :real], cache)
        pad = token_ids.shape[1] - real
        return jnp.pad(logits, ((0, 0), (0, pad), (0, 0))), cache

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
                 ) -> list[Completion]:
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        return [super(HybridReferenceGenerator, self).generate([p], [sp])[0]
                for p, sp in zip(prompts, params)]
