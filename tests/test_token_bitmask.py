"""apply_token_bitmask (JAX) against a per-token numpy reference of the packed bitmask layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokenspeed_jax.structured.bitmask import apply_token_bitmask, bitmask_words, full_bitmask


def reference_apply(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    """Token t of row r is allowed when bit t % 32 of word t // 32 is set (read as unsigned)."""
    out = logits.copy()
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            word = int(bitmask[r, t // 32].view(np.uint32))
            if not (word >> (t % 32)) & 1:
                out[r, t] = -np.inf
    return out


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 100, 320])
def test_masked_logits_match_the_numpy_reference(vocab_size):
    rng = np.random.default_rng(vocab_size)
    rows = 4
    logits = rng.standard_normal((rows, vocab_size)).astype(np.float32)
    words = bitmask_words(vocab_size)
    bitmask = rng.integers(-(2**31), 2**31, size=(rows, words), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1  # an unconstrained row
    bitmask[2, :] = 0
    bitmask[2, -1] = np.uint32(1 << ((vocab_size - 1) % 32)).view(np.int32)  # the last token only
    got = np.asarray(jax.jit(apply_token_bitmask)(jnp.asarray(logits), jnp.asarray(bitmask)))
    want = reference_apply(logits, bitmask)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[1], logits[1])
    assert np.isfinite(got[2]).sum() == 1 and got[2, -1] == logits[2, -1]


def test_all_ones_rows_leave_logits_bit_for_bit():
    logits = np.array([[np.nan, -np.inf, np.inf, 1.5, -0.0] * 8], np.float32)
    got = apply_token_bitmask(jnp.asarray(logits), jnp.asarray(full_bitmask(1, 40)))
    np.testing.assert_array_equal(np.asarray(got), logits)


def test_one_compiled_sampler_takes_every_mask():
    compiled = jax.jit(apply_token_bitmask).lower(
        jax.ShapeDtypeStruct((2, 70), jnp.float32), jax.ShapeDtypeStruct((2, 3), jnp.int32)
    ).compile()
    logits = np.arange(140, dtype=np.float32).reshape(2, 70)
    for seed in range(3):
        bitmask = np.random.default_rng(seed).integers(-(2**31), 2**31, (2, 3)).astype(np.int32)
        got = np.asarray(compiled(jnp.asarray(logits), jnp.asarray(bitmask)))
        np.testing.assert_array_equal(got, reference_apply(logits, bitmask))


def test_a_bitmask_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match=r"bitmask must be int32 \[2, 3\]"):
        apply_token_bitmask(jnp.zeros((2, 70)), jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(ValueError, match="vocab_size=0 must be positive"):
        bitmask_words(0)
