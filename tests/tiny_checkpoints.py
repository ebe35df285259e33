"""Tiny checkpoints the engine tests load, assembled from the golden files.

Invariants: the weights and config are symlinks to ``tests/golden/tiny_kimi`` (never copies, so a
regenerated golden is picked up); the tokenizer is word-level over the checkpoint's 256 ids
(``w0`` .. ``w255``), so every token id round-trips as text, and ``w2`` is the end of sequence.
"""

from __future__ import annotations

import os
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


def save_word_tokenizer(directory: Path, chat_template: str | None = None) -> None:
    """The word-level tokenizer over the 256 ids, saved into ``directory``."""
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {f"w{i}": i for i in range(KIMI_VOCAB)}, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    Tokenizer(backend, chat_template=chat_template, eos_token="w2").save(directory)
