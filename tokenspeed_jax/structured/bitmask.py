"""Packed token bitmasks and their application to logits inside a compiled sampler.

A bitmask row for a vocabulary of ``V`` tokens is ``ceil(V / 32)`` int32 words: bit ``i`` of word
``j`` (``(word >> i) & 1``) says whether token ``32 * j + i`` may be sampled. Bits past ``V`` in
the last word are ignored. A batch's mask is ``[rows, words]``; a row without a grammar is all
ones (every word ``-1``), which leaves its logits exactly as they were.

``apply_token_bitmask`` is a pure JAX function of two arrays with static shapes, so the sampler
takes the mask as one more input array: constrained and unconstrained batches run the same
executable, and a change of grammar never recompiles. It belongs after the penalties and
``logit_bias`` and before temperature, top-k, top-p and min-p, so truncation only ever sees
allowed tokens; greedy rows take the argmax of the masked logits. A grammar always allows at
least one token (an end-of-sequence token once it is complete), so a masked row is never all
``-inf``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    """Words in one bitmask row for ``vocab_size`` tokens."""
    if vocab_size < 1:
        raise ValueError(f"{vocab_size=} must be positive")
    return -(-vocab_size // BITS_PER_WORD)


def full_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """A ``[rows, words]`` int32 mask allowing every token: the start of each step's mask."""
    return np.full((rows, bitmask_words(vocab_size)), -1, dtype=np.int32)


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """``logits`` [rows, V] with every token whose bit is 0 in ``bitmask`` [rows, ceil(V/32)]
    (int32) set to ``-inf``; allowed tokens keep their logits bit for bit."""
    rows, vocab_size = logits.shape
    words = bitmask_words(vocab_size)
    if bitmask.shape != (rows, words) or bitmask.dtype != jnp.int32:
        raise ValueError(
            f"bitmask must be int32 [{rows}, {words}] for logits {logits.shape}, "
            f"got {bitmask.dtype} {bitmask.shape}"
        )
    shifts = jnp.arange(BITS_PER_WORD, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [rows, words, 32]
    allowed = bits.reshape(rows, words * BITS_PER_WORD)[:, :vocab_size] == 1
    return jnp.where(allowed, logits, jnp.asarray(-jnp.inf, logits.dtype))
