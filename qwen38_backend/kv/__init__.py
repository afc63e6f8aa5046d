"""KV stores for attention layers and the options that pick one.

`make_kv_factory(**kv_options)` returns a zero-argument callable that builds one layer's KV
store; models call it once per attention layer in `make_state`. Every store implements
`attend(q, k, v, scale)` (paged ones also `attend_then`) plus the LayerState protocol (state.py).

Options (wherever sampling options are accepted; validated and decided by policy.choose_kv):
- kv_paged: "off" (contiguous store), "on" (paged, Quest whenever the budget does not cover
  the context), "auto" (paged, Quest from 4x the budget on). Unset: "off", or "on" when any
  other kv_ option is given. "auto" is not the default: already at 4x sparse decode changes
  some top-1 tokens against dense (README, "Sparse decode quality").
- kv_topk: token budget of the pages a decode step reads (sinks and recent window included),
  rounded up to whole pages; a budget >= the context means dense.
- kv_page_tokens: tokens per page (32). kv_sinks: leading tokens always selected. kv_recent:
  tokens before the open page always selected (both rounded up to whole pages). The top-k
  pages are chosen once per step for all KV heads (quest.shared_scores).
- kv_pool_tokens: resident rows per attention layer (the page pool's fixed capacity), or
  "auto" (default): sized from the memory available when the sequence first writes.
- kv_spill_dir: where a sequence whose pool is full spills sealed pages (default: kv-spill
  under the engine's cache dir); the file is removed when the sequence closes.
"""

from __future__ import annotations

from collections.abc import Callable

from .contiguous import ContiguousKV
from .paged import PagedKV, prefilling
from .policy import KV_DEFAULTS, KV_OPTION_KEYS, KVChoice, auto_pool_tokens, choose_kv
from .pool import PagePool
from .spill import SpillFile

__all__ = [
    "KV_OPTION_KEYS",
    "KV_DEFAULTS",
    "ContiguousKV",
    "KVChoice",
    "KVFactory",
    "PagedKV",
    "prefilling",
    "PagePool",
    "SpillFile",
    "choose_kv",
    "collect_kv_stats",
    "make_kv_factory",
]


class KVFactory:
    """Builds the paged stores of one sequence (models call it once per attention layer).

    What the layers of a sequence share lives here: the auto pool size, computed once when
    the first layer writes (from the memory available then and the number of layers built),
    and the spill file (created on the first page that has to leave a full pool).
    """

    def __init__(self, choice: KVChoice):
        self.choice = choice
        self.layers = 0
        self._auto_tokens: int | None | bool = False  # False: not computed yet
        self.spill = SpillFile(choice.spill_dir)

    def __call__(self) -> PagedKV:
        c = self.choice
        self.layers += 1
        pages = c.pool_pages()
        return PagedKV(
            page_tokens=c.page_tokens,
            budget=c.budget,
            sinks=c.sinks,
            recent=c.recent,
            mode=c.mode,
            pool_pages=pages if pages is not None else self._auto_pages,
            spill=self.spill,
        )

    def _auto_pages(self, page_bytes: int) -> int | None:
        """Per-layer pool pages of an auto pool (the same token count for every layer)."""
        P = self.choice.page_tokens
        if self._auto_tokens is False:
            from ..admission import available_memory

            self._auto_tokens = auto_pool_tokens(available_memory(), self.layers * page_bytes // P)
        if self._auto_tokens is None:
            return None
        from .policy import AUTO_MIN_PAGES

        return max(-(-self._auto_tokens // P), AUTO_MIN_PAGES)


def make_kv_factory(**options) -> Callable[[], object]:
    """A factory for the KV store the options ask for (validated with InvalidOptionError)."""
    choice = choose_kv(**options)
    if not choice.paged:
        return ContiguousKV
    return KVFactory(choice)


# Counters that every layer reports identically (summing them over layers would be wrong).
_SAME_PER_LAYER = frozenset({"decode_steps", "sparse_steps"})


def collect_kv_stats(state) -> dict:
    """Sum the numeric `kv_stats()` of every layer store that reports them, plus rates.

    Derived (when decode ran): pages_selected_per_step and kv_read_bytes_per_token (over all
    layers and KV heads), selection_time_share (selection / attention time of sparse steps;
    measured only with QWEN38_KV_PROFILE=1, else 0).
    """
    totals: dict = {}
    for layer in state.layers:
        report = getattr(layer, "kv_stats", None)
        if report is None:
            continue
        for key, value in report().items():
            if key in _SAME_PER_LAYER:
                totals[key] = max(totals.get(key, 0), value)
            else:
                totals[key] = totals.get(key, 0) + value
    steps = totals.get("decode_steps", 0)
    if steps:
        totals["pages_selected_per_step"] = totals.get("pages_selected", 0) / steps
        totals["kv_read_bytes_per_token"] = totals.get("kv_read_bytes", 0) / steps
        timed = totals.get("select_seconds", 0) + totals.get("attend_seconds", 0)
        totals["selection_time_share"] = totals.get("select_seconds", 0) / timed if timed else 0.0
    return totals
