"""Paged KV store with Quest sparse decode: the attention math over a page table.

Layout: one `PagePool` per attention layer (kv/pool.py) holds K and V in the model's KV
dtype, stored head-major as [kv_heads, slots * page_tokens, head_dim] (`pages_view()` shows
the DESIGN layout [slots, page_tokens, kv_heads, head_dim] as a view). Why head-major: MLX
matmul (the CPU SDPA path) copies any operand whose row stride is not its row length, so the
token-major layout cost a full copy of K and V on every dense decode step (measured);
head-major gives each head contiguous rows, dense views without copies, and the same bits
as ContiguousKV. A sequence's `PagedKV` keeps its `PageTable` (kv/table.py: logical page ->
slot or spilled, residency, eviction) and the Quest metadata of its sealed pages (always
resident; the open page has none: a selection always takes it whole, and its rows, kept
while it is open, give its bounds when it seals).

- Prefill (T > 1) writes into the pages and attends over the stored run: one fused SDPA while
  the past is short (with the identity table that is a strided view of the pool, the same
  math as ContiguousKV), else the blocked walk of kv/blocked.py, which streams spilled
  blocks from the spill file.
- Decode (T == 1) either attends densely (the selection would cover every page, or `auto` is
  below its threshold; with spilled pages through the blocked walk) or scores sealed pages
  with the Quest bound, selects (sinks + recent window + top-k; one page set shared by the
  KV heads unless shared=False, then each head's own), makes the
  selection resident (pinned while misses are fetched), gathers the selected rows per head
  into [Hkv, n_sel * page_tokens, D] and attends through kv/one_token.py (the split-KV CUDA
  kernel, else mx.fast.scaled_dot_product_attention).
- QSA layers (models/qsa.py) select with their own indexer: they set `quest = False` (no
  Quest metadata, decode dense through `attend` while the model says so), write with
  `store` and read their selection with `gather(positions)`, which makes the pages
  resident (pinned while spilled misses are fetched) and reads rows through the table.
- A bounded pool (`pool_pages`) with a spill tier (`spill`, kv/spill.py) writes sealed pages
  behind and evicts the least recently used; without one a full pool is an AdmissionError.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import mlx.core as mx
import numpy as np

from .. import scalars
from ..errors import AdmissionError, InvalidOptionError, SpillError
from ..rows import STEP_MAX_ROWS
from ..state import checks_later
from .blocked import BLOCK_TOKENS, attend_past, blocked_attention, spans
from .one_token import attend_pages, attend_rows
from .pool import PagePool, PoolFullError
from .quest import META_DTYPE, forced_pages, outward_bf16, page_min_max, selector
from .spill import SpillFile
from .table import SPILLED, PageTable, from_host

# Set while a prompt is prefilled (Model.prefill): its rows attend densely however few they
# are. Quest selects for decode steps only, so a prompt's last token has the logits of a
# dense prefill whether it came in a chunk of its own (a cached prefix re-fed one token, a
# chunk boundary one token before the end) or not.
_PREFILLING: ContextVar[bool] = ContextVar("qwen38_prefilling", default=False)


@contextmanager
def prefilling() -> Iterator[None]:
    """Forwards inside are a prompt's prefill (dense attention in every paged store)."""
    token = _PREFILLING.set(True)
    try:
        yield
    finally:
        _PREFILLING.reset(token)


# Set QWEN38_KV_PROFILE=1 (or PagedKV.profile = True) to time selection: it evaluates the
# selection separately each step, which serialises decode, so it is off by default.
PROFILE_ENV = "QWEN38_KV_PROFILE"

__all__ = ["PROFILE_ENV", "PagedKV", "PagePool"]


class PagedKV:
    """K/V of one attention layer of one sequence, in pages, with Quest selection at decode."""

    can_truncate = True
    profile = False
    # Whether a spilled step attends on a guess before reading its selection
    # (_attend_checked). None: on a GPU, where the device would idle while the host reads;
    # not on the CPU, whose cores run both and where a wrong guess's rerun is only extra work
    # (CPU, tiny dims, 64 layers, 8K: 53.6 vs 48.3 ms per step waiting first, median of 5).
    # True / False force it (tests, benchmarks comparing the two in one run).
    attend_on_guess: bool | None = None
    quest = True  # Quest metadata and selection; False where the model selects (QSA)
    block_tokens = BLOCK_TOKENS  # prefill walks a longer past in blocks (kv/blocked.py)

    def __init__(
        self,
        page_tokens: int = 32,
        budget: int = 2048,
        sinks: int = 32,
        recent: int = 64,
        mode: str = "on",
        pool: PagePool | None = None,
        always_select: bool = False,
        pool_pages: int | Callable[[int], int | None] | None = None,
        spill: SpillFile | None = None,
        shared: bool = True,
        meta_dtype: mx.Dtype = META_DTYPE,
    ):
        if mode not in ("on", "auto"):
            raise InvalidOptionError(f"PagedKV mode {mode!r}: must be 'on' or 'auto'")
        self.page_tokens = page_tokens
        self.pool = pool or PagePool(page_tokens, pool_pages)
        if self.pool.page_tokens != page_tokens:
            raise InvalidOptionError("the pool's page_tokens differ from the store's")
        # With a spill tier, sealed pages can leave a bounded pool for the sequence's file.
        self.table = PageTable(self.pool, spill.region() if spill is not None else None)
        self._behind_at = 0  # n_sealed when write-behind last looked
        self._guess: tuple | None = None  # a step attended on a guess, unchecked
        self._retry: tuple | None = None  # a wrong guess's fetched selection, to attend on
        P = page_tokens
        self.budget_pages = -(-budget // P)  # token budget rounded up to whole pages
        self.sink_pages = -(-sinks // P)
        self.recent_pages = -(-recent // P)  # sealed pages before the last (open) one
        self.mode = mode
        # One selection for all KV heads (quest.shared_scores) or one per KV head.
        self.shared = shared
        # Page min/max kept in fp32, or in bf16 rounded outward (quest.outward_bf16: still a
        # bound, half the bytes); the open page's running min/max stays fp32.
        if meta_dtype not in (mx.float32, mx.bfloat16):
            raise InvalidOptionError(f"Quest metadata dtype {meta_dtype}: float32 or bfloat16")
        self.meta_dtype = meta_dtype
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
                "pages_fetched",
                "spill_read_bytes",
                "reattended",
            ),
            0,
        )

    def _reset(self) -> None:
        self._drop_guess()
        self.table.clear()
        self._behind_at = 0
        self._fetched = 0  # pages fetched (so evicted) since the written reserve was topped up
        self.length = 0
        self.kmin: mx.array | None = None  # [Hkv, meta_capacity, D] meta_dtype, by page
        self.kmax: mx.array | None = None
        # The open page's rows as written ([Hkv, t, D] pieces): its bounds when it seals.
        # Not read from the pool: a lazy read of the pool would keep its buffer alive and
        # make the next write copy the whole pool.
        self.open_rows: list[mx.array] = []

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
        pad_min = mx.zeros((hkv, grow, d), self.meta_dtype)
        pad_max = mx.zeros((hkv, grow, d), self.meta_dtype)
        if self.kmin is None:
            self.kmin, self.kmax = pad_min, pad_max
        else:
            self.kmin = mx.concatenate([self.kmin, pad_min], axis=1)
            self.kmax = mx.concatenate([self.kmax, pad_max], axis=1)

    def _seal(self, first: int, mins: mx.array, maxs: mx.array) -> None:
        """Record Quest metadata [Hkv, n, D] of pages first..first+n-1."""
        n = mins.shape[1]
        if self.meta_dtype == mx.bfloat16:
            mins, maxs = outward_bf16(mins, maxs)
        self.kmin[:, first : first + n] = mins
        self.kmax[:, first : first + n] = maxs

    def _pool_full(self, err: PoolFullError, what: str = "sequence") -> Exception:
        P = self.page_tokens
        region = self.table.spill
        if region is not None and region.failed:
            failure = region.io.error
            return type(failure)(
                f"{failure}. The KV pool ({self.pool.capacity} pages of {P} tokens) is full "
                f"and pages cannot spill: a {self.length:,}-token {what} does not fit resident"
            )
        cause = "nothing evictable" if region is not None else "no spill tier"
        return AdmissionError(
            f"KV page pool full: {self.pool.capacity} pages of {P} tokens "
            f"({self.pool.capacity * P:,} tokens) hold this layer, and a {self.length:,}-token "
            f"{what} needs more with {cause} ({err}); raise kv_pool_tokens or shorten the "
            "context"
        )

    def _behind_pages(self, reserve: int | None = None) -> list[int]:
        """Least recently used dirty sealed pages to queue for the spill file, so that
        `reserve` slots (default: a quarter of a bounded pool) are empty or on disk and
        evictions need not wait for writes."""
        region, pool = self.table.spill, self.pool
        if region is None or pool.max_pages is None or region.failed:
            return []
        reserve = self._behind_reserve() if reserve is None else reserve
        need = reserve - (pool.free_slots + pool.max_pages - pool.capacity)
        candidates = []
        for slot in pool.victims():
            if len(candidates) >= need:
                break
            owner, page = pool.owner_of(slot)
            if owner is self.table:
                candidates.append(page)
        return region.unqueued(candidates)

    def _behind_reserve(self) -> int:
        return max((self.pool.max_pages or 0) // 4, 1)

    def _write_behind(self, reserve: int | None = None) -> None:
        """Queue _behind_pages(reserve) (not waited for) when pages were sealed since the
        last look."""
        if self.table.n_sealed == self._behind_at:
            return
        self._behind_at = self.table.n_sealed
        todo = self._behind_pages(reserve)
        if todo:
            self.table.write_behind(todo)

    def append(self, kr: mx.array, vr: mx.array, meta: bool | None = None) -> None:
        """Write rows kr/vr [Hkv, T, D] at the end; seal the pages they fill.

        Metadata comes from the rows being written (a page's rows kept while it is open),
        never from re-reading the pool. A write needing more pages than the pool can give at
        once goes in pieces: each piece's sealed pages can be evicted for the next.
        """
        P = self.page_tokens
        T = kr.shape[1]
        meta = self.quest if meta is None else meta
        self.pool.bind(kr, vr)
        done = 0
        while done < T:
            start = self.length
            room = self.pool.room()
            n = T - done
            need = -(-(start + n) // P) - len(self.table)
            # The pages this piece will evict go to the writer in one batch now (a restore
            # far longer than the pool evicts all of it per piece), not one copy each later.
            self._write_behind(max(min(need, room), self._behind_reserve()))
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
        t = 0
        if start % P:  # rows that go on the open page
            t = min(P - start % P, T)
            self.open_rows.append(kr[:, :t])
            if (start + t) % P == 0:
                self._seal_open(start // P)
        n_full = (T - t) // P
        if n_full:  # whole pages in this write: their bounds from the rows themselves
            mins, maxs = page_min_max(kr[:, t : t + n_full * P].reshape(hkv, n_full, P, d))
            self._seal((start + t) // P, mins, maxs)
            t += n_full * P
        if t < T:  # a new open page: no bounds until it seals (a selection takes it whole)
            self.open_rows = [kr[:, t:]]

    def _seal_open(self, page: int) -> None:
        """Seal the open page from its rows: one reduction when it fills, rather than a
        running min / max widened every step (min and max are exact in any order)."""
        rows = self.open_rows
        whole = rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=1)  # [Hkv, P, D]
        mins, maxs = page_min_max(whole[:, None])
        self._seal(page, mins, maxs)
        self.open_rows = []

    # ----- reading --------------------------------------------------------------------------
    def _dense_kv(self) -> tuple[mx.array, mx.array]:
        """Every stored row as [1, Hkv, L, D] (a strided view of the pool when identity;
        spilled pages are read back)."""
        if self.table.n_spilled:
            keys, values = self._assemble(0, self.length, self._read(self._spilled(0, self.length)))
        else:
            keys, values = self._span(0, self.length)
        return keys[None], values[None]

    def _span(self, start: int, end: int) -> tuple[mx.array, mx.array]:
        """Rows [start, end) as [Hkv, n, D], whose pages are all resident."""
        if self.table.identity:
            return self.pool.k[:, start:end], self.pool.v[:, start:end]
        rows = self._rows(start, end)
        return self.pool.k[:, rows], self.pool.v[:, rows]

    def _spilled(self, start: int, end: int) -> list[int]:
        P = self.page_tokens
        slots = self.table.slots
        return [p for p in range(start // P, -(-end // P)) if slots[p] == SPILLED]

    def _read(self, pages: list[int]) -> dict:
        if not pages:
            return {}
        data = self.table.spill.read(pages)
        self._count_read(len(pages))
        return data

    def _count_read(self, n_pages: int) -> None:
        self.stats["pages_fetched"] += n_pages
        self.stats["spill_read_bytes"] += n_pages * self.table.spill.page_bytes

    def _upload(self, pages: list[int], fetched: dict) -> tuple[mx.array, mx.array]:
        """K and V of fetched pages as [Hkv, n * P, D] on the device: one host-to-device
        copy for all of them (a copy per page cost ~0.5 ms each on the H200's host), from
        one host buffer filled by a single copy of the pages."""
        k, v = fetched[pages[0]]
        both = np.empty((2, k.shape[0], len(pages) * k.shape[1], k.shape[2]), k.dtype)
        for i in (0, 1):
            np.concatenate([fetched[p][i] for p in pages], axis=1, out=both[i])
        both = from_host(both, self.pool.k.dtype)
        return both[:1].squeeze(0), both[1:].squeeze(0)  # views ([0] would be a gather)

    def _assemble(self, start: int, end: int, fetched: dict) -> tuple[mx.array, mx.array]:
        """Rows [start, end) (start page-aligned) from resident runs and fetched pages."""
        P = self.page_tokens
        slots = self.table.slots
        parts_k, parts_v = [], []
        page, last = start // P, -(-end // P)
        while page < last:
            spilled = slots[page] == SPILLED
            run = page
            while run < last and (slots[run] == SPILLED) == spilled:
                run += 1
            if spilled:
                k, v = self._upload(list(range(page, run)), fetched)
            else:
                k, v = self._span(page * P, run * P)
            parts_k.append(k)
            parts_v.append(v)
            page = run
        n = end - start
        return mx.concatenate(parts_k, axis=1)[:, :n], mx.concatenate(parts_v, axis=1)[:, :n]

    def _past_blocks(self, past: int, block: int):
        """K/V of rows [0, past) in page-aligned blocks [1, Hkv, B, D]. Blocks holding
        spilled pages are read one block ahead (the read overlaps this block's compute); the
        walk keeps at most two blocks alive (kv/blocked.py)."""
        blocks = list(spans(past, block))
        if not self.table.n_spilled:
            for a, b in blocks:
                kb, vb = self._span(a, b)
                yield kb[None], vb[None]
            return
        region = self.table.spill
        ahead = None
        for i, (a, b) in enumerate(blocks):
            pages = self._spilled(a, b)
            if ahead is not None:
                fetched = ahead.result()
                self._count_read(len(pages))
            else:
                fetched = self._read(pages)
            ahead = None
            if i + 1 < len(blocks):
                more = self._spilled(*blocks[i + 1])
                if more:
                    ahead = region.read_async(more)
            kb, vb = self._assemble(a, b, fetched) if pages else self._span(a, b)
            yield kb[None], vb[None]

    def _fetch(self, pages: list[int], settle: Callable[[], None] | None = None) -> list[int]:
        """Bring spilled pages back into slots (batched reads); returns their slots. The
        caller pins what it needs resident, so these allocations cannot evict it; `settle`
        runs between the reads and the pool writes."""
        data = self._read(pages)
        if settle is not None:
            settle()
        try:
            slots = self.pool.alloc(len(pages), self.pool.k, self.pool.v)
        except PoolFullError as e:
            raise self._pool_full(e, "sequence's selection") from None
        P = self.page_tokens
        rows = (mx.array(slots, dtype=mx.int32)[:, None] * P + mx.arange(P)).reshape(-1)
        self.pool.k[:, rows], self.pool.v[:, rows] = self._upload(pages, data)
        self.table.place(pages, slots)
        # The allocations evicted pages: once they used half the written reserve, the next
        # selection tops it up, so evictions find clean pages instead of writing them while
        # they wait (and the eviction order is scanned every few steps, not every step).
        self._fetched += len(pages)
        return slots

    def selection_size(self) -> tuple[int, int]:
        """(pages in the context, pages a decode step would select)."""
        return self.selection_at(self.length)

    def selection_at(self, length: int) -> tuple[int, int]:
        """selection_size() of a decode step at a context of `length` tokens (speculative
        decoding asks ahead, dense_through)."""
        n_pages = len(self.table) if length == self.length else -(-length // self.page_tokens)
        if length < self.sparse_from or not self.quest:
            return n_pages, n_pages
        _, n_forced = forced_pages(n_pages, self.sink_pages, self.recent_pages)
        return n_pages, min(n_pages, max(self.budget_pages, n_forced))

    # ----- the model's own selection (QSA) ---------------------------------------------------
    def store(self, k: mx.array, v: mx.array) -> None:
        """Append k/v [1, Hkv, T, D] without attending (the caller gathers its selection)."""
        self.append(k[0], v[0])

    def gather(self, positions: mx.array) -> tuple[mx.array, mx.array]:
        """K and V rows at token `positions` (int array of any shape S, each < length) as
        [Hkv, *S, D]. Spilled pages among them are fetched first (resident ones pinned, so
        the fetches cannot evict them); with a bounded pool at most `gather_limit()` pages."""
        P = self.page_tokens
        if self.table.n_spilled:
            pinned, slots, _ = self._resident_selection(positions // P)
            rows = mx.array(slots, dtype=mx.int32) * P + positions % P
        else:
            pinned = []
            rows = positions
            if not self.table.identity:
                rows = self.table.array()[positions // P] * P + positions % P
        keys = mx.take(self.pool.k, rows, axis=1)
        values = mx.take(self.pool.v, rows, axis=1)
        if pinned:  # the gathers read this version of the pool: later writes cannot reach it
            self.pool.unpin(pinned)
            self.pool.touch(pinned)
        return keys, values

    def block_pool(
        self, block_tokens: int
    ) -> tuple[mx.array, mx.array, Callable[[mx.array], mx.array]] | None:
        """The pool [1, Hkv, slots * page_tokens, D] as blocks of block_tokens rows the
        split-KV kernel reads as pages, and the map from the sequence's block ids to the
        pool's (through the page table); None with a page spilled (a gather fetches it) or
        pages that are not whole blocks."""
        P = self.page_tokens
        if self.pool.k is None or self.table.n_spilled or P % block_tokens:
            return None
        per = P // block_tokens
        k, v = self.pool.k[None], self.pool.v[None]
        if self.table.identity:
            return k, v, lambda blocks: blocks
        slots = self.table.array()
        return k, v, lambda blocks: slots[blocks // per] * per + blocks % per

    def gather_limit(self) -> int | None:
        """Pages one gather may make resident at once (half a bounded pool: the open page
        and the next writes need room too); None when the pool is unbounded."""
        if self.pool.max_pages is None:
            return None
        return max(self.pool.max_pages // 2, 1)

    def reserve(self, n: int) -> None:
        """Slots for n more rows now (growing the pool within its bound), so appending them
        (a speculative verify's rows) moves no live buffer."""
        if self.pool.k is None:
            return  # nothing written yet: the first write sizes the pool
        need = -(-(self.length + n) // self.page_tokens) - len(self.table)
        if need > 0:
            self.pool.reserve(need, self.pool.k, self.pool.v)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """Append k/v [1, Hkv, T, D], then causal attention of q [1, Hq, T, D] over the pages."""
        return self.attend_then(q, k, v, scale, lambda out: out)

    def attend_then(
        self,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        scale: float,
        then: Callable[[mx.array], mx.array],
    ) -> mx.array:
        """then(attend(q, k, v, scale)), where `then` is the rest of the layer and keeps no
        state (layers.py decode_attention): a spilled Quest step hands both to the device
        before it reads its selection on the host (_attend_checked)."""
        if self._retry is not None:  # a wrong guess, fetched: its rows are stored already
            return self._attend_retry(q, scale, then)
        self.append(k[0], v[0])
        T = q.shape[2]
        if T == 1 and not _PREFILLING.get():
            self.stats["decode_steps"] += 1
            n_pages, n_sel = self.selection_size()
            if n_sel < n_pages or self.always_select:
                return self._attend_selected(q, scale, n_pages, n_sel, then)
            self.stats["pages_selected"] += n_pages * k.shape[1]
            self.stats["kv_read_bytes"] += self.length * (k[0, :, 0].nbytes + v[0, :, 0].nbytes)
            return then(self._attend_dense(q, k, v, scale))
        past = self.length - T
        if T <= STEP_MAX_ROWS and self.dense_from(past + 1):
            # a step (a speculative verify): each row as the dense decode step at its position
            return then(self._attend_dense(q, k, v, scale))
        return then(
            attend_past(
                q,
                past,
                lambda block: self._past_blocks(past, block),
                k,
                v,
                scale,
                self._dense_kv,
                self._block(),
                self.page_tokens,
            )
        )

    def _attend_dense(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """Decode steps reading every page: the newest T rows q [1, Hq, T, D] (k, v theirs,
        already stored), each row as the step at its position."""
        T = q.shape[2]
        if not self.table.n_spilled:
            return attend_rows(q, *self._dense_kv(), scale)
        # stream the past through the walk (no refetch storm), row by row
        past = self.length - T
        outs = [
            blocked_attention(
                q[:, :, t : t + 1],
                self._past_blocks(past + t, self._block()),
                k[:, :, t : t + 1],
                v[:, :, t : t + 1],
                scale,
            )
            for t in range(T)
        ]
        return outs[0] if T == 1 else mx.concatenate(outs, axis=2)

    def reads_back(self) -> bool:
        """Whether a decode step reads device results on the host mid-step: a selection with
        spilled pages must be known on the host to fetch them (SequenceState.reads_back)."""
        return self.table.n_spilled > 0

    def _block(self) -> int:
        return max(self.block_tokens // self.page_tokens, 1) * self.page_tokens

    def dense_through(self, length: int) -> bool:
        """Whether a decode step at every context length from now up to `length` tokens reads
        every page (Quest selects all of them, or `auto` is below its threshold): the span
        where a verify of several tokens, which attends densely, equals single steps
        (speculative.py's gate)."""
        return self.dense_from(self.length + 1, length)

    def dense_from(self, start: int, end: int | None = None) -> bool:
        """Whether decode steps at every context length in [start, end] (end: the stored
        length) read every page."""
        if self.always_select:
            return False
        end = self.length if end is None else end
        sizes = (self.selection_at(n) for n in range(start, end + 1))
        return all(n_sel >= n_pages for n_pages, n_sel in sizes)

    def select(self, q: mx.array, n_sel: int) -> mx.array:
        """Selected logical pages per KV head, int32 [Hkv, n_sel] ascending. q: [Hq, D].
        One compiled graph (quest.selector); the last page is always forced, so its
        (possibly unsealed) metadata is never used."""
        run = selector(n_sel, self.sink_pages, self.recent_pages, self.shared)
        n_pages = scalars.int32(len(self.table))
        return run(q, self.kmin, self.kmax, n_pages)

    def _read_selection(self, pages: mx.array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The selection on the host: (selected pages, the distinct ones, their slots or
        SPILLED). One wait, which also gathers the pages due for write-behind."""
        behind = []
        if self._fetched and self._fetched >= self._behind_reserve() // 2:
            behind, self._fetched = self._behind_pages(), 0
        gathered = self.table.gather_pages([self.table.slots[p] for p in behind]) if behind else ()
        mx.eval(pages, *gathered)
        if behind:
            self.table.write_behind(behind, gathered)
        selected = np.array(pages)
        wanted = np.unique(selected)
        slots = self.table.slots
        wanted_slots = np.array([slots[p] for p in wanted.tolist()], dtype=np.int32)
        return selected, wanted, wanted_slots

    def _resident_selection(
        self, pages: mx.array, settle: Callable[[], None] | None = None
    ) -> tuple[list[int], np.ndarray, bool]:
        """Make every selected page resident: pin the resident ones, fetch the misses (the
        pins keep those allocations from evicting the selection). Returns the pinned slots
        (none when nothing missed), the slot of each entry of `pages` (a host array of its
        shape: the caller gathers through it instead of uploading the whole table), and
        whether anything missed. `settle` runs after the misses are read from disk and
        before they are written into the pool."""
        selected, wanted, wanted_slots = self._read_selection(pages)
        missed = wanted_slots == SPILLED
        resident = wanted_slots[~missed].tolist()
        if not missed.any():
            # Nothing allocates before the caller's gather, so nothing needs pinning: only
            # the recency that unpinning would give (the usual step of a real model).
            self.pool.touch(resident)
            return [], wanted_slots[np.searchsorted(wanted, selected)], False
        self.pool.pin(resident)
        try:
            fetched = self._fetch(wanted[missed].tolist(), settle)
        except (SpillError, AdmissionError):
            self.pool.unpin(resident)
            raise
        self.pool.pin(fetched)
        wanted_slots[missed] = fetched
        return resident + fetched, wanted_slots[np.searchsorted(wanted, selected)], True

    def _attend_selected(
        self,
        q: mx.array,
        scale: float,
        n_pages: int,
        n_sel: int,
        then: Callable[[mx.array], mx.array],
    ) -> mx.array:
        if self.profile:
            mx.eval(q, self.pool.k, self.pool.v, self.kmin, self.kmax)
            t0 = time.perf_counter()
        pages = self.select(q[0, :, 0, :], n_sel)
        # The last (open) page is selected and sorts last: drop its unwritten tail.
        n_rows = n_sel * self.page_tokens - (n_pages * self.page_tokens - self.length)
        self._count_selected(n_pages, n_sel, n_rows)
        # (a shared selection's rows are one row broadcast)
        chosen = pages[:1] if self.shared else pages
        if self.table.n_spilled and self._guessing():
            return self._attend_checked(q, scale, pages, chosen, n_rows, then)
        if self.profile:
            mx.eval(pages)
            t1 = time.perf_counter()
        if self.table.n_spilled:
            pinned, host_slots, _ = self._resident_selection(chosen)
            slots = mx.broadcast_to(mx.array(host_slots), pages.shape)
        else:
            pinned = []
            slots = pages if self.table.identity else self.table.array()[pages]
        out = self._attend_slots(q, scale, slots, n_rows)
        if pinned:
            # The attention above reads this version of the pool: later writes cannot reach it.
            self.pool.unpin(pinned)
            self.pool.touch(pinned)
        if self.profile:
            mx.eval(out)
            self.stats["select_seconds"] += t1 - t0
            self.stats["attend_seconds"] += time.perf_counter() - t1
        return then(out)

    def _attend_checked(
        self,
        q: mx.array,
        scale: float,
        pages: mx.array,
        chosen: mx.array,
        n_rows: int,
        then: Callable[[mx.array], mx.array],
    ) -> mx.array:
        """A spilled step that does not wait for its selection before attending: the slots
        come from the device's copy of the page table (a spilled page reads slot 0 instead),
        the attention and `then` go to the device, and the host reads the selection after:
        here, or, inside SequenceState.run_layers, when the loop reaches the next layer that
        cannot be put back (check_guess). Waiting first left the device idle at every
        attention layer of every step, a page fetched or not (H200, 16 layers, 131K, 32K
        pool: 9.6 vs 5.1 ms per step, profile_spill_16l_131k_churn0.json). When every
        selected page was resident (the usual step of real text) the guess is the answer; a
        miss is fetched and the layer attends again (`then` keeps no state)."""
        guess = mx.maximum(self.table.array()[chosen], 0)
        done = then(self._attend_slots(q, scale, mx.broadcast_to(guess, pages.shape), n_rows))
        mx.async_eval(done)
        self._guess = (chosen, pages.shape, n_rows, done)
        if checks_later() or self.check_guess():
            return done
        return self._attend_retry(q, scale, then)

    def _guessing(self) -> bool:
        if self.profile:  # profiling times the selection on its own
            return False
        if self.attend_on_guess is not None:
            return self.attend_on_guess
        return mx.default_device().type == mx.DeviceType.gpu

    def guessed(self) -> bool:
        """The last step attended on a guess that check_guess() has not looked at."""
        return self._guess is not None

    def check_guess(self) -> bool:
        """Read the guessing step's selection on the host: True if every selected page was
        resident (the guess was right); else the misses are fetched (pinned with the rest of
        the selection) and the layer's next call attends on them without storing its rows
        again (_attend_retry)."""
        chosen, shape, n_rows, done = self._guess
        self._guess = None
        # Before fetched pages are written into the pool, the guess must have read it: a
        # write while a pending read holds the pool would copy all of it.
        pinned, host_slots, missed = self._resident_selection(chosen, lambda: mx.eval(done))
        if not missed:
            return True
        self._retry = (pinned, host_slots, shape, n_rows)
        self.stats["reattended"] += 1
        return False

    def _attend_retry(
        self, q: mx.array, scale: float, then: Callable[[mx.array], mx.array]
    ) -> mx.array:
        pinned, host_slots, shape, n_rows = self._retry
        self._retry = None
        slots = mx.broadcast_to(mx.array(host_slots), shape)
        out = then(self._attend_slots(q, scale, slots, n_rows))
        # The attention above reads this version of the pool: later writes cannot reach it.
        self.pool.unpin(pinned)
        self.pool.touch(pinned)
        return out

    def _drop_guess(self) -> None:
        """Forget an unchecked guess or a pending retry (a rewind, a reset, an interrupted
        step), and the pins of the retry's selection."""
        self._guess = None
        if self._retry is not None:
            self.pool.unpin(self._retry[0])
            self._retry = None

    def _attend_slots(self, q: mx.array, scale: float, slots: mx.array, n_rows: int) -> mx.array:
        if slots.dtype != mx.int32:
            slots = slots.astype(mx.int32)
        pool_k, pool_v, P = self.pool.k[None], self.pool.v[None], self.page_tokens
        return attend_pages(q, pool_k, pool_v, slots, n_rows, P, scale, self.shared)

    def _count_selected(self, n_pages: int, n_sel: int, n_rows: int) -> None:
        hkv, d = self.pool.k.shape[0], self.pool.k.shape[2]
        item = self.pool.k.dtype.size
        self.stats["sparse_steps"] += 1
        self.stats["pages_selected"] += n_sel * hkv
        self.stats["kv_read_bytes"] += 2 * n_rows * hkv * d * item
        self.stats["meta_read_bytes"] += 2 * n_pages * hkv * d * self.kmin.itemsize

    # ----- LayerState -----------------------------------------------------------------------
    def nbytes(self) -> int:
        meta = 0 if self.kmin is None else 2 * len(self.table) * self.kmin[:, 0].nbytes
        resident = len(self.table) - self.table.n_spilled
        return resident * self.pool.page_bytes() + meta

    def kv_stats(self) -> dict:
        region = self.table.spill
        return {
            "pages_resident": len(self.table) - self.table.n_spilled,
            "pages_spilled": self.table.n_spilled,
            "spill_writes": region.n_written if region is not None else 0,
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
        }
        if not self.quest:
            return snap
        snap["quest_min"] = mx.array(self.kmin[:, :n_sealed])
        snap["quest_max"] = mx.array(self.kmax[:, :n_sealed])
        return snap

    def restore(self, tensors: dict[str, mx.array]) -> None:
        self._reset()
        if not tensors:
            return
        keys, values = tensors["keys"], tensors["values"]
        same_pages = int(tensors["page_tokens"].item()) == self.page_tokens
        if not self.quest:
            self.append(keys, values, meta=False)
            return
        if "quest_min" not in tensors or tensors["quest_min"].dtype != self.meta_dtype:
            same_pages = False  # written without Quest, or in another dtype: recompute
        # With another page size the metadata is recomputed from the rows being written.
        self.append(keys, values, meta=not same_pages)
        if same_pages:
            n_sealed = tensors["quest_min"].shape[1]
            hkv, d = keys.shape[0], keys.shape[2]
            self._grow_meta(len(self.table), hkv, d)
            if n_sealed:
                self.kmin[:, :n_sealed] = tensors["quest_min"]
                self.kmax[:, :n_sealed] = tensors["quest_max"]
            if keys.shape[1] > n_sealed * self.page_tokens:
                self.open_rows = [keys[:, n_sealed * self.page_tokens :]]

    def truncate(self, length: int) -> None:
        """Drop rows past `length`: free whole pages, un-seal a page cut in the middle."""
        self._drop_guess()
        if length >= self.length:
            return
        P = self.page_tokens
        keep = -(-length // P)
        cut = keep - 1 if length % P else None
        # A cut page that is spilled is read before the table forgets its disk copy.
        back = self._read([cut]) if cut is not None and self.table.slots[cut] == SPILLED else {}
        self.table.truncate(keep, length // P)
        self._behind_at = 0
        self.length = length
        self.open_rows = []
        if back:
            try:
                slot = self.pool.alloc(1, self.pool.k, self.pool.v)
            except PoolFullError as e:
                raise self._pool_full(e, "rewound sequence") from None
            k, v = back[cut]
            rows = mx.arange(slot[0] * P, (slot[0] + 1) * P)
            self.pool.k[:, rows] = from_host(k, self.pool.k.dtype)
            self.pool.v[:, rows] = from_host(v, self.pool.v.dtype)
            self.table.place([cut], slot)
        if cut is not None and self.quest:
            # Rewind is rare and the page is partial: its rows are read back from the pool
            # (the only time the pool is re-read).
            self.open_rows = [self._span(cut * P, length)[0]]

    def spill_file(self) -> SpillFile | None:
        """The sequence's spill file (shared by its layers), if it has a spill tier."""
        region = self.table.spill
        return region.owner if region is not None else None

    def close(self) -> None:
        """Remove the sequence's spill file (every layer's; the first call does it)."""
        region = self.table.spill
        if region is not None and region.owner is not None:
            region.owner.close()
