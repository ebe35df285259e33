"""The compilers a runner uses, built from its ``EngineConfig``: the ``PlanCompiler`` of its
start-up arrays and plans (progress bar, executable cache, XLA options, threads) and the
``LadderCompiler`` of its buckets.

Invariants: every compiler of one config shares its executable cache and options; on a GPU the
autotuned compilers keep XLA's autotune results beside the cache; a quick compiler (the quick
skeleton's, and the one of plans that are not autotuned: ``autotunes_prefill``) never autotunes
and runs several compiles at once (nothing it compiles times kernels on the device); a cache
directory or key file that cannot be trusted is fatal.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.buckets import Buckets
from tokenspeed_jax.engine.ladders import LadderCompiler
from tokenspeed_jax.graph import PlanCompiler
from tokenspeed_jax.graph.cache import ExecutableCache
from tokenspeed_jax.graph.trust import CacheTrustError, load_mac_key

# The quick compiler's XLA options: no autotuning, so compiles are short, do not time kernels on
# the device, and may run side by side; and cuBLAS for the matrix products, whose heuristics
# pick fast kernels untuned where XLA's Triton products, untuned, ran prefill 4-36x slower.
NO_AUTOTUNE = {"xla_gpu_autotune_level": "0", "xla_gpu_enable_triton_gemm": False}
QUICK_COMPILE_THREADS = min(8, os.cpu_count() or 1)


def engine_compiler(config: EngineConfig, *, description: str, fingerprint: str | None,
                    mesh: Any, quick: bool = False) -> PlanCompiler:
    """The ``PlanCompiler`` of a runner built from ``config``: its progress bar, executable
    cache, XLA options and threads; on a GPU, XLA's autotune results kept beside the cache.
    ``quick``: the quick skeleton's compiler (``engine/ladders.py``): no autotuning, at least
    ``QUICK_COMPILE_THREADS`` threads. A cache directory or key file that cannot be trusted
    (``graph/trust.py``) is fatal: ``CacheTrustError`` naming the flags that choose others."""
    cache_dir, cache = config.compile_cache_path, None
    if cache_dir:
        try:
            cache = ExecutableCache(cache_dir, load_mac_key(config.compile_cache_key_file))
        except CacheTrustError as error:
            raise CacheTrustError(f"{error} (--compile-cache-dir, --compile-cache-key-file; "
                                  f"--no-compile-cache turns the cache off)") from None
    options, threads = config.compiler_options, config.compile_threads
    if quick:
        options, threads = {**options, **NO_AUTOTUNE}, max(threads, QUICK_COMPILE_THREADS)
    autotune_dir = (cache.autotune_directory()
                    if cache is not None and jax.default_backend() == "gpu" and not quick
                    else None)
    return PlanCompiler(progress=config.compile_progress, description=description,
                        cache=cache, fingerprint=fingerprint, mesh=mesh, compiler_options=options,
                        threads=threads, autotune_cache_dir=autotune_dir)


def uses_quick_skeleton(config: EngineConfig, platform: str | None = None) -> bool:
    """Whether the skeleton is compiled quick and autotuned in the background: an explicit
    ``quick_skeleton``, else on a GPU with ``background_compile`` (on a CPU nothing is
    autotuned, so there is nothing to gain)."""
    if config.quick_skeleton is not None:
        return config.quick_skeleton and config.background_compile
    return config.background_compile and (platform or jax.default_backend()) == "gpu"


def autotunes_prefill(config: EngineConfig, platform: str | None = None) -> bool:
    """Whether the prefill and full-sampler plans compile with XLA's autotuning, like the
    others: an explicit ``prefill_autotune``, else not on a GPU (they run as fast untuned, and
    then compile side by side); on a CPU, where nothing is autotuned, they stay with the
    others."""
    if config.prefill_autotune is not None:
        return config.prefill_autotune
    return (platform or jax.default_backend()) != "gpu"


def ladder_compiler(config: EngineConfig, buckets: Buckets, *, description: str,
                    fingerprint: str, mesh: Any) -> LadderCompiler:
    """The ``LadderCompiler`` of a runner's ``buckets``: the skeleton before serving with
    ``background_compile`` (quick with ``uses_quick_skeleton``), else every bucket; a quick
    compiler for the quick skeleton and, unless ``autotunes_prefill``, the plans added with
    ``autotune=False``."""
    compiler = engine_compiler(config, description=description, fingerprint=fingerprint,
                               mesh=mesh)
    quick_skeleton, untuned_plans = uses_quick_skeleton(config), not autotunes_prefill(config)
    quick = None
    if quick_skeleton or untuned_plans:
        quick = engine_compiler(config, description=f"{description} (not autotuned)",
                                fingerprint=fingerprint, mesh=mesh, quick=True)
    skeleton = buckets.skeleton() if config.background_compile else buckets
    return LadderCompiler(compiler, buckets, skeleton, quick=quick,
                          quick_skeleton=quick_skeleton, untuned_plans=untuned_plans)
