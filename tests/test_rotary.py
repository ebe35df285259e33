"""RoPE tables (``kernels.rotary``) against HF's rotate-half formula written out by hand."""

import jax.numpy as jnp
import numpy as np

from tokenspeed_jax.kernels.rotary import rotary_tables, rotate, swapped_features


def test_rotate_matches_rotate_half_by_hand():
    """x [B, T, N, Dh] at positions [B, T]: (x1 cos - x2 sin, x2 cos + x1 sin) per feature pair,
    returned in x's dtype."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
    positions = np.array([[0, 1, 2, 3, 4], [7, 100, 4095, 0, 9]], np.int32)
    inv_freq = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    got = rotate(jnp.asarray(x), rotary_tables(jnp.asarray(positions), inv_freq))
    angles = positions[..., None].astype(np.float64) * inv_freq
    cos, sin = np.cos(angles)[..., None, :], np.sin(angles)[..., None, :]
    first, second = x[..., :4], x[..., 4:]
    want = np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got)[0, 0], x[0, 0])  # position 0: identity
    assert rotate(jnp.asarray(x, jnp.bfloat16), rotary_tables(
        jnp.asarray(positions), inv_freq)).dtype == jnp.bfloat16


def test_swapped_features_pair_each_half_with_the_other():
    assert np.asarray(swapped_features(8)).tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
