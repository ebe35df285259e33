"""Attention at the break: paged K/V writes, prefill over paged KV, and decode (plain JAX).

The paged KV cache of one layer is ``k_pages, v_pages [num_pages, page_size, Hkv, Dh]``; slot
``s`` is page ``s // page_size``, row ``s % page_size``. Invariants:

* ``write_kv`` writes token ``t`` at slot ``slot_mapping[t]``; a slot < 0 (a padding token) writes
  nothing (it is sent out of range and dropped), so padding never touches a real page.
* A query reads only its own request's pages, positions 0..its own position (causal, prefix pages
  included); a query with ``token_request < 0`` or position < 0 is padding and gets zeros.
* Page-table entries beyond a request's length may hold any valid page id: they are masked.
* The arithmetic is ``attention_ref.masked_attention``'s (float32 softmax, GQA grouping), so the
  kernels match the reference forward exactly on real tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tokenspeed_jax.kernels.attention_ref import masked_attention


def write_kv(
    pages: jax.Array,  # [num_pages, page_size, Hkv, Dh]
    new: jax.Array,  # [T, Hkv, Dh]
    slot_mapping: jax.Array,  # i32[T]; < 0 writes nothing
) -> jax.Array:  # [num_pages, page_size, Hkv, Dh]
    """``pages`` with ``new`` scattered into the slots of ``slot_mapping``."""
    num_pages, page_size = pages.shape[:2]
    num_slots = num_pages * page_size
    slots = jnp.where(slot_mapping >= 0, slot_mapping, num_slots)
    flat = pages.reshape(num_slots, *pages.shape[2:])
    flat = flat.at[slots].set(new.astype(pages.dtype), mode="drop")
    return flat.reshape(pages.shape)


def gather_pages(pages: jax.Array, page_tables: jax.Array) -> jax.Array:
    """[num_pages, P, ...] pages, page_tables i32[B, n] -> each request's context [B, n*P, ...]."""
    batch, width = page_tables.shape
    ctx = jnp.take(pages, page_tables, axis=0, mode="clip")  # [B, n, page_size, Hkv, Dh]
    return ctx.reshape(batch, width * pages.shape[1], *pages.shape[2:])


def paged_prefill_attention(
    q: jax.Array,  # [T, Hq, Dh]
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, Dh], this step's K already written
    v_pages: jax.Array,  # [num_pages, page_size, Hkv, Dh]
    page_tables: jax.Array,  # i32[B, P]
    token_request: jax.Array,  # i32[T]: row of page_tables each token belongs to; < 0 = padding
    positions: jax.Array,  # i32[T]
    *,
    scale: float,
) -> jax.Array:  # [T, Hq, Dh]
    """Causal attention of a packed batch of prompts (with prefix pages) over the paged cache.

    All requests' contexts are laid side by side ([B * P * page_size] slots) and each token's mask
    admits only its own request's slots up to its position.
    """
    batch, width = page_tables.shape
    context = width * k_pages.shape[1]
    k = gather_pages(k_pages, page_tables).reshape(1, batch * context, *k_pages.shape[2:])
    v = gather_pages(v_pages, page_tables).reshape(1, batch * context, *v_pages.shape[2:])
    slot_request = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), context)  # [B * C]
    slot_position = jnp.tile(jnp.arange(context, dtype=jnp.int32), batch)
    mask = ((slot_request[None, :] == token_request[:, None])
            & (slot_position[None, :] <= positions[:, None])
            & (positions[:, None] >= 0))
    return masked_attention(q[None], k, v, mask[None], scale=scale)[0]


def paged_decode_attention(
    q: jax.Array,  # [B, Hq, Dh]: one query per request
    k_pages: jax.Array,  # [num_pages, page_size, Hkv, Dh], this step's K already written
    v_pages: jax.Array,
    page_tables: jax.Array,  # i32[B, P]
    positions: jax.Array,  # i32[B]; < 0 = padding row
    *,
    scale: float,
) -> jax.Array:  # [B, Hq, Dh]
    """Each request's single query over its own pages, positions 0..its position."""
    k = gather_pages(k_pages, page_tables)  # [B, C, Hkv, Dh]
    v = gather_pages(v_pages, page_tables)
    slots = jnp.arange(k.shape[1], dtype=jnp.int32)
    mask = (slots[None, :] <= positions[:, None]) & (positions[:, None] >= 0)  # [B, C]
    return masked_attention(q[:, None], k, v, mask[:, None, :], scale=scale)[:, 0]
