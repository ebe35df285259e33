"""Attention at the break: paged K/V writes and decode (prefill: ``paged_prefill_attention``).

The paged KV cache of one layer is ``k_pages, v_pages [Hkv, num_pages, page_size, Dh]`` (the
layout of JAX's Pallas paged-attention op); slot ``s`` is page ``s // page_size``, row
``s % page_size``. Invariants:

* ``write_kv`` writes token ``t`` at slot ``slot_mapping[t]``; a slot < 0 (a padding token) writes
  nothing (it is sent out of range and dropped), so padding never touches a real page. The
  scatter updates the pages in place and never has the rows' computation fused into it.
* A query reads only its own request's keys, positions 0..its own position (causal, prefix pages
  included); a query with position < 0 is padding and gets zeros.
* Prefill (``paged_prefill_attention.py``) writes the step's K/V first, then reads every query's
  keys through its request's page table, like decode: its shapes never depend on the context.
* Decode reads each request's pages up to its position: through the Pallas op on a GPU, through
  ``paged_decode_attention_reference`` (which gathers the whole page table) elsewhere; the choice
  is ``paged_attention_backend.DecodeKernel``, made once. A decode layer's whole attention
  (write, then read) is ``paged_decode.decode_attention_step``.
* Page-table entries beyond a request's length may hold any valid page id: they are masked.
* The arithmetic is ``attention_ref.masked_attention``'s (float32 softmax, GQA grouping), so the
  kernels match the reference forward on real tokens up to float summation order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tokenspeed_jax.kernels.attention_ref import masked_attention
from tokenspeed_jax.kernels.paged_attention_backend import (
    PALLAS,
    REFERENCE_KERNEL,
    DecodeKernel,
    pallas_paged_decode,
)


def write_kv(
    pages: jax.Array,  # [Hkv, num_pages, page_size, Dh]
    new: jax.Array,  # [T, Hkv, Dh]
    slot_mapping: jax.Array,  # i32[T]; < 0 writes nothing
) -> jax.Array:  # [Hkv, num_pages, page_size, Dh]
    """``pages`` with ``new`` scattered into the slots of ``slot_mapping``."""
    num_kv_heads, num_pages, page_size, head_dim = pages.shape
    num_slots = num_pages * page_size
    # The barrier keeps XLA from fusing the computation of ``new`` (e.g. the K/V projections of
    # a decode step) into the scatter, which then recomputed it per written element.
    new = jax.lax.optimization_barrier(new)
    slots = jnp.where(slot_mapping >= 0, slot_mapping, num_slots)
    if slots.shape[0] == 1:
        # XLA rewrites a one-row scatter into a dynamic-update-slice and then copies the whole
        # cache around it (measured: 60 cache-sized copies in a batch-1 decode step on the CPU).
        # A second row aimed past the end (dropped) keeps it a scatter, updated in place.
        slots = jnp.concatenate([slots, jnp.full((1,), num_slots, slots.dtype)])
        new = jnp.concatenate([new, jnp.zeros_like(new)])
    flat = pages.reshape(num_kv_heads, num_slots, head_dim)
    flat = flat.at[:, slots].set(jnp.swapaxes(new, 0, 1).astype(pages.dtype), mode="drop")
    return flat.reshape(pages.shape)


def gather_slots(pages: jax.Array, slots: jax.Array) -> jax.Array:
    """[Hkv, num_pages, page_size, Dh] pages, slots i32[...] -> [..., Hkv, Dh] (clipped ids)."""
    num_kv_heads, num_pages, page_size, head_dim = pages.shape
    flat = pages.reshape(num_kv_heads, num_pages * page_size, head_dim)
    picked = jnp.take(flat, slots.reshape(-1), axis=1, mode="clip")  # [Hkv, S, Dh]
    return jnp.swapaxes(picked, 0, 1).reshape(*slots.shape, num_kv_heads, head_dim)


def paged_decode_attention_reference(
    q: jax.Array,  # [B, Hq, Dh]: one query per request
    k_pages: jax.Array,  # [Hkv, num_pages, page_size, Dh], this step's K already written
    v_pages: jax.Array,
    page_tables: jax.Array,  # i32[B, P]
    positions: jax.Array,  # i32[B]; < 0 = padding row
    *,
    scale: float,
) -> jax.Array:  # [B, Hq, Dh]
    """Each request's single query over its own whole page table, masked to 0..its position."""
    page_size = k_pages.shape[2]
    slots = (page_tables[:, :, None] * page_size
             + jnp.arange(page_size, dtype=page_tables.dtype)).reshape(page_tables.shape[0], -1)
    k = gather_slots(k_pages, slots)  # [B, P * page_size, Hkv, Dh]
    v = gather_slots(v_pages, slots)
    index = jnp.arange(slots.shape[1], dtype=jnp.int32)
    mask = (index[None, :] <= positions[:, None]) & (positions[:, None] >= 0)  # [B, C]
    return masked_attention(q[:, None], k, v, mask[:, None, :], scale=scale)[:, 0]


def paged_decode_attention(
    q: jax.Array,  # [B, Hq, Dh]: one query per request
    k_pages: jax.Array,  # [Hkv, num_pages, page_size, Dh], this step's K already written
    v_pages: jax.Array,
    page_tables: jax.Array,  # i32[B, P]
    positions: jax.Array,  # i32[B]; < 0 = padding row
    *,
    scale: float,
    kernel: DecodeKernel = REFERENCE_KERNEL,
) -> jax.Array:  # [B, Hq, Dh]
    """Decode attention through ``kernel``'s backend (the reference by default)."""
    if kernel.backend == PALLAS:
        return pallas_paged_decode(kernel, q, k_pages, v_pages, page_tables, positions,
                                   scale=scale)
    return paged_decode_attention_reference(q, k_pages, v_pages, page_tables, positions,
                                            scale=scale)
