"""Layer pieces shared by the model families: einsum projections, weight init, RMSNorm, and the
token embedding / LM head pair.

Invariants: ``dtype`` is the compute dtype and ``param_dtype`` the stored weight dtype; a float32
compute dtype means full float32 matmuls (no TF32); norms and logits are computed in float32.
Weight layouts are written in the einsums: ``embed_tokens [V, D]``, ``lm_head [D, V]``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


def linear(spec: str, x: jax.Array, weight: nnx.Param, dtype: Any, **kwargs: Any) -> jax.Array:
    """``einsum(spec, x, weight)`` in the compute dtype; float32 means full float32 (no TF32)."""
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None
    return jnp.einsum(spec, x.astype(dtype), weight[...].astype(dtype), precision=precision,
                      **kwargs)


class ShapeOnly:
    """Stands in for ``nnx.Rngs`` where only a model's structure is wanted, under
    ``nnx.eval_shape`` (``Family.abstract_model``): ``normal_param`` then makes zeros, which
    ``eval_shape`` never allocates, instead of drawing from an RNG stream, whose counter update
    costs milliseconds a weight under tracing (most of a second for SmolLM2's 211 weights)."""


SHAPE_ONLY = ShapeOnly()


def normal_param(rngs: nnx.Rngs | ShapeOnly, shape: tuple[int, ...], dtype: Any) -> nnx.Param:
    """A weight drawn from N(0, 0.02^2), the init of the HF checkpoints these models load; with
    ``SHAPE_ONLY``, zeros of that shape (a structure to fill, never a model to run)."""
    if rngs is SHAPE_ONLY:
        return nnx.Param(jnp.zeros(shape, dtype))
    return nnx.Param(0.02 * jax.random.normal(rngs.params(), shape, dtype))


class RMSNorm(nnx.Module):
    """RMS normalisation over the last axis, computed in float32."""

    def __init__(self, dim: int, *, eps: float, dtype: Any, param_dtype: Any) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.weight[...].astype(jnp.float32)).astype(self.dtype)


class CausalLMBase(nnx.Module):
    """The embedding and the head (final norm, then tied or separate LM head) of a causal LM.

    Subclasses set ``config`` (with ``vocab_size``, ``hidden_size``, ``rms_norm_eps`` and
    ``tie_word_embeddings``) and ``dtype``, call ``init_embedding`` before their layers and
    ``init_head`` after them, so random init draws the weights in checkpoint order.
    """

    config: Any
    dtype: Any

    def init_embedding(self, param_dtype: Any, rngs: nnx.Rngs) -> None:
        """Creates ``embed_tokens [V, D]``."""
        self.embed_tokens = normal_param(
            rngs, (self.config.vocab_size, self.config.hidden_size), param_dtype)

    def init_head(self, param_dtype: Any, rngs: nnx.Rngs) -> None:
        """Creates the final ``norm`` and, unless embeddings are tied, ``lm_head [D, V]``."""
        config = self.config
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=self.dtype,
                            param_dtype=param_dtype)
        if not config.tie_word_embeddings:
            self.lm_head = normal_param(rngs, (config.hidden_size, config.vocab_size), param_dtype)

    def zero_head_from(self, first_id: int) -> None:
        """Zero the head's weights of the ids from ``first_id`` on (``lm_head`` columns, or the
        embedding rows when tied), so their logits are exactly 0."""
        if self.config.tie_word_embeddings:
            self.embed_tokens[...] = self.embed_tokens[...].at[first_id:].set(0)
        else:
            self.lm_head[...] = self.lm_head[...].at[:, first_id:].set(0)

    def embed(self, token_ids: jax.Array) -> jax.Array:
        """int32 [..., T] -> [..., T, D]."""
        return jnp.take(self.embed_tokens[...], token_ids, axis=0).astype(self.dtype)

    def head(self, hidden: jax.Array) -> jax.Array:
        """[..., D] -> float32 logits [..., V]."""
        x = self.norm(hidden)
        if self.config.tie_word_embeddings:
            return linear("...D,VD->...V", x, self.embed_tokens, self.dtype,
                          preferred_element_type=jnp.float32)
        return linear("...D,DV->...V", x, self.lm_head, self.dtype,
                      preferred_element_type=jnp.float32)
