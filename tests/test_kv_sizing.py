"""KV cache sizing from free memory: stable across restarts, within the configured bounds."""

import pytest

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine import engine

PAGE_BYTES = 1000


def pages_with_free(monkeypatch, free_bytes: int, **options) -> int:
    monkeypatch.setattr(engine, "free_device_bytes", lambda: (free_bytes, "test"))
    config = EngineConfig(max_model_len=1024, page_size=16, mem_fraction=0.5, **options)
    return engine.num_kv_pages(config, PAGE_BYTES)


def test_small_changes_in_free_memory_keep_the_page_count(monkeypatch):
    # 2 * 1000 bytes free per page at mem_fraction 0.5: 2628 and 2630 affordable pages
    first = pages_with_free(monkeypatch, 2628 * 2 * PAGE_BYTES, max_num_seqs=1000)
    second = pages_with_free(monkeypatch, 2630 * 2 * PAGE_BYTES, max_num_seqs=1000)
    assert first == second == 2560


def test_page_count_stays_within_one_sequence_and_max_num_seqs(monkeypatch):
    per_sequence = 1024 // 16
    assert pages_with_free(monkeypatch, 100 * 2 * PAGE_BYTES) == 100  # under one rounding step
    assert pages_with_free(monkeypatch, 10**9, max_num_seqs=2) == 2 * per_sequence
    with pytest.raises(ValueError, match="fewer than one sequence"):
        pages_with_free(monkeypatch, 10 * 2 * PAGE_BYTES)
