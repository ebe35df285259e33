"""KV cache sizing from free memory: stable across restarts, within the configured bounds.

Free memory is whatever ``free_device_bytes`` reads (patched here). With the executable cache
on, the first count is recorded in the cache directory and kept while it fits
(``engine/sizing_record.py``); the tests that pin the sizing alone turn the cache off.
"""

import json
import logging

import pytest

from tokenspeed_jax.config import EngineConfig
from tokenspeed_jax.engine import sizing_record, startup

PAGE_BYTES = 1000


def config_with_free(monkeypatch, free_bytes: int, **options) -> EngineConfig:
    monkeypatch.setattr(startup, "free_device_bytes", lambda: (free_bytes, "test"))
    return EngineConfig(**{"max_model_len": 1024, "page_size": 16, "mem_fraction": 0.5,
                           **options})


def pages_with_free(monkeypatch, free_bytes: int, **options) -> int:
    """The page count sized from ``free_bytes`` alone (no record: the cache is off)."""
    config = config_with_free(monkeypatch, free_bytes, compile_cache=False, **options)
    return startup.num_kv_pages(config, PAGE_BYTES)


def affording(pages: int, reserved_bytes: int = 0) -> int:
    """Free bytes in which mem_fraction 0.5 affords ``pages`` pages beside ``reserved_bytes``."""
    return 2 * (pages * PAGE_BYTES + reserved_bytes)


def test_small_changes_in_free_memory_keep_the_page_count(monkeypatch):
    # 2 * 1000 bytes free per page at mem_fraction 0.5: 2628 and 2630 affordable pages
    first = pages_with_free(monkeypatch, affording(2628), max_num_seqs=1000)
    second = pages_with_free(monkeypatch, affording(2630), max_num_seqs=1000)
    assert first == second == 2560


def test_page_count_stays_within_one_sequence_and_max_num_seqs(monkeypatch):
    per_sequence = 1024 // 16
    assert pages_with_free(monkeypatch, affording(100)) == 100  # under one rounding step
    assert pages_with_free(monkeypatch, 10**9, max_num_seqs=2) == 2 * per_sequence
    with pytest.raises(ValueError, match="fewer than one sequence"):
        pages_with_free(monkeypatch, affording(10))


def recorded_pages(monkeypatch, tmp_path, free_bytes: int, *, reserved_bytes: int = 0,
                   model: str = "tiny", **options) -> int:
    """The page count with the cache (and its sizing record) in ``tmp_path``."""
    config = config_with_free(monkeypatch, free_bytes, max_num_seqs=1000,
                              compile_cache_dir=str(tmp_path), **options)
    return startup.num_kv_pages(config, PAGE_BYTES, reserved_bytes, model=model)


def the_record(tmp_path) -> dict:
    (path,) = tmp_path.glob("kv-pages-*.json")
    return json.loads(path.read_text())


def test_the_first_count_is_kept_while_it_fits(monkeypatch, tmp_path):
    assert recorded_pages(monkeypatch, tmp_path, affording(2628)) == 2560
    assert the_record(tmp_path)["num_pages"] == 2560
    # sized anew these would be 4864 and 2304 pages: other shapes, every executable recompiled
    assert recorded_pages(monkeypatch, tmp_path, affording(5000)) == 2560
    assert recorded_pages(monkeypatch, tmp_path, affording(2560)) == 2560
    assert the_record(tmp_path)["num_pages"] == 2560


def test_a_count_that_no_longer_fits_is_sized_again_and_replaces_the_record(
        monkeypatch, tmp_path, caplog):
    assert recorded_pages(monkeypatch, tmp_path, affording(2628)) == 2560
    with caplog.at_level(logging.WARNING, logger=startup.__name__):
        assert recorded_pages(monkeypatch, tmp_path, affording(2559)) == 2304
    (message,) = [r.getMessage() for r in caplog.records if "does not fit" in r.getMessage()]
    assert "2560" in message and "holds 2559 pages" in message
    assert the_record(tmp_path)["num_pages"] == 2304
    assert recorded_pages(monkeypatch, tmp_path, affording(5000)) == 2304  # kept from now on


def test_the_fit_counts_the_reserved_bytes(monkeypatch, tmp_path):
    reserved = 300 * PAGE_BYTES
    assert recorded_pages(monkeypatch, tmp_path, affording(2628, reserved),
                          reserved_bytes=reserved) == 2560
    # 2860 pages of memory, 2560 of them free beside the reservation: still fits
    assert recorded_pages(monkeypatch, tmp_path, affording(2560, reserved),
                          reserved_bytes=reserved) == 2560
    # 2859 pages of memory would hold the record's count without the reservation, not with it
    assert recorded_pages(monkeypatch, tmp_path, affording(2559, reserved),
                          reserved_bytes=reserved) == 2304


def test_each_setup_keeps_its_own_record(monkeypatch, tmp_path):
    assert recorded_pages(monkeypatch, tmp_path, affording(2628)) == 2560
    assert recorded_pages(monkeypatch, tmp_path, affording(5000), model="other") == 4864
    assert recorded_pages(monkeypatch, tmp_path, affording(5000), max_model_len=2048) == 4864
    assert recorded_pages(monkeypatch, tmp_path, affording(5000), page_size=32) == 4864
    assert recorded_pages(monkeypatch, tmp_path, affording(5000)) == 2560
    assert len(list(tmp_path.glob("kv-pages-*.json"))) == 4


@pytest.mark.parametrize("content", [
    "{not json", "[2560]", '{"format": 1, "num_pages": 2560}',
    '{"format": 1, "key": KEY, "num_pages": 0}', '{"format": 1, "key": KEY, "num_pages": "9"}',
    '{"format": 1, "key": KEY, "num_pages": true}', '{"format": 99, "key": KEY, "num_pages": 9}',
])
def test_a_bad_record_is_ignored_with_a_warning_and_replaced(monkeypatch, tmp_path, caplog,
                                                             content):
    config = config_with_free(monkeypatch, affording(5000), max_num_seqs=1000,
                              compile_cache_dir=str(tmp_path))
    key = startup.sizing_key(config, PAGE_BYTES, 0, "tiny")
    path = sizing_record.record_path(tmp_path, key)
    path.write_text(content.replace("KEY", json.dumps(key)))
    with caplog.at_level(logging.WARNING, logger=sizing_record.__name__):
        assert startup.num_kv_pages(config, PAGE_BYTES, model="tiny") == 4864
    assert any("ignoring the KV sizing record" in r.getMessage() for r in caplog.records)
    assert json.loads(path.read_text()) == {"format": sizing_record.RECORD_FORMAT, "key": key,
                                            "num_pages": 4864}


def test_a_record_that_cannot_be_written_costs_only_the_record(monkeypatch, tmp_path, caplog):
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    with caplog.at_level(logging.WARNING, logger=sizing_record.__name__):
        assert recorded_pages(monkeypatch, not_a_directory, affording(2628)) == 2560
    assert any("could not record" in r.getMessage() for r in caplog.records)


def test_with_the_cache_off_every_start_sizes_from_free_memory(monkeypatch, tmp_path):
    assert recorded_pages(monkeypatch, tmp_path, affording(2628), compile_cache=False) == 2560
    assert recorded_pages(monkeypatch, tmp_path, affording(5000), compile_cache=False) == 4864
    assert list(tmp_path.iterdir()) == []


class _Reserved(Exception):
    """Raised by the patched sizing with the bytes start-up reserved: the test ends there."""


@pytest.mark.parametrize(("model", "stacked_copy"), [("tiny_llama", True),
                                                      ("tiny_deepseek_v3", False)])
def test_start_up_reserves_the_runners_own_device_bytes(monkeypatch, model, stacked_copy):
    """Before sizing the KV cache, start-up sets aside what the family's runner adds: a Llama
    runner with stacked decode weights holds a copy of its layer weights; the MLA runner of
    DeepSeek-V3 uses its weights in place, whatever ``stack_decode_weights`` says."""
    import jax
    from flax import nnx

    from tokenspeed_jax.models.loader import load_model

    def sizing(config, page_bytes, reserved, *, model):
        raise _Reserved(reserved)

    monkeypatch.setattr(startup, "num_kv_pages", sizing)
    loaded = load_model(f"tests/golden/{model}")
    config = EngineConfig(model=f"tests/golden/{model}", stack_decode_weights=True,
                          compile_cache=False)
    with pytest.raises(_Reserved) as reserved:
        startup.build_engine(config, loaded)
    layer_bytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(
        [nnx.state(layer) for layer in loaded.model.layers]))
    assert reserved.value.args[0] == (layer_bytes if stacked_copy else 0)
