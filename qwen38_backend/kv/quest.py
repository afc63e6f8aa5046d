"""Quest page metadata and selection (Tang et al., 2024), in plain MLX ops on device.

Each sealed page keeps, per KV head, the elementwise min and max of its keys (in bf16 rounded
outward by default, META_DTYPE: the bound below still holds). For a query q
the Quest bound of a page is sum_d max(q_d * min_d, q_d * max_d), an upper bound of q . k for
every key k in the page. Since max(q*lo, q*hi) = relu(q) * hi + min(q, 0) * lo, the bound is two
matmuls, and summing it over the query heads of a KV group is the same two matmuls applied to
the group's summed relu(q) and min(q, 0).

Variants studied by benchmarks/quest_recall.py, all reading the same two [D] vectors per page
and KV head (`page_summary`, `page_scores`):
- summary "minmax" (the bound above) or "meanstd": the page's per-dimension mean and standard
  deviation, scored q . mean + width * |q| . std (an estimate, not a bound);
- group "sum" (the bound summed over the group's query heads), "max" (the largest per-head
  bound: still an upper bound of every head's q . k) or "softmax" (each head's scores as a
  softmax over pages, summed: every head's share of attention counts the same);
- per-KV-head selection, or one selection shared by every KV head (`shared_scores`: the
  scores summed over KV heads, so the sum stays an upper bound of the summed q . k).
On the demo model (benchmarks/results/cpu/quest_recall_demo.json) smaller pages and a shared
selection recall the most attention mass at the same token budget (8-token pages more than
16, at 4x the metadata of 32); meanstd, max, softmax and a lag-one query do not help.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import lru_cache, partial

import mlx.core as mx

from ..kernel_import import kernel_module

_SIGN = 0x80000000
_LOW32 = 0xFFFFFFFF
# Page min/max are kept in bf16 rounded outward (outward_bf16): half the bytes of fp32, still
# a bound, and the same selection quality on the demo (benchmarks/quest_quality.py: top-1
# agreement within one token of 128 of fp32's at every ratio from 4x to 32x, mean |d log p|
# within 0.002).
META_DTYPE = mx.bfloat16


def page_min_max(rows: mx.array) -> tuple[mx.array, mx.array]:
    """rows [Hkv, n_pages, page_tokens, D] -> per head and page min, max [Hkv, n_pages, D] fp32."""
    rows = rows.astype(mx.float32)
    return rows.min(axis=2), rows.max(axis=2)


def _round_bf16(x: mx.array, down: bool) -> mx.array:
    """fp32 -> bf16 rounded toward -inf (down) or +inf (up), exactly: drop the 16 low bits
    (toward zero), then step one bf16 ulp away from zero where that went the wrong way."""
    bits = mx.view(x.astype(mx.float32), mx.uint32)
    toward_zero = bits & 0xFFFF0000
    inexact = (bits & 0xFFFF) != 0
    negative = (bits & _SIGN) != 0
    away = inexact & (negative == down)  # down on a negative, or up on a positive
    rounded = mx.where(away, toward_zero + 0x10000, toward_zero)
    return mx.view(rounded, mx.float32).astype(mx.bfloat16)  # exact: low bits are zero


def outward_bf16(mins: mx.array, maxs: mx.array) -> tuple[mx.array, mx.array]:
    """Page min/max in bf16 rounded outward (min down, max up): half the metadata bytes, and
    the Quest bound computed from them still bounds every key of the page."""
    return _round_bf16(mins, down=True), _round_bf16(maxs, down=False)


def quest_scores(q: mx.array, kmin: mx.array, kmax: mx.array) -> mx.array:
    """Quest bound per KV head and page, summed over each KV group's query heads.

    q: [Hq, D] (one decode position); kmin, kmax: [Hkv, n_pages, D]. Returns [Hkv, n_pages]
    in fp32.
    """
    hkv, _, d = kmin.shape
    qg = q.astype(mx.float32).reshape(hkv, -1, d)
    qpos = mx.maximum(qg, 0.0).sum(axis=1, keepdims=True)  # [Hkv, 1, D]
    qneg = mx.minimum(qg, 0.0).sum(axis=1, keepdims=True)
    hi = qpos @ kmax.astype(mx.float32).swapaxes(1, 2)
    lo = qneg @ kmin.astype(mx.float32).swapaxes(1, 2)
    return (hi + lo)[:, 0, :]


SUMMARIES = ("minmax", "meanstd")
GROUP_REDUCES = ("sum", "max", "softmax")


def check_variant(summary: str, group: str) -> None:
    if summary not in SUMMARIES:
        raise ValueError(f"page summary {summary!r}: must be one of {', '.join(SUMMARIES)}")
    if group not in GROUP_REDUCES:
        raise ValueError(f"group reduce {group!r}: must be one of {', '.join(GROUP_REDUCES)}")


def page_summary(rows: mx.array, summary: str = "minmax") -> tuple[mx.array, mx.array]:
    """rows [Hkv, n_pages, page_tokens, D] -> the two per-page vectors of `summary` (fp32)."""
    check_variant(summary, "sum")
    if summary == "minmax":
        return page_min_max(rows)
    rows = rows.astype(mx.float32)
    mean = rows.mean(axis=2)
    return mean, mx.sqrt(mx.maximum((rows * rows).mean(axis=2) - mean * mean, 0.0))


def head_scores(q: mx.array, a: mx.array, b: mx.array, summary: str, width: float) -> mx.array:
    """Per query head scores [Hkv, group, n_pages]: q [Hq, D]; a, b [Hkv, n_pages, D]."""
    hkv, _, d = a.shape
    qg = q.astype(mx.float32).reshape(hkv, -1, d)
    if summary == "minmax":
        return mx.maximum(qg, 0.0) @ b.swapaxes(1, 2) + mx.minimum(qg, 0.0) @ a.swapaxes(1, 2)
    return qg @ a.swapaxes(1, 2) + width * (mx.abs(qg) @ b.swapaxes(1, 2))


def page_scores(
    q: mx.array,
    a: mx.array,
    b: mx.array,
    summary: str = "minmax",
    group: str = "sum",
    scale: float = 1.0,
    width: float = 1.0,
) -> mx.array:
    """Score per KV head and page [Hkv, n_pages] for query q [Hq, D] (see the module doc).

    a, b: `page_summary` of the pages. `scale` (the attention scale) only matters to
    "softmax"; `width` only to "meanstd".
    """
    check_variant(summary, group)
    if summary == "minmax" and group == "sum":
        return quest_scores(q, a, b)
    per_head = head_scores(q, a.astype(mx.float32), b.astype(mx.float32), summary, width)
    if group == "sum":
        return per_head.sum(axis=1)
    if group == "max":
        return per_head.max(axis=1)
    return mx.softmax(per_head * scale, axis=-1).sum(axis=1)


def shared_scores(scores: mx.array) -> mx.array:
    """[Hkv, n_pages] -> every KV head gets the scores summed over KV heads (so all select
    the same pages: one page set per step, the fewest pages to keep resident or fetch)."""
    return mx.broadcast_to(scores.sum(axis=0, keepdims=True), scores.shape)


def order_keys(scores: mx.array) -> mx.array:
    """A uint64 per page whose order is (higher score, then lower page id): ties are exact.

    Floats map to uint32 in an order-preserving way (flip all bits of negatives, set the sign
    bit of positives); the low 32 bits hold the complement of the page id.
    """
    # + 0.0 turns -0.0 into +0.0, so equal scores get equal high bits.
    bits = mx.view(scores.astype(mx.float32) + 0.0, mx.uint32)
    neg = (bits & _SIGN) != 0
    ordered = mx.where(neg, ~bits, bits | _SIGN).astype(mx.uint64)
    ids = mx.arange(scores.shape[-1], dtype=mx.uint64)
    return (ordered << 32) | (_LOW32 - ids)


def key_scores(keys: mx.array) -> mx.array:
    """The fp32 scores back from `order_keys` (the inverse of its high 32 bits)."""
    ordered = (keys >> 32).astype(mx.uint32)
    positive = (ordered & _SIGN) != 0
    bits = mx.where(positive, ordered & ~mx.array(_SIGN, mx.uint32), ~ordered)
    return mx.view(bits.astype(mx.uint32), mx.float32)


# Pages a first round of top_pages partitions at once: MLX's CUDA sort takes rows up to this
# long in one block (block_sort_kernel, 128 threads x 8); longer rows took a multi-block
# merge sort, 0.69 of a 131K Quest step's 1.27 ms of selection (ncu, session 29).
TOP_ROUND = 1024


def top_pages(keys: mx.array, n_select: int) -> mx.array:
    """The n_select pages with the highest order keys per row [rows, n], int32 ascending.

    Keys are unique, so the top set is exact, and it is the top set of each TOP_ROUND-page
    chunk's own top n_select: past one chunk, a first round keeps those per chunk, a second
    picks among them (each a one-block sort on a GPU)."""
    rows, n = keys.shape
    if n_select >= n:
        return mx.broadcast_to(mx.arange(n, dtype=mx.int32), keys.shape)
    if n <= TOP_ROUND or n_select >= TOP_ROUND:
        # ~key ascending == key descending
        top = mx.argpartition(~keys, kth=n_select - 1, axis=-1)[..., :n_select]
        return mx.sort(top.astype(mx.int32), axis=-1)
    chunks = -(-n // TOP_ROUND)
    # key 0 pads the last chunk: every real key is above it (its low half, ~id, is not 0)
    padded = mx.pad(keys, [(0, 0), (0, chunks * TOP_ROUND - n)])
    split = padded.reshape(rows, chunks, TOP_ROUND)
    first = mx.argpartition(~split, kth=n_select - 1, axis=-1)[..., :n_select]
    kept = mx.take_along_axis(split, first, axis=-1).reshape(rows, -1)
    pages = (first + mx.arange(chunks, dtype=first.dtype)[:, None] * TOP_ROUND).reshape(rows, -1)
    second = mx.argpartition(~kept, kth=n_select - 1, axis=-1)[..., :n_select]
    top = mx.take_along_axis(pages, second, axis=-1)
    return mx.sort(top.astype(mx.int32), axis=-1)


def select_pages(scores: mx.array, forced: mx.array | None, n_select: int) -> mx.array:
    """Per KV head, the n_select pages to attend: forced pages, then the best by score.

    scores: [Hkv, n_pages]; forced: bool [n_pages] (sinks and the recent window) or None.
    Returns int32 [Hkv, n_select], ascending page ids per head.
    """
    if forced is not None:
        scores = mx.where(forced, mx.array(float("inf"), mx.float32), scores)
    return top_pages(order_keys(scores), n_select)


def forced_pages(n_pages: int, sink_pages: int, recent_pages: int) -> tuple[mx.array, int]:
    """Mask of the pages always selected (first sinks, last page plus recent sealed ones)."""
    first_recent = max(n_pages - 1 - recent_pages, 0)
    sinks = min(sink_pages, n_pages)
    count = sinks + n_pages - max(first_recent, sinks)
    ids = mx.arange(n_pages)
    return (ids < sinks) | (ids >= first_recent), count


def op_page_keys(
    q: mx.array,
    kmin: mx.array,
    kmax: mx.array,
    n_pages: mx.array,
    sink_pages: int,
    recent_pages: int,
    shared: bool,
) -> mx.array:
    """uint64 order keys [rows, capacity] of every metadata slot (rows 1 when `shared`, else
    Hkv): the Quest bound of q [Hq, D], +inf for the forced pages (forced_pages) and -inf
    past n_pages (an int32 scalar array), so slots past the live pages sort last."""
    scores = quest_scores(q, kmin, kmax)
    if shared:  # one top-k row serves every KV head (shared_scores' rows are equal)
        scores = scores.sum(axis=0, keepdims=True)
    ids = mx.arange(scores.shape[-1])
    live = ids < n_pages
    first_recent = mx.maximum(n_pages - 1 - recent_pages, 0)
    forced = live & ((ids < sink_pages) | (ids >= first_recent))
    scores = mx.where(live, scores, mx.array(-float("inf"), mx.float32))
    scores = mx.where(forced, mx.array(float("inf"), mx.float32), scores)
    return order_keys(scores)


def kernel_usable(q: mx.array, kmin: mx.array, kmax: mx.array) -> bool:
    """Whether the page-key kernel runs for these operands. QWEN38_QUEST_KERNEL: auto (probe
    once per shape, `kernel_mismatch`), off, force (skip the probe)."""
    kernel = kernel_module("quest_select")
    if kernel is None:
        return False
    from ..kernels.switch import kernel_switch  # present with the kernel module

    choice = kernel_switch("QWEN38_QUEST_KERNEL")
    if choice == "off" or not kernel.supported(q, kmin, kmax):
        return False
    if choice == "force":
        return True
    return _kernel_agrees(q.shape[0], kmax.shape[0], kmax.shape[2], q.dtype, kmax.dtype)


def kernel_mismatch(
    hq: int, hkv: int, d: int, q_dtype: mx.Dtype, meta_dtype: mx.Dtype
) -> str | None:
    """Run the page-key kernel and op_page_keys on random metadata (shared and per head, a
    partial capacity, sinks and a recent window): None when the selections agree and the
    bounds agree to fp32 rounding, else what differs."""
    kernel = kernel_module("quest_select")
    keys = mx.random.split(mx.random.key(5), 3)
    capacity, live, n_select = 1500, 1234, 64
    q = mx.random.normal((hq, d), key=keys[0]).astype(q_dtype)
    lo = mx.random.normal((hkv, capacity, d), key=keys[1])
    hi = lo + mx.abs(mx.random.normal((hkv, capacity, d), key=keys[2]))
    kmin, kmax = (x.astype(meta_dtype) for x in outward_bf16(lo, hi))
    n_pages = mx.array(live, dtype=mx.int32)
    for shared in (True, False):
        got = kernel.page_keys(q, kmin, kmax, n_pages, 2, 3, shared)
        want = op_page_keys(q, kmin, kmax, n_pages, 2, 3, shared)
        g, w = key_scores(got), key_scores(want)
        finite = mx.isfinite(w)
        if not mx.array_equal(mx.isfinite(g), finite).item():
            return "forced / dead pages differ"
        err = mx.abs(mx.where(finite, g - w, 0.0)).max() / mx.abs(mx.where(finite, w, 0.0)).max()
        if err.item() > 1e-5:
            return f"bounds differ by {err.item():.2e} (relative)"
        if not mx.array_equal(top_pages(got, n_select), top_pages(want, n_select)).item():
            return "selections differ"
    return None


@lru_cache(maxsize=16)
def _kernel_agrees(hq: int, hkv: int, d: int, q_dtype: mx.Dtype, meta_dtype: mx.Dtype) -> bool:
    """Whether the page-key kernel's probe finds nothing wrong; else a warning, and the op
    path runs."""
    try:
        why = kernel_mismatch(hq, hkv, d, q_dtype, meta_dtype)
    except Exception as e:  # noqa: BLE001 - any failure means: use the op path
        why = f"unavailable ({e})"
    if why is not None:
        warnings.warn(f"Quest page-key kernel {why}; using the op path", stacklevel=2)
    return why is None


@lru_cache(maxsize=64)
def selector(n_select: int, sink_pages: int, recent_pages: int, shared: bool):
    """The whole Quest selection of one decode step:
    (q [Hq, D], kmin, kmax [Hkv, capacity, D], n_pages int32 scalar) -> int32 [Hkv, n_select]
    ascending, equal to select_pages over `quest_scores` of the first n_pages pages with
    `forced_pages`. The metadata is scored over its whole capacity with the pages past
    n_pages masked out, so a graph is traced again only when the capacity grows (x1.5),
    not every page. On CUDA the page keys come from one kernel (kernels/quest_select.py,
    where its probe passed) and their top-k from a radix select in one launch
    (kernels/top_select.py, where its probe passed; else compiled ops: an earlier one-launch
    top-k, a sort, lost to them on the H200, depth_topk_compare.json); elsewhere the whole
    selection is one compiled graph."""

    def select(q: mx.array, kmin: mx.array, kmax: mx.array, n_pages: mx.array) -> mx.array:
        keys = op_page_keys(q, kmin, kmax, n_pages, sink_pages, recent_pages, shared)
        return mx.broadcast_to(top_pages(keys, n_select), (kmin.shape[0], n_select))

    ops, top = mx.compile(select), mx.compile(partial(top_pages, n_select=n_select))

    def keys_of(q: mx.array, kmin: mx.array, kmax: mx.array, n_pages: mx.array, **threads):
        kernel = kernel_module("quest_select")
        pages = (sink_pages, recent_pages, shared)
        return kernel.page_keys(q, kmin, kmax, n_pages, *pages, **threads)

    def launches(q: mx.array, kmin: mx.array, kmax: mx.array, n_pages: mx.array, **threads):
        top_select = kernel_module("top_select")
        return [top_select.top_ids(keys_of(q, kmin, kmax, n_pages, **threads), n_select)]

    def together(*operands) -> list:
        """Both launches as one (kernels/fused.py: one thread count, the top-k's)."""
        threads = kernel_module("top_select").THREADS  # page keys: a warp a page, any block
        return launches(*operands, threads=threads)

    # traced once per shape: a selection runs outside the layers' compiled graphs, and
    # composing the fused launch is host work
    fused = mx.compile(lambda *operands: kernel_module("fused").run(lambda _: together(*operands)))

    choice = (n_select, sink_pages, recent_pages, shared)
    fuses: dict[tuple, bool] = {}  # by operand shapes and dtypes: this runs every token

    def run(q: mx.array, kmin: mx.array, kmax: mx.array, n_pages: mx.array) -> mx.array:
        if not kernel_usable(q, kmin, kmax):
            return ops(q, kmin, kmax, n_pages)
        shapes = (q.shape, q.dtype, kmin.shape, kmin.dtype)
        if shapes not in fuses:
            usable = top_kernel_usable(kmin.shape[1], n_select)
            operands = (q, kmin, kmax, n_pages)
            fuses[shapes] = usable and _fuses(operands, together, choice)
        if not top_kernel_usable(kmin.shape[1], n_select):
            chosen = top(keys_of(q, kmin, kmax, n_pages))
        elif fuses[shapes]:
            (chosen,) = fused(q, kmin, kmax, n_pages)
        else:
            chosen = launches(q, kmin, kmax, n_pages)[0]
        return mx.broadcast_to(chosen, (kmin.shape[0], n_select))

    return run


def _fuses(operands: tuple, launches: Callable, choice: tuple) -> bool:
    """Whether the page keys and their top-k (`launches` of `operands`) run as one launch
    with the bits of the two (kernels/fused.py's probe, on these operands, once per shape
    and `choice`: the metadata's capacity is in the fused kernel's text)."""
    fused = kernel_module("fused")
    if fused is None:
        return False
    q, kmin = operands[:2]
    key = ("quest selection", choice, q.shape, kmin.shape, str(q.dtype), str(kmin.dtype))
    return fused.agrees(str(key), lambda _: launches(*operands))


def top_kernel_usable(capacity: int, n_select: int) -> bool:
    """Whether the top-k of `capacity` page keys runs as one launch (kernels/top_select.py,
    where its probe passed; QWEN38_QUEST_TOP_KERNEL)."""
    kernel = kernel_module("top_select")
    return kernel is not None and capacity > n_select and kernel.top_available(n_select)
