"""Prefix store: longest-prefix lookup, truncation rules, byte caps with LRU, list/prune/clear."""

from __future__ import annotations

import os
import time

import pytest
from helpers import dense_fixture

import qwen38_backend
from qwen38_backend.prefix_store import PrefixStore, StateFileWarning, snapshot_nbytes
from qwen38_backend.state_files import SUFFIX, model_fingerprint

IDS = [(i * 13 + 5) % 480 + 10 for i in range(64)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return qwen38_backend.load(str(dense_fixture("qwen3", tmp_path_factory.mktemp("d"))))


def _snap(model, ids):
    state = model.new_state()
    model.prefill(ids, state)
    return state.snapshot()


def test_longest_exact_prefix_wins_from_disk(model, tmp_path):
    store = PrefixStore(tmp_path, memory_bytes=0)  # disk tier only
    fp = model_fingerprint(model)
    for n in (8, 24, 40):
        store.put(model, _snap(model, IDS[:n]))
    fresh = PrefixStore(tmp_path)
    hit = fresh.lookup(fp, IDS[:30] + [1, 2, 3], truncatable=False)
    assert (hit.length, hit.n_tokens, hit.tier) == (24, 24, "disk")
    assert fresh.load(hit, model).tokens == IDS[:24]
    # a prompt that stops inside an entry: only a truncatable state may use it
    hit = fresh.lookup(fp, IDS[:30] + [1, 2, 3], truncatable=True)
    assert (hit.length, hit.n_tokens) == (30, 40)
    # never the whole prompt: its last token must run to give logits
    assert fresh.lookup(fp, IDS[:24], truncatable=False, limit=23).length == 8
    assert fresh.lookup(fp, [999] + IDS, truncatable=True) is None
    assert fresh.lookup("0" * 64, IDS, truncatable=True) is None  # another model


def test_memory_tier_serves_before_disk(model, tmp_path):
    store = PrefixStore(tmp_path)
    store.put(model, _snap(model, IDS[:16]))
    hit = store.lookup(model_fingerprint(model), IDS, truncatable=False)
    assert hit.tier == "memory" and hit.length == 16


def test_disk_byte_cap_evicts_least_recently_used(model, tmp_path):
    one = snapshot_nbytes(_snap(model, IDS[:32]))
    store = PrefixStore(tmp_path, memory_bytes=0, max_bytes=int(2.5 * (one + 4096)))
    fp = model_fingerprint(model)
    a, b, c = ([k] + IDS[:31] for k in (1, 2, 3))
    store.put(model, _snap(model, a))
    store.put(model, _snap(model, b))
    for i, e in enumerate(sorted(store.entries(), key=lambda e: e.n_tokens)):
        os.utime(e.path, (time.time() - 100 - i, time.time() - 100 - i))  # both old
    store.load(store.lookup(fp, a + [5], truncatable=False), model)  # a: most recently used
    store.put(model, _snap(model, c))  # over the cap: the least recently used (b) goes
    assert store.lookup(fp, b + [5], truncatable=False) is None
    for kept in (a, c):
        assert store.lookup(fp, kept + [5], truncatable=False).length == 32
    assert store.disk_bytes() <= store.max_bytes


def test_memory_byte_cap(model, tmp_path):
    one = snapshot_nbytes(_snap(model, IDS[:32]))
    store = PrefixStore(tmp_path, disk=False, memory_bytes=2 * one)
    for first in (1, 2, 3):
        store.put(model, _snap(model, [first] + IDS[:31]))
    assert [e.n_tokens for e in store.entries()] == [32, 32]
    assert store.memory_used() <= 2 * one
    assert not list(tmp_path.iterdir())


def test_supersede_drops_prefix_entries(model, tmp_path):
    store = PrefixStore(tmp_path)
    store.put(model, _snap(model, IDS[:10]))
    store.put(model, _snap(model, IDS[:20]), supersede=True)
    assert [(e.tier, e.n_tokens) for e in store.entries()] == [("memory", 20), ("disk", 20)]


def test_list_prune_clear(model, tmp_path):
    store = PrefixStore(tmp_path)
    for n in (8, 16, 24):
        store.put(model, _snap(model, IDS[:n]))
    disk = [e for e in store.list() if e.tier == "disk"]
    assert sorted(e.n_tokens for e in disk) == [8, 16, 24]
    assert all(e.path.name.endswith(SUFFIX) and e.nbytes == e.path.stat().st_size for e in disk)
    stale = time.time() - 3600
    eight = next(e for e in disk if e.n_tokens == 8)
    os.utime(eight.path, (stale, stale))
    assert store.prune(older_than=60) == [eight.path]
    rest = {e.n_tokens: e for e in store.list() if e.tier == "disk"}
    os.utime(rest[16].path, (stale + 60, stale + 60))  # 16 is now the least recently used
    store.prune(max_bytes=rest[24].nbytes)
    assert [e.n_tokens for e in store.list() if e.tier == "disk"] == [24]
    store.clear()
    assert store.list() == [] and not list(tmp_path.rglob(f"*{SUFFIX}"))


def test_corrupt_file_is_refused_and_removed(model, tmp_path):
    store = PrefixStore(tmp_path, memory_bytes=0)
    store.put(model, _snap(model, IDS[:16]))
    (path,) = tmp_path.rglob(f"*{SUFFIX}")
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    fresh = PrefixStore(tmp_path)
    hit = fresh.lookup(model_fingerprint(model), IDS, truncatable=True)
    from qwen38_backend.errors import StateFileError

    with pytest.warns(StateFileWarning, match="fails its checksum"):
        with pytest.raises(StateFileError):
            fresh.load(hit, model)
    assert not path.exists()
