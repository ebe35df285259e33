"""models.cache_spec: a family's pools give the bytes start-up sizes the cache with and the
arrays its runner allocates; both must agree, for every family's golden checkpoint."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.runner import ModelRunner
from tokenspeed_jax.models.cache_spec import PAGE, SLOT, CachePool, unit_bytes
from tokenspeed_jax.models.hf_checkpoint import iter_hf_tensors
from tokenspeed_jax.models.loader import build_model, read_config

GOLDEN = Path(__file__).parent / "golden"


def test_a_pool_inserts_its_count_and_splits_its_bytes():
    pool = CachePool("k_pages.0", PAGE, (4, 16, 8), "bfloat16", count_axis=1,
                     spec=PartitionSpec("tp", None, None, None))
    assert pool.shape(10) == (4, 10, 16, 8)
    assert pool.unit_bytes() == 4 * 16 * 8 * 2 and pool.unit_bytes(4) == 16 * 8 * 2
    odd = CachePool("conv.0", SLOT, (3, 5), "float32", spec=PartitionSpec(None, None, "tp"))
    assert odd.unit_bytes(2) == 30  # 60 bytes over two devices
    replicated = CachePool("latent.1", PAGE, (16, 6), "float32")
    assert replicated.unit_bytes(8) == 16 * 6 * 4
    assert unit_bytes([pool, odd, replicated], PAGE, 4) == 16 * 8 * 2 + 16 * 6 * 4
    with pytest.raises(ValueError, match="per must be"):
        CachePool("x", "row", (1,), "float32")
    with pytest.raises(ValueError, match="count_axis"):
        CachePool("x", PAGE, (1,), "float32", count_axis=2)


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_kimi", "tiny_deepseek_v3"])
def test_the_runner_allocates_what_the_family_declares(name):
    family, model_config = read_config(GOLDEN / name)
    model = build_model(model_config, iter_hf_tensors(GOLDEN / name), dtype=jnp.float32)
    config = EngineConfig(max_model_len=64, prefill_graph_max_tokens=16, max_num_seqs=2,
                          decode_graph_max_bs=2)
    pools = family.cache_pools(model_config, 8, "float32", "float32", 1)
    pages, slots = 5, 3
    runner = ModelRunner(model, config, num_pages=pages, page_size=8,
                         num_state_slots=slots if family.has_recurrent_state else 0)
    arrays = runner.pools
    assert sorted(arrays) == sorted(pool.name for pool in pools)
    for pool in pools:
        count = pages if pool.per == PAGE else slots
        assert arrays[pool.name].shape == pool.shape(count)
        assert arrays[pool.name].dtype == np.dtype(pool.dtype)
    allocated = sum(array.nbytes for array in arrays.values())
    assert allocated == pages * unit_bytes(pools, PAGE) + slots * unit_bytes(pools, SLOT)
