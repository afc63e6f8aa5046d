"""Paged KV: dense equivalence, sparse gather, metadata, rewind, snapshots, memory, options."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qwen38_backend
from qwen38_backend.errors import InvalidOptionError
from qwen38_backend.kv import PagedKV, collect_kv_stats, make_kv_factory
from qwen38_backend.kv.contiguous import ContiguousKV
from qwen38_backend.kv.quest import outward_bf16
from qwen38_backend.models import build_model
from qwen38_backend.models.assign import assign_weights
from qwen38_backend.sampling import SamplingParams
from tests.helpers import DENSE_ARCHS, dense_fixture

FIXTURES = Path(__file__).parent / "fixtures" / "dense"
P = 16
LENGTHS = (1, P - 1, P, P + 1, 6 * P + 5)  # page-boundary lengths and many pages
N_TOKENS = 200


def decode_tokens(length: int) -> int:
    """Tokens decoded after a prompt of `length` in the default runs: the many-page prompt
    decodes N_TOKENS (to 301 positions: 19 pages, past ContiguousKV's first 256-row buffer),
    each page-edge prompt 48 (three more page edges crossed while decoding)."""
    return N_TOKENS if length == LENGTHS[-1] else 3 * P


def load_dense_net(arch: str):
    d = FIXTURES / arch
    net = build_model(json.loads((d / "config.json").read_text()))
    assign_weights(net, mx.load(str(d / "model.safetensors")), {}, mx.float32)
    return net


def prompt(length: int, vocab: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed + length)
    return rng.integers(10, min(vocab, 32000) - 10, size=length).tolist()


def net_greedy(net, ids: list[int], factory, n: int = N_TOKENS, chunk: int = 24) -> list[int]:
    """Greedy decode straight on the nn.Module (chunked prefill that cuts pages mid-way)."""
    state = net.make_state(kv_factory=factory)
    for s in range(0, len(ids), chunk):
        logits = net(mx.array(ids[s : s + chunk]), state, last_only=True)
        state.advance(ids[s : s + chunk])
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits[-1]).item())
        out.append(token)
        logits = net(mx.array([token]), state, last_only=True)
        state.advance([token])
    return out


FULL = functools.partial(PagedKV, page_tokens=P, budget=10**6)
FULL_GATHER = functools.partial(PagedKV, page_tokens=P, budget=10**6, always_select=True)
# Each KV head selecting its own pages (the selection before issue 18; still a variant).
FULL_GATHER_PER_HEAD = functools.partial(FULL_GATHER, shared=False)


@pytest.mark.parametrize("arch", DENSE_ARCHS)
def test_full_selection_equals_dense_on_dense_fixtures(arch):
    net = load_dense_net(arch)
    for length in LENGTHS:
        ids, n = prompt(length, net.config.vocab_size), decode_tokens(length)
        ref = net_greedy(net, ids, ContiguousKV, n)
        assert net_greedy(net, ids, FULL, n) == ref, f"dense route, prompt {length}"
        # The gather path (every page selected through the Quest machinery) too.
        assert net_greedy(net, ids, FULL_GATHER, n) == ref, f"gather route, prompt {length}"
        per_head = net_greedy(net, ids, FULL_GATHER_PER_HEAD, n)
        assert per_head == ref, f"per-head gather route, prompt {length}"


def model_streams_equal(model, lengths=LENGTHS, n_tokens: int | None = None) -> None:
    """Each route's greedy stream after each prompt length, n_tokens long (default: that
    length's decode_tokens)."""
    vocab = model.config.vocab_size
    for length in lengths:
        ids, n = prompt(length, vocab), n_tokens or decode_tokens(length)
        ref = list(model.generate_tokens(ids, n, stop_token_ids=[], kv_paged="off"))
        assert len(ref) == n
        paged = model.generate_tokens(
            ids, n, stop_token_ids=[], kv_paged="on", kv_topk=10**6, kv_page_tokens=P
        )
        assert list(paged) == ref, f"dense route, prompt {length}"
        assert paged.stats.kv["pages_resident"] > 0
        state = model.net.make_state(kv_factory=FULL_GATHER)
        params = SamplingParams.from_options(max_tokens=n, stop_token_ids=[])
        assert list(model.run(ids, state, params)) == ref, f"gather route, prompt {length}"


@pytest.mark.demo
def test_full_selection_equals_dense_demo_quick(demo_model):
    """The default run's share: two page-edge prompts, 24 tokens each (across one and two
    page edges while decoding; the full check is slow)."""
    model_streams_equal(demo_model, lengths=(P - 1, P + 1), n_tokens=24)


@pytest.mark.demo
@pytest.mark.slow
def test_full_selection_equals_dense_demo(demo_model):
    """All page-boundary prompt lengths, 200 tokens each (3,000 demo decode steps)."""
    model_streams_equal(demo_model, n_tokens=N_TOKENS)


def test_full_selection_equals_dense_tiny_qwen3_5(tmp_path):
    from qwen38_backend.testing import make_tiny_weights

    model = qwen38_backend.load(str(make_tiny_weights("qwen3_5", tmp_path / "q", seed=3)))
    model_streams_equal(model)


# ----- the store on synthetic data ---------------------------------------------------------
def filled_store(hkv=2, d=8, length=37, page=4, seed=0, chunks=(5, 1, 1, 9, 2, 1, 30), **kw):
    """A PagedKV written in uneven chunks (decode singles and prefill blocks)."""
    rng = np.random.default_rng(seed)
    keys = rng.normal(size=(hkv, length, d)).astype(np.float32)
    values = rng.normal(size=(hkv, length, d)).astype(np.float32)
    store = PagedKV(page_tokens=page, **kw)
    pos, i = 0, 0
    while pos < length:
        n = min(chunks[i % len(chunks)], length - pos)
        store.append(mx.array(keys[:, pos : pos + n]), mx.array(values[:, pos : pos + n]))
        pos, i = pos + n, i + 1
    return store, keys, values


@pytest.mark.parametrize("chunks", [(5, 1, 1, 9, 2, 1, 30), (1,), (3, 1)])
def test_metadata_is_min_max_of_each_page(chunks):
    """Each sealed page's min / max, whatever the writes' sizes (decode steps write one row
    each: a page opened and sealed by single rows, its bounds taken from its rows when it
    seals; a prefill chunk finishing a page another chunk opened)."""
    store, keys, _ = filled_store(length=38, page=4, meta_dtype=mx.float32, chunks=chunks)
    n_sealed = 38 // 4
    pages = keys[:, : n_sealed * 4].reshape(2, n_sealed, 4, 8)
    np.testing.assert_array_equal(np.array(store.kmin[:, :n_sealed]), pages.min(axis=2))
    np.testing.assert_array_equal(np.array(store.kmax[:, :n_sealed]), pages.max(axis=2))
    assert not np.array(store.kmin[:, n_sealed]).any()  # the open page: no bounds yet
    more = np.random.default_rng(7).normal(size=(2, 2, 8)).astype(np.float32)
    for i in range(2):  # the open page's last two rows, one step each: it seals
        store.append(mx.array(more[:, i : i + 1]), mx.array(more[:, i : i + 1]))
    last = np.concatenate([keys[:, 36:], more], axis=1)
    np.testing.assert_array_equal(np.array(store.kmin[:, n_sealed]), last.min(axis=1))
    np.testing.assert_array_equal(np.array(store.kmax[:, n_sealed]), last.max(axis=1))
    # The pool seen in the DESIGN layout [slots, page, heads, dim] holds the rows.
    view = np.array(store.pool.pages_view("k"))
    np.testing.assert_array_equal(view[:9].reshape(36, 2, 8), keys[:, :36].transpose(1, 0, 2))


def test_bf16_metadata_is_the_outward_rounded_min_max():
    store, keys, values = filled_store(length=38, page=4, meta_dtype=mx.bfloat16)
    n_sealed = 38 // 4
    pages = mx.array(keys[:, : n_sealed * 4].reshape(2, n_sealed, 4, 8))
    lo, hi = outward_bf16(pages.min(axis=2), pages.max(axis=2))
    assert store.kmin.dtype == mx.bfloat16 and store.kmin[:, 0].nbytes == 2 * 8 * 2
    np.testing.assert_array_equal(f32(store.kmin[:, :n_sealed]), f32(lo))
    np.testing.assert_array_equal(f32(store.kmax[:, :n_sealed]), f32(hi))
    # a snapshot keeps them; a fp32 store restoring it recomputes its own from the rows
    snap = store.snapshot()
    again = PagedKV(page_tokens=4, meta_dtype=mx.bfloat16)
    again.restore(snap)
    assert_same_store(again, store)
    fp32 = PagedKV(page_tokens=4)
    fp32.restore(snap)
    direct, _, _ = filled_store(length=38, page=4)
    assert_same_store(fp32, direct)
    with pytest.raises(InvalidOptionError, match="float32 or bfloat16"):
        PagedKV(meta_dtype=mx.float16)


def test_full_selection_with_bf16_metadata_equals_dense():
    ids = prompt(90, 400, seed=4)
    net = load_dense_net(DENSE_ARCHS[0])
    dense = net_greedy(net, ids, ContiguousKV)
    factory = functools.partial(PagedKV, page_tokens=8, budget=4096, meta_dtype=mx.bfloat16,
                                always_select=True)  # fmt: skip
    assert net_greedy(net, ids, factory) == dense


def reference_attention(q, keys, values, pages_per_head, length, page, scale):
    """numpy attention of q [Hq, D] over each head's selected pages."""
    hkv = keys.shape[0]
    group = q.shape[0] // hkv
    out = np.zeros_like(q, dtype=np.float64)
    for h in range(hkv):
        rows = [r for p in pages_per_head[h] for r in range(p * page, min((p + 1) * page, length))]
        k, v = keys[h, rows].astype(np.float64), values[h, rows].astype(np.float64)
        for g in range(group):
            s = k @ q[h * group + g] * scale
            w = np.exp(s - s.max())
            out[h * group + g] = (w / w.sum()) @ v
    return out


def repeat_last_row(store, q, keys, values):
    """One decode step of `store` whose new K/V repeat its last row; returns the output and
    the keys / values with that row appended (what a reference attends over)."""
    out = store.attend(
        mx.array(q)[None, :, None],
        mx.array(keys[:, -1:])[None],
        mx.array(values[:, -1:])[None],
        0.3,
    )
    keys = np.concatenate([keys, keys[:, -1:]], axis=1)
    values = np.concatenate([values, values[:, -1:]], axis=1)
    return out, keys, values


def test_sparse_decode_attends_over_each_heads_own_pages():
    differs = False
    for seed in range(6):
        store, keys, values = filled_store(seed=seed, budget=12, sinks=4, recent=4)
        rng = np.random.default_rng(100 + seed)
        k_new = rng.normal(size=(2, 1, 8)).astype(np.float32)
        v_new = rng.normal(size=(2, 1, 8)).astype(np.float32)
        q = rng.normal(size=(6, 8)).astype(np.float32)
        out = store.attend(
            mx.array(q)[None, :, None], mx.array(k_new)[None], mx.array(v_new)[None], 0.3
        )
        keys = np.concatenate([keys, k_new], axis=1)
        values = np.concatenate([values, v_new], axis=1)
        n_pages, n_sel = store.selection_size()
        assert (n_pages, n_sel) == (10, 3)
        pages = np.array(store.select(mx.array(q), n_sel))
        # Forced: sink page 0, the last page and one recent page: nothing left for top-k.
        assert [list(p) for p in pages] == [[0, 8, 9], [0, 8, 9]]
        ref = reference_attention(q, keys, values, pages, 38, 4, 0.3)
        np.testing.assert_allclose(np.array(out)[0, :, 0], ref, rtol=1e-5, atol=1e-5)
    for seed in range(6):
        store, keys, values = filled_store(
            seed=seed, length=40, budget=16, sinks=4, recent=0, shared=False
        )
        q = np.random.default_rng(seed).normal(size=(6, 8)).astype(np.float32) * 4
        out, keys, values = repeat_last_row(store, q, keys, values)
        pages = np.array(store.select(mx.array(q), 4))
        differs |= not (pages[0] == pages[1]).all()
        ref = reference_attention(q, keys, values, pages, 41, 4, 0.3)
        np.testing.assert_allclose(np.array(out)[0, :, 0], ref, rtol=1e-5, atol=1e-5)
        assert store.stats["sparse_steps"] == 1
    assert differs, "per-head selection never differed between heads: not exercised"


def test_shared_selection_is_the_top_k_of_the_bound_summed_over_heads():
    """shared=True: every KV head attends over the same pages, the best by the Quest bound
    summed over all query heads (brute force below), ties to the lower page id."""
    for seed in range(6):
        store, keys, values = filled_store(seed=seed, length=40, budget=16, sinks=4, recent=0)
        q = np.random.default_rng(seed).normal(size=(6, 8)).astype(np.float32) * 4
        if seed % 2:  # two identical pages: equal scores, the lower id must win
            keys[:, 8:12] = keys[:, 4:8]
            store, *_ = filled_store(seed=seed, length=40, budget=16, sinks=4, recent=0)
            store.restore(
                {"keys": mx.array(keys), "values": mx.array(values), "page_tokens": mx.array(0)}
            )
        out, keys, values = repeat_last_row(store, q, keys, values)
        pages = np.array(store.select(mx.array(q), 4))
        sealed = keys[:, :40].reshape(2, 10, 4, 8).astype(np.float64)
        lo, hi = sealed.min(axis=2), sealed.max(axis=2)  # [2, 10, 8]
        qg = q.reshape(2, 3, 8).astype(np.float64)
        bound = np.maximum(qg[:, :, None] * lo[:, None], qg[:, :, None] * hi[:, None])
        total = bound.sum(axis=(0, 1, 3))  # [10 pages], summed over every query head
        # Forced: sink page 0 and the open page 10; two more by score, ties to lower id.
        best = sorted(range(1, 10), key=lambda p: (-total[p], p))[:2]
        want = sorted([0, 10, *best])
        assert [list(p) for p in pages] == [want, want]
        ref = reference_attention(q, keys, values, pages, 41, 4, 0.3)
        np.testing.assert_allclose(np.array(out)[0, :, 0], ref, rtol=1e-5, atol=1e-5)


def f32(a: mx.array) -> np.ndarray:
    """numpy has no bf16: compare metadata as fp32 (exact for bf16 values)."""
    return np.array(a.astype(mx.float32))


def assert_same_store(a: PagedKV, b: PagedKV) -> None:
    assert a.length == b.length and len(a.table) == len(b.table)
    n_sealed = a.length // a.page_tokens
    if a.length == 0:
        return
    for x, y in zip(a._dense_kv(), b._dense_kv(), strict=True):
        np.testing.assert_array_equal(np.array(x), np.array(y))
    assert a.kmin.dtype == b.kmin.dtype
    for x, y in ((a.kmin, b.kmin), (a.kmax, b.kmax)):
        np.testing.assert_array_equal(f32(x[:, :n_sealed]), f32(y[:, :n_sealed]))


@pytest.mark.parametrize("cut", [45, 44, 40, 1, 0])
def test_truncate_unseals_and_frees_pages(cut):
    full, keys, values = filled_store(length=70, page=8, seed=1)
    free_before = full.pool.free_slots
    full.truncate(cut)
    assert len(full.table) == math.ceil(cut / 8)
    assert full.pool.free_slots == free_before + math.ceil(70 / 8) - math.ceil(cut / 8)
    fresh = PagedKV(page_tokens=8)
    if cut:
        fresh.append(mx.array(keys[:, :cut]), mx.array(values[:, :cut]))
    assert_same_store(full, fresh)
    # Writing on from the cut seals pages exactly as if the rewound rows never existed.
    full.append(mx.array(keys[:, cut:]), mx.array(values[:, cut:]))
    whole = PagedKV(page_tokens=8)
    whole.append(mx.array(keys), mx.array(values))
    assert_same_store(full, whole)


def test_snapshot_holds_live_rows_and_restores_exactly():
    store, keys, values = filled_store(length=50, page=8, seed=2)
    snap = store.snapshot()
    assert all(isinstance(v, mx.array) for v in snap.values())
    assert snap["keys"].shape == (2, 50, 8) and snap["page_table"].shape == (7,)
    assert snap["quest_min"].shape == (2, 6, 8)
    more = np.ones((2, 20, 8), np.float32)
    store.append(mx.array(more), mx.array(more))
    np.testing.assert_array_equal(np.array(snap["keys"]), keys)  # later writes do not leak in
    other = PagedKV(page_tokens=8)
    other.restore(snap)
    original, _, _ = filled_store(length=50, page=8, seed=2)
    assert_same_store(other, original)
    # Writing on seals the restored open page from all its rows, as the original store does.
    on = np.random.default_rng(5).normal(size=(2, 9, 8)).astype(np.float32)
    for s in (other, original):
        for i in range(9):
            s.append(mx.array(on[:, i : i + 1]), mx.array(on[:, i : i + 1]))
    assert_same_store(other, original)
    # Another page size: metadata rebuilt from the restored rows.
    resized = PagedKV(page_tokens=16)
    resized.restore(snap)
    direct = PagedKV(page_tokens=16)
    direct.append(mx.array(keys), mx.array(values))
    assert_same_store(resized, direct)
    other.restore({})
    assert other.length == 0 and other.pool.free_slots == other.pool.capacity


def test_session_rewind_reuses_paged_state(tmp_path):
    model = qwen38_backend.load(str(dense_fixture("qwen3", tmp_path)))
    opts = {"kv_paged": "on", "kv_topk": 32, "kv_page_tokens": 8, "max_tokens": 12}
    ids = prompt(70, model.config.vocab_size)
    session = model.session(**opts)
    list(session.generate(ids))
    list(session.generate(ids[:50] + [11, 12, 13]))  # truncates the live state to 50
    assert session.last_stats.cached_tokens == 50
    cached_stream = session.state.tokens
    fresh = model.session(**opts)
    list(fresh.generate(ids[:50] + [11, 12, 13]))
    assert fresh.state.tokens == cached_stream


def test_a_prompts_last_token_attends_densely_however_it_is_fed(tmp_path):
    """Quest selects for decode steps only: a prompt's last token has the logits of a dense
    prefill when it is fed alone (after a cached prefix, or as a chunk of its own), so the
    same prompt answers the same cached or not."""
    model = qwen38_backend.load(str(dense_fixture("qwen3", tmp_path)))
    opts = {"kv_paged": "on", "kv_topk": 16, "kv_page_tokens": 8, "kv_sinks": 8, "kv_recent": 8}
    ids = prompt(90, model.config.vocab_size)

    def last_logits(chunk: int) -> np.ndarray:
        state = model.new_state(**opts)
        return np.array(model.prefill(ids, state, chunk=chunk).astype(mx.float32))

    whole = last_logits(len(ids))
    np.testing.assert_allclose(last_logits(len(ids) - 1), whole, atol=1e-4)
    session = model.session(**opts, max_tokens=8)
    list(session.generate(ids))
    fresh_tokens = session.state.tokens
    list(session.generate(ids))  # the live state is cut back to all but the last token
    assert session.last_stats.cached_tokens == len(ids) - 1
    assert session.state.tokens == fresh_tokens


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    return qwen38_backend.load(str(dense_fixture("qwen3", tmp_path_factory.mktemp("q3"))))


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(24, 110),
    chunk=st.integers(1, 40),
    cached=st.integers(0, 109),
    topk=st.sampled_from([8, 16, 24]),
)
def test_quest_prompt_logits_do_not_depend_on_how_the_prompt_is_fed(
    qwen3_model, n, chunk, cached, topk
):
    """Under Quest, a prompt's last logits are those of one dense prefill whatever the chunk
    size and however much of it came from an earlier call's state (rewound to `cached`)."""
    model = qwen3_model
    opts = {"kv_paged": "on", "kv_topk": topk, "kv_page_tokens": 8, "kv_sinks": 8}
    opts["kv_recent"] = 8
    ids = prompt(n, model.config.vocab_size, seed=chunk)
    whole = np.array(model.prefill(ids, model.new_state(**opts), chunk=n).astype(mx.float32))
    state = model.new_state(**opts)
    model.prefill(ids, state, chunk=chunk)
    mx.eval(model.forward([7], state))  # a decode step past the prompt, as a call leaves it
    state.truncate(min(cached, n - 1))
    fed = model.prefill(ids[state.offset :], state, chunk=chunk)
    np.testing.assert_allclose(np.array(fed.astype(mx.float32)), whole, atol=1e-4)


# ----- memory ------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [512, 10**6])
def test_pool_bytes_and_flat_peak_memory(budget):
    hkv, d, length, group = 4, 64, 4096, 2
    store = PagedKV(page_tokens=32, budget=budget)
    rng = np.random.default_rng(0)
    rows = mx.array(rng.normal(size=(hkv, length, d)).astype(np.float32))
    store.pool.reserve(length // 32 + 8, rows, rows)  # no growth inside the measured steps
    store.append(rows, rows)
    mx.eval(store.pool.k, store.pool.v, store.kmin, store.kmax)
    stats = store.kv_stats()
    page_bytes = 2 * 32 * hkv * d * 4
    assert stats["pool_bytes"] == store.pool.k.nbytes + store.pool.v.nbytes
    assert stats["pool_bytes"] == stats["pool_pages"] * page_bytes
    assert stats["pages_resident"] == length // 32
    cache_bytes = 2 * length * hkv * d * 4
    peaks = []
    for _ in range(40):
        mx.eval(store.pool.k, store.pool.v)
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        q = mx.random.normal((1, hkv * group, 1, d))
        k = mx.random.normal((1, hkv, 1, d))
        mx.eval(store.attend(q, k, k, d**-0.5))
        peaks.append(mx.get_peak_memory() - base)
    # No per-step copy of the cache, and no growth across steps. A step's peak jitters by a
    # few of its own small buffers (whether the CPU stream freed one before the next is
    # allocated), so growth is judged on the floor of the peaks, not on their maximum.
    assert max(peaks) < cache_bytes / 4, peaks
    assert min(peaks[-10:]) <= min(peaks[:10]) + 64 * 1024, peaks


# ----- options and stats -------------------------------------------------------------------
@pytest.mark.parametrize(
    "options",
    [
        {"kv_paged": "yes"},
        {"kv_paged": True},
        {"kv_topk": 0},
        {"kv_topk": 1.5},
        {"kv_topk": True},
        {"kv_page_tokens": 0},
        {"kv_page_tokens": 10**6},
        {"kv_sinks": -1},
        {"kv_recent": "many"},
        {"kv_bogus": 1},
    ],
)
def test_invalid_options_are_refused(options, tmp_path):
    with pytest.raises(InvalidOptionError):
        make_kv_factory(**options)
    if "kv_bogus" in options:
        return
    model = qwen38_backend.load(str(dense_fixture("llama", tmp_path)))
    with pytest.raises(InvalidOptionError):
        model.generate_tokens([1, 2, 3], 4, **options)
    with pytest.raises(InvalidOptionError):
        list(model.session().generate([1, 2, 3], **options))


def test_factory_kinds():
    assert make_kv_factory() is ContiguousKV
    assert make_kv_factory(kv_paged="off") is ContiguousKV
    store = make_kv_factory(kv_topk="100", kv_page_tokens=16, kv_sinks=0, kv_recent=20)()
    assert isinstance(store, PagedKV) and store.mode == "on"
    assert (store.budget_pages, store.sink_pages, store.recent_pages) == (7, 0, 2)
    auto = make_kv_factory(kv_paged="auto", kv_topk=64, kv_page_tokens=16)()
    assert auto.sparse_from == 256


def test_auto_is_dense_below_its_threshold():
    store, *_ = filled_store(
        length=100, page=4, budget=8, mode="auto", sinks=4, recent=4
    )  # sparse from 32
    assert store.selection_size() == (25, 3)
    small, *_ = filled_store(length=20, page=4, budget=8, mode="auto", sinks=4, recent=4)
    assert small.selection_size() == (5, 5)
    on, *_ = filled_store(length=20, page=4, budget=8, mode="on", sinks=4, recent=4)
    assert on.selection_size() == (5, 3)


def test_generation_reports_kv_stats(tmp_path):
    model = qwen38_backend.load(str(dense_fixture("qwen2", tmp_path)))
    cfg = model.config
    stream = model.generate_tokens(
        prompt(100, cfg.vocab_size),
        20,
        stop_token_ids=[],
        kv_topk=32,
        kv_page_tokens=16,
        kv_sinks=16,
        kv_recent=16,
    )
    assert len(list(stream)) == 20
    kv = stream.stats.kv
    layers = cfg.num_hidden_layers
    assert kv["pages_resident"] == layers * math.ceil((100 + 19) / 16)
    assert kv["decode_steps"] == kv["sparse_steps"] == 19
    # 32 tokens = 2 pages, but the sink page, one recent page and the open page are forced.
    assert kv["pages_selected_per_step"] == layers * cfg.num_key_value_heads * 3
    assert (
        0
        < kv["kv_read_bytes_per_token"]
        < layers * 2 * 119 * cfg.num_key_value_heads * (cfg.head_dim * 4)
    )
    assert kv["pool_bytes"] > 0 and "selection_time_share" in kv
    state = model.new_state(kv_topk=32)
    assert collect_kv_stats(state)["pages_resident"] == 0


def test_demo_spilled_equals_resident(demo_model, tmp_path):
    """The demo (the README's model, fp32) with a 96-token pool under a 150-token prompt and
    Quest: the same greedy tokens as all resident, with pages really spilled and fetched."""
    rng = np.random.default_rng(5)
    ids = rng.integers(10, demo_model.config.vocab_size - 10, 150).tolist()
    kv = {"kv_paged": "on", "kv_page_tokens": 16, "kv_sinks": 16, "kv_recent": 16, "kv_topk": 32}

    def run(**extra):
        state = demo_model.new_state(**kv, **extra)
        params = SamplingParams(max_tokens=16, stop_token_ids=[], temperature=0.0)
        return list(demo_model.run(ids, state, params)), state

    ref, _ = run()
    out, state = run(kv_pool_tokens=96, kv_spill_dir=str(tmp_path))
    assert out == ref
    stats = collect_kv_stats(state)
    layers = demo_model.config.num_hidden_layers
    assert stats["pool_pages"] == layers * 6
    assert stats["pages_spilled"] >= layers * (10 - 6)  # 166 tokens = 11 pages, 6 resident
    assert stats["pages_fetched"] > 0 and stats["spill_read_bytes"] > 0
