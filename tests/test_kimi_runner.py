"""ModelRunner: the inline-KDA segmented route, the ordinary route (KDA at a break) and the decode
route match the eager plan with the pure-JAX KDA reference, on outputs and on the whole state
pool (checkpoints included); padded requests and tokens never write a pool row or a page.

The eager reference runs op by op, and each new step size (tokens, requests, sampled rows)
compiles its ops again (seconds each on a CPU): where a test's point allows it, its batch has the
size of an earlier test's reference step, so that step's compiled ops serve it."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine.batch import StepBatch, StepRequest
from tokenspeed_jax.engine.runner import ModelRunner
from tokenspeed_jax.graph import PlanCompiler, choose_bucket
from tokenspeed_jax.kernels.mla_attention import MLAKernel
from tokenspeed_jax.kernels.paged_attention_backend import PALLAS, REFERENCE
from tokenspeed_jax.models.kimi_linear import MLA, KimiLinearForCausalLM
from tokenspeed_jax.models.kimi_linear import forward as kimi_forward
from tokenspeed_jax.models.kimi_linear.forward import checkpoint_split
from tokenspeed_jax.models.loader import load_checkpoint
from tokenspeed_jax.models.moe import KimiMoE
from tokenspeed_jax.sampling_params import SamplingParams

GOLDEN = Path(__file__).parent / "golden"
PAGE = 16
ATOL = 2e-4
CONFIG = EngineConfig(
    prefill_graph_capture_token_sizes=(128,), prefill_graph_max_tokens=128,
    prefill_graph_capture_batch_sizes=(2,), prefill_graph_max_bs=2,
    decode_graph_capture_batch_sizes=(2,), decode_graph_max_bs=2,
    max_model_len=128, compile_progress=False, strict_no_compile=True)


def test_llama_only_settings_are_logged_as_ignored(caplog):
    """``inline_prefill_attention``, ``fused_decode_attention`` and ``stack_decode_weights``
    name Llama-family routes: the Kimi runner says it ignores each when set away from its
    default, and says nothing at the defaults. ``alternate_decode_executables`` applies to its
    decode executables too, so it is not named."""
    checkpoint = load_checkpoint(GOLDEN / "tiny_kimi", dtype="float32")

    def warnings(config):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=kimi_forward.__name__):
            ModelRunner(checkpoint.model, config, num_pages=24, num_state_slots=6, page_size=PAGE)
        return [record.message for record in caplog.records]

    changed = warnings(dataclasses.replace(CONFIG, inline_prefill_attention=True,
                                           fused_decode_attention=False,
                                           stack_decode_weights=True,
                                           alternate_decode_executables=True))
    for setting in ("inline_prefill_attention=True", "fused_decode_attention=False",
                    "stack_decode_weights=True"):
        assert sum(f"{setting} does not apply to Kimi Linear" in m for m in changed) == 1
    assert not any("alternate_decode_executables" in m for m in changed)
    assert not any("does not apply" in m for m in warnings(CONFIG))


def runner_builder(**config) -> Callable[[], ModelRunner]:
    """Builds the tiny Kimi checkpoint's runner with ``CONFIG`` (fields replaced by ``config``),
    not yet compiled; the checkpoint is loaded now. ``test_compile_cache`` starts it (with
    ``disable_kda_prefill_graph``) in fresh processes on the session's executable cache, so this
    module's runners load what those processes compiled (all but the inline route's)."""
    checkpoint = load_checkpoint(GOLDEN / "tiny_kimi", dtype="float32")
    return functools.partial(ModelRunner, checkpoint.model, dataclasses.replace(CONFIG, **config),
                             num_pages=24, num_state_slots=6, page_size=PAGE)


def new_runner(**config) -> ModelRunner:
    """The runner ``runner_builder(**config)`` builds."""
    return runner_builder(**config)()


@pytest.fixture(scope="module")
def runner():
    runner = new_runner()
    runner.compile_all()
    return runner


def request(rid: str, tokens: np.ndarray, start: int, first_page: int, slot: int,
            checkpoint: int = -1) -> StepRequest:
    pages = np.arange(first_page, first_page + 8, dtype=np.int32)
    return StepRequest(rid, tokens.astype(np.int32), start, pages, True,
                           SamplingParams(temperature=0.0), state_slot=slot,
                           checkpoint_slot=checkpoint)


def noisy_pools(runner: ModelRunner, seed: int) -> dict[str, np.ndarray]:
    """Random values in every pool row and page, so a stray write is visible."""
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(p.shape).astype(p.dtype) for n, p in runner.pools.items()}


def run(runner: ModelRunner, pools: dict, how: str, requests: list, *,
        eager_plan: str = "reference") -> tuple:
    with runner.guard.allowed("test pools"):
        runner.pools = {n: jnp.asarray(p) for n, p in pools.items()}
    if how == "eager":
        out = runner.run_eager(requests, plan=eager_plan)
    elif how == "step":
        out = runner.step(StepBatch(requests))
    else:
        out = runner.run_compiled(how, requests)
    return out, {n: np.asarray(p) for n, p in runner.pools.items()}


def assert_same(a: tuple, b: tuple, *, pool_rtol: float = 0.0) -> None:
    (out_a, pools_a), (out_b, pools_b) = a, b
    np.testing.assert_array_equal(out_a.token_ids, out_b.token_ids)
    np.testing.assert_allclose(out_a.logprobs, out_b.logprobs, atol=ATOL)
    for name in pools_a:
        np.testing.assert_allclose(pools_a[name].astype(np.float32),
                                   pools_b[name].astype(np.float32), rtol=pool_rtol, atol=ATOL,
                                   err_msg=name)


def prompts(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, 256, 70), rng.integers(3, 256, 40)


def test_a_second_runner_loads_every_executable_from_the_cache(runner):
    """The executable cache serves Kimi's plans too: a second runner over the same model and
    configuration compiles nothing and computes the same tokens and pools."""
    second = new_runner()
    summary = second.compile_all()
    assert summary.num_compiled == 0 and summary.num_loaded == summary.num_executables > 10
    long, short = prompts(3)
    batch = [request("a", long, 0, 0, slot=1), request("b", short, 0, 8, slot=3)]
    pools = noisy_pools(runner, 3)
    assert_same(run(second, pools, "inline", batch), run(runner, pools, "inline", batch))


def test_consecutive_kda_layers_share_a_segment_and_mla_layers_are_breaks(runner):
    """The last segment also gathers the sampled rows for the head."""
    names = [call.stage.name for call in runner.plans["inline"].calls]
    assert names == ["embed+kda+kda+mla_in", "attention", "mla_out+kda+kda+mla_in", "attention",
                     "mla_out+kda+rows"]
    ordinary = [call.stage.name for call in runner.plans["ordinary"].calls]
    assert ordinary.count("kda") == 5 and ordinary.count("attention") == 2


def test_prefill_routes_match_eager_reference_with_checkpoint_and_padding(runner):
    long, short = prompts()
    # request a checkpoints at 64 tokens (main 64, tail 6) into row 4; rows 0, 2, 5 and every
    # page outside 0..15 belong to nobody and must keep their random contents.
    batch = [request("a", long, 0, 0, slot=1, checkpoint=4), request("b", short, 0, 8, slot=3)]
    pools = noisy_pools(runner, 0)
    eager = run(runner, pools, "eager", batch)
    inline = run(runner, pools, "inline", batch)
    ordinary = run(runner, pools, "ordinary", batch)
    assert_same(inline, eager)
    assert_same(ordinary, eager)
    written = inline[1]
    for name, before in pools.items():
        if name.startswith("latent"):
            np.testing.assert_array_equal(written[name][16:], before[16:])
        else:
            np.testing.assert_array_equal(written[name][[0, 2, 5]], before[[0, 2, 5]])
            assert not np.allclose(written[name][4], before[4])


def test_checkpoint_equals_the_state_after_the_prefix_alone(runner):
    long, _ = prompts()
    pools = noisy_pools(runner, 1)
    _, with_checkpoint = run(runner, pools, "inline", [request("a", long, 0, 0, slot=1,
                                                               checkpoint=4)])
    _, prefix_only = run(runner, pools, "inline", [request("p", long[:64], 0, 0, slot=2)])
    for name in with_checkpoint:
        if not name.startswith("latent"):
            np.testing.assert_allclose(with_checkpoint[name][4], prefix_only[name][2], atol=ATOL)


def test_padded_request_in_bucket_writes_nothing(runner):
    _, short = prompts()
    pools = noisy_pools(runner, 2)
    eager = run(runner, pools, "eager", [request("b", short, 0, 8, slot=3)])
    inline = run(runner, pools, "inline", [request("b", short, 0, 8, slot=3)])
    assert_same(inline, eager)
    for name, before in pools.items():
        # 40 tokens fill pages 8..10 of the request's table; its state row is 3.
        untouched = np.r_[0:8, 11:len(before)] if name.startswith("latent") else [0, 1, 2, 4, 5]
        np.testing.assert_array_equal(inline[1][name][untouched], before[untouched])


def test_decode_route_matches_eager_and_extends_the_prefill(runner):
    long, short = prompts()
    pools = noisy_pools(runner, 3)
    prefill = [request("a", long[:-1], 0, 0, slot=1), request("b", short[:-1], 0, 8, slot=3)]
    _, after = run(runner, pools, "inline", prefill)
    decode = [request("a", long[-1:], 69, 0, slot=1), request("b", short[-1:], 39, 8, slot=3)]
    assert runner.route(decode) == "decode"
    compiled = run(runner, after, "decode", decode)
    eager = run(runner, after, "eager", decode)
    assert_same(compiled, eager)
    whole = run(runner, pools, "inline", [request("a", long, 0, 0, slot=1),
                                          request("b", short, 0, 8, slot=3)])
    assert_same(compiled, whole)
    assert runner.stats()["runtime_compiles"] == 0


def test_decode_is_one_executable_per_batch_bucket(runner):
    """A decode step is one executable call: the decode plan is a single call (every layer,
    the head, the sampler and the token board inside), compiled once per decode bucket, with
    no head or segment executables of its own."""
    for rows in runner.buckets.decode_executables:
        (call,) = runner.decode_plan(rows).calls
        assert call.stage.name == "decode"
    labels = runner.ladders.compiler.labels
    assert [label for label in labels if label.startswith("decode")] == [
        f"decode B={rows}" for rows in runner.buckets.decode_executables]
    assert [label for label in labels if label.startswith("head")] == [
        f"head B={rows}" for rows in runner.buckets.prefill_requests]


class Traced(Exception):
    """Raised where XLA would start compiling: every plan has been traced by then."""


def test_every_moe_layer_of_a_compiled_step_knows_its_padding_rows(monkeypatch):
    """The decode and prefill plans hand each MoE layer the rows that are real tokens
    (``live``, from the positions), so a bucket's padding rows route to no expert and read no
    expert weights (``moe.KimiMoE``); the dense first layer is not asked. ``compile_all`` traces
    every plan as it adds it (the cache off: none is loaded instead) and is stopped there, before
    the compiles, which would not call the layers again."""
    calls = []
    original = KimiMoE.__call__

    def recording(self, x, *, mesh=None, live=None):
        calls.append(live is not None)
        return original(self, x, mesh=mesh, live=live)

    def stop(self, **kwargs):
        raise Traced

    runner = new_runner(compile_cache=False)  # its pools' allocation compiles here
    monkeypatch.setattr(KimiMoE, "__call__", recording)
    monkeypatch.setattr(PlanCompiler, "compile_all", stop)
    with pytest.raises(Traced):
        runner.compile_all()
    assert calls and all(calls)


def test_decode_steps_alternate_between_two_loaded_copies_when_asked(runner):
    """With ``alternate_decode_executables`` successive decode steps of a bucket run two loaded
    copies of its executable in turn, with the tokens and pools of the single copy."""
    alternating = new_runner(alternate_decode_executables=True)
    alternating.compile_all()
    first, second = alternating._decode_turns[2].slots
    assert first.plan is not second.plan
    assert runner._decode_turns[2].slots[0].plan is runner._decode_turns[2].slots[1].plan
    long, short = prompts(5)
    _, pools = run(runner, noisy_pools(runner, 8), "inline",
                   [request("a", long[:-2], 0, 0, slot=1), request("b", short[:-2], 0, 8, slot=3)])
    for offset in (2, 1):
        decode = [request("a", long[-offset:][:1], 70 - offset, 0, slot=1),
                  request("b", short[-offset:][:1], 40 - offset, 8, slot=3)]
        want = run(runner, pools, "step", decode)
        assert_same(run(alternating, pools, "step", decode), want)
        pools = want[1]
    assert alternating.stats()["runtime_compiles"] == 0


def test_pallas_mla_kernels_interpreted_give_the_reference_kernels_results(runner):
    """The Pallas MLA kernels, interpreted on the CPU: prefill attention at the breaks, a
    second chunk attending over the first chunk's cached latent pages (as a prefix-cache hit
    does), and decode attention inside the decode executable give the tokens and pools of the
    plain-JAX references. The kernel choice is part of the executable cache key. The prefill
    steps take the ordinary route, the only one the kernels' runner compiles: its MLA pieces
    and attention breaks are the inline route's, and it compiles in half the time."""
    checkpoint = load_checkpoint(GOLDEN / "tiny_kimi", dtype="float32")
    kernels = ModelRunner(checkpoint.model,
                          dataclasses.replace(CONFIG, disable_kda_prefill_graph=True),
                          num_pages=24, num_state_slots=6, page_size=PAGE,
                          settings=MLAKernel(PALLAS, interpret=True))
    assert runner.forward.mla_kernel.backend == REFERENCE
    assert kernels.cache_fingerprint() != runner.cache_fingerprint()
    kernels.compile_all()
    long, short = prompts(6)
    pools = noisy_pools(runner, 9)
    steps = [("ordinary", [request("a", long[:32], 0, 0, slot=1),
                           request("b", short[:-1], 0, 8, slot=3)]),
             ("ordinary", [request("a", long[32:-1], 32, 0, slot=1)]),
             ("decode", [request("a", long[-1:], 69, 0, slot=1),
                         request("b", short[-1:], 39, 8, slot=3)])]
    for how, batch in steps:
        want = run(runner, pools, how, batch)
        assert_same(run(kernels, pools, how, batch), want)
        pools = want[1]
    assert kernels.stats()["runtime_compiles"] == 0


def test_bf16_state_rows_round_where_the_reference_stores():
    """``kda_state_dtype="bfloat16"``: the state pools are bf16, and a decode step's kernels (run
    op by op) match the KDA reference, which also rounds a state only where it stores it, to
    one bf16 rounding; rows of other requests keep their bits. (The prefill kernel's bf16 pool
    is checked in test_kda.)"""
    checkpoint = load_checkpoint(GOLDEN / "tiny_kimi", dtype="float32")
    config = dataclasses.replace(CONFIG, kda_state_dtype="bfloat16")
    runner = ModelRunner(checkpoint.model, config, num_pages=24, num_state_slots=6,
                        page_size=PAGE)
    dtypes = {n: p.dtype for n, p in runner.pools.items()}
    assert {d for n, d in dtypes.items() if n.startswith("state")} == {jnp.dtype(jnp.bfloat16)}
    assert {d for n, d in dtypes.items() if not n.startswith("state")} == {jnp.dtype(jnp.float32)}

    long, short = prompts()
    decode = [request("a", long[-1:], 69, 0, slot=1), request("b", short[-1:], 39, 8, slot=3)]
    pools = noisy_pools(runner, 5)
    kernels = run(runner, pools, "eager", decode, eager_plan="decode")
    reference = run(runner, pools, "eager", decode)
    assert all(kernels[1][name].dtype == dtype for name, dtype in dtypes.items())
    assert_same(kernels, reference, pool_rtol=2.0**-7)  # one bf16 rounding apart
    for name, before in pools.items():
        if name.startswith("state"):
            np.testing.assert_array_equal(kernels[1][name][[0, 2, 4, 5]], before[[0, 2, 4, 5]])
            assert not np.array_equal(kernels[1][name][[1, 3]], before[[1, 3]])


def test_a_mixed_step_runs_its_decode_rows_on_the_decode_route(runner):
    """``step`` runs a mixed step's decode row on the decode route and the prompts on the inline
    route; tokens and the whole pool match the eager reference of the step as one batch."""
    long, short = prompts(2)
    pools = noisy_pools(runner, 5)
    mixed = [request("c", short[:9], 0, 16, slot=5),
             dataclasses.replace(request("b", short, 0, 8, slot=3), sample=False),
             request("a", long[:1], 70, 0, slot=1)]
    before = dict(runner.stats())
    stepped = run(runner, pools, "step", mixed)
    runs = {key: runner.stats()[key] - before[key]
            for key in ("mixed_splits", "decode_runs", "prefill_runs", "ordinary_runs",
                        "eager_runs")}
    assert runs == {"mixed_splits": 1, "decode_runs": 1, "prefill_runs": 1, "ordinary_runs": 0,
                    "eager_runs": 0}
    assert len(stepped[0].token_ids) == 2
    assert_same(stepped, run(runner, pools, "eager", mixed))


def test_decode_steps_run_ahead_on_the_token_board(runner):
    """A decode step launched before the previous one's tokens are fetched, its input tokens
    read from the token board, gives the tokens and the whole pool of two eager reference steps
    fed with the host's tokens."""
    long, short = prompts(4)
    first, after_prefill = run(runner, noisy_pools(runner, 7), "inline",
                               [request("a", long, 0, 0, slot=1),
                                request("b", short, 0, 8, slot=3)])

    def decode(tokens, offset: int, **extra) -> list[StepRequest]:
        return [dataclasses.replace(request(rid, np.array([t]), n + offset, page, slot), **extra)
                for rid, t, n, page, slot in zip("ab", tokens, (70, 40), (0, 8), (1, 3))]

    reference = [run(runner, after_prefill, "eager", decode(first.token_ids, 0))]
    reference.append(run(runner, reference[0][1], "eager",
                         decode(reference[0][0].token_ids, 1)))
    with runner.guard.allowed("test pools"):
        runner.pools = {n: jnp.asarray(p) for n, p in after_prefill.items()}
    pending = runner.launch(StepBatch(decode(first.token_ids, 0)))
    ahead = runner.launch(StepBatch([dataclasses.replace(r, token_row=row) for row, r in
                                     enumerate(decode([0, 0], 1))]))
    assert pending.on_board and ahead.on_board
    outputs = [pending.result(), ahead.result()]
    pools = {n: np.asarray(p) for n, p in runner.pools.items()}
    assert_same((outputs[0], reference[1][1]), (reference[0][0], reference[1][1]))
    assert_same((outputs[1], pools), reference[1])
    with pytest.raises(ValueError, match="token_row"):
        runner.launch(StepBatch(decode([0, 0], 2, token_row=0,
                                       params=SamplingParams(repetition_penalty=1.2))))
    assert runner.stats()["runtime_compiles"] == 0


def test_routes_and_fallbacks(runner):
    long, short = prompts()
    prefill = [request("a", long, 0, 0, slot=1), request("b", short, 0, 8, slot=3)]
    assert runner.route(prefill) == "inline"
    mixed = [request("a", long[:1], 70, 0, slot=1), request("b", short, 0, 8, slot=3)]
    assert runner.route(mixed) == "ordinary"
    three = prefill + [request("c", short[:5], 0, 16, slot=5)]
    assert runner.route(three) == "inline"  # in groups of whole requests
    too_long = [request("d", np.concatenate([long, long]), 0, 0, slot=1)]
    assert runner.route(too_long) == "eager"  # 140 tokens: no 128-token bucket holds it whole


def test_a_step_of_more_requests_than_the_largest_bucket_runs_in_groups_of_whole_requests(
        runner):
    """Three prompts with a largest request bucket of 2 run as two compiled prefill groups (one
    request split counted), no request cut and nothing eager, with the tokens and the whole pool
    of the eager reference step of all three (9, 40 and 1 tokens: the mixed step's size)."""
    long, short = prompts(9)
    three = [request("a", long[:9], 0, 0, slot=1), request("b", short, 0, 8, slot=3),
             request("c", short[:1], 0, 16, slot=5)]
    pools = noisy_pools(runner, 13)
    before = dict(runner.stats())
    stepped = run(runner, pools, "step", three)
    runs = {key: runner.stats()[key] - before[key]
            for key in ("prefill_runs", "request_splits", "chunked_prefill_splits", "eager_runs")}
    assert runs == {"prefill_runs": 2, "request_splits": 1, "chunked_prefill_splits": 0,
                    "eager_runs": 0}
    assert_same(stepped, run(runner, pools, "eager", three))


def test_a_decode_step_past_the_largest_bucket_runs_in_bucket_groups(runner):
    """Three decode requests with a largest decode bucket of 2 run on the decode executables as
    two groups (counted as a decode split), with the tokens and pools of the eager reference
    step of all three."""
    long, short = prompts(7)
    prefill = [request("a", long[:-1], 0, 0, slot=1), request("b", short[:-1], 0, 8, slot=3),
               request("c", short[:19], 0, 16, slot=5)]
    _, after = run(runner, noisy_pools(runner, 11), "step", prefill)  # compiled, in 2 groups
    decode = [request("a", long[-1:], 69, 0, slot=1), request("b", short[-1:], 39, 8, slot=3),
              request("c", short[19:20], 19, 16, slot=5)]
    assert runner.route(decode) == "decode" and runner.buckets.decode_requests[-1] == 2
    before = runner.stats()
    stepped = run(runner, after, "step", decode)
    after_stats = runner.stats()
    assert after_stats["decode_splits"] - before["decode_splits"] == 1
    assert after_stats["decode_runs"] - before["decode_runs"] == 2
    assert after_stats["eager_runs"] == before["eager_runs"]
    assert_same(stepped, run(runner, after, "eager", decode))
    assert runner.stats()["runtime_compiles"] == 0


def test_checkpoint_split_of_two_extends_at_granularity_128():
    splits = [checkpoint_split(0, n, 128) for n in (868, 869)]
    assert splits == [768, 768]
    assert [n - s for n, s in zip((868, 869), splits)] == [100, 101]
    assert choose_bucket((1024, 2048), 868 + 869) == 2048
    assert checkpoint_split(128, 100, 128) == 0
    assert checkpoint_split(64, 200, 128) == 192


def test_two_extends_of_868_and_869_tokens_share_the_2048_by_2_executable():
    """TokenSpeed's example through the runner's host side: the route, the executable's bucket
    and the KDA metadata that goes in (main scans 768 + 768, tails 100 + 101)."""
    checkpoint = load_checkpoint(GOLDEN / "tiny_kimi", dtype="float32")
    config = EngineConfig(
        prefill_graph_capture_token_sizes=(1024, 2048), prefill_graph_max_tokens=2048,
        prefill_graph_capture_batch_sizes=(1, 2), prefill_graph_max_bs=2,
        decode_graph_capture_batch_sizes=(2,), max_model_len=1024, prefix_granularity=128,
        compile_progress=False)
    runner = ModelRunner(checkpoint.model, config, num_pages=128, num_state_slots=4,
                        page_size=PAGE)
    rng = np.random.default_rng(5)
    batch = [StepRequest(f"r{i}", rng.integers(3, 256, n).astype(np.int32), 0,
                         np.arange(64 * i, 64 * i + 64, dtype=np.int32), True,
                         SamplingParams(temperature=0.0), state_slot=i, checkpoint_slot=2 + i)
             for i, n in enumerate((868, 869))]
    assert runner.route(batch) == "inline"
    assert runner.prefill_bucket(batch) == (2048, 2)
    inputs, _ = runner.prefill_arrays(batch, 2048, 2, 2)
    np.testing.assert_array_equal(inputs["cu_seqlens"], [0, 868, 868 + 869])
    np.testing.assert_array_equal(inputs["checkpoint_offsets"], [768, 768])
    np.testing.assert_array_equal(inputs["checkpoint_slots"], [2, 3])
    tails = np.diff(inputs["cu_seqlens"]) - inputs["checkpoint_offsets"]
    np.testing.assert_array_equal(tails, [100, 101])


def test_disable_switch_compiles_only_the_ordinary_route():
    checkpoint = load_checkpoint(GOLDEN / "tiny_kimi_qlora", dtype="float32")
    config = EngineConfig(**{**{f: getattr(CONFIG, f) for f in CONFIG.__slots__},
                             "disable_kda_prefill_graph": True,
                             "decode_graph_capture_batch_sizes": (1,), "decode_graph_max_bs": 1,
                             "prefill_graph_capture_batch_sizes": (1,),
                             "prefill_graph_max_bs": 1})
    runner = ModelRunner(checkpoint.model, config, num_pages=8, num_state_slots=2, page_size=PAGE)
    summary = runner.compile_all()
    assert not any(label.startswith("inline") for label in summary.seconds_per_label)
    tokens = np.random.default_rng(4).integers(3, 256, 40)  # the padded test's step size
    batch = [request("a", tokens, 0, 0, slot=0)]
    assert runner.route(batch) == "ordinary"
    pools = noisy_pools(runner, 4)
    assert_same(run(runner, pools, "ordinary", batch), run(runner, pools, "eager", batch))


def test_a_model_without_kda_layers_runs_with_nothing_to_restore(runner):
    """Only MLA layers: no KDA state pools and no restore executable; compiled == eager (on
    the prefill test's two requests, one checkpointing)."""
    config = dataclasses.replace(runner.model_config, num_hidden_layers=2,
                                 layer_types=(MLA, MLA))
    with runner.guard.allowed("random weights of a second model"):
        model = KimiLinearForCausalLM(config, rngs=nnx.Rngs(3))
    mla_only = ModelRunner(model, CONFIG, num_pages=24, num_state_slots=3, page_size=PAGE)
    summary = mla_only.compile_all()
    assert mla_only.state_pools == () and mla_only.restore_plan is None
    assert not any(label.startswith("restore") for label in summary.seconds_per_label)
    long, short = prompts(5)
    requests = [request("a", long, 0, 1, 0, checkpoint=1), request("b", short, 0, 9, 2)]
    pools = noisy_pools(mla_only, 6)
    assert_same(run(mla_only, pools, "inline", requests), run(mla_only, pools, "eager", requests))
    mla_only.guard.disarm()


def test_serves_from_a_skeleton_while_the_ladder_compiles(runner):
    """Background compile: of token buckets (32, 64, 128) the skeleton compiles 32 and 128
    before serving. A 40-token step (the padded test's) runs in the 128-token plans until the
    deferred compile has added 64, then in those; tokens and pools are the eager reference's
    either way, and nothing compiles on the step's path. (The ordinary route alone: half the
    compiles.)"""
    checkpoint = load_checkpoint(GOLDEN / "tiny_kimi", dtype="float32")
    config = dataclasses.replace(CONFIG, prefill_graph_capture_token_sizes=(32, 64, 128),
                                 disable_kda_prefill_graph=True, background_compile=True)
    ladder = ModelRunner(checkpoint.model, config, num_pages=24, num_state_slots=6,
                        page_size=PAGE)
    ladder.compile_all(start_background=False)
    try:
        _, short = prompts(6)
        batch = [request("b", short, 0, 8, slot=3)]
        pools = noisy_pools(runner, 8)
        expected = run(runner, pools, "eager", batch)
        assert ladder.ready.tokens == (32, 128) and ladder.prefill_bucket(batch) == (128, 2)
        assert_same(run(ladder, pools, "step", batch), expected)
        ladder.ladders.compile_deferred()
        assert ladder.ready == ladder.buckets and ladder.prefill_bucket(batch) == (64, 2)
        assert_same(run(ladder, pools, "step", batch), expected)
        stats = ladder.stats()
        assert stats["ordinary_runs"] == 2 and stats["padded_tokens"] == (128 - 40) + (64 - 40)
        assert stats["runtime_compiles"] == 0
        assert (stats["buckets_ready"], stats["buckets_total"]) == (5, 5)
    finally:
        ladder.guard.disarm()


def test_a_runner_without_prefill_buckets_starts_and_restores_state_rows():
    """Eager (as with the prefill graph off) there are no prefill request buckets: the runner
    compiles no restore executable, and a restore copies each checkpoint row to its request's
    slot op by op, touching nothing else."""
    runner = new_runner(enforce_eager=True)
    runner.compile_all()
    assert not [key for key in runner._compiled if key[0] == "restore"]
    pools = noisy_pools(runner, seed=3)
    with runner.guard.allowed("test pools"):
        runner.pools = {n: jnp.asarray(p) for n, p in pools.items()}
    tokens = np.zeros(1, np.int32)
    runner.restore([dataclasses.replace(request("a", tokens, 0, 0, slot=3), restore_slot=1),
                    request("b", tokens, 0, 8, slot=4)])
    for name, before in pools.items():
        expected = before.copy()
        if name in runner.state_pools:
            expected[3] = before[1]
        np.testing.assert_array_equal(np.asarray(runner.pools[name]), expected)
    assert runner.counters["kda_state_restores"] == 1
