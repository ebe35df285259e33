"""DeepSeek-V3's rotary embedding of the rope part: plain RoPE or yarn, and the softmax scale.

With yarn (``YarnScaling``) each rotary pair's frequency blends the original one (pairs that turn
fast, kept: "extrapolation") and the original divided by ``factor`` (slow pairs:
"interpolation"), with a linear ramp between the correction dimensions of ``beta_fast`` and
``beta_slow`` rotations over ``original_max_position_embeddings``; the cos/sin tables are then
multiplied by ``attention_factor`` (``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``
when both are set, else ``mscale(factor)``, unless given). Independently the softmax scale
``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5`` is multiplied by ``mscale(factor,
mscale_all_dim) ** 2`` when ``mscale_all_dim`` is set. Both are what transformers'
``DeepseekV3ForCausalLM`` computes; ``mscale(s, m) = 0.1 m ln s + 1`` for ``s > 1``, else 1.

Invariants: frequencies are computed once on the host (float64); tables are float32.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from tokenspeed_jax.kernels.rotary import rotary_tables
from tokenspeed_jax.models.deepseek_v3.config import DeepseekV3Config, YarnScaling


def mscale(scale: float, weight: float = 1.0) -> float:
    """Yarn's magnitude correction ``0.1 * weight * ln(scale) + 1``; 1 when ``scale <= 1``."""
    return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0


def _correction_dim(rotations: float, dim: int, base: float, max_positions: int) -> float:
    """The (fractional) feature index whose pair turns ``rotations`` times over
    ``max_positions``."""
    return dim * math.log(max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, yarn: YarnScaling) -> np.ndarray:
    """float64 [dim / 2]: the blended angular frequency of each rotary pair."""
    low = _correction_dim(yarn.beta_fast, dim, base, yarn.original_max_position_embeddings)
    high = _correction_dim(yarn.beta_slow, dim, base, yarn.original_max_position_embeddings)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a nonzero width
    inv_freq = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: the original frequency, 0: divided by the factor
    return inv_freq / yarn.factor * (1.0 - keep) + inv_freq * keep


def attention_factor(yarn: YarnScaling | None) -> float:
    """The factor yarn multiplies the cos/sin tables by (1 without yarn)."""
    if yarn is None:
        return 1.0
    if yarn.attention_factor is not None:
        return yarn.attention_factor
    if yarn.mscale and yarn.mscale_all_dim:
        return mscale(yarn.factor, yarn.mscale) / mscale(yarn.factor, yarn.mscale_all_dim)
    return mscale(yarn.factor)


def softmax_scale(config: DeepseekV3Config) -> float:
    """The attention's score scale (module docstring)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    yarn = config.rope_scaling
    if yarn is not None and yarn.mscale_all_dim:
        scale *= mscale(yarn.factor, yarn.mscale_all_dim) ** 2
    return scale


def rope_inv_freq(config: DeepseekV3Config) -> np.ndarray:
    """float64 [qk_rope_head_dim / 2]: the frequency of each rotary pair."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    if config.rope_scaling is None:
        return 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    return yarn_inv_freq(dim, base, config.rope_scaling)


def rope_tables(config: DeepseekV3Config, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) float32 ``[..., T, qk_rope_head_dim]`` of ``positions [..., T]``, rotate-half
    layout (``kernels.rotary``), times yarn's attention factor."""
    cos, sin = rotary_tables(positions, rope_inv_freq(config))
    factor = attention_factor(config.rope_scaling)
    return cos * factor, sin * factor
