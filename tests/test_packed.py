"""Packed step metadata: fields travel bit-exactly, and a PackedBuilder's buffers start from its
defaults and never change once taken."""

from __future__ import annotations

import numpy as np
import pytest

from tokenspeed_jax.graph.packed import Packed, PackedBuilder

ODD_FLOATS = np.array([-0.0, np.nan, np.inf, 1e-45], np.float32)  # sign, NaN, inf, subnormal


def fields() -> dict[str, np.ndarray]:
    return {"ids": np.arange(6, dtype=np.int32).reshape(2, 3) - 3,
            "floats": ODD_FLOATS.copy(),
            "keys": np.array([[2**32 - 1, 7]], np.uint32)}


def test_unpack_returns_every_field_bit_exactly():
    arrays = fields()
    out = Packed.of(arrays).unpack()
    assert list(out) == list(arrays)
    for name, array in arrays.items():
        assert out[name].dtype == array.dtype and out[name].shape == array.shape
        np.testing.assert_array_equal(np.asarray(out[name]).view(np.int32), array.view(np.int32))


def test_a_64_bit_field_is_refused_by_name():
    with pytest.raises(TypeError, match="'wide'"):
        Packed.of({"wide": np.zeros(2, np.int64)})


def test_builder_starts_every_buffer_from_the_defaults():
    defaults = Packed.of(fields())
    builder = PackedBuilder(defaults)
    views = builder.reset()
    views["ids"][0] = [9, 9, 9]
    views["floats"][:2] = [1.5, 2.5]
    views["keys"][0, 1] = 3
    first = builder.take()
    second = builder.take()
    builder.reset()
    untouched = builder.take()

    expected = fields()
    expected["ids"][0] = 9
    expected["floats"][:2] = [1.5, 2.5]
    expected["keys"][0, 1] = 3
    np.testing.assert_array_equal(first.buffer, Packed.of(expected).buffer)
    np.testing.assert_array_equal(second.buffer, first.buffer)
    np.testing.assert_array_equal(untouched.buffer, defaults.buffer)
    assert first.layout == defaults.layout


def test_a_taken_buffer_does_not_change_with_later_writes():
    builder = PackedBuilder(Packed.of(fields()))
    builder.reset()["ids"][:] = 1
    taken = builder.take()
    builder.reset()["ids"][:] = 2
    np.testing.assert_array_equal(np.asarray(taken.unpack()["ids"]), np.ones((2, 3), np.int32))
