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

import os
import time
from collections.abc import Callable

import mlx.core as mx

from ..errors import AdmissionError, InvalidOptionError
from .blocked import BLOCK_TOKENS, attend_past, spans
from .pool import PagePool, PoolFullError
from .quest import forced_pages, page_min_max, quest_scores, select_pages
from .table import PageTable

# Set QWEN38_KV_PROFILE=1 (or PagedKV.profile = True) to time selection: it evaluates the
# selection separately each step, which serialises decode, so it is off by default.
PROFILE_ENV = "QWEN38_KV_PROFILE"

__all__ = ["PROFILE_ENV", "PagedKV", "PagePool"]


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
        pool_pages: int | Callable[[int], int | None] | None = None,
    ):
        if mode not in ("on", "auto"):
            raise InvalidOptionError(f"PagedKV mode {mode!r}: must be 'on' or 'auto'")
        self.page_tokens = page_tokens
        self.pool = pool or PagePool(page_tokens, pool_pages)
        if self.pool.page_tokens != page_tokens:
            raise InvalidOptionError("the pool's page_tokens differ from the store's")
        self.table = PageTable(self.pool)
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
        self.table.clear()
        self.length = 0
        self.kmin: mx.array | None = None  # [Hkv, meta_capacity, D] fp32, by logical page
        self.kmax: mx.array | None = None
        self.open_min: mx.array | None = None  # [Hkv, D] fp32 running min of the open page
        self.open_max: mx.array | None = None

    @property
    def identity(self) -> bool:
        """table[i] == i for every page: contiguous slices of the pool instead of gathers."""
        return self.table.identity

    # ----- writing --------------------------------------------------------------------------
    def _rows(self, start: int, end: int) -> mx.array:
        """Pool row index of each token position in [start, end) through the page table."""
        return self.table.rows(start, end)

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

    def _pool_full(self, err: PoolFullError) -> Exception:
        P = self.page_tokens
        return AdmissionError(
            f"KV page pool full: {self.pool.capacity} pages of {P} tokens "
            f"({self.pool.capacity * P:,} tokens) hold this layer, and a {self.length:,}-token "
            f"sequence needs more with nothing evictable ({err}); raise kv_pool_tokens or "
            "shorten the context"
        )

    def append(self, kr: mx.array, vr: mx.array, meta: bool = True) -> None:
        """Write rows kr/vr [Hkv, T, D] at the end; seal the pages they fill.

        Metadata comes from the rows being written (plus the open page's running min/max),
        never from re-reading the pool. A write needing more pages than the pool can give at
        once goes in pieces: each piece's sealed pages can be evicted for the next.
        """
        P = self.page_tokens
        T = kr.shape[1]
        self.pool.bind(kr, vr)
        done = 0
        while done < T:
            start = self.length
            room = self.pool.room()
            n = T - done
            need = -(-(start + n) // P) - len(self.table)
            if need > room:
                # As many whole pages as fit (the open page's rest counts first).
                n = max(room * P + (len(self.table) * P - start), 1)
            self._write(kr[:, done : done + n], vr[:, done : done + n], meta)
            done += n

    def _write(self, kr: mx.array, vr: mx.array, meta: bool) -> None:
        P = self.page_tokens
        start, end = self.length, self.length + kr.shape[1]
        need = -(-end // P) - len(self.table)
        if need > 0:
            try:
                self.table.extend(need, kr, vr)
            except PoolFullError as e:
                raise self._pool_full(e) from None
        if self.table.identity:
            self.pool.k[:, start:end] = kr
            self.pool.v[:, start:end] = vr
        else:
            rows = self._rows(start, end)
            self.pool.k[:, rows] = kr
            self.pool.v[:, rows] = vr
        self.length = end
        if meta:
            self._update_meta(kr, start)
        self.table.seal_through(end // P)

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

    # ----- reading --------------------------------------------------------------------------
    def _dense_kv(self) -> tuple[mx.array, mx.array]:
        """Every stored row as [1, Hkv, L, D] (a strided view of the pool when identity)."""
        keys, values = self._span(0, self.length)
        return keys[None], values[None]

    def _span(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Rows [start, end) as [Hkv, n, D], whose pages are all resident."""
        if self.table.identity:
            return self.pool.k[:, start:end], self.pool.v[:, start:end]
        rows = self._rows(start, end)
        return self.pool.k[:, rows], self.pool.v[:, rows]

    def _past_blocks(self, past: int, block: int):
        """K/V of rows [0, past) in page-aligned blocks [1, Hkv, B, D]."""
        for a, b in spans(past, block):
            kb, vb = self._span(a, b)
            yield kb[None], vb[None]

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
            keys, values = self._dense_kv()
            return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)
        past = self.length - T
        block = max(self.block_tokens // self.page_tokens, 1) * self.page_tokens
        return attend_past(
            q, past, lambda: self._past_blocks(past, block), k, v, scale, self._dense_kv, block
        )

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
        slots = pages if self.table.identity else self.table.array()[pages]
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
        resident = len(self.table) - self.table.n_spilled
        return resident * self.pool.page_bytes() + meta

    def kv_stats(self) -> dict:
        return {
            "pages_resident": len(self.table) - self.table.n_spilled,
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
            "page_table": mx.array(self.table.slots, dtype=mx.int32),
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
        self.table.truncate(keep, length // P)
        self.length = length
        self.open_min = self.open_max = None
        if length % P:
            # Rewind is rare and the page is partial: its running min/max is rebuilt from its
            # live rows (the only time the pool is re-read).
            part = self._span((keep - 1) * P, length)[0].astype(mx.float32)
            self.open_min, self.open_max = part.min(axis=1), part.max(axis=1)
