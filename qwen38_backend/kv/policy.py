"""Which KV store a request gets, decided once from its options.

`choose_kv(**options)` validates the KV options and returns a `KVChoice`; the KV factory
(`make_kv_factory`) builds stores from it and admission's memory plan sizes them from it, so
what is planned is what is allocated. `auto_pool_tokens` is the one rule for the pool size
when `kv_pool_tokens` is not given.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidOptionError

KV_OPTION_KEYS = frozenset(
    {
        "kv_paged",
        "kv_topk",
        "kv_page_tokens",
        "kv_sinks",
        "kv_recent",
        "kv_pool_tokens",
        "kv_spill_dir",
    }
)
# 32-token pages: 16 select more of the attention mass per K/V byte but scan and keep 2x the
# metadata; at equal K/V + metadata bytes 32 does as well or better (README, "Sparse decode
# quality"; benchmarks/results/cpu/quest_recall_demo.json).
KV_DEFAULTS = {"kv_topk": 2048, "kv_page_tokens": 32, "kv_sinks": 32, "kv_recent": 64}
_MINIMUM = {"kv_topk": 1, "kv_page_tokens": 1, "kv_sinks": 0, "kv_recent": 0, "kv_pool_tokens": 1}
_MAX_PAGE_TOKENS = 4096

# The auto pool leaves this much of the memory available when the sequence starts for
# activations, the OS and other programs (weights are loaded before: already not available).
AUTO_HEADROOM_FRACTION = 0.25
AUTO_HEADROOM_MIN = 1 << 30
AUTO_MIN_PAGES = 64


@dataclass(frozen=True)
class KVChoice:
    """The KV store of a request: contiguous, or paged with these sizes."""

    paged: bool
    mode: str  # "off", "on" (Quest whenever the budget is below the context) or "auto"
    page_tokens: int
    budget: int  # kv_topk: tokens a sparse step may read (sinks and recent window included)
    sinks: int
    recent: int
    pool_tokens: int | None  # resident rows per attention layer; None: auto from RAM
    spill_dir: Path | None  # None: spill_root() (under the engine's cache dir)

    def pool_pages(self) -> int | None:
        if self.pool_tokens is None:
            return None
        return -(-self.pool_tokens // self.page_tokens)


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


def choose_kv(**options) -> KVChoice:
    """Validate KV options (InvalidOptionError) and decide the store.

    kv_paged unset: "off", or "on" when any other kv_ option is given. kv_pool_tokens: an
    integer, or "auto"/unset (sized from free memory when the sequence first writes).
    kv_spill_dir: a directory for the spill files of sequences whose pool is full.
    """
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
    pool = options.get("kv_pool_tokens", "auto")
    pool_tokens = None if pool == "auto" else _int_option("kv_pool_tokens", pool)
    if pool_tokens is not None and pool_tokens < 2 * sized["kv_page_tokens"]:
        raise InvalidOptionError(
            f"kv_pool_tokens={pool_tokens}: must hold at least two pages "
            f"({2 * sized['kv_page_tokens']} tokens with kv_page_tokens={sized['kv_page_tokens']})"
        )
    spill = options.get("kv_spill_dir")
    if spill is not None and not isinstance(spill, (str, Path)):
        raise InvalidOptionError(f"kv_spill_dir={spill!r}: must be a directory path")
    if spill is not None and Path(spill).expanduser().exists():
        if not Path(spill).expanduser().is_dir():  # found here, not when a page first spills
            raise InvalidOptionError(f"kv_spill_dir={str(spill)!r}: is a file, not a directory")
    paged_only = sorted(set(options) - {"kv_paged"})  # every other kv_ option is the pages'
    if paged == "off" and paged_only:  # they would do nothing: say so before any work
        raise InvalidOptionError(
            f"KV options {', '.join(paged_only)} need the paged KV store (kv_paged='on' or "
            "'auto', or leave kv_paged unset); kv_paged='off' keeps one contiguous buffer per "
            "layer and attends every token"
        )
    return KVChoice(
        paged=paged != "off",
        mode=paged,
        page_tokens=sized["kv_page_tokens"],
        budget=sized["kv_topk"],
        sinks=sized["kv_sinks"],
        recent=sized["kv_recent"],
        pool_tokens=pool_tokens,
        spill_dir=Path(spill).expanduser() if spill is not None else None,
    )


def auto_pool_tokens(available: int | None, token_bytes: int) -> int | None:
    """Resident KV rows per attention layer for an auto pool: the memory available when the
    sequence starts, less the headroom, over `token_bytes` (K+V of one token across every
    attention layer of the sequence), with room beside the pool for the buffer its last
    growth replaces (under 2/3 of the pool: kv.pool.grown_capacity), so 3/5 of what is left
    goes to the pool. None (unbounded) when availability is unknown."""
    if available is None or token_bytes <= 0:
        return None
    headroom = max(int(available * AUTO_HEADROOM_FRACTION), AUTO_HEADROOM_MIN)
    return max(available - headroom, 0) * 3 // 5 // token_bytes


def spill_root() -> Path:
    """Default directory of spill files: under the engine's cache dir."""
    from ..loading.paths import cache_dir

    return cache_dir() / "kv-spill"
