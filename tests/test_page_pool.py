"""The bounded page pool (kv/pool.py), the page table split out of PagedKV, pool options."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qwen38_backend.errors import AdmissionError, InvalidOptionError
from qwen38_backend.kv import KVFactory, PagedKV, choose_kv, make_kv_factory
from qwen38_backend.kv.policy import AUTO_HEADROOM_MIN, auto_pool_tokens
from qwen38_backend.kv.pool import PagePool, PoolFullError, grown_capacity

LIKE = mx.zeros((2, 1, 4))


class Owner:
    """A page owner that records evictions and can refuse them."""

    def __init__(self, refuse=()):
        self.evicted: list[tuple[int, int]] = []
        self.refuse = set(refuse)

    def evict(self, page: int, slot: int) -> bool:
        if page in self.refuse:
            return False
        self.evicted.append((page, slot))
        return True


def sealed_pool(n: int, max_pages: int) -> tuple[PagePool, Owner, list[int]]:
    pool = PagePool(4, max_pages)
    owner = Owner()
    slots = pool.alloc(n, LIKE, LIKE)
    for page, slot in enumerate(slots):
        pool.seal(slot, owner, page)
    return pool, owner, slots


def test_capacity_is_a_bound_and_slots_come_lowest_first():
    pool = PagePool(4, max_pages=10)
    assert pool.alloc(3, LIKE, LIKE) == [0, 1, 2]  # identity-friendly order
    assert pool.capacity == 10 and pool.k.shape == (2, 40, 4)  # growth stopped at the bound
    assert pool.alloc(7, LIKE, LIKE) == list(range(3, 10))
    with pytest.raises(PoolFullError, match="none evictable"):
        pool.alloc(1, LIKE, LIKE)  # the open pages are not sealed: nothing can leave
    assert pool.capacity == 10


def test_eviction_is_lru_over_sealed_unpinned_pages():
    pool, owner, slots = sealed_pool(6, 6)
    assert pool.eviction_order() == slots
    pool.touch([slots[0]])  # used now: evicted last
    pool.pin([slots[1], slots[2]])  # the live selection: never evicted while pinned
    got = pool.alloc(3, LIKE, LIKE)
    assert [p for p, _ in owner.evicted] == [3, 4, 5]
    assert sorted(got) == sorted(slots[3:6])
    pool.unpin([slots[1]])  # back in the queue as most recently used
    assert pool.eviction_order() == [slots[0], slots[1]]
    pool.unpin([slots[2]])
    pool.alloc(1, LIKE, LIKE)
    assert owner.evicted[-1] == (0, slots[0])
    # A pin count: two pins need two unpins.
    pool.pin([slots[1]])
    pool.pin([slots[1]])
    pool.unpin([slots[1]])
    assert slots[1] not in pool.eviction_order()
    pool.unpin([slots[1]])
    assert slots[1] in pool.eviction_order()


def test_an_owner_that_refuses_keeps_its_page_resident():
    pool, owner, slots = sealed_pool(3, 3)
    owner.refuse = {0}
    assert pool.alloc(1, LIKE, LIKE) == [slots[1]]  # page 0 stays, page 1 leaves
    assert slots[0] not in pool.eviction_order()
    pool.unseal(slots[2])  # re-opened by a rewind: not evictable either
    with pytest.raises(PoolFullError):
        pool.alloc(1, LIKE, LIKE)
    pool.release([slots[2]])
    assert pool.alloc(1, LIKE, LIKE) == [slots[2]]


def test_growth_within_the_bound():
    assert grown_capacity(0, 1, None) == 64
    assert grown_capacity(64, 65, None) == 128
    assert grown_capacity(128, 129, None) == 192  # x1.5
    assert grown_capacity(128, 129, 150) == 150
    assert grown_capacity(150, 151, 150) == 150
    # a bounded pool reaching 2/3 of its bound goes there at once: the buffer replaced by its
    # last growth stays under 2/3 of the bound
    assert grown_capacity(64, 65, 190) == 190  # 128 >= 2/3 of 190
    assert grown_capacity(64, 65, 200) == 128  # 128 < 2/3 of 200
    cap, replaced = 0, 0
    for need in range(1, 3001):
        new = grown_capacity(cap, need, 3000)
        if new > cap:
            replaced, cap = cap, new
    assert cap == 3000 and 3 * replaced < 2 * 3000
    assert grown_capacity(100, 50, 10) == 100  # never shrinks


def fill(store: PagedKV, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = rng.normal(size=(2, n, 4)).astype(np.float32)
    for s in range(0, n, 5):
        store.append(mx.array(rows[:, s : s + 5]), mx.array(rows[:, s : s + 5]))
    return rows


def test_bounded_store_without_spill_refuses_past_its_pool():
    store = PagedKV(page_tokens=4, pool_pages=8)
    rows = fill(store, 32)  # exactly 8 pages
    assert store.pool.capacity == 8 and store.table.identity
    np.testing.assert_array_equal(np.array(store._dense_kv()[0][0]), rows)
    assert store.pool.eviction_order() == list(range(8))  # all sealed, all evictable
    with pytest.raises(AdmissionError, match="KV page pool full: 8 pages of 4 tokens"):
        store.append(mx.zeros((2, 1, 4)), mx.zeros((2, 1, 4)))
    # A rewind frees pages and the store goes on.
    store.truncate(30)
    store.append(mx.ones((2, 2, 4)), mx.ones((2, 2, 4)))
    assert store.length == 32 and len(store.table) == 8


def test_pool_options_and_the_factory():
    with pytest.raises(InvalidOptionError, match="at least two pages"):
        choose_kv(kv_pool_tokens=40, kv_page_tokens=32)
    with pytest.raises(InvalidOptionError, match="need the paged KV store"):
        choose_kv(kv_paged="off", kv_pool_tokens=4096)
    # Quest's options do nothing without pages: refused by name, not ignored
    with pytest.raises(InvalidOptionError, match="kv_sinks, kv_topk need the paged KV store"):
        choose_kv(kv_paged="off", kv_topk=16, kv_sinks=4)
    assert not choose_kv(kv_paged="off", kv_topk=None).paged  # unset options are not given
    with pytest.raises(InvalidOptionError):
        choose_kv(kv_pool_tokens="lots")
    with pytest.raises(InvalidOptionError):
        choose_kv(kv_spill_dir=3)
    assert choose_kv(kv_pool_tokens="100").paged  # another kv_ option turns paging on
    assert choose_kv(kv_pool_tokens="auto").pool_tokens is None
    store = make_kv_factory(kv_pool_tokens=100, kv_page_tokens=16)()
    fill(store, 10)
    assert store.pool.max_pages == 7  # 100 tokens -> 7 whole pages


def test_auto_pool_from_available_memory(monkeypatch):
    import qwen38_backend.admission as admission

    available = 3 * AUTO_HEADROOM_MIN
    monkeypatch.setattr(admission, "available_memory", lambda: available)
    factory = make_kv_factory(kv_paged="on", kv_page_tokens=4)
    assert isinstance(factory, KVFactory)
    stores = [factory() for _ in range(3)]  # three attention layers share the budget
    for s in stores:
        fill(s, 8)
    token_bytes = 3 * 2 * 2 * 4 * 4  # layers x (K,V) x heads x dim x fp32
    tokens = auto_pool_tokens(available, token_bytes)
    # A quarter of 3 GiB is below the 1 GiB minimum headroom: 2 GiB left, 3/5 of it for the
    # pools (the rest for the buffer a growth replaces)
    assert tokens == 2 * AUTO_HEADROOM_MIN * 3 // 5 // token_bytes
    assert all(s.pool.max_pages == -(-tokens // 4) for s in stores)
    assert auto_pool_tokens(None, 10) is None
    assert auto_pool_tokens(10, 10) == 0  # less than the headroom: nothing to give


def test_block_pool_maps_blocks_through_the_page_table():
    """QSA's in-place reads (PagedKV.block_pool): with two stores taking turns on one pool
    (neither table identity-mapped), the rows of blocks of 4 read from the pool view at the
    mapped ids are the store's own rows (its gather); pages that are not whole blocks give
    None (the caller gathers)."""
    pool = PagePool(8)
    stores = [PagedKV(page_tokens=8, budget=10**6, pool=pool) for _ in range(2)]
    rows = {}
    for step in range(5):
        for i, store in enumerate(stores):
            k = mx.random.normal((2, 9, 16), key=mx.random.key(10 * step + i))
            store.append(k, -k)
            rows.setdefault(i, []).append(k)
    store = stores[1]
    assert not store.table.identity
    keys, values, to_pool = store.block_pool(4)
    blocks = mx.array([0, 3, 4, 9, 10], dtype=mx.int32)  # 45 rows: blocks 0..11
    pooled = to_pool(blocks)
    at = (pooled[:, None] * 4 + mx.arange(4)).reshape(-1)
    want_k, want_v = store.gather((blocks[:, None] * 4 + mx.arange(4)).reshape(-1))
    assert mx.array_equal(keys[0][:, at], want_k).item()
    assert mx.array_equal(values[0][:, at], want_v).item()
    assert mx.array_equal(mx.concatenate(rows[1], axis=1)[:, 36:40], keys[0][:, at[12:16]])
    assert store.block_pool(3) is None  # pages of 8 are not whole blocks of 3
