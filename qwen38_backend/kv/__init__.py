"""KV stores for attention layers and the options that pick one.

`make_kv_factory(**kv_options)` returns a zero-argument callable that builds one layer's KV
store; models call it once per attention layer in `make_state`. Every store implements
`attend(q, k, v, scale)` plus the LayerState protocol (state.py).

Options (wherever sampling options are accepted):
- kv_paged: "off" (contiguous store), "on" (paged, Quest whenever the budget does not cover
  the context), "auto" (paged, Quest from 4x the budget on). Unset: "off", or "on" when any
  other kv_ option is given.
- kv_topk: token budget of the pages a decode step reads (sinks and recent window included),
  rounded up to whole pages; a budget >= the context means dense.
- kv_page_tokens: tokens per page. kv_sinks: leading tokens always selected. kv_recent: tokens
  before the open page always selected (both rounded up to whole pages).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from ..errors import InvalidOptionError
from .contiguous import ContiguousKV
from .paged import PagedKV, PagePool

KV_OPTION_KEYS = frozenset({"kv_paged", "kv_topk", "kv_page_tokens", "kv_sinks", "kv_recent"})

KV_DEFAULTS = {"kv_topk": 2048, "kv_page_tokens": 32, "kv_sinks": 32, "kv_recent": 64}
_MINIMUM = {"kv_topk": 1, "kv_page_tokens": 1, "kv_sinks": 0, "kv_recent": 0}
_MAX_PAGE_TOKENS = 4096

__all__ = [
    "KV_OPTION_KEYS",
    "KV_DEFAULTS",
    "ContiguousKV",
    "PagedKV",
    "PagePool",
    "collect_kv_stats",
    "make_kv_factory",
]


def _int_option(name: str, value) -> int:
    # CLIs hand options over as strings; accept decimal strings, refuse bools and floats.
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidOptionError(f"{name}={value!r}: must be an integer")
    if value < _MINIMUM[name]:
        raise InvalidOptionError(f"{name}={value}: must be >= {_MINIMUM[name]}")
    if name == "kv_page_tokens" and value > _MAX_PAGE_TOKENS:
        raise InvalidOptionError(f"{name}={value}: must be <= {_MAX_PAGE_TOKENS}")
    return value


def make_kv_factory(**options) -> Callable[[], object]:
    """A factory for the KV store the options ask for (validated with InvalidOptionError)."""
    unknown = set(options) - KV_OPTION_KEYS
    if unknown:
        raise InvalidOptionError(f"unknown KV option(s): {', '.join(sorted(unknown))}")
    options = {k: v for k, v in options.items() if v is not None}
    sized = {name: _int_option(name, options.get(name, KV_DEFAULTS[name])) for name in KV_DEFAULTS}
    paged = options.get("kv_paged")
    if paged is None:
        paged = "on" if set(options) - {"kv_paged"} else "off"
    if paged not in ("on", "off", "auto"):
        raise InvalidOptionError(f"kv_paged={paged!r}: must be 'on', 'off' or 'auto'")
    if paged == "off":
        return ContiguousKV
    return functools.partial(
        PagedKV,
        page_tokens=sized["kv_page_tokens"],
        topk=sized["kv_topk"],
        sinks=sized["kv_sinks"],
        recent=sized["kv_recent"],
        mode=paged,
    )


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
