"""The merge of a split decode kernel's per-split states into the attention output.

A decode kernel that cuts each request's cached positions into ``S`` splits
(``paged_decode.fused_paged_decode``, ``mla_decode.mla_decode``) writes per split the
unnormalised sums ``acc f32[S, B, H, D]``, the base-2 running maxima ``row_max f32[S, B, H]``
(``-inf`` where a split saw no position) and the sums of weights ``row_sum f32[S, B, H]``. The
output ``[B, H, D]`` (float32) is ``sum_s w_s acc_s / sum_s w_s row_sum_s`` with ``w_s =
exp2(row_max_s - max_s row_max_s)``; a row no split saw (padding) gets zeros. The merges
may write it rounded once to a narrower ``dtype`` (what the attention's caller takes).

Two implementations of one function:

* ``merge_splits``: plain JAX. After an MLA decode (H = 32 heads of R = 512) XLA runs it as
  four kernels (the maximum, the weights' sum, the weighted sum of ``acc``, the division).
* ``merge_splits_pallas``: one Pallas call (Triton lowering, ``pallas_backend``), a program per
  (request, head) that loads its ``S`` states in power-of-2 parts (Triton blocks) and writes the
  row.

``merge_split_results`` is what ``mla_decode`` calls: the Pallas merge where the kernel is
compiled, writing the activations' dtype itself (no conversion kernel after it), and
``merge_splits`` where it is interpreted (the CPU), so the CPU's numerics are the plain merge's.
The two sum the splits in different orders (float32). Measured on an H200 side by side in one
process: the Pallas merge took 8-12 us off the whole Kimi-Linear batch-1 step (7 MLA
layers), and added 37 us to Llama-3-8B's (32 GQA layers of 32 heads of 128, 4 splits), where
XLA's merge costs less; ``fused_paged_decode`` keeps ``merge_splits``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from tokenspeed_jax.kernels import pallas_backend
from tokenspeed_jax.kernels.kernel_math import is_power_of_2, power_of_2_parts


def merge_splits(acc: jax.Array, row_max: jax.Array, row_sum: jax.Array) -> jax.Array:
    """The attention output [B, H, D] from per-split unnormalised sums acc [S, B, H, D],
    base-2 running maxima and sums [S, B, H]; rows no split saw (padding) get zeros."""
    top = jnp.max(row_max, axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weight = jnp.exp2(row_max - top)  # a split that saw nothing has -inf: weight 0
    total = jnp.sum(weight * row_sum, axis=0)
    out = jnp.sum(weight[..., None] * acc, axis=0)
    return out / jnp.where(total > 0, total, 1.0)[..., None]


def _merge_kernel(acc_ref, max_ref, sum_ref, out_ref):
    request, head = pl.program_id(0), pl.program_id(1)
    parts = [(max_ref[splits, request, head], sum_ref[splits, request, head],
              acc_ref[splits, request, head, :])
             for splits in power_of_2_parts(acc_ref.shape[0])]
    top = functools.reduce(jnp.maximum, [jnp.max(row_max) for row_max, _, _ in parts])
    top = jnp.where(top > -jnp.inf, top, 0.0)
    total, out = 0.0, 0.0
    for row_max, row_sum, acc in parts:
        weight = jnp.exp2(row_max - top)
        total = total + jnp.sum(weight * row_sum)
        out = out + jnp.sum(weight[:, None] * acc, axis=0)
    out_ref[request, head, :] = (out / jnp.where(total > 0, total, 1.0)).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("dtype", "num_warps", "interpret"))
def merge_splits_pallas(acc: jax.Array, row_max: jax.Array, row_sum: jax.Array, *,
                        dtype: jnp.dtype = jnp.float32, num_warps: int = 4,
                        interpret: bool | None = None) -> jax.Array:
    """``merge_splits`` as one Pallas call (module docstring), its float32 result rounded once
    to ``dtype``."""
    splits, batch, heads, width = acc.shape
    if row_max.shape != (splits, batch, heads) or row_sum.shape != row_max.shape:
        raise ValueError(f"acc {acc.shape}, row_max {row_max.shape} and row_sum "
                         f"{row_sum.shape} must be [S, B, H, D], [S, B, H] and [S, B, H]")
    if not is_power_of_2(width):
        raise ValueError(f"the state width {width} must be a power of 2")
    whole = pl.BlockSpec()
    return pl.pallas_call(
        _merge_kernel,
        grid=(batch, heads),
        in_specs=[whole] * 3,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct((batch, heads, width), dtype),
        compiler_params=pallas_backend.compiler_params(num_warps=num_warps, num_stages=1),
        interpret=pallas_backend.resolve_interpret(interpret),
        name="split_merge",
    )(acc, row_max, row_sum)


def merge_split_results(acc: jax.Array, row_max: jax.Array, row_sum: jax.Array, *,
                        dtype: jnp.dtype, interpret: bool) -> jax.Array:
    """The merge a decode kernel runs after its splits, in ``dtype``: the Pallas call where the
    kernel is compiled, ``merge_splits`` where it is interpreted (module docstring)."""
    if interpret:
        return merge_splits(acc, row_max, row_sum).astype(dtype)
    return merge_splits_pallas(acc, row_max, row_sum, dtype=dtype, interpret=False)
