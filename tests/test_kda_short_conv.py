"""Short causal depthwise convolution with state, against a direct per-sequence loop."""

import jax.numpy as jnp
import numpy as np

from tokenspeed_jax.kernels.short_conv import short_conv, short_conv_pool

D, W = 6, 4


def direct(x, weight, state, lengths):
    """Per sequence: prepend its state, convolve, take the last W - 1 inputs as the new state."""
    out, states, start = [], [], 0
    for n, length in enumerate(lengths):
        seq = np.concatenate([state[n], x[start:start + length]])
        for t in range(length):
            out.append((seq[t:t + W] * weight.T).sum(0))
        states.append(seq[len(seq) - (W - 1):])
        start += length
    return np.array(out), np.array(states)


def test_short_conv_matches_direct_loop_and_resets_at_boundaries():
    rng = np.random.default_rng(0)
    lengths = [1, 2, 5, 9]
    x = rng.standard_normal((sum(lengths) + 3, D)).astype(np.float32)
    weight = rng.standard_normal((D, W)).astype(np.float32)
    state = rng.standard_normal((len(lengths), W - 1, D)).astype(np.float32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    y, new_state = short_conv(jnp.asarray(x), jnp.asarray(weight), jnp.asarray(state), cu,
                              activation=None)
    y_ref, state_ref = direct(x, weight, state, lengths)
    np.testing.assert_allclose(y[: sum(lengths)], y_ref, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(y[sum(lengths):]) == 0)
    np.testing.assert_allclose(new_state, state_ref, rtol=0, atol=0)


def test_split_prefill_then_decode_equals_one_pass_and_padding_untouched():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((11, D)).astype(np.float32)
    weight = jnp.asarray(rng.standard_normal((D, W)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(D), jnp.float32)
    pool = jnp.asarray(rng.standard_normal((3, W - 1, D)), jnp.float32)
    fresh = jnp.zeros((1, W - 1, D), jnp.float32)
    y_all, _ = short_conv(jnp.asarray(x), weight, fresh, jnp.array([0, 11]), bias=bias)
    pool = pool.at[2].set(0.0)
    slots = jnp.array([2, -1], jnp.int32)
    y1, pool1 = short_conv_pool(jnp.asarray(x[:8]), weight, pool, slots,
                                jnp.array([0, 6, 8]), bias=bias)
    np.testing.assert_array_equal(pool1[:2], pool[:2])
    # the first 6 tokens were request 0; continue it with tokens 6.. one at a time
    pieces = [np.asarray(y1[:6])]
    for t in range(6, 11):
        y_t, pool1 = short_conv_pool(jnp.asarray(x[t:t + 1]), weight, pool1, slots[:1],
                                     jnp.array([0, 1]), bias=bias)
        pieces.append(np.asarray(y_t))
    np.testing.assert_allclose(np.concatenate(pieces), y_all, rtol=1e-5, atol=1e-5)
