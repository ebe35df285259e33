"""The one place that chooses how decode attention over the paged KV cache runs.

On a GPU, decode attention is JAX's own Pallas op
``jax.experimental.pallas.ops.gpu.paged_attention.paged_attention``: it walks each request's page
table only up to the request's length, so a decode step costs what the live contexts hold, not
``max_model_len``. Asked for (``fused=True``), it is instead our own kernel
(``paged_decode.fused_paged_decode``), which also writes the step's K/V: one kernel per layer
where the op's route takes about six. Elsewhere (the CPU) it is the plain-JAX reference in
``attention.py``. Invariants:

* The choice is static: ``choose_decode_kernel`` decides once, from the platform, the head size,
  the page size and the cache dtype, and the runner compiles that choice in. A shape the op cannot
  run is declared by ``pallas_unsupported_reason`` and takes the reference path knowingly, logged
  once; nothing is tried and caught at run time.
* The op's layout is the cache's layout: pages ``[num_kv_heads, num_pages, page_size, head_dim]``,
  queries ``[batch, num_q_heads, head_dim]``. It does not scale the scores, so the query is scaled
  before the call; it pads a head group that is not a multiple of ``block_h`` by itself.
* A row with position < 0 (padding) has length 0: the op reads no page for it and returns zeros.
* Tensor parallelism: a kernel with a ``mesh`` runs the op per shard under ``jax.shard_map``,
  queries and pages split by KV head over ``parallel.AXIS`` (each device's query heads read only
  its own KV heads, so no collective). With fewer KV heads than devices the cache is replicated
  and a device's queries would need a slice of it: that case takes the reference, logged
  (``kv_heads_split_problem``). Prefill attention shares this rule and ``shard_by_kv_head``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from tokenspeed_jax import parallel
from tokenspeed_jax.kernels.kernel_math import is_power_of_2

try:
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as _pallas_op
except ImportError as error:  # declared below: this jax has no such op, decode uses the reference
    _pallas_op = None
    _IMPORT_ERROR = f"jax {jax.__version__} has no pallas.ops.gpu.paged_attention ({error})"
else:
    _IMPORT_ERROR = ""

logger = logging.getLogger(__name__)

PALLAS = "pallas"
FUSED = "fused"
REFERENCE = "reference"
PALLAS_DTYPES = ("bfloat16", "float16", "float32")
MIN_DOT_DIM = 16  # Triton's dot needs every operand dimension >= 16


@dataclasses.dataclass(frozen=True)
class DecodeKernel:
    """How decode attention runs: the backend and its Pallas kernel's tuning knobs (the op's
    and the fused kernel's have the same meaning)."""

    backend: str = REFERENCE
    block_h: int = 16  # query heads per program; the op requires a multiple of 16
    pages_per_compute_block: int = 8  # pages loaded per inner step (a power of 2)
    # At most this many partitions of a page table, reduced at the end: the setting that was
    # best, or close to it, at small and large batches alike.
    k_splits: int = 4
    interpret: bool = False  # run the Pallas op in the interpreter (tests on the CPU)
    mesh: Mesh | None = None  # run the op per shard of the KV heads over this mesh

    def __post_init__(self) -> None:
        if self.backend not in (PALLAS, FUSED, REFERENCE):
            raise ValueError(f"backend={self.backend!r} must be {PALLAS!r}, {FUSED!r} or "
                             f"{REFERENCE!r}")
        if self.block_h % 16:
            raise ValueError(f"block_h={self.block_h} must be a multiple of 16")
        if not is_power_of_2(self.pages_per_compute_block) or self.k_splits < 1:
            raise ValueError(f"pages_per_compute_block={self.pages_per_compute_block} must be a "
                             f"power of 2 and k_splits={self.k_splits} >= 1")


def check_pallas_or_reference(backend: str) -> None:
    """ValueError unless ``backend`` is PALLAS or REFERENCE (the prefill kernels' choices)."""
    if backend not in (PALLAS, REFERENCE):
        raise ValueError(f"backend={backend!r} must be {PALLAS!r} or {REFERENCE!r}")


REFERENCE_KERNEL = DecodeKernel(REFERENCE)
# The fused kernel's knobs. It splits a request's pages only at small batches, up to k_splits
# (paged_decode.fused_split_count).
FUSED_KERNEL = DecodeKernel(FUSED, pages_per_compute_block=4, k_splits=4)


def pallas_unsupported_reason(*, head_dim: int, page_size: int, dtype: jnp.dtype,
                              kernel: DecodeKernel = REFERENCE_KERNEL) -> str | None:
    """Why the Pallas op cannot run this cache shape, or None when it can.

    Triton loads and stores whole power-of-2 blocks, and its dot needs dimensions >= 16.
    """
    if _pallas_op is None:
        return _IMPORT_ERROR
    if page_size * kernel.pages_per_compute_block < MIN_DOT_DIM:
        return (f"page_size={page_size} x pages_per_compute_block="
                f"{kernel.pages_per_compute_block} < {MIN_DOT_DIM}")
    return paged_cache_problem(head_dim=head_dim, page_size=page_size, dtype=dtype)


def paged_cache_problem(*, head_dim: int, page_size: int, dtype: jnp.dtype) -> str | None:
    """Why a Triton-lowered kernel cannot read this paged cache, or None: whole power-of-2
    blocks, dot dimensions >= 16, and a 16- or 32-bit float dtype."""
    if not is_power_of_2(head_dim) or head_dim < MIN_DOT_DIM:
        return f"head_dim={head_dim} is not a power of 2 >= {MIN_DOT_DIM}"
    if not is_power_of_2(page_size):
        return f"page_size={page_size} is not a power of 2"
    if jnp.dtype(dtype).name not in PALLAS_DTYPES:
        return f"cache dtype {jnp.dtype(dtype).name} is not one of {PALLAS_DTYPES}"
    return None


def kv_heads_split_problem(mesh: Mesh | None, num_kv_heads: int) -> str | None:
    """Why a kernel cannot run per shard of ``num_kv_heads`` KV heads over ``mesh``, or None:
    the heads must split evenly (fewer heads than devices are replicated, ``llama/sharding.py``)."""
    if mesh is None or num_kv_heads % mesh.size == 0:
        return None
    return f"num_kv_heads={num_kv_heads} are replicated over {mesh.size} devices, not split"


def shard_by_kv_head(op: Callable[..., object], mesh: Mesh, *, ins: str,
                     outs: str = "h") -> Callable[..., object]:
    """``op`` run per shard under ``jax.shard_map``, its arguments and results laid out by one
    letter each (``outs`` of one letter: a single result): ``h`` an activation ``[T, H, Dh]``
    split by head, ``p`` pages ``[Hkv, ...]`` split by KV head, ``r`` replicated metadata. A
    device's query heads read only its own KV heads, so there is no collective."""
    specs = {"h": parallel.head_spec(3), "p": parallel.head_spec(4, axis=0), "r": PartitionSpec()}
    out_specs = tuple(specs[kind] for kind in outs)
    return jax.shard_map(op, mesh=mesh, in_specs=tuple(specs[kind] for kind in ins),
                         out_specs=out_specs[0] if len(outs) == 1 else out_specs,
                         check_vma=False)


def on_gpu(platform: str | None) -> bool:
    """Whether ``platform`` (default: JAX's default backend) is a GPU, where the kernels run."""
    return (platform or jax.default_backend()) == "gpu"


def pallas_runs(shape_problem: str | None, *, platform: str | None, mesh: Mesh | None,
                num_kv_heads: int, log: Callable[[str], None]) -> bool:
    """The rule both attention kernels are chosen by: the Pallas kernel runs on a GPU
    (``platform``, default JAX's default backend) for a cache shape it supports
    (``shape_problem`` is None) whose KV heads split over ``mesh``. Otherwise the reference runs;
    on a GPU, ``log`` gets the reason."""
    if not on_gpu(platform):
        return False
    reason = shape_problem or kv_heads_split_problem(mesh, num_kv_heads)
    if reason is not None:
        log(reason)
        return False
    return True


@functools.cache
def log_reference_once(what: str, reason: str) -> None:
    """Warn, once per ``what`` and ``reason``, that ``what`` (an attention) runs its plain-JAX
    reference because its Pallas kernel cannot run here."""
    logger.warning("%s uses the plain-JAX reference: the Pallas kernel cannot run here: %s",
                   what, reason)


def choose_decode_kernel(*, head_dim: int, page_size: int, dtype: jnp.dtype,
                         platform: str | None = None, mesh: Mesh | None = None,
                         num_kv_heads: int = 1, fused: bool = False) -> DecodeKernel:
    """The decode kernel for this platform (default: JAX's default backend) and cache shape:
    the fused kernel with ``fused``, else (or where the fused kernel cannot read the cache, with
    the reason logged) JAX's op.

    With a ``mesh`` (the cache split by KV head over it) the kernel runs per shard; a cache that
    replicates its ``num_kv_heads`` over more devices takes the reference (module docstring).
    """
    shape = {"head_dim": head_dim, "page_size": page_size, "dtype": dtype}
    chosen = DecodeKernel(PALLAS)
    if fused:
        fused_problem = pallas_unsupported_reason(**shape, kernel=FUSED_KERNEL)
        if fused_problem is None:
            chosen = FUSED_KERNEL
        elif on_gpu(platform):
            _log_op_once(fused_problem)
    problem = pallas_unsupported_reason(**shape, kernel=chosen)
    if not pallas_runs(problem, platform=platform, mesh=mesh, num_kv_heads=num_kv_heads,
                       log=_log_reference_once):
        return REFERENCE_KERNEL
    return dataclasses.replace(chosen, mesh=mesh)


@functools.cache
def _log_op_once(reason: str) -> None:
    logger.warning("decode attention uses JAX's paged-attention op: the fused kernel cannot run "
                   "here: %s", reason)


@functools.cache
def _log_reference_once(reason: str) -> None:
    logger.warning("decode attention uses the plain-JAX reference (it reads max_model_len "
                   "slots per request): the Pallas paged_attention op cannot run here: %s", reason)


def pallas_paged_decode(
    kernel: DecodeKernel,
    q: jax.Array,  # [B, Hq, Dh]
    k_pages: jax.Array,  # [Hkv, num_pages, page_size, Dh]
    v_pages: jax.Array,  # [Hkv, num_pages, page_size, Dh]
    page_tables: jax.Array,  # i32[B, P]
    positions: jax.Array,  # i32[B]; < 0 = padding row
    *,
    scale: float,
) -> jax.Array:  # [B, Hq, Dh]
    """Each query over its request's pages 0..its position, through the Pallas op.

    The page table is padded (with page 0, never read past the length) to a multiple of
    ``pages_per_compute_block * k_splits``, which the op requires.
    """
    if _pallas_op is None:
        raise ValueError(_IMPORT_ERROR)
    width = page_tables.shape[1]
    block = kernel.pages_per_compute_block
    k_splits = min(kernel.k_splits, math.ceil(width / block))
    padded = -(-width // (block * k_splits)) * (block * k_splits)
    tables = jnp.pad(page_tables.astype(jnp.int32), ((0, 0), (0, padded - width)))
    lengths = jnp.maximum(positions + 1, 0).astype(jnp.int32)
    scaled = (q.astype(jnp.float32) * scale).astype(k_pages.dtype)
    op = functools.partial(_pallas_op, block_h=kernel.block_h, pages_per_compute_block=block,
                           k_splits=k_splits, interpret=kernel.interpret)
    if kernel.mesh is not None:
        op = shard_by_kv_head(op, kernel.mesh, ins="hpprr")
    return op(scaled, k_pages, v_pages, tables, lengths).astype(q.dtype)
