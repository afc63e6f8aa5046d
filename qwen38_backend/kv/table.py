"""Page table of one layer's store: logical page -> pool slot, or SPILLED (in the spill file).

The residency bookkeeping lives here, apart from the attention math (paged.py): which pages
are sealed, which slot holds each resident page, and, with a spill tier, moving sealed
pages out of the pool on eviction and back in on a miss. The pool asks the table to
`evict(page, slot)`; the table writes the page out first if the spill file does not hold
it yet, and says no when it cannot (no spill tier, or the tier failed).
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx
import numpy as np

from .pool import PagePool

SPILLED = -1


class SpillTier(Protocol):
    """What a table needs from the spill tier (kv/spill.py SpillRegion)."""

    failed: bool

    def dirty(self, page: int) -> None: ...

    def forget(self, first_page: int) -> None: ...

    def submit(self, page: int, k: np.ndarray, v: np.ndarray) -> None: ...

    def ensure_written(self, page: int, k: np.ndarray, v: np.ndarray) -> bool: ...

    def wait_written(self, page: int) -> bool: ...

    def is_clean(self, page: int) -> bool: ...

    def unqueued(self, pages: list[int]) -> list[int]: ...


class PageTable:
    """Logical pages of one store mapped to slots of its pool (or SPILLED)."""

    def __init__(self, pool: PagePool, spill: SpillTier | None = None):
        self.pool = pool
        self.spill = spill
        self.slots: list[int] = []  # logical page -> slot, or SPILLED
        self.n_sealed = 0  # pages [0, n_sealed) are full and sealed
        self.n_spilled = 0
        self._identity: bool | None = True  # None: not known since the last change
        self._array: mx.array | None = None

    def __len__(self) -> int:
        return len(self.slots)

    def _changed(self) -> None:
        self._array = None
        self._identity = None
        self.n_spilled = self.slots.count(SPILLED)

    @property
    def identity(self) -> bool:
        """Every page resident with table[i] == i: rows are plain slices of the pool."""
        if self.n_spilled:
            return False  # no scan of the whole table on every spilled step
        if self._identity is None:  # decided when asked: a decode step evicts many times
            self._identity = self.slots == list(range(len(self.slots)))
        return self._identity

    def array(self) -> mx.array:
        """The table as int32 (cached until it changes); SPILLED entries are -1."""
        if self._array is None:
            self._array = mx.array(self.slots, dtype=mx.int32)
        return self._array

    def rows(self, start: int, end: int) -> mx.array:
        """Pool row of each position in [start, end) (all of whose pages are resident).
        Only the spanned pages' slots go to the device: a decode step's write spans one page,
        and the whole table is uploaded again after every change (each spilled step)."""
        P = self.pool.page_tokens
        first = start // P
        slots = mx.array(self.slots[first : -(-end // P)], dtype=mx.int32)
        pos = mx.arange(start, end)
        return slots[pos // P - first] * P + pos % P

    def resident_slots(self) -> list[int]:
        return [s for s in self.slots if s != SPILLED]

    # ----- growth and sealing --------------------------------------------------------------
    def extend(self, n_pages: int, like_k: mx.array, like_v: mx.array) -> None:
        """Give n_pages new (open) pages slots; may evict other sealed pages."""
        self.slots.extend(self.pool.alloc(n_pages, like_k, like_v))
        self._changed()

    def seal_through(self, n_sealed: int) -> None:
        """Pages [self.n_sealed, n_sealed) are full: evictable, and dirty for the spill."""
        for page in range(self.n_sealed, n_sealed):
            self.pool.seal(self.slots[page], self, page)
            if self.spill is not None:
                self.spill.dirty(page)
        self.n_sealed = max(self.n_sealed, n_sealed)

    # ----- eviction (called by the pool) and the spill tier --------------------------------
    def gather_pages(self, slots: list[int]) -> tuple[mx.array, mx.array]:
        """K and V of the pages in `slots`, [Hkv, n * page_tokens, D] (lazy)."""
        P = self.pool.page_tokens
        rows = (mx.array(slots, dtype=mx.int32)[:, None] * P + mx.arange(P)).reshape(-1)
        return self.pool.k[:, rows], self.pool.v[:, rows]

    def page_rows(
        self, slots: list[int], gathered: tuple[mx.array, mx.array] | None = None
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """K and V of the pages in `slots` as host arrays [Hkv, page_tokens, D] (one
        device-to-host copy for all of them; `gathered`: their gather_pages, if made)."""
        P = self.pool.page_tokens
        k, v = gathered if gathered is not None else self.gather_pages(slots)
        k, v = to_host(k), to_host(v)
        return [(k[:, i * P : (i + 1) * P], v[:, i * P : (i + 1) * P]) for i in range(len(slots))]

    def write_behind(
        self, pages: list[int], gathered: tuple[mx.array, mx.array] | None = None
    ) -> None:
        """Queue resident sealed pages for the spill file (not waited for)."""
        data = self.page_rows([self.slots[p] for p in pages], gathered)
        for page, (k, v) in zip(pages, data, strict=True):
            self.spill.submit(page, k, v)

    def evict(self, page: int, slot: int) -> bool:
        if self.spill is None or page >= len(self.slots) or self.slots[page] != slot:
            return False
        if self.spill.failed:
            return False  # after a failure pages stay resident (reads would raise it)
        if not self.spill.is_clean(page):
            if self.spill.unqueued([page]):  # not on its way: copy it out and write it now
                (k, v) = self.page_rows([slot])[0]
                written = self.spill.ensure_written(page, k, v)
            else:  # written behind already (one batched copy): wait for that write
                written = self.spill.wait_written(page)
            if not written:
                return False
        self.slots[page] = SPILLED
        self.n_spilled += 1  # counted, not recounted: evictions come by the hundred
        self._array = None
        self._identity = False
        return True

    def place(self, pages: list[int], slots: list[int]) -> None:
        """Fetched pages now live in `slots` (sealed ones become evictable again)."""
        for page, slot in zip(pages, slots, strict=True):
            if self.slots[page] == SPILLED:
                self.n_spilled -= 1  # counted, not recounted: the table has thousands of pages
            self.slots[page] = slot
            if page < self.n_sealed:
                self.pool.seal(slot, self, page)
        self._array = None
        self._identity = None

    # ----- truncation ----------------------------------------------------------------------
    def truncate(self, n_pages: int, n_sealed: int) -> None:
        """Keep pages [0, n_pages), of which [0, n_sealed) stay sealed (a page past them
        becomes open again; if it is spilled the caller brings it back)."""
        gone = [s for s in self.slots[n_pages:] if s != SPILLED]
        self.pool.release(gone)
        del self.slots[n_pages:]
        for page in range(n_sealed, min(self.n_sealed, n_pages)):
            if self.slots[page] != SPILLED:
                self.pool.unseal(self.slots[page])
        self.n_sealed = min(self.n_sealed, n_sealed)
        if self.spill is not None:
            self.spill.forget(self.n_sealed)  # its copies past the sealed run are stale
        self._changed()

    def clear(self) -> None:
        self.pool.release(self.resident_slots())
        self.slots = []
        self.n_sealed = 0
        if self.spill is not None:
            self.spill.forget(0)
        self._changed()


def to_host(a: mx.array) -> np.ndarray:
    """An mx array as numpy (bf16 carried as its uint16 bits: numpy has no bf16)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a)


def from_host(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    out = mx.array(a)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out
