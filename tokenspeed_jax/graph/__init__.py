"""The segmented-compile core, independent of LLMs: plans, buckets, AOT compile, replay, guard.

See docs/graph.md for the contract and a runnable example on a plain JAX function.
"""

from tokenspeed_jax.graph.buckets import (
    batch_ladder,
    choose_bucket,
    explicit_ladder,
    padding_waste,
    skeleton,
    token_ladder,
)
from tokenspeed_jax.graph.cache import ExecutableCache
from tokenspeed_jax.graph.compile import CompileError, CompileSummary, PlanCompiler, abstract
from tokenspeed_jax.graph.guard import CompileGuard, RuntimeCompileError
from tokenspeed_jax.graph.pieces import Piece, PlanBuilder
from tokenspeed_jax.graph.plan import Break, Call, Plan, Segment
from tokenspeed_jax.graph.runner import CompiledPlan, run_eager, whole_forward

__all__ = [
    "Break",
    "Call",
    "CompileError",
    "CompileGuard",
    "CompileSummary",
    "CompiledPlan",
    "ExecutableCache",
    "Piece",
    "Plan",
    "PlanBuilder",
    "PlanCompiler",
    "RuntimeCompileError",
    "Segment",
    "abstract",
    "batch_ladder",
    "choose_bucket",
    "explicit_ladder",
    "padding_waste",
    "run_eager",
    "skeleton",
    "token_ladder",
    "whole_forward",
]
