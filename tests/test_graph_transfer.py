"""graph/transfer.py: step metadata reaches the device as ``jax.device_put`` would put it."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tokenspeed_jax.graph.transfer import default_sharding, put_host_leaves


def test_leaves_arrive_bit_exact_on_the_given_sharding():
    leaves = [np.arange(94, dtype=np.int32), np.linspace(-1, 1, 12, dtype=np.float32)
              .reshape(3, 4), np.array([2**32 - 1, 7], np.uint32), np.int32(5)]
    placed = put_host_leaves(leaves, default_sharding())
    reference = jax.device_put(leaves)
    for got, ref, host in zip(placed, reference, leaves):
        assert got.dtype == ref.dtype and got.shape == ref.shape
        np.testing.assert_array_equal(np.asarray(got), np.asarray(host))
        assert got.sharding.device_set == ref.sharding.device_set


def test_replicated_sharding_puts_a_copy_on_every_device():
    devices = np.array(jax.devices())  # one on this suite's CPU, several under tensor parallelism
    sharding = NamedSharding(jax.sharding.Mesh(devices, ("tp",)), PartitionSpec())
    host = np.arange(10, dtype=np.int32)
    (placed,) = put_host_leaves([host], sharding)
    assert placed.sharding == sharding
    for shard in placed.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), host)


def test_empty_list_is_no_transfer():
    assert put_host_leaves([], default_sharding()) == []
