"""Page allocation, reference counts and the prefix cache of full pages."""

import pytest

from tokenspeed_jax.engine.block_manager import BlockManager


def _fill(manager: BlockManager, tokens: list[int]) -> list[int]:
    """Allocate pages for ``tokens`` as if a request had computed all of them."""
    pages = manager.allocate(manager.pages_for(len(tokens)))
    manager.commit(pages, tokens, len(tokens))
    return pages


def test_allocate_and_free_track_free_pages():
    manager = BlockManager(num_pages=5, page_size=4)
    pages = manager.allocate(3)
    assert len(set(pages)) == 3
    assert manager.num_free_pages == 2
    manager.free(pages)
    assert manager.num_free_pages == 5
    with pytest.raises(RuntimeError):
        manager.allocate(6)


def test_freeing_twice_is_an_error():
    manager = BlockManager(num_pages=2, page_size=4)
    pages = manager.allocate(1)
    manager.free(pages)
    with pytest.raises(RuntimeError, match="freed more often"):
        manager.free(pages)


def test_prefix_hit_shares_full_pages_and_counts_references():
    manager = BlockManager(num_pages=8, page_size=4)
    first = _fill(manager, list(range(10)))  # pages: [0..3] [4..7] [8, 9]
    hit = manager.acquire_prefix(list(range(8)) + [50, 51, 52])
    assert hit == first[:2]
    assert [manager.pages[p].ref_count for p in first] == [2, 2, 1]
    manager.free(first)
    assert [manager.pages[p].ref_count for p in hit] == [1, 1]
    assert manager.num_free_pages == 8 - 2


def test_shared_page_is_never_handed_out_while_in_use():
    manager = BlockManager(num_pages=4, page_size=2)
    first = _fill(manager, [1, 2, 3, 4])
    manager.free(first)
    hit = manager.acquire_prefix([1, 2, 3, 4, 5])
    assert hit == first
    others = manager.allocate(manager.num_free_pages)
    assert not set(others) & set(hit)


def test_last_token_is_always_left_to_compute():
    manager = BlockManager(num_pages=4, page_size=4)
    pages = _fill(manager, list(range(8)))
    assert manager.acquire_prefix(list(range(8))) == pages[:1]


def test_hash_chain_depends_on_earlier_pages():
    manager = BlockManager(num_pages=6, page_size=2)
    _fill(manager, [1, 2, 3, 4])
    assert manager.acquire_prefix([9, 9, 3, 4, 5]) == []


def test_freed_pages_are_revived_until_reused_least_recent_first():
    manager = BlockManager(num_pages=3, page_size=2)
    a = _fill(manager, [1, 2])
    b = _fill(manager, [3, 4])
    manager.free(a)
    manager.free(b)
    assert manager.acquire_prefix([3, 4, 0]) == b
    manager.free(b)
    reused = manager.allocate(2)  # the never-used page, then a's page (freed before b)
    assert a[0] in reused and b[0] not in reused
    assert manager.acquire_prefix([1, 2, 0]) == []
    assert manager.acquire_prefix([3, 4, 0]) == b


def test_uncomputed_and_partial_pages_are_not_cached():
    manager = BlockManager(num_pages=4, page_size=4)
    pages = manager.allocate(2)
    manager.commit(pages, list(range(8)), num_computed=6)
    assert manager.acquire_prefix(list(range(9))) == pages[:1]


def test_disabled_prefix_cache_never_hits():
    manager = BlockManager(num_pages=4, page_size=2, enable_prefix_caching=False)
    _fill(manager, [1, 2, 3, 4])
    assert manager.acquire_prefix([1, 2, 3, 4, 5]) == []
