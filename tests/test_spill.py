"""The SSD tier (kv/spill.py): a pool smaller than the context spills and fetches pages and
gives the same tokens as all-resident; I/O failures become typed errors, never wrong output."""

from __future__ import annotations

import errno
import gc
import os

import mlx.core as mx
import numpy as np
import pytest
from helpers import dense_fixture

import qwen38_backend
from qwen38_backend.errors import AdmissionError, SpillDiskFullError, SpillError
from qwen38_backend.kv import PagedKV, SpillFile, collect_kv_stats, make_kv_factory
from qwen38_backend.kv.quest import outward_bf16, page_min_max
from qwen38_backend.kv.spill import read_all, remove_stale, write_all
from qwen38_backend.kv.table import SPILLED
from qwen38_backend.state_files import read_state_file, save_state_file

P = 8


def tiny_weights(arch: str, directory, seed: int = 0):
    from qwen38_backend.testing import make_tiny_weights

    return make_tiny_weights(arch, directory, seed=seed)


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return qwen38_backend.load(str(dense_fixture("qwen3", tmp_path_factory.mktemp("d"))))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return qwen38_backend.load(str(tiny_weights("qwen3_5", tmp_path_factory.mktemp("q"), 7)))


@pytest.fixture(autouse=True, params=[True, False], ids=["guess", "wait"])
def guessing(request, monkeypatch):
    """Every test with a spilled step attending on a guess (the GPU's default) and waiting
    for its selection first (the CPU's)."""
    monkeypatch.setattr(PagedKV, "attend_on_guess", request.param)
    return request.param


def prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(10, vocab - 10, n).tolist()


def factory(spill_dir, budget=10**6, pool_pages=12):
    spill = SpillFile(spill_dir) if pool_pages else None
    return lambda: PagedKV(
        page_tokens=P, budget=budget, sinks=P, recent=P, pool_pages=pool_pages, spill=spill
    )


def greedy(net, ids, kv_factory, n=30, chunk=24, state=None):
    """Chunked prefill (cutting pages) and greedy decode on the module; returns (tokens, state)."""
    state = state or net.make_state(kv_factory=kv_factory)
    logits = None
    for s in range(0, len(ids), chunk):
        logits = net(mx.array(ids[s : s + chunk]), state, last_only=True)
        state.advance(ids[s : s + chunk])
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits[-1]).item())
        out.append(token)
        logits = net(mx.array([token]), state, last_only=True)
        state.advance([token])
    return out, state


# ----- the write and read loops --------------------------------------------------------------
def test_complete_write_and_read_loops(tmp_path, monkeypatch):
    data = np.random.default_rng(0).integers(0, 255, 1000, dtype=np.uint8).tobytes()
    real_write, real_read = os.pwrite, os.pread
    calls = {"w": 0, "r": 0}

    def short_write(fd, buf, offset):
        calls["w"] += 1
        if calls["w"] % 3 == 0:
            raise InterruptedError(errno.EINTR, "interrupted")
        return real_write(fd, bytes(buf[:7]), offset)  # at most 7 bytes per call

    def short_read(fd, n, offset):
        calls["r"] += 1
        if calls["r"] % 4 == 0:
            raise InterruptedError(errno.EINTR, "interrupted")
        return real_read(fd, min(n, 5), offset)

    monkeypatch.setattr(os, "pwrite", short_write)
    monkeypatch.setattr(os, "pread", short_read)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
    write_all(fd, data, 100)
    assert read_all(fd, len(data), 100) == data
    assert calls["w"] > 140 and calls["r"] > 200
    with pytest.raises(OSError, match="ends early"):
        read_all(fd, 10, 1095)
    os.close(fd)


# ----- a store on synthetic rows -------------------------------------------------------------
def rows(n: int, seed: int = 0, hkv: int = 2, d: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(hkv, n, d)).astype(np.float32),
        rng.normal(size=(hkv, n, d)).astype(np.float32),
    )


def fill(store: PagedKV, k: np.ndarray, v: np.ndarray, chunk: int = 10) -> None:
    for s in range(0, k.shape[1], chunk):
        store.append(mx.array(k[:, s : s + chunk]), mx.array(v[:, s : s + chunk]))
        mx.eval(store.pool.k, store.pool.v)


def test_store_spills_and_reads_back(tmp_path):
    k, v = rows(100)
    spill = SpillFile(tmp_path)
    store = PagedKV(page_tokens=P, pool_pages=5, spill=spill)
    fill(store, k, v)
    assert store.pool.capacity == 5  # bounded: 13 pages, 5 resident
    assert store.table.n_spilled == 8 and store.table.slots.count(SPILLED) == 8
    assert spill.path is not None and spill.path.exists()
    assert spill.path.stat().st_size >= 8 * store.table.spill.page_bytes
    keys, values = store._dense_kv()
    np.testing.assert_array_equal(np.array(keys[0]), k)
    np.testing.assert_array_equal(np.array(values[0]), v)
    assert store.stats["pages_fetched"] == 8
    # Quest metadata stayed resident for the spilled pages.
    lo, _ = outward_bf16(*page_min_max(mx.array(k[:, :96]).reshape(2, 12, P, 8)))
    np.testing.assert_array_equal(
        np.array(store.kmin[:, :12].astype(mx.float32)), np.array(lo.astype(mx.float32))
    )
    store.close()
    assert not spill.path.exists()


@pytest.mark.parametrize("shared", [True, False])
def test_sparse_decode_fetches_misses_and_keeps_the_selection_pinned(tmp_path, shared):
    k, v = rows(120, seed=1)
    spilled = PagedKV(page_tokens=P, budget=4 * P, sinks=P, recent=P, pool_pages=8,
                      spill=SpillFile(tmp_path), shared=shared)  # fmt: skip
    resident = PagedKV(page_tokens=P, budget=4 * P, sinks=P, recent=P, shared=shared)
    fill(spilled, k, v)
    fill(resident, k, v)
    rng = np.random.default_rng(5)
    fetched = 0
    for _ in range(12):
        q = mx.array(rng.normal(size=(1, 4, 1, 8)).astype(np.float32) * 3)
        kn = mx.array(rng.normal(size=(1, 2, 1, 8)).astype(np.float32))
        a = spilled.attend(q, kn, kn, 0.35)
        b = resident.attend(q, kn, kn, 0.35)
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6, atol=1e-6)
        fetched = spilled.stats["pages_fetched"]
        assert not spilled.pool._pins  # pins last only while a step gathers
    assert fetched > 0 and spilled.stats["sparse_steps"] == 12
    assert spilled.table.n_spilled > 0


def test_a_spilled_step_hands_its_layer_over_before_reading_the_selection(
    tmp_path, monkeypatch, guessing
):
    """On a guess, the rest of the layer (`then`) is built from the device's page table
    before the host reads the selection, and a step that missed fetches and attends again;
    waiting, the selection is read first. Either way every answer is the resident one."""
    k, v = rows(120, seed=1)
    spilled = PagedKV(page_tokens=P, budget=4 * P, sinks=P, recent=P, pool_pages=8,
                      spill=SpillFile(tmp_path))  # fmt: skip
    resident = PagedKV(page_tokens=P, budget=4 * P, sinks=P, recent=P)
    fill(spilled, k, v)
    fill(resident, k, v)
    events = []
    read = PagedKV._read_selection

    def reading(self, pages):
        events.append("read")
        return read(self, pages)

    def then(out):
        events.append("then")
        return out * 2 + 1

    monkeypatch.setattr(PagedKV, "_read_selection", reading)
    rng = np.random.default_rng(5)
    missed = 0
    for _ in range(12):
        q = mx.array(rng.normal(size=(1, 4, 1, 8)).astype(np.float32) * 3)
        kn = mx.array(rng.normal(size=(1, 2, 1, 8)).astype(np.float32))
        events.clear()
        before = spilled.stats["pages_fetched"]
        a = spilled.attend_then(q, kn, kn, 0.35, then)
        b = resident.attend(q, kn, kn, 0.35) * 2 + 1
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6, atol=1e-6)
        assert events[:2] == (["then", "read"] if guessing else ["read", "then"])
        missed += spilled.stats["pages_fetched"] > before
        assert not spilled.pool._pins
    assert missed > 0 and spilled.stats["reattended"] == (missed if guessing else 0)


def test_a_step_without_misses_refreshes_its_selection_without_pins(tmp_path):
    k, v = rows(120, seed=1)
    store = PagedKV(page_tokens=P, budget=4 * P, sinks=P, recent=P, pool_pages=8,
                    spill=SpillFile(tmp_path))  # fmt: skip
    fill(store, k, v)
    q = mx.array(np.random.default_rng(5).normal(size=(1, 4, 1, 8)).astype(np.float32) * 3)
    kn = mx.zeros((1, 2, 1, 8))
    mx.eval(store.attend(q, kn, kn, 0.35))  # fetches what it misses
    fetched = store.stats["pages_fetched"]
    pages = np.array(store.select(q[0, :, 0, :], store.selection_size()[1]))[0].tolist()
    sealed = [store.table.slots[p] for p in pages if p < store.table.n_sealed]
    others = [s for s in store.pool.eviction_order() if s not in sealed]
    store.pool.touch(others)  # the selection is now the least recently used
    mx.eval(store.attend(q, kn, kn, 0.35))  # the same selection, all resident
    assert store.stats["pages_fetched"] == fetched
    assert store.pool.eviction_order()[-len(sealed) :] == sealed  # used: most recent again
    assert not store.pool._pins


def test_decode_evictions_find_pages_already_written(tmp_path, monkeypatch):
    """A fetch evicts pages; the next selection queues the reserve behind again, so a decode
    step's evictions find pages already written or queued to the writer thread, instead of
    writing them while it waits. (Whether a queued write has finished by the eviction
    depends on the thread's timing: the test counts evictions that had to queue a write.)"""
    from qwen38_backend.kv.spill import SpillRegion

    k, v = rows(400, seed=3)
    store = PagedKV(page_tokens=P, budget=8 * P, sinks=P, recent=P, pool_pages=24,
                    spill=SpillFile(tmp_path))  # fmt: skip
    fill(store, k, v)
    waited = []
    ensure_written = SpillRegion.ensure_written

    def counting(self, page, kp, vp):
        with self.io.cond:
            queued = self.pending.get(page) == self.version.get(page)
            waited.append(not self._clean(page) and not queued)
        return ensure_written(self, page, kp, vp)

    monkeypatch.setattr(SpillRegion, "ensure_written", counting)
    evicted = store.pool.evictions
    rng = np.random.default_rng(7)
    for _ in range(P - 1):  # no page seals meanwhile: only fetches move pages
        q = mx.array(rng.normal(size=(1, 4, 1, 8)).astype(np.float32) * 10)
        kn = mx.array(rng.normal(size=(1, 2, 1, 8)).astype(np.float32))
        mx.eval(store.attend(q, kn, kn, 0.35))
    # the selections churned through more than twice the written reserve (a quarter)
    assert store.pool.evictions - evicted > 2 * 24 // 4
    assert not any(waited), f"{sum(waited)} evictions had to queue their page's write"


def test_a_write_far_longer_than_the_pool_queues_its_evictions_in_batches(tmp_path, monkeypatch):
    """A restore (one append of a whole layer) into a small pool evicts the pool once per
    piece: each piece's evictions are queued to the writer in one batch first, so no
    eviction copies its page to the host and writes it by itself (one wait per page)."""
    from qwen38_backend.kv.table import PageTable

    copies = []
    page_rows = PageTable.page_rows

    def counting(self, slots, gathered=None):
        copies.append(len(slots))
        return page_rows(self, slots, gathered)

    monkeypatch.setattr(PageTable, "page_rows", counting)
    k, v = rows(100 * P, seed=4)
    store = PagedKV(page_tokens=P, budget=4 * P, sinks=P, recent=P, pool_pages=12,
                    spill=SpillFile(tmp_path))  # fmt: skip
    store.append(mx.array(k), mx.array(v))
    assert store.table.n_spilled == 100 - 12
    assert sum(copies) >= 100 - 12 and 1 not in copies, copies
    keys, values = store._dense_kv()  # every page reads back as written
    np.testing.assert_array_equal(np.array(keys[0]), k)
    np.testing.assert_array_equal(np.array(values[0]), v)
    store.close()


def test_selection_larger_than_the_pool_is_refused(tmp_path):
    k, v = rows(200, seed=2)
    store = PagedKV(page_tokens=P, budget=12 * P, sinks=P, recent=P, pool_pages=6,
                    spill=SpillFile(tmp_path))  # fmt: skip
    fill(store, k, v)
    q = mx.ones((1, 4, 1, 8))
    with pytest.raises(AdmissionError, match="sequence's selection"):
        store.attend(q, mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 1, 8)), 0.3)
    assert not store.pool._pins


# ----- models: same tokens as all-resident, with pages really spilled and fetched ---------
@pytest.mark.parametrize("budget", [10**6, 4 * P])
def test_dense_model_spilled_equals_resident(dense, tmp_path, budget, guessing):
    ids = prompt(150, dense.config.vocab_size)
    ref, _ = greedy(dense.net, ids, factory(None, budget, pool_pages=None))
    out, state = greedy(dense.net, ids, factory(tmp_path, budget, pool_pages=12))
    assert out == ref
    kv = collect_kv_stats(state)
    layers = dense.config.num_hidden_layers
    assert kv["pages_spilled"] >= layers * (22 - 12)  # 180 tokens = 23 pages, 12 resident
    assert kv["spill_writes"] >= kv["pages_spilled"]
    assert kv["pages_fetched"] > 0 and kv["spill_read_bytes"] > 0
    assert kv["pool_pages"] == layers * 12
    if budget < 10**6 and guessing:  # sparse steps attended on a guess; wrong ones again
        assert 0 < kv["reattended"] < kv["sparse_steps"] * layers
    else:
        assert kv["reattended"] == 0


def test_hybrid_model_spilled_equals_resident(hybrid, tmp_path, guessing):
    ids = prompt(120, hybrid.config.vocab_size, seed=3)
    for budget in (10**6, 4 * P):
        ref, resident = greedy(hybrid.net, ids, factory(None, budget, pool_pages=None), n=20)
        out, state = greedy(hybrid.net, ids, factory(tmp_path, budget, pool_pages=10), n=20)
        assert out == ref, budget
        # with pages spilled, a step hands each layer to the device as it is built
        assert state.reads_back() and not resident.reads_back()
        kv = collect_kv_stats(state)
        assert kv["pages_spilled"] > 0 and kv["pages_fetched"] > 0
        # steps that guessed wrong ran again from the guessing layer
        assert (kv["reattended"] > 0) == (budget < 10**6 and guessing)


def test_a_hybrid_step_checks_a_guess_after_building_the_layers_that_follow(
    hybrid, tmp_path, monkeypatch, guessing
):
    """Inside a step, an attention layer's guess is checked only when the loop reaches the
    next attention layer (or the end): the Gated DeltaNet layers between are built (their
    state marked) first, and a wrong guess puts them back and runs them again. Waiting,
    nothing is guessed or marked."""
    from qwen38_backend.models.gated_deltanet import GatedDeltaNetState

    events = []
    check, mark = PagedKV.check_guess, GatedDeltaNetState.mark

    def checking(self):
        right = check(self)
        events.append("right" if right else "wrong")
        return right

    def marking(self):
        events.append("mark")
        return mark(self)

    monkeypatch.setattr(PagedKV, "check_guess", checking)
    monkeypatch.setattr(GatedDeltaNetState, "mark", marking)
    ids = prompt(120, hybrid.config.vocab_size, seed=3)
    ref, _ = greedy(hybrid.net, ids, factory(None, 4 * P, pool_pages=None), n=20)
    out, _ = greedy(hybrid.net, ids, factory(tmp_path, 4 * P, pool_pages=10), n=20)
    assert out == ref
    if not guessing:
        assert events == []
        return
    checks = [i for i, e in enumerate(events) if e in ("right", "wrong")]
    assert "wrong" in events and "right" in events
    # 8 layers, attention every 4th: the first guess (layer 3) is checked after layers 4-6
    assert events[checks[0] - 3 : checks[0]] == ["mark"] * 3


def test_without_per_layer_hand_over_a_step_hands_over_what_it_built_before_a_check(
    hybrid, tmp_path, monkeypatch
):
    """QWEN38_EAGER_LAYERS=0 (no hand-over per layer): before it waits on a guess's check,
    the loop hands the layers built since the guess to the device."""
    from qwen38_backend.models.gated_deltanet import GatedDeltaNetState

    monkeypatch.setenv("QWEN38_EAGER_LAYERS", "0")
    monkeypatch.setattr(PagedKV, "attend_on_guess", True)
    events = []
    check, mark, hand = PagedKV.check_guess, GatedDeltaNetState.mark, mx.async_eval

    def checking(self):
        events.append("check")
        return check(self)

    def marking(self):
        events.append("mark")
        return mark(self)

    def handing(*arrays):
        events.append("hand")
        return hand(*arrays)

    monkeypatch.setattr(PagedKV, "check_guess", checking)
    monkeypatch.setattr(GatedDeltaNetState, "mark", marking)
    monkeypatch.setattr(mx, "async_eval", handing)
    ids = prompt(120, hybrid.config.vocab_size, seed=3)
    ref, _ = greedy(hybrid.net, ids, factory(None, 4 * P, pool_pages=None), n=12)
    events.clear()
    out, _ = greedy(hybrid.net, ids, factory(tmp_path, 4 * P, pool_pages=10), n=12)
    assert out == ref
    checks = [i for i, e in enumerate(events) if e == "check"]
    marked, previous = 0, -1
    for at in checks:  # layers built after the guess: handed over, then the check
        window = events[previous + 1 : at]
        if "mark" in window:
            last_mark = len(window) - 1 - window[::-1].index("mark")
            assert "hand" in window[last_mark + 1 :], window
            marked += 1
        previous = at
    assert marked > 0


def test_engine_options_spill(dense, tmp_path):
    ids = prompt(150, dense.config.vocab_size, seed=4)
    opts = {"kv_topk": 4 * P, "kv_page_tokens": P, "kv_sinks": P, "kv_recent": P}
    ref = dense.generate_tokens(ids, 25, stop_token_ids=[], **opts)
    ref_tokens = list(ref)
    stream = dense.generate_tokens(
        ids, 25, stop_token_ids=[], kv_pool_tokens=12 * P, kv_spill_dir=str(tmp_path), **opts
    )
    assert list(stream) == ref_tokens
    assert stream.stats.kv["pages_spilled"] > 0 and stream.stats.kv["pages_fetched"] > 0
    assert ref.stats.kv["pages_spilled"] == 0


def test_a_spill_dir_that_is_a_file_is_refused_before_any_work(dense, tmp_path):
    """kv_spill_dir naming a file is an option error when the request is built, not a spill
    failure part-way through a prefill (before, `llm -o kv_spill_dir FILE` failed with
    "File exists" once the pool filled); a directory that does not exist yet is created."""
    from qwen38_backend.errors import InvalidOptionError

    afile = tmp_path / "not-a-dir"
    afile.write_text("x")
    ids = prompt(150, dense.config.vocab_size, seed=4)
    opts = {"kv_topk": 4 * P, "kv_page_tokens": P, "kv_sinks": P, "kv_recent": P}
    opts["kv_pool_tokens"] = 12 * P
    with pytest.raises(InvalidOptionError, match="is a file, not a directory"):
        dense.generate_tokens(ids, 5, stop_token_ids=[], kv_spill_dir=str(afile), **opts)
    fresh = tmp_path / "new" / "spill"
    stream = dense.generate_tokens(ids, 5, stop_token_ids=[], kv_spill_dir=str(fresh), **opts)
    assert len(list(stream)) == 5 and stream.stats.kv["pages_spilled"] > 0


def test_a_spill_dir_that_cannot_be_created_is_refused_before_any_work(dense, tmp_path):
    """A session whose plan spills creates its spill directory before the prefill: one that
    cannot be made (its parent is a file) is refused by name, not reported as a full disk
    (before: "/proc/x ... has 0 free") or failed part-way through."""
    from qwen38_backend.errors import AdmissionError

    (tmp_path / "afile").write_text("x")
    where = tmp_path / "afile" / "spill"
    opts = {"kv_topk": 4 * P, "kv_page_tokens": P, "kv_sinks": P, "kv_recent": P}
    session = dense.session(cache=False, **opts, kv_pool_tokens=12 * P, kv_spill_dir=str(where))
    ids = prompt(150, dense.config.vocab_size, seed=4)
    with pytest.raises(AdmissionError, match="cannot be created"):
        list(session.generate(ids, max_tokens=5))
    assert session.state is None
    fine = dense.session(cache=False, **opts, kv_pool_tokens=12 * P)
    fine_dir = tmp_path / "made" / "here"
    list(fine.generate(ids, max_tokens=5, kv_spill_dir=str(fine_dir)))
    assert fine_dir.is_dir() and fine.last_stats.kv["pages_spilled"] > 0


# ----- rewind and state files across spilled pages --------------------------------------------
@pytest.mark.parametrize("where", ["inside a spilled page", "at a spilled page", "late"])
def test_rewind_across_spilled_pages(dense, tmp_path, where):
    ids = prompt(170, dense.config.vocab_size, seed=6)
    make = factory(tmp_path, 4 * P, pool_pages=10)
    _, state = greedy(dense.net, ids, make, n=5)
    first = state.layers[0]
    spilled = [p for p, s in enumerate(first.table.slots) if s == SPILLED]
    cut = {
        "inside a spilled page": spilled[1] * P + 3,
        "at a spilled page": spilled[1] * P,
        "late": 150,
    }[where]
    state.truncate(cut)
    if cut % P:
        assert first.table.slots[cut // P] != SPILLED  # the cut page came back, open again
    tail = prompt(30, dense.config.vocab_size, seed=7)
    out, _ = greedy(dense.net, tail, None, n=15, chunk=7, state=state)
    # The same continuation as an all-resident run of the same tokens in the same chunks.
    ref_state = dense.net.make_state(kv_factory=factory(None, 4 * P, None))
    greedy(dense.net, ids[:cut], None, n=0, state=ref_state)
    ref_out, _ = greedy(dense.net, tail, None, n=15, chunk=7, state=ref_state)
    assert out == ref_out


def test_state_file_across_spilled_pages(dense, tmp_path):
    ids = prompt(160, dense.config.vocab_size, seed=8)
    make = factory(tmp_path / "a", 4 * P, pool_pages=10)
    _, state = greedy(dense.net, ids, make, n=4)
    assert state.layers[0].table.n_spilled > 0
    path = save_state_file(tmp_path / "s.ckpt.safetensors", state, dense).path
    restored = dense.net.make_state(kv_factory=factory(tmp_path / "b", 4 * P, pool_pages=10))
    restored.restore(read_state_file(path, dense))
    assert restored.layers[0].table.n_spilled > 0  # restoring spilled again
    resident = dense.net.make_state(kv_factory=factory(None, 4 * P, None))
    resident.restore(read_state_file(path, dense))
    more = prompt(20, dense.config.vocab_size, seed=9)
    a, _ = greedy(dense.net, more, None, n=12, state=restored)
    b, _ = greedy(dense.net, more, None, n=12, state=resident)
    c, _ = greedy(dense.net, more, None, n=12, state=state)
    assert a == b == c


# ----- injected failures ---------------------------------------------------------------------
def failing_pwrite(code: int, after: int = 0):
    real = os.pwrite
    calls = {"n": 0}

    def pwrite(fd, buf, offset):
        calls["n"] += 1
        if calls["n"] > after:
            raise OSError(code, os.strerror(code))
        return real(fd, buf, offset)

    return pwrite


def test_disk_full_keeps_working_resident_only_then_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "pwrite", failing_pwrite(errno.ENOSPC))
    k, v = rows(120, seed=3)
    store = PagedKV(page_tokens=P, pool_pages=12, spill=SpillFile(tmp_path))
    fill(store, k[:, :90], v[:, :90])  # 12 pages: write-behind starts and fails
    region = store.table.spill
    region.io.wait(lambda: region.failed)
    assert isinstance(region.io.error, SpillDiskFullError)
    # The context still fits: nothing was evicted, reads need no disk, rows are right.
    assert store.table.n_spilled == 0
    np.testing.assert_array_equal(np.array(store._dense_kv()[0][0]), k[:, :90])
    with pytest.raises(SpillDiskFullError, match="free disk space or set kv_spill_dir"):
        fill(store, k[:, 90:], v[:, 90:])  # past the pool: a clear error
    # Reset: the failure is cleared and the store works again (the disk has room now).
    monkeypatch.undo()
    store.restore({})
    assert not region.failed
    fill(store, k, v)
    assert store.table.n_spilled > 0
    np.testing.assert_array_equal(np.array(store._dense_kv()[0][0]), k)


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_a_failed_write_is_raised_by_the_next_read(dense, tmp_path, monkeypatch, code):
    ids = prompt(150, dense.config.vocab_size, seed=10)
    make = factory(tmp_path, 4 * P, pool_pages=10)
    ref, _ = greedy(dense.net, ids, factory(None, 4 * P, None), n=30)
    state = dense.net.make_state(kv_factory=make)
    logits = None
    for s in range(0, len(ids), 24):
        logits = dense.net(mx.array(ids[s : s + 24]), state, last_only=True)
        state.advance(ids[s : s + 24])
    assert state.layers[0].table.n_spilled > 0  # pages already on disk
    monkeypatch.setattr(os, "pwrite", failing_pwrite(code))
    got = []
    kind = SpillDiskFullError if code == errno.ENOSPC else SpillError
    with pytest.raises(kind):
        for _ in range(30):
            token = int(mx.argmax(logits[-1]).item())
            got.append(token)
            logits = dense.net(mx.array([token]), state, last_only=True)
            state.advance([token])
    assert got == ref[: len(got)]  # every token before the error is right
    # Reset the sequence: it runs again, and right.
    monkeypatch.undo()
    state.truncate(0)
    out, _ = greedy(dense.net, ids, None, n=30, state=state)
    assert out == ref


def test_read_errors_and_corrupt_pages_are_typed_errors(tmp_path, monkeypatch):
    k, v = rows(100, seed=4)
    store = PagedKV(page_tokens=P, pool_pages=5, spill=SpillFile(tmp_path))
    fill(store, k, v)
    path = store.table.spill.io.path
    # Corrupt one spilled page on disk: its checksum refuses it (never wrong bytes).
    offset = store.table.spill._offset(0)
    with open(path, "r+b") as f:
        f.seek(offset + 3)
        f.write(b"\xff\xfe")
    with pytest.raises(SpillError, match="checksum"):
        store._dense_kv()
    with pytest.raises(SpillError):  # recorded: every later read raises it too
        store.table.spill.read([1])
    store.restore({})
    fill(store, k, v)
    # One page in the middle of a run read at once fails its own checksum.
    assert store.table.slots[:8] == [SPILLED] * 8
    with open(path, "r+b") as f:
        f.seek(store.table.spill._offset(5) + 11)
        f.write(b"\x01\x02")
    with pytest.raises(SpillError, match="page 5 fails its checksum"):
        store.table.spill.read(list(range(8)))
    store.restore({})
    fill(store, k, v)

    def eio(fd, n, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pread", eio)
    with pytest.raises(SpillError, match="Input/output error"):
        store._dense_kv()


def test_short_writes_and_eintr_give_the_same_tokens(dense, tmp_path, monkeypatch):
    real = os.pwrite
    calls = {"n": 0}

    def flaky(fd, buf, offset):
        calls["n"] += 1
        if calls["n"] % 2:
            raise InterruptedError(errno.EINTR, "interrupted")
        return real(fd, bytes(memoryview(buf)[:1000]), offset)

    ids = prompt(140, dense.config.vocab_size, seed=11)
    ref, _ = greedy(dense.net, ids, factory(None, 4 * P, None), n=20)
    monkeypatch.setattr(os, "pwrite", flaky)
    out, state = greedy(dense.net, ids, factory(tmp_path, 4 * P, pool_pages=10), n=20)
    assert out == ref and calls["n"] > 100
    assert collect_kv_stats(state)["pages_fetched"] > 0


# ----- the file's life -----------------------------------------------------------------------
def test_spill_file_removed_when_the_sequence_goes(dense, tmp_path):
    ids = prompt(150, dense.config.vocab_size, seed=12)
    state = dense.net.make_state(
        kv_factory=make_kv_factory(kv_pool_tokens=10 * P, kv_page_tokens=P, kv_spill_dir=tmp_path)
    )
    greedy(dense.net, ids, None, n=2, state=state)
    files = list(tmp_path.glob("kv-*.spill"))
    assert len(files) == 1  # one file for every layer of the sequence
    del state
    gc.collect()
    assert not list(tmp_path.glob("kv-*.spill"))
    # A file left by a process that is gone is removed when a new one is created there.
    stale = tmp_path / "kv-999999999-0-1.spill"
    stale.write_bytes(b"x")
    (tmp_path / "kv-notapid.spill").write_bytes(b"x")
    remove_stale(tmp_path)
    assert not stale.exists() and (tmp_path / "kv-notapid.spill").exists()


def test_default_spill_dir_is_under_the_cache_dir(dense, isolated_home):
    ids = prompt(150, dense.config.vocab_size, seed=13)
    factory_ = make_kv_factory(kv_pool_tokens=10 * P, kv_page_tokens=P)
    state = dense.net.make_state(kv_factory=factory_)
    greedy(dense.net, ids, None, n=1, state=state)
    assert factory_.spill.path.parent == isolated_home / "cache" / "kv-spill"
    state.layers[0].close()
    assert not factory_.spill.path.exists()


def test_session_closes_its_spill_file_without_garbage_collection(dense, tmp_path):
    """The file goes when the session says so (close, a replaced state, `with`), not when a
    collector gets round to it: a long-lived process would otherwise keep gigabytes."""
    opts = {"kv_pool_tokens": 10 * P, "kv_page_tokens": P, "kv_spill_dir": str(tmp_path)}
    ids = prompt(150, dense.config.vocab_size, seed=13)
    gc.disable()  # prove the removal does not wait for a collection
    try:
        with dense.session(cache=False, **opts) as session:
            list(session.generate(ids, max_tokens=3, temperature=0.0))
            first = set(tmp_path.glob("kv-*.spill"))
            assert len(first) == 1
            # cache=False: the next call builds a fresh state; the old one's file goes
            list(session.generate(ids[::-1], max_tokens=3, temperature=0.0))
            second = set(tmp_path.glob("kv-*.spill"))
            assert len(second) == 1 and second != first
        assert not list(tmp_path.glob("kv-*.spill"))
        with dense.new_state(**opts) as state:
            dense.prefill(ids, state)
            assert list(tmp_path.glob("kv-*.spill"))
        assert not list(tmp_path.glob("kv-*.spill"))
    finally:
        gc.enable()


def test_saving_a_spilled_sequence_streams_one_layer_at_a_time(dense, tmp_path, monkeypatch):
    """A large state is written layer by layer: each layer's KV (spilled pages read back) is
    written before the next layer's is read, and the file restores to the same tokens."""
    import qwen38_backend.state_files as state_files

    ids = prompt(160, dense.config.vocab_size, seed=14)
    _, state = greedy(dense.net, ids, factory(tmp_path / "a", 4 * P, pool_pages=10), n=4)
    assert state.layers[0].table.n_spilled > 0
    events: list[str] = []
    snapshot, write_all = PagedKV.snapshot, state_files._write_all
    monkeypatch.setattr(PagedKV, "snapshot", lambda self: events.append("read") or snapshot(self))
    monkeypatch.setattr(
        state_files, "_write_all", lambda fd, data: events.append("write") or write_all(fd, data)
    )
    monkeypatch.setattr(state_files, "STREAM_BYTES", 0)  # this tiny state counts as large
    path = save_state_file(tmp_path / "s.ckpt.safetensors", state, dense).path
    reads = [i for i, e in enumerate(events) if e == "read"]
    assert len(reads) == len(state.layers) >= 2
    assert all("write" in events[a:b] for a, b in zip(reads, reads[1:], strict=False))
    monkeypatch.setattr(state_files, "STREAM_BYTES", 1 << 40)
    eager = save_state_file(tmp_path / "e.ckpt.safetensors", state, dense).path
    more = prompt(20, dense.config.vocab_size, seed=15)
    outs = []
    for saved in (path, eager):
        restored = dense.net.make_state(kv_factory=factory(None, 4 * P, None))
        restored.restore(read_state_file(saved, dense))
        outs.append(greedy(dense.net, more, None, n=10, state=restored)[0])
    outs.append(greedy(dense.net, more, None, n=10, state=state)[0])
    assert outs[0] == outs[1] == outs[2]
