"""The page pool of one attention layer: bounded slots, a free queue in eviction order, pins.

Modelled on vLLM's v1 block pool: a fixed capacity, slots handed out from a free queue,
reference counts (here: pins) that keep a slot out of eviction while something reads it.
What differs: a freed vLLM block holds a reusable prefix, ours holds a sealed page of a live
sequence, so evicting it means the owner first moves the page out (to the spill file).

- Empty slots (never used, or released by a truncate) sit in a min-heap: the lowest slot
  first keeps a growing sequence's page table identity-mapped (table[i] == i), so prefill
  and dense decode read the pool through plain slices.
- Sealed, unpinned pages sit in `_lru`, least recently used first: that is the eviction
  order. The open page (still being written) and pinned pages are never there.
- Storage is head-major [kv_heads, slots * page_tokens, head_dim] (see paged.py for why),
  grown geometrically (x1.5, at least a block of pages) up to `max_pages`; growth stops at
  the bound, after which allocations evict.
"""

from __future__ import annotations

import heapq
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Protocol

import mlx.core as mx

from ..errors import Qwen38Error

MIN_GROW_PAGES = 64


class PoolFullError(Qwen38Error):
    """No slot is empty and no page can be evicted (the caller turns this into a typed
    error that names the options)."""


class PageOwner(Protocol):
    def evict(self, page: int, slot: int) -> bool:
        """Move logical `page` (held in `slot`) out of the pool; False if it cannot leave."""


def grown_capacity(capacity: int, need: int, max_pages: int | None) -> int:
    """The pool's capacity after making room for `need` slots in total (no change if it
    holds them already): x1.5 growth, at least a block, never past `max_pages`; a bounded
    pool that would reach two thirds of its bound goes to the bound at once, so the buffer
    alive during its last growth is under two thirds of the bound (the auto pool's sizing
    counts on that). Admission simulates the pool with this same function."""
    if need <= capacity:
        return capacity
    new = capacity + max(need - capacity, MIN_GROW_PAGES, capacity // 2)
    if max_pages is None:
        return new
    if 3 * new >= 2 * max_pages:
        new = max_pages
    return max(capacity, min(new, max_pages))


class PagePool:
    """Slots of `page_tokens` rows for one attention layer (one or more sequences' tables)."""

    def __init__(
        self, page_tokens: int, max_pages: int | Callable[[int], int | None] | None = None
    ):
        """max_pages: the bound; None: unbounded; a callable: decided from the page's bytes
        when the first rows arrive (the auto pool)."""
        if isinstance(max_pages, int) and max_pages < 1:
            raise ValueError("a page pool needs at least one slot")
        self.page_tokens = page_tokens
        self._sizer = max_pages if callable(max_pages) else None
        self.max_pages: int | None = None if callable(max_pages) else max_pages
        self.k: mx.array | None = None  # [Hkv, capacity * page_tokens, D]
        self.v: mx.array | None = None
        self.capacity = 0
        self._empty: list[int] = []  # min-heap of slots that hold nothing
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable, oldest first
        self._owner: dict[int, tuple[weakref.ref, int]] = {}  # slot -> (table, page)
        self._pins: dict[int, int] = {}
        self.evictions = 0

    # ----- sizes ---------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        """Allocated slots that hold nothing."""
        return len(self._empty)

    @property
    def evictable(self) -> int:
        return len(self._lru)

    def room(self) -> int:
        """Slots an allocation could get now: empty, not yet grown, or evictable."""
        if self.max_pages is None:
            return 1 << 62
        return len(self._empty) + len(self._lru) + self.max_pages - self.capacity

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

    # ----- allocation ----------------------------------------------------------------------
    def bind(self, like_k: mx.array, like_v: mx.array) -> None:
        """Decide a deferred bound now that a page's size is known (rows [Hkv, T, D])."""
        if self._sizer is not None:
            item = like_k.dtype.size
            page = self.page_tokens * like_k.shape[0] * (like_k.shape[2] + like_v.shape[2]) * item
            self.max_pages, self._sizer = self._sizer(page), None

    def reserve(self, n_pages: int, like_k: mx.array, like_v: mx.array) -> None:
        """Grow (within the bound) so that n_pages more slots are empty if possible."""
        self.bind(like_k, like_v)
        new = grown_capacity(self.capacity, self.capacity - len(self._empty) + n_pages, None)
        if self.max_pages is not None:
            new = min(new, self.max_pages)
        grow = new - self.capacity
        if grow <= 0:
            return
        rows = grow * self.page_tokens
        new_k = mx.zeros((like_k.shape[0], rows, like_k.shape[2]), like_k.dtype)
        new_v = mx.zeros((like_v.shape[0], rows, like_v.shape[2]), like_v.dtype)
        if self.k is None:
            self.k, self.v = new_k, new_v
        else:
            self.k = mx.concatenate([self.k, new_k], axis=1)
            self.v = mx.concatenate([self.v, new_v], axis=1)
        for slot in range(self.capacity, new):
            heapq.heappush(self._empty, slot)
        self.capacity = new

    def alloc(self, n_pages: int, like_k: mx.array, like_v: mx.array) -> list[int]:
        """n_pages slots: empty ones first (growing within the bound), then by eviction of
        the least recently used sealed, unpinned pages. Raises PoolFullError (taking none)."""
        if n_pages > len(self._empty):
            self.reserve(n_pages, like_k, like_v)
        while len(self._empty) < n_pages:
            if not self._evict_one():
                raise PoolFullError(
                    f"page pool full: {self.capacity} slots of {self.page_tokens} tokens, "
                    f"{n_pages} needed, {len(self._empty)} empty, none evictable"
                )
        return [heapq.heappop(self._empty) for _ in range(n_pages)]

    def _evict_one(self) -> bool:
        while self._lru:
            slot, _ = self._lru.popitem(last=False)
            ref, page = self._owner[slot]
            owner = ref()
            if owner is not None and not owner.evict(page, slot):
                # It cannot leave (e.g. the spill tier failed): it stays resident, unlisted.
                continue
            del self._owner[slot]
            heapq.heappush(self._empty, slot)
            self.evictions += 1
            return True
        return False

    def release(self, slots: list[int]) -> None:
        """Slots whose pages are gone (truncated or reset) become empty."""
        for slot in slots:
            self._lru.pop(slot, None)
            self._owner.pop(slot, None)
            self._pins.pop(slot, None)
            heapq.heappush(self._empty, slot)

    # ----- eviction order and pins ---------------------------------------------------------
    def seal(self, slot: int, owner: PageOwner, page: int) -> None:
        """A full page: evictable (most recently used) unless pinned."""
        self._owner[slot] = (weakref.ref(owner), page)
        if not self._pins.get(slot):
            self._lru[slot] = None

    def unseal(self, slot: int) -> None:
        """The page is being written again (a rewind cut it): not evictable."""
        self._lru.pop(slot, None)
        self._owner.pop(slot, None)

    def touch(self, slots: list[int]) -> None:
        """Used now: move evictable slots to the most recently used end."""
        for slot in slots:
            if slot in self._lru:
                self._lru.move_to_end(slot)

    def pin(self, slots: list[int]) -> None:
        for slot in slots:
            self._pins[slot] = self._pins.get(slot, 0) + 1
            self._lru.pop(slot, None)

    def unpin(self, slots: list[int]) -> None:
        for slot in slots:
            n = self._pins.get(slot, 0) - 1
            if n > 0:
                self._pins[slot] = n
                continue
            self._pins.pop(slot, None)
            if slot in self._owner:  # sealed: evictable again, as just used
                self._lru[slot] = None

    def owner_of(self, slot: int) -> tuple[object | None, int]:
        """(table, logical page) of a sealed slot."""
        ref, page = self._owner[slot]
        return ref(), page

    def victims(self) -> Iterator[int]:
        """Evictable slots, next victim first, without copying the order (the caller does
        not change the pool while it iterates)."""
        return iter(self._lru)

    def eviction_order(self) -> list[int]:
        """Evictable slots, next victim first (tests, stats)."""
        return list(self._lru)
