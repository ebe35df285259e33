"""The one place that chooses how MLA attention over the paged latent cache runs, and runs it.

On a GPU, decode is ``mla_decode.mla_decode`` (which also writes the step's latent rows) and
prefill ``mla_prefill.mla_prefill``, both Pallas kernels; elsewhere their plain-JAX references.
Invariants:

* The choice is static: ``choose_mla_kernel`` decides once, from the platform and the latent
  cache's shape (R, r, page size, dtype). A shape the kernels cannot read takes the references,
  logged once on a GPU; nothing is tried and caught at run time.
* ``mla_decode_step`` writes the step's latent rows and attends, on either route, in one call.
  ``mla_prefill_step`` attends over rows the caller has already written (``mla.write_latent``);
  the Pallas route needs ``prefill_work`` items cut with ``kernel.prefill.block_q``.
* Tensor parallelism (``parallel``): the query heads are split and the latent cache replicated.
  With a ``mesh`` the kernels run per shard under ``jax.shard_map`` on the shard's own heads, and
  every device writes the same rows into its replica, so there is no collective. The references
  need no mesh: XLA partitions them.
* The decode kernel's knobs and split count are fixed per compiled shape: ``mla_decode_blocks``
  of the batch size, ``mla_split_count`` of it and the shard's head count.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from tokenspeed_jax.kernels.mla_decode import (
    MLADecodeBlocks,
    mla_decode,
    mla_decode_blocks,
    mla_decode_problem,
    mla_decode_reference,
    mla_split_count,
)
from tokenspeed_jax.kernels.mla_prefill import (
    MLAPrefillBlocks,
    mla_prefill,
    mla_prefill_blocks,
    mla_prefill_problem,
    mla_prefill_reference,
)
from tokenspeed_jax.kernels.paged_attention_backend import (
    PALLAS,
    REFERENCE,
    check_pallas_or_reference,
    log_reference_once,
    pallas_runs,
    shard_by_kv_head,
)


@dataclasses.dataclass(frozen=True)
class MLAKernel:
    """How MLA attention runs: the backend, both kernels' knobs, interpretation, the mesh."""

    backend: str = REFERENCE
    decode: MLADecodeBlocks | None = None  # None: ``mla_decode_blocks`` of each batch size
    prefill: MLAPrefillBlocks = dataclasses.field(default_factory=MLAPrefillBlocks)
    interpret: bool = False  # run the Pallas kernels in the interpreter (tests on the CPU)
    mesh: Mesh | None = None  # run the Pallas kernels per shard of the query heads over this mesh

    def __post_init__(self) -> None:
        check_pallas_or_reference(self.backend)


REFERENCE_MLA = MLAKernel(REFERENCE)


def choose_mla_kernel(*, kv_lora_rank: int, rope_dim: int, page_size: int, dtype: jnp.dtype,
                      platform: str | None = None, mesh: Mesh | None = None) -> MLAKernel:
    """The MLA kernels for this platform (default: JAX's default backend) and latent cache
    shape: the Pallas kernels on a GPU, the references elsewhere. With a ``mesh`` the kernels run
    per shard of the query heads (the replicated cache needs no split of its own)."""
    shape = {"kv_lora_rank": kv_lora_rank, "rope_dim": rope_dim, "page_size": page_size,
             "dtype": dtype}
    problem = mla_decode_problem(**shape) or mla_prefill_problem(**shape)
    # The latent cache is one replicated head, never split over the mesh: no KV-head rule.
    if not pallas_runs(problem, platform=platform, mesh=None, num_kv_heads=1,
                       log=functools.partial(log_reference_once, "MLA attention")):
        return REFERENCE_MLA
    return MLAKernel(PALLAS, prefill=mla_prefill_blocks(dtype), mesh=mesh)


def mla_decode_step(
    q: jax.Array,  # [B, H, R + r]: one query per request
    latent: jax.Array,  # [B, R + r]: this step's latent rows
    pages: jax.Array,  # [num_pages, page_size, R + r]
    page_tables: jax.Array,  # i32[B, P]
    positions: jax.Array,  # i32[B]; < 0 = padding row
    *,
    scale: float,
    kv_lora_rank: int,
    kernel: MLAKernel = REFERENCE_MLA,
) -> tuple[jax.Array, jax.Array]:
    """A decode layer's latent attention: (output [B, H, R], pages with the step's rows
    written), through ``kernel``'s backend, per shard of ``kernel.mesh`` when it has one."""
    if kernel.backend != PALLAS:
        return mla_decode_reference(q, latent, pages, page_tables, positions, scale=scale,
                                    kv_lora_rank=kv_lora_rank)

    def op(q, latent, pages, page_tables, positions):  # a shard's heads, with a mesh
        blocks = (mla_decode_blocks(q.shape[0], pages.dtype, pages.shape[1])
                  if kernel.decode is None else kernel.decode)
        splits = mla_split_count(q.shape[0], q.shape[1], blocks)
        return mla_decode(q, latent, pages, page_tables, positions, scale=scale,
                          kv_lora_rank=kv_lora_rank, splits=splits, blocks=blocks,
                          interpret=kernel.interpret)

    if kernel.mesh is not None:
        op = shard_by_kv_head(op, kernel.mesh, ins="hrrrr", outs="hr")
    return op(q, latent, pages, page_tables, positions)


def mla_prefill_step(
    q: jax.Array,  # [T, H, R + r]
    pages: jax.Array,  # [num_pages, page_size, R + r], this step's rows already written
    page_tables: jax.Array,  # i32[rows, pages_per_row]
    token_request: jax.Array,  # i32[T]; < 0 = padding
    positions: jax.Array,  # i32[T]; < 0 = padding
    work: jax.Array | None,  # i32[items, 4] (``prefill_work``); the Pallas kernel's only
    *,
    scale: float,
    kv_lora_rank: int,
    kernel: MLAKernel = REFERENCE_MLA,
) -> jax.Array:  # [T, H, R]
    """A prefill layer's latent attention through ``kernel``'s backend, per shard of
    ``kernel.mesh`` when it has one."""
    if kernel.backend != PALLAS:
        return mla_prefill_reference(q, pages, page_tables, token_request, positions,
                                     scale=scale, kv_lora_rank=kv_lora_rank)
    if work is None:
        raise ValueError("the Pallas MLA prefill kernel needs work items (prefill_work)")
    op = functools.partial(mla_prefill, scale=scale, kv_lora_rank=kv_lora_rank,
                           blocks=kernel.prefill, interpret=kernel.interpret)
    if kernel.mesh is not None:
        op = shard_by_kv_head(op, kernel.mesh, ins="hrrrr")
    return op(q, pages, page_tables, positions, work)
