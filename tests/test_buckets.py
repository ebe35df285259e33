"""Bucket ladders: the TokenSpeed token ladder, request-count ladders, choice and padding bounds."""

from __future__ import annotations

import itertools

import pytest

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.graph.buckets import (
    batch_ladder,
    choose_bucket,
    explicit_ladder,
    padding_waste,
    skeleton,
    token_ladder,
)


def test_token_ladder_rungs_follow_the_step_rule():
    ladder = token_ladder(8192)
    assert ladder[0] == 16 and ladder[-1] == 8192
    for low, high in itertools.pairwise(ladder):
        power = 1
        while power * 2 <= low / 8:
            power *= 2
        assert high - low == min(max(power, 16), 512), (low, high)
    # hand-checked rungs around the step changes
    assert ladder[:9] == (16, 32, 48, 64, 80, 96, 112, 128, 144)
    assert {256, 288, 512, 576, 4096, 4608} <= set(ladder)


def test_token_ladder_ends_at_a_top_off_the_ladder():
    assert token_ladder(100) == (16, 32, 48, 64, 80, 96, 100)
    assert token_ladder(10) == (10,)


@pytest.mark.parametrize("top", [8192, 3000, 16384])
def test_padding_waste_is_at_most_one_eighth_above_128_tokens(top):
    ladder = token_ladder(top)
    worst = max(padding_waste(n, choose_bucket(ladder, n)) for n in range(129, top + 1))
    assert worst <= 0.125


def test_explicit_ladder_filters_sorts_and_keeps_the_max():
    assert explicit_ladder([64, 0, -3, 16, 5000, 64, 32], 512) == (16, 32, 64, 512)
    assert explicit_ladder([512], 512) == (512,)


def test_batch_ladder_default_decode_buckets():
    assert batch_ladder(160) == (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160)
    assert batch_ladder(5) == (1, 2, 4, 5)
    assert batch_ladder(1) == (1,)


def test_choose_bucket_picks_the_smallest_fit_or_none():
    ladder = (16, 32, 48)
    assert [choose_bucket(ladder, n) for n in (1, 16, 17, 48)] == [16, 16, 32, 48]
    assert choose_bucket(ladder, 49) is None


def test_top_bucket_is_min_of_graph_max_and_chunk_size():
    assert EngineConfig().prefill_token_limit == 8192
    assert EngineConfig(chunked_prefill_size=2048).prefill_token_limit == 2048
    assert EngineConfig(prefill_graph_max_tokens=1024).prefill_token_limit == 1024
    assert EngineConfig(prefill_graph_max_tokens=20000,
                        chunked_prefill_size=0).prefill_token_limit == 20000
    assert not EngineConfig(prefill_graph_max_tokens=0).prefill_graph_enabled


def test_config_rejects_bad_values_naming_them():
    with pytest.raises(ValueError, match="decode_graph_max_bs"):
        EngineConfig(decode_graph_max_bs=0)
    for option in ("xla_cpu_enable_fast_math", "=true", " xla_x=1"):
        with pytest.raises(ValueError, match="xla_compiler_options"):
            EngineConfig(xla_compiler_options=(option,))
    assert EngineConfig(xla_compiler_options=["a=b=c", "d=", "e=false", "f=TRUE"]
                        ).compiler_options == {"a": "b=c", "d": "", "e": False, "f": True}
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        EngineConfig(chunked_prefill_size=-1)
    with pytest.raises(ValueError, match="compile_threads must be >= 1, got 0"):
        EngineConfig(compile_threads=0)
    with pytest.raises(ValueError, match="kda_state_dtype must be one of .*got 'float16'"):
        EngineConfig(kda_state_dtype="float16")


def test_skeleton_of_the_default_token_ladder_is_rungs_four_times_apart():
    assert skeleton(token_ladder(8192)) == (16, 32, 128, 512, 2048, 8192)
    assert skeleton(token_ladder(100)) == (16, 32, 100)  # 25 is nearer 32 than 16 in ratio
    assert skeleton(token_ladder(32)) == (16, 32)
    assert skeleton((7,)) == (7,)
    assert skeleton(batch_ladder(64), None) == (1, 64)
    with pytest.raises(ValueError, match="ratio must be > 1"):
        skeleton((16, 32), 1)


@pytest.mark.parametrize("top", [8192, 3000, 100])
def test_skeleton_fits_what_the_ladder_fits_with_bounded_padding(top):
    """A size that fits the ladder fits the skeleton, in a bucket at most 4x the one the full
    ladder picks."""
    ladder = token_ladder(top)
    rungs = skeleton(ladder)
    assert set(rungs) <= set(ladder) and rungs[-1] == top
    worst = max(choose_bucket(rungs, n) / choose_bucket(ladder, n) for n in range(1, top + 1))
    assert worst <= 4
