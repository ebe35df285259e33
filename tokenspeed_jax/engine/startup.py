"""Start-up: load a model, size its KV cache (and state pool), build its runner, compile, and
hand back a ready ``Engine`` (``build_engine``).

Invariants:

* The KV page count is a shape of every executable, so it does not follow free memory from one
  start to the next: sized from free memory when ``num_pages`` is not set, it is recorded beside
  the executable cache and later starts of the same setup keep it while it fits in the memory
  free then (``num_kv_pages``, ``sizing_record``); with the cache off each start sizes anew.
* A model runs on the runner its family names (``models/registry.py``). A family with recurrent
  state (Kimi-Linear: KDA state beside a paged latent cache) gets a state pool of
  ``max_num_seqs`` live rows plus, with prefix caching, as many checkpoint rows
  (``state_slots.StateSlots``).
* No compiled batch bucket exceeds ``max_num_seqs``: larger buckets could never be used.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Any

from tokenspeed_jax import parallel
from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine import sizing_record
from tokenspeed_jax.engine.engine import Engine
from tokenspeed_jax.engine.runner import ModelRunner
from tokenspeed_jax.engine.state_slots import StateSlots
from tokenspeed_jax.models.cache_spec import PAGE, SLOT, unit_bytes

logger = logging.getLogger(__name__)


# The CPU backend's "device memory" is host RAM shared with everything else on the machine, so
# the KV cache there takes only this share of what is free (times mem_fraction).
CPU_MEMORY_SHARE = 0.1
# Free memory moves a little between starts; the page count is a compiled shape, so it is rounded
# down to this many pages to keep it (and the executable cache's keys) the same across restarts.
KV_PAGE_ROUNDING = 256


def hybrid_state_slots(config: EngineConfig) -> StateSlots:
    """The state rows of a hybrid model: ``max_num_seqs`` live rows, plus as many checkpoint rows
    when prefix caching is on (the caller turns it off when checkpoints cannot line up with
    pages)."""
    from tokenspeed_jax.kernels.kda_ref import CHUNK_SIZE

    checkpoints = config.max_num_seqs if config.enable_prefix_caching else 0
    return StateSlots(config.max_num_seqs, checkpoints, granularity=config.prefix_granularity,
                      chunk=CHUNK_SIZE, page_size=config.page_size)


def free_device_bytes() -> tuple[int, str]:
    """Free memory of the first device, and where the figure came from."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)), "device"
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(available * CPU_MEMORY_SHARE), "host"


def total_device_bytes() -> int:
    """Memory of the first device: what its allocator may use, or on the CPU the host's RAM."""
    import jax

    stats = jax.devices()[0].memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def sizing_key(config: EngineConfig, page_bytes: int, reserved_bytes: int, model: str
               ) -> dict[str, Any]:
    """What decides the page count besides free memory: the key of its sizing record."""
    import jax

    return {"model": model, "page_bytes": page_bytes, "reserved_bytes": reserved_bytes,
            "page_size": config.page_size, "max_model_len": config.max_model_len,
            "max_num_seqs": config.max_num_seqs, "mem_fraction": config.mem_fraction,
            "tensor_parallel_size": config.tensor_parallel_size,
            "device_kind": jax.devices()[0].device_kind,
            "device_total_bytes": total_device_bytes()}


def num_kv_pages(config: EngineConfig, page_bytes: int, reserved_bytes: int = 0, *,
                 model: str = "") -> int:
    """KV pages to allocate: the explicit ``num_pages``, else what the free memory allows (less
    ``reserved_bytes`` taken by other per-engine buffers).

    Never more than ``max_num_seqs`` full-length sequences need, never fewer than one sequence of
    ``max_model_len`` needs.

    With the executable cache on, a count sized from free memory is recorded in the cache
    directory (``sizing_record``), keyed by ``sizing_key``: ``model`` (its path), the page and
    reserved bytes, ``page_size``, ``max_model_len``, ``max_num_seqs``, ``mem_fraction``,
    ``tensor_parallel_size`` and the device's kind and total memory. A later call with the same
    key returns the recorded count while it is within the bounds above and fits in the memory
    free now (``mem_fraction`` of it, less ``reserved_bytes``), however much more is free, so
    the executables' shapes stay those of the first start; a count that no longer fits is sized
    again (logged with the numbers) and replaces the record. Delete the record, or set
    ``num_pages``, to choose anew. With the cache off every call sizes from free memory.
    """
    if config.num_pages is not None:
        if config.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {config.num_pages}")
        return config.num_pages
    if not 0.0 < config.mem_fraction <= 1.0:
        raise ValueError(f"mem_fraction must be in (0, 1], got {config.mem_fraction}")
    per_sequence = math.ceil(config.max_model_len / config.page_size)
    most = config.max_num_seqs * per_sequence
    free, _ = free_device_bytes()
    affordable = (int(free * config.mem_fraction) - reserved_bytes) // page_bytes
    directory = config.compile_cache_path
    key = sizing_key(config, page_bytes, reserved_bytes, model) if directory else None
    recorded = None if key is None else sizing_record.read_pages(directory, key)
    if recorded is not None:
        if per_sequence <= recorded <= min(affordable, most):
            logger.info("KV cache: %d pages, as recorded at an earlier start in %s", recorded,
                        sizing_record.record_path(directory, key))
            return recorded
        logger.warning(
            "the KV page count recorded at an earlier start, %d, does not fit now: %.2f GiB "
            "free x mem_fraction=%s holds %d pages of %d bytes (bounds %d..%d); sizing again, "
            "so executables of the new count are compiled", recorded, free / 2**30,
            config.mem_fraction, affordable, page_bytes, per_sequence, most)
    if affordable >= KV_PAGE_ROUNDING:
        affordable = max(affordable // KV_PAGE_ROUNDING * KV_PAGE_ROUNDING, per_sequence)
    if affordable < per_sequence:
        raise ValueError(
            f"{free / 2**30:.2f} GiB free x mem_fraction={config.mem_fraction} holds "
            f"{affordable} KV pages of {page_bytes} bytes, fewer than one sequence of "
            f"max_model_len={config.max_model_len} needs ({per_sequence}); lower max_model_len "
            f"or set num_pages"
        )
    pages = min(affordable, most)
    if key is not None:
        path = sizing_record.write_pages(directory, key, pages)
        if path is not None:
            logger.info("KV cache: %d pages sized from %.2f GiB free; recorded in %s for later "
                        "starts", pages, free / 2**30, path)
    return pages


@dataclasses.dataclass
class EngineBundle:
    """A ready engine and what start-up produced on the way."""

    engine: Engine
    runner: Any  # of the runner class the model's family names
    compile_summary: Any  # graph.CompileSummary
    model_path: str
    seconds: float
    loaded: Any  # models.loader.LoadedModel (with its family)
    config: EngineConfig  # as run: buckets clamped, prefix caching off where it cannot work


def build_engine(config: EngineConfig, loaded: Any = None) -> EngineBundle:
    """Load the model (unless ``loaded`` is given), size the KV cache, compile every executable,
    return a ready engine."""
    from tokenspeed_jax.models.loader import load_model

    start = time.perf_counter()
    # No step ever holds more than max_num_seqs requests: larger batch buckets would be dead code.
    config = dataclasses.replace(
        config,
        decode_graph_max_bs=min(config.decode_graph_max_bs, config.max_num_seqs),
        prefill_graph_max_bs=min(config.prefill_graph_max_bs, config.max_num_seqs),
    )
    mesh = parallel.make_mesh(config.tensor_parallel_size)
    if loaded is None:
        loaded = load_model(config.model, dtype=config.dtype, mesh=mesh,
                            load_format=config.load_format, tokenizer=config.tokenizer)
    family = loaded.family
    dtype = getattr(loaded.model, "dtype", "float32")
    devices = parallel.mesh_size(mesh)
    if mesh is not None:
        family.check_split(loaded.config, mesh.size)
    # each device holds its share of every page and state row; free memory is per device
    pools = family.cache_pools(loaded.config, config.page_size, dtype, config.kda_state_dtype,
                               devices)
    page_bytes = unit_bytes(pools, PAGE, devices)
    state_slots = None
    reserved = 0
    if family.has_recurrent_state:
        if config.enable_prefix_caching and config.prefix_granularity % config.page_size:
            logger.warning(
                "prefix caching is off for this hybrid model: prefix_granularity=%d is not a "
                "multiple of page_size=%d, so KDA checkpoints cannot end on a page",
                config.prefix_granularity, config.page_size)
            config = dataclasses.replace(config, enable_prefix_caching=False)
        state_slots = hybrid_state_slots(config)
        reserved = state_slots.num_slots * unit_bytes(pools, SLOT, devices)
    reserved += ModelRunner.extra_device_bytes(config, loaded.model)
    num_pages = num_kv_pages(config, page_bytes, reserved, model=str(loaded.path))
    runner = ModelRunner(loaded.model, config, num_pages, config.page_size,
                         num_state_slots=0 if state_slots is None else state_slots.num_slots)
    summary = runner.compile_all()
    budget = config.prefill_token_limit if config.chunked_prefill_size else config.max_model_len
    engine = Engine(
        runner,
        loaded.tokenizer,
        num_pages=num_pages,
        page_size=config.page_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=min(config.max_model_len, loaded.config.max_position_embeddings),
        enable_prefix_caching=config.enable_prefix_caching,
        state_slots=state_slots,
        overlap_schedule=config.overlap_schedule,
    )
    return EngineBundle(engine, runner, summary, str(loaded.path), time.perf_counter() - start,
                        loaded, config)
