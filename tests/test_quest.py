"""Quest bound and selection: properties against brute force."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen38_backend.kv.quest import (
    GROUP_REDUCES,
    SUMMARIES,
    forced_pages,
    order_keys,
    outward_bf16,
    page_min_max,
    page_scores,
    page_summary,
    quest_scores,
    select_pages,
    selector,
    shared_scores,
)


@st.composite
def pages_and_query(draw):
    hkv = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    d = draw(st.integers(1, 8))
    n_pages = draw(st.integers(1, 6))
    page = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    keys = rng.normal(size=(hkv, n_pages, page, d)).astype(np.float32) * 3
    q = rng.normal(size=(hkv * group, d)).astype(np.float32) * 3
    return q, keys, group


@settings(max_examples=150, deadline=None)
@given(pages_and_query())
def test_bound_dominates_every_key_in_the_page(case):
    q, keys, group = case
    hkv, n_pages, _, d = keys.shape
    kmin, kmax = page_min_max(mx.array(keys))
    scores = np.array(quest_scores(mx.array(q), kmin, kmax))
    # Group sum of q.k for every key, and the bound computed elementwise as the paper states.
    qg = q.reshape(hkv, group, d).astype(np.float64)
    dots = np.einsum("hgd,hnpd->hnp", qg, keys.astype(np.float64))
    lo, hi = np.array(kmin, np.float64), np.array(kmax, np.float64)
    literal = np.maximum(qg[:, :, None, :] * lo[:, None], qg[:, :, None, :] * hi[:, None])
    literal = literal.sum(axis=(1, 3))
    tol = 1e-4 * (1 + np.abs(literal))
    np.testing.assert_allclose(scores, literal, rtol=1e-5, atol=1e-4)
    assert (scores[:, :, None] >= dots - tol[:, :, None]).all()
    # The bound is tight per dimension: it is reached by the corner key of the box.
    assert (literal >= dots.max(axis=2) - 1e-9).all()


@settings(max_examples=150, deadline=None)
@given(pages_and_query())
def test_bf16_outward_metadata_still_bounds_every_key(case):
    """Min rounded down and max rounded up to bf16: each within one bf16 step of the fp32
    value, and the bound from them still dominates q.k of every key in the page."""
    q, keys, group = case
    hkv, _, _, d = keys.shape
    kmin, kmax = page_min_max(mx.array(keys))
    lo, hi = outward_bf16(kmin, kmax)
    assert lo.dtype == hi.dtype == mx.bfloat16
    lo64, hi64 = (
        np.array(lo.astype(mx.float32), np.float64),
        np.array(hi.astype(mx.float32), np.float64),
    )
    mn, mxv = np.array(kmin, np.float64), np.array(kmax, np.float64)
    assert (lo64 <= mn).all() and (hi64 >= mxv).all()
    step = 2.0**-7 * np.maximum(np.abs(mn), np.abs(mxv)) + 1e-38
    assert (mn - lo64 <= step).all() and (hi64 - mxv <= step).all()
    scores = np.array(quest_scores(mx.array(q), lo, hi), np.float64)
    qg = q.reshape(hkv, group, d).astype(np.float64)
    dots = np.einsum("hgd,hnpd->hnp", qg, keys.astype(np.float64))
    tol = 1e-4 * (1 + np.abs(scores))
    assert (scores[:, :, None] >= dots - tol[:, :, None]).all()


def test_outward_bf16_at_signs_zeros_and_exact_values():
    x = mx.array([0.0, -0.0, 1.0, -1.0, 1.0 + 2**-10, -(1.0 + 2**-10), 3e-39, -3e-39], mx.float32)
    lo, hi = (np.array(a.astype(mx.float32)) for a in outward_bf16(x, x))
    xv = np.array(x)
    assert (lo <= xv).all() and (hi >= xv).all()
    np.testing.assert_array_equal(lo[:4], xv[:4])  # representable values stay put
    np.testing.assert_array_equal(hi[:4], xv[:4])
    assert lo[4] == 1.0 and hi[4] == 1.0 + 2**-7 and lo[5] == -(1.0 + 2**-7) and hi[5] == -1.0


def brute_force(scores: np.ndarray, forced: np.ndarray, n_select: int) -> np.ndarray:
    out = []
    for row in scores:
        order = sorted(range(len(row)), key=lambda i: (not forced[i], -row[i], i))
        out.append(sorted(order[:n_select]))
    return np.array(out)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 40),
    st.integers(0, 3),
    st.integers(0, 3),
    st.integers(1, 40),
    st.integers(0, 2**31 - 1),
    st.booleans(),
)
def test_selection_equals_brute_force_top_k(hkv, n_pages, sinks, recent, budget, seed, ties):
    rng = np.random.default_rng(seed)
    if ties:  # few distinct values, negatives and zeros: tie-breaking must be by page id
        scores = rng.integers(-2, 3, size=(hkv, n_pages)).astype(np.float32)
        scores[(scores == 0) & (rng.random(scores.shape) < 0.5)] = -0.0
    else:
        scores = rng.normal(size=(hkv, n_pages)).astype(np.float32) * 100
    forced, n_forced = forced_pages(n_pages, sinks, recent)
    forced_np = np.array(forced)
    assert n_forced == forced_np.sum()
    assert forced_np[n_pages - 1] and forced_np[: min(sinks, n_pages)].all()
    n_select = min(n_pages, max(budget, n_forced))
    got = np.array(select_pages(mx.array(scores), forced, n_select))
    np.testing.assert_array_equal(got, brute_force(scores, forced_np, n_select))


@settings(max_examples=120, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.integers(2, 40),
    st.integers(0, 30),
    st.integers(0, 3),
    st.integers(0, 3),
    st.integers(1, 40),
    st.integers(0, 2**31 - 1),
    st.booleans(),
    st.booleans(),
)
def test_compiled_selector_equals_the_selection_over_live_pages(
    hkv, group, n_pages, spare, sinks, recent, budget, seed, ties, shared
):
    """The one-graph selection scores the metadata's whole capacity: pages past n_pages
    (stale or garbage) never count, and the result is select_pages over the live pages."""
    rng = np.random.default_rng(seed)
    d = 4
    shape = (hkv, n_pages + spare, d)
    if ties:  # integer metadata and query: equal bounds, broken by the lower page id
        kmin = rng.integers(-2, 2, size=shape).astype(np.float32)
        q = rng.integers(-1, 2, size=(hkv * group, d)).astype(np.float32)
    else:
        kmin = rng.normal(size=shape).astype(np.float32)
        q = rng.normal(size=(hkv * group, d)).astype(np.float32) * 3
    kmax = kmin + np.abs(rng.normal(size=shape)).astype(np.float32) * (not ties)
    kmin[:, n_pages:] = 1e30 * (rng.random((hkv, spare, d)) - 0.5)  # what may sit there
    kmin, kmax, q = mx.array(kmin), mx.array(np.maximum(kmax, kmin)), mx.array(q)
    forced, n_forced = forced_pages(n_pages, sinks, recent)
    n_select = min(n_pages, max(budget, n_forced))
    scores = quest_scores(q, kmin[:, :n_pages], kmax[:, :n_pages])
    want = select_pages(shared_scores(scores) if shared else scores, forced, n_select)
    run = selector(n_select, sinks, recent, shared)
    got = run(q, kmin, kmax, mx.array(n_pages, dtype=mx.int32))
    np.testing.assert_array_equal(np.array(got), np.array(want))


@given(st.lists(st.floats(width=32, allow_nan=False), min_size=2, max_size=20))
def test_order_keys_follow_score_then_lower_id(values):
    keys = np.array(order_keys(mx.array(np.array(values, np.float32))[None]))[0]
    for i in range(len(values)):
        for j in range(len(values)):
            a, b = np.float32(values[i]), np.float32(values[j])
            if a > b or (a == b and i < j):
                assert keys[i] > keys[j]


def literal_head_scores(q, keys, group, summary, width):
    """Per query head scores [Hkv, group, n_pages] in float64, written from the definitions."""
    hkv, n_pages, _, d = keys.shape
    k = keys.astype(np.float64)
    qg = q.reshape(hkv, group, d).astype(np.float64)[:, :, None, :]
    if summary == "minmax":
        lo, hi = k.min(axis=2)[:, None], k.max(axis=2)[:, None]
        return np.maximum(qg * lo, qg * hi).sum(-1)
    mean, std = k.mean(axis=2)[:, None], k.std(axis=2)[:, None]
    return (qg * mean).sum(-1) + width * (np.abs(qg) * std).sum(-1)


@settings(max_examples=120, deadline=None)
@given(
    pages_and_query(),
    st.sampled_from(SUMMARIES),
    st.sampled_from(GROUP_REDUCES),
    st.floats(0.5, 3.0),
)
def test_variant_scores_match_their_definition(case, summary, group, width):
    q, keys, g = case
    a, b = page_summary(mx.array(keys), summary)
    got = np.array(page_scores(mx.array(q), a, b, summary, group, scale=0.4, width=width))
    per_head = literal_head_scores(q, keys, g, summary, width)
    if group == "sum":
        want = per_head.sum(axis=1)
    elif group == "max":
        want = per_head.max(axis=1)
    else:
        e = np.exp(0.4 * (per_head - per_head.max(axis=-1, keepdims=True)))
        want = (e / e.sum(axis=-1, keepdims=True)).sum(axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 * (1 + np.abs(want).max()))


@settings(max_examples=120, deadline=None)
@given(pages_and_query())
def test_group_max_bound_dominates_every_heads_dot_products(case):
    """'max' claims an upper bound of each query head's q . k (not only of their sum)."""
    q, keys, group = case
    hkv, n_pages, _, d = keys.shape
    a, b = page_summary(mx.array(keys), "minmax")
    scores = np.array(page_scores(mx.array(q), a, b, "minmax", "max")).astype(np.float64)
    dots = np.einsum("hgd,hnpd->hgnp", q.reshape(hkv, group, d), keys).astype(np.float64)
    tol = 1e-4 * (1 + np.abs(scores))
    assert (scores >= dots.max(axis=(1, 3)) - tol).all()
    # ... and it is the tightest such bound per dimension box: a corner key reaches it.
    literal = literal_head_scores(q, keys, group, "minmax", 1.0).max(axis=1)
    np.testing.assert_allclose(scores, literal, rtol=1e-5, atol=1e-4)


@settings(max_examples=120, deadline=None)
@given(pages_and_query())
def test_shared_scores_bound_the_dot_products_summed_over_all_heads(case):
    """Every KV head gets the same scores: the bound summed over KV heads, an upper bound of
    sum over heads of the best key's group-summed q . k in the page."""
    q, keys, group = case
    hkv, n_pages, _, d = keys.shape
    kmin, kmax = page_min_max(mx.array(keys))
    per_head = np.array(quest_scores(mx.array(q), kmin, kmax)).astype(np.float64)
    shared = np.array(shared_scores(mx.array(per_head.astype(np.float32)))).astype(np.float64)
    np.testing.assert_allclose(
        shared, np.broadcast_to(per_head.sum(0), shared.shape), rtol=1e-5, atol=1e-4
    )
    dots = np.einsum("hgd,hnpd->hnp", q.reshape(hkv, group, d), keys).astype(np.float64)
    best = dots.max(axis=2).sum(axis=0)  # [n_pages]
    assert (shared >= best - 1e-4 * (1 + np.abs(shared))).all()


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(SUMMARIES),
    st.sampled_from(GROUP_REDUCES),
    st.integers(2, 12),
    st.integers(1, 6),
    st.integers(0, 2**31 - 1),
)
def test_variants_tie_exactly_on_identical_pages(summary, group, n_pages, n_select, seed):
    """Pages with the same keys score the same bits in every variant; the lower id wins."""
    rng = np.random.default_rng(seed)
    page = rng.normal(size=(2, 1, 4, 8)).astype(np.float32)
    keys = np.repeat(page, n_pages, axis=1)
    q = rng.normal(size=(4, 8)).astype(np.float32)
    a, b = page_summary(mx.array(keys), summary)
    scores = np.array(page_scores(mx.array(q), a, b, summary, group, scale=0.3))
    assert (scores == scores[:, :1]).all()
    n_select = min(n_select, n_pages)
    got = np.array(select_pages(mx.array(scores), None, n_select))
    np.testing.assert_array_equal(got, np.broadcast_to(np.arange(n_select), got.shape))


def test_page_summary_meanstd_and_bad_variants():
    rows = np.random.default_rng(3).normal(size=(2, 3, 5, 4)).astype(np.float32)
    mean, std = page_summary(mx.array(rows), "meanstd")
    np.testing.assert_allclose(np.array(mean), rows.mean(axis=2), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(std), rows.std(axis=2), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="page summary 'median'"):
        page_summary(mx.array(rows), "median")
    with pytest.raises(ValueError, match="group reduce 'mean'"):
        page_scores(mx.array(rows[0, 0]), mean, std, "minmax", "mean")


def test_key_scores_invert_order_keys():
    """key_scores (what the page-key kernel's probe compares) reads back the exact score
    from an order key, -0.0 as +0.0, infinities included."""
    from qwen38_backend.kv.quest import key_scores

    rng = np.random.default_rng(2)
    values = np.concatenate(
        [
            rng.normal(size=200) * 10.0 ** rng.integers(-30, 30, size=200),
            [0.0, -0.0, np.inf, -np.inf],
        ]
    ).astype(np.float32)
    got = np.array(key_scores(order_keys(mx.array(values))))
    np.testing.assert_array_equal(got, values + np.float32(0.0))


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 200),
    st.integers(1, 80),
    st.sampled_from([4, 16, 64]),
    st.integers(0, 2**31 - 1),
)
def test_top_pages_in_rounds_is_the_top_set(rows, n, n_select, round_pages, seed):
    """top_pages' two rounds (the best of each chunk, then the best of those) give the
    brute-force top n_select by (score, then lower page id), ties included, for any chunk
    size against the row's length (a partial last chunk, n_select past a chunk)."""
    import qwen38_backend.kv.quest as quest

    rng = np.random.default_rng(seed)
    scores = rng.integers(-3, 4, size=(rows, n)).astype(np.float32)  # many ties
    keys = order_keys(mx.array(scores))
    saved = quest.TOP_ROUND
    quest.TOP_ROUND = round_pages
    try:
        got = np.array(quest.top_pages(keys, n_select))
    finally:
        quest.TOP_ROUND = saved
    k = min(n_select, n)
    for r in range(rows):
        order = sorted(range(n), key=lambda i: (-scores[r, i], i))
        np.testing.assert_array_equal(got[r], np.sort(order[:k]))


def test_top_pages_at_a_131k_page_count():
    """4,096 pages (131K tokens of 32-token pages), 64 chosen: the rounds' answer is one
    argpartition's over the whole row."""
    from qwen38_backend.kv.quest import top_pages

    scores = mx.random.normal((2, 4096), key=mx.random.key(9))
    keys = order_keys(scores)
    one = mx.sort(mx.argpartition(~keys, kth=63, axis=-1)[..., :64].astype(mx.int32), axis=-1)
    assert mx.array_equal(top_pages(keys, 64), one).item()
