"""``Family.abstract_model`` (built with ``SHAPE_ONLY``, no RNG draws) has exactly the structure,
shapes and dtypes of the model its random init builds, for every family's golden checkpoint."""

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from tokenspeed_jax.models.loader import read_config

GOLDEN = Path(__file__).parent / "golden"


def shapes(model) -> list:
    return jax.tree_util.tree_leaves_with_path(
        jax.tree_util.tree_map(lambda leaf: (leaf.shape, jnp.dtype(leaf.dtype)),
                               nnx.state(model)))


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_qwen3", "tiny_tied", "tiny_kimi",
                                  "tiny_kimi_qlora", "tiny_deepseek_v3"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_abstract_model_matches_the_random_init_structure(name, dtype):
    family, config = read_config(GOLDEN / name)
    drawn = nnx.eval_shape(lambda: family.model_class(config, dtype=dtype, param_dtype=dtype,
                                                      rngs=nnx.Rngs(0)))
    abstract = family.abstract_model(config, dtype)
    assert nnx.graphdef(abstract) == nnx.graphdef(drawn)
    assert shapes(abstract) == shapes(drawn)
