"""KV stores for attention layers and the options that pick one.

`make_kv_factory(**kv_options)` returns a zero-argument callable that builds one layer's KV
store; models call it once per attention layer in `make_state`. Every store implements
`attend(q, k, v, scale)` plus the LayerState protocol (state.py).
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import InvalidOptionError
from .contiguous import ContiguousKV

KV_OPTION_KEYS = frozenset({"kv_paged", "kv_topk", "kv_page_tokens", "kv_sinks", "kv_recent"})


def make_kv_factory(**options) -> Callable[[], object]:
    """A factory for the KV store the options ask for (contiguous until the paged store lands)."""
    unknown = set(options) - KV_OPTION_KEYS
    if unknown:
        raise InvalidOptionError(f"unknown KV option(s): {', '.join(sorted(unknown))}")
    paged = options.get("kv_paged") or "off"
    if paged not in ("on", "off", "auto"):
        raise InvalidOptionError(f"kv_paged={paged!r}: must be 'on', 'off' or 'auto'")
    return ContiguousKV


def collect_kv_stats(state) -> dict:
    """Sum the numeric `kv_stats()` of every layer store that reports them."""
    totals: dict = {}
    for layer in state.layers:
        report = getattr(layer, "kv_stats", None)
        if report is None:
            continue
        for key, value in report().items():
            totals[key] = totals.get(key, 0) + value
    return totals
