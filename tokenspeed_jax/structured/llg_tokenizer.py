"""The llguidance view of the engine's tokenizer: every token's bytes, the vocabulary width, EOS.

llguidance computes token masks from the byte string each token decodes to. It reads those from
the HF ``tokenizers`` JSON that ``tokenspeed_jax.tokenizer.Tokenizer`` wraps (HF directories and
GGUF files alike), so the grammar sees exactly the ids the engine samples.

Invariants:

* ``vocab_size`` is the width of the model's logits, at least the tokenizer's vocabulary: ids the
  tokenizer does not define (padding rows of an embedding table) are never allowed by a mask.
* The end-of-sequence ids are the tokenizer's ``eos_token_ids``, all of them: once a grammar is
  complete the mask allows exactly these, and any of them ends the grammar. A tokenizer without
  one cannot end a constrained output and is refused.
* Building one reads the whole vocabulary (a fraction of a second for 50k tokens): build it once
  per tokenizer and share it; it is immutable and thread-safe.
"""

from __future__ import annotations

import llguidance
import tokenizers

from tokenspeed_jax.tokenizer import Tokenizer


def llguidance_tokenizer(
    tokenizer: Tokenizer, vocab_size: int | None = None
) -> llguidance.LLTokenizer:
    """An ``LLTokenizer`` for ``tokenizer`` over ``vocab_size`` logits (default: its vocabulary)."""
    if vocab_size is None:
        vocab_size = tokenizer.vocab_size
    if vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"{vocab_size=} is smaller than the tokenizer's vocabulary of {tokenizer.vocab_size}"
        )
    if not tokenizer.eos_token_ids:
        raise ValueError("the tokenizer has no end-of-sequence token, so a grammar cannot end")
    backend = tokenizers.Tokenizer.from_str(tokenizer.backend.to_str())
    backend.no_padding()
    backend.no_truncation()
    return llguidance.LLTokenizer(
        backend.to_str(), n_vocab=vocab_size, eos_token=list(tokenizer.eos_token_ids)
    )
