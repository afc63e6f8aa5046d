"""Paged KV store with Quest sparse decode.

Layout: one `PagePool` per attention layer holds K and V in the model's KV dtype, stored
head-major as [kv_heads, slots * page_tokens, head_dim] (`pages_view()` shows the DESIGN
layout [slots, page_tokens, kv_heads, head_dim] as a view). Why head-major: MLX matmul (the CPU
SDPA path) copies any operand whose row stride is not its row length, so the token-major layout
cost a full copy of K and V on every dense decode step (measured); head-major gives each head
contiguous rows, dense views without copies, and the same bits as ContiguousKV.
A sequence's `PagedKV` keeps a page table (logical page -> slot), the Quest metadata of its
sealed pages and the running min/max of its open page.

- Prefill (T > 1) writes into the pages and attends densely over the stored run: with the
  identity table (the normal case) that is a strided view of the pool, so the dense kernels run
  unchanged and the math is the same as ContiguousKV.
- Decode (T == 1) either attends densely (the selection would cover every page, or `auto` is
  below its threshold) or scores sealed pages with the Quest bound, selects per KV head
  (sinks + recent window + top-k), gathers the selected rows per head into
  [Hkv, n_sel * page_tokens, D] and runs mx.fast.scaled_dot_product_attention.
"""

from __future__ import annotations

import heapq
import os
import time

import mlx.core as mx

from ..errors import InvalidOptionError
from .blocked import BLOCK_TOKENS, attend_past, spans
from .quest import forced_pages, page_min_max, quest_scores, select_pages

# Set QWEN38_KV_PROFILE=1 (or PagedKV.profile = True) to time selection: it evaluates the
# selection separately each step, which serialises decode, so it is off by default.
PROFILE_ENV = "QWEN38_KV_PROFILE"


class PagePool:
    """Slots of `page_tokens` rows for one attention layer; grows by whole blocks of pages."""

    min_grow_pages = 64

    def __init__(self, page_tokens: int):
        self.page_tokens = page_tokens
        self.k: mx.array | None = None  # [Hkv, capacity * page_tokens, D]
        self.v: mx.array | None = None
        self.capacity = 0
        self._free: list[int] = []  # min-heap: lowest slot first keeps tables identity-mapped

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def page_bytes(self) -> int:
        if self.k is None:
            return 0
        return self.page_tokens * (self.k[:, 0].nbytes + self.v[:, 0].nbytes)

    def nbytes(self) -> int:
        return self.capacity * self.page_bytes()

    def pages_view(self, which: str = "k") -> mx.array:
        """The pool as [slots, page_tokens, kv_heads, head_dim] (a reshape, no copy)."""
        arr = self.k if which == "k" else self.v
        hkv, _, d = arr.shape
        return arr.reshape(hkv, self.capacity, self.page_tokens, d).transpose(1, 2, 0, 3)

    def reserve(self, n_pages: int, like_k: mx.array, like_v: mx.array) -> None:
        """Make room for n_pages more allocations (rows shaped like like_k/like_v [Hkv,T,D])."""
        short = n_pages - len(self._free)
        if short <= 0:
            return
        # Geometric growth (x1.5, at least a block): the copy happens once per block, never
        # per token, and the pool stays within 1.5x of what is resident.
        grow = max(short, self.min_grow_pages, self.capacity // 2)
        rows = grow * self.page_tokens
        new_k = mx.zeros((like_k.shape[0], rows, like_k.shape[2]), like_k.dtype)
        new_v = mx.zeros((like_v.shape[0], rows, like_v.shape[2]), like_v.dtype)
        if self.k is None:
            self.k, self.v = new_k, new_v
        else:
            self.k = mx.concatenate([self.k, new_k], axis=1)
            self.v = mx.concatenate([self.v, new_v], axis=1)
        for slot in range(self.capacity, self.capacity + grow):
            heapq.heappush(self._free, slot)
        self.capacity += grow

    def alloc(self, n_pages: int) -> list[int]:
        if n_pages > len(self._free):
            raise RuntimeError("PagePool.alloc without reserve")  # internal invariant
        return [heapq.heappop(self._free) for _ in range(n_pages)]

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            heapq.heappush(self._free, slot)


class PagedKV:
    """K/V of one attention layer of one sequence, in pages, with Quest selection at decode."""

    can_truncate = True
    profile = False
    block_tokens = BLOCK_TOKENS  # prefill walks a longer past in blocks (kv/blocked.py)

    def __init__(
        self,
        page_tokens: int = 32,
        topk: int = 2048,
        sinks: int = 32,
        recent: int = 64,
        mode: str = "on",
        pool: PagePool | None = None,
        always_select: bool = False,
    ):
        if mode not in ("on", "auto"):
            raise InvalidOptionError(f"PagedKV mode {mode!r}: must be 'on' or 'auto'")
        self.page_tokens = page_tokens
        self.pool = pool or PagePool(page_tokens)
        if self.pool.page_tokens != page_tokens:
            raise InvalidOptionError("the pool's page_tokens differ from the store's")
        P = page_tokens
        self.budget_pages = -(-topk // P)  # token budget rounded up to whole pages
        self.sink_pages = -(-sinks // P)
        self.recent_pages = -(-recent // P)  # sealed pages before the last (open) one
        self.mode = mode
        # `auto` decodes densely until selecting would skip most of the context.
        self.sparse_from = 4 * self.budget_pages * P if mode == "auto" else 0
        self.always_select = always_select  # tests: run the gather path even if it covers all
        self.profile = self.profile or os.environ.get(PROFILE_ENV) == "1"
        self._reset()
        self.stats = dict.fromkeys(
            (
                "decode_steps",
                "sparse_steps",
                "pages_selected",
                "kv_read_bytes",
                "meta_read_bytes",
                "select_seconds",
                "attend_seconds",
            ),
            0,
        )

    def _reset(self) -> None:
        if getattr(self, "table", None):
            self.pool.release(self.table)
        self.table: list[int] = []
        self.identity = True  # table[i] == i for all i: contiguous slices instead of gathers
        self.length = 0
        self.kmin: mx.array | None = None  # [Hkv, meta_capacity, D] fp32, by logical page
        self.kmax: mx.array | None = None
        self.open_min: mx.array | None = None  # [Hkv, D] fp32 running min of the open page
        self.open_max: mx.array | None = None

    # ----- writing --------------------------------------------------------------------------
    def _rows(self, start: int, end: int) -> mx.array:
        """Pool row index of each token position in [start, end) through the page table."""
        P = self.page_tokens
        pos = mx.arange(start, end)
        table = mx.array(self.table, dtype=mx.int32)
        return table[pos // P] * P + pos % P

    def _grow_meta(self, n_pages: int, hkv: int, d: int) -> None:
        cap = 0 if self.kmin is None else self.kmin.shape[1]
        if n_pages <= cap:
            return
        grow = max(n_pages - cap, 64, cap // 2)
        # Two distinct arrays: slice writes update an mx.array object in place.
        pad_min, pad_max = mx.zeros((hkv, grow, d)), mx.zeros((hkv, grow, d))
        if self.kmin is None:
            self.kmin, self.kmax = pad_min, pad_max
        else:
            self.kmin = mx.concatenate([self.kmin, pad_min], axis=1)
            self.kmax = mx.concatenate([self.kmax, pad_max], axis=1)

    def _seal(self, first: int, mins: mx.array, maxs: mx.array) -> None:
        """Record Quest metadata [Hkv, n, D] of pages first..first+n-1."""
        n = mins.shape[1]
        self.kmin[:, first : first + n] = mins
        self.kmax[:, first : first + n] = maxs

    def append(self, kr: mx.array, vr: mx.array, meta: bool = True) -> None:
        """Write rows kr/vr [Hkv, T, D] at the end; seal the pages they fill.

        Metadata comes from the rows being written (plus the open page's running min/max),
        never from re-reading the pool.
        """
        P = self.page_tokens
        start, end = self.length, self.length + kr.shape[1]
        need = -(-end // P) - len(self.table)
        if need > 0:
            self.pool.reserve(need, kr, vr)
            slots = self.pool.alloc(need)
            base = len(self.table)
            self.identity = self.identity and slots == list(range(base, base + need))
            self.table.extend(slots)
        if self.identity:
            self.pool.k[:, start:end] = kr
            self.pool.v[:, start:end] = vr
        else:
            rows = self._rows(start, end)
            self.pool.k[:, rows] = kr
            self.pool.v[:, rows] = vr
        self.length = end
        if meta:
            self._update_meta(kr, start)

    def _update_meta(self, kr: mx.array, start: int) -> None:
        P = self.page_tokens
        hkv, T, d = kr.shape
        self._grow_meta(-(-(start + T) // P), hkv, d)
        kf = kr.astype(mx.float32)
        t = 0
        if start % P:  # finish the open page
            t = min(P - start % P, T)
            part = kf[:, :t]
            self.open_min = mx.minimum(self.open_min, part.min(axis=1))
            self.open_max = mx.maximum(self.open_max, part.max(axis=1))
            if (start + t) % P == 0:
                self._seal(start // P, self.open_min[:, None], self.open_max[:, None])
                self.open_min = self.open_max = None
        n_full = (T - t) // P
        if n_full:
            mins, maxs = page_min_max(kf[:, t : t + n_full * P].reshape(hkv, n_full, P, d))
            self._seal((start + t) // P, mins, maxs)
            t += n_full * P
        if t < T:  # a new open page
            part = kf[:, t:]
            self.open_min, self.open_max = part.min(axis=1), part.max(axis=1)

    # ----- attention ------------------------------------------------------------------------
    def _dense_kv(self) -> tuple[mx.array, mx.array]:
        """Every stored row as [1, Hkv, L, D] (a strided view of the pool when identity)."""
        if self.identity:
            keys, values = self.pool.k[:, : self.length], self.pool.v[:, : self.length]
        else:
            rows = self._rows(0, self.length)
            keys, values = self.pool.k[:, rows], self.pool.v[:, rows]
        return keys[None], values[None]

    def selection_size(self) -> tuple[int, int]:
        """(pages in the context, pages a decode step would select)."""
        n_pages = len(self.table)
        if self.length < self.sparse_from:
            return n_pages, n_pages
        _, n_forced = forced_pages(n_pages, self.sink_pages, self.recent_pages)
        return n_pages, min(n_pages, max(self.budget_pages, n_forced))

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """Append k/v [1, Hkv, T, D], then causal attention of q [1, Hq, T, D] over the pages."""
        self.append(k[0], v[0])
        T = q.shape[2]
        if T == 1:
            self.stats["decode_steps"] += 1
            n_pages, n_sel = self.selection_size()
            if n_sel < n_pages or self.always_select:
                return self._attend_selected(q, scale, n_pages, n_sel)
            self.stats["pages_selected"] += n_pages * k.shape[1]
            self.stats["kv_read_bytes"] += self.length * (k[0, :, 0].nbytes + v[0, :, 0].nbytes)
        if T == 1:
            keys, values = self._dense_kv()
            return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)
        past = self.length - T
        block = max(self.block_tokens // self.page_tokens, 1) * self.page_tokens
        return attend_past(
            q, past, lambda: self._past_blocks(past, block), k, v, scale, self._dense_kv, block
        )

    def _past_blocks(self, past: int, block: int):
        """K/V of rows [0, past) in page-aligned blocks [1, Hkv, B, D]."""
        for a, b in spans(past, block):
            if self.identity:
                kb, vb = self.pool.k[:, a:b], self.pool.v[:, a:b]
            else:
                rows = self._rows(a, b)
                kb, vb = self.pool.k[:, rows], self.pool.v[:, rows]
            yield kb[None], vb[None]

    def select(self, q: mx.array, n_sel: int) -> mx.array:
        """Selected logical pages per KV head, int32 [Hkv, n_sel] ascending. q: [Hq, D]."""
        n_pages = len(self.table)
        forced, _ = forced_pages(n_pages, self.sink_pages, self.recent_pages)
        # The last page is always forced, so its (possibly unsealed) metadata is never used.
        scores = quest_scores(q, self.kmin[:, :n_pages], self.kmax[:, :n_pages])
        return select_pages(scores, forced, n_sel)

    def _attend_selected(self, q: mx.array, scale: float, n_pages: int, n_sel: int) -> mx.array:
        P = self.page_tokens
        hkv, d = self.pool.k.shape[0], self.pool.k.shape[2]
        if self.profile:
            mx.eval(q, self.pool.k, self.pool.v, self.kmin, self.kmax)
            t0 = time.perf_counter()
        pages = self.select(q[0, :, 0, :], n_sel)
        if self.profile:
            mx.eval(pages)
            t1 = time.perf_counter()
        slots = pages if self.identity else mx.array(self.table, dtype=mx.int32)[pages]
        # The last (open) page is selected and sorts last: drop its unwritten tail.
        n_rows = n_sel * P - (n_pages * P - self.length)
        rows = (slots[:, :, None] * P + mx.arange(P, dtype=mx.int32)).reshape(hkv, -1)[:, :n_rows]
        heads = mx.arange(hkv)[:, None]
        keys = self.pool.k[heads, rows][None]  # [1, Hkv, n_rows, D]: per-head pages
        values = self.pool.v[heads, rows][None]
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)
        if self.profile:
            mx.eval(out)
            self.stats["select_seconds"] += t1 - t0
            self.stats["attend_seconds"] += time.perf_counter() - t1
        item = self.pool.k.dtype.size
        self.stats["sparse_steps"] += 1
        self.stats["pages_selected"] += n_sel * hkv
        self.stats["kv_read_bytes"] += 2 * n_rows * hkv * d * item
        self.stats["meta_read_bytes"] += 2 * n_pages * hkv * d * 4
        return out

    # ----- LayerState -----------------------------------------------------------------------
    def nbytes(self) -> int:
        meta = 0 if self.kmin is None else 2 * len(self.table) * self.kmin[:, 0].nbytes
        return len(self.table) * self.pool.page_bytes() + meta

    def kv_stats(self) -> dict:
        return {
            "pages_resident": len(self.table),
            "pool_pages": self.pool.capacity,
            "pool_bytes": self.pool.nbytes(),
            **self.stats,
        }

    def snapshot(self) -> dict[str, mx.array]:
        """Live rows in logical order, the page table and the Quest metadata (plain arrays)."""
        if self.length == 0:
            return {}
        keys, values = self._dense_kv()
        n_sealed = self.length // self.page_tokens
        snap = {
            # Slices and gathers are copies in MLX semantics: later writes do not reach them.
            "keys": mx.array(keys[0]),  # [Hkv, length, D]
            "values": mx.array(values[0]),
            "page_table": mx.array(self.table, dtype=mx.int32),
            "page_tokens": mx.array(self.page_tokens, dtype=mx.int32),
            "quest_min": mx.array(self.kmin[:, :n_sealed]),
            "quest_max": mx.array(self.kmax[:, :n_sealed]),
        }
        if self.open_min is not None:
            snap["open_min"], snap["open_max"] = self.open_min, self.open_max
        return snap

    def restore(self, tensors: dict[str, mx.array]) -> None:
        self._reset()
        if not tensors:
            return
        keys, values = tensors["keys"], tensors["values"]
        same_pages = int(tensors["page_tokens"].item()) == self.page_tokens
        # With another page size the metadata is recomputed from the rows being written.
        self.append(keys, values, meta=not same_pages)
        if same_pages:
            n_sealed = tensors["quest_min"].shape[1]
            hkv, d = keys.shape[0], keys.shape[2]
            self._grow_meta(len(self.table), hkv, d)
            if n_sealed:
                self.kmin[:, :n_sealed] = tensors["quest_min"]
                self.kmax[:, :n_sealed] = tensors["quest_max"]
            self.open_min = tensors.get("open_min")
            self.open_max = tensors.get("open_max")

    def truncate(self, length: int) -> None:
        """Drop rows past `length`: free whole pages, un-seal a page cut in the middle."""
        if length >= self.length:
            return
        P = self.page_tokens
        keep = -(-length // P)
        self.pool.release(self.table[keep:])
        del self.table[keep:]
        self.length = length
        self.identity = self.table == list(range(len(self.table)))
        self.open_min = self.open_max = None
        if length % P:
            # Rewind is rare and the page is partial: its running min/max is rebuilt from its
            # live rows (the only time the pool is re-read).
            first = (keep - 1) * P
            if self.identity:
                part = self.pool.k[:, first:length]
            else:
                part = self.pool.k[:, self._rows(first, length)]
            part = part.astype(mx.float32)
            self.open_min, self.open_max = part.min(axis=1), part.max(axis=1)
