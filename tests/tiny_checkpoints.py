"""Tiny checkpoints the engine tests load, assembled from the golden files.

Invariants: the weights and config are symlinks to ``tests/golden/tiny_kimi`` (never copies, so a
regenerated golden is picked up); the tokenizer is word-level over the checkpoint's 256 ids
(``w0`` .. ``w255``), so every token id round-trips as text, and ``w2`` is the end of sequence.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import tokenizers

from tokenspeed_jax.tokenizer import Tokenizer

GOLDEN = Path(__file__).parent / "golden"
KIMI_VOCAB = 256


def tiny_kimi(directory: Path, chat_template: str | None = None) -> Path:
    """``directory`` (created) as the tiny Kimi-Linear checkpoint with a word-level tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        os.symlink((GOLDEN / "tiny_kimi" / name).resolve(), directory / name)
    save_word_tokenizer(directory, chat_template)
    return directory


@contextlib.contextmanager
def inline_route_only() -> Iterator[None]:
    """Kimi-Linear runners built inside compile the inline prefill route alone, without the
    ordinary route beside it: for engines whose steps never take that route (only a step with a
    one-token continuation chunk does, ``LatentForward.prefill_route``), it is compiled for
    nothing. Such a step would find no compiled plan and fail. The inline route's plans, its
    executables' cache keys and its outputs are the same either way."""
    from tokenspeed_jax.models.kimi_linear.forward import LatentForward

    init = LatentForward.__init__

    def inline_only(self: LatentForward, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        if self.prefill_routes != ("inline", "ordinary"):
            raise ValueError(f"inline_route_only: the routes are {self.prefill_routes}")
        self.prefill_routes = ("inline",)

    LatentForward.__init__ = inline_only
    try:
        yield
    finally:
        LatentForward.__init__ = init


def save_word_tokenizer(directory: Path, chat_template: str | None = None) -> None:
    """The word-level tokenizer over the 256 ids, saved into ``directory``."""
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"w{i}": i for i in range(KIMI_VOCAB)}, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    Tokenizer(backend, chat_template=chat_template, eos_token="w2").save(directory)
