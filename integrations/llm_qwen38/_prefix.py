"""The plugin's prefix store: checkpoints under `llm.user_dir()/qwen38/checkpoints`.

Sessions given this store look every prompt up in it (longest saved prefix, memory then
disk) and save checkpoints after each turn, so `llm -c` in a new process restores the
conversation instead of prefilling it again. The store refuses corrupt or foreign
checkpoints itself (the prompt is then recomputed, never wrong).

Without qwen38_backend.prefix_store (an older engine) `store()` is None and sessions only
reuse their live state.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from . import _home

_STORES: dict[Path, Any] = {}


def store() -> Any | None:
    """The prefix store for the plugin's checkpoint dir (one per process), or None."""
    directory = _home.checkpoints_dir()
    if directory not in _STORES:
        try:
            module = importlib.import_module("qwen38_backend.prefix_store")
        except ImportError:
            _STORES[directory] = None
        else:
            _STORES[directory] = module.PrefixStore(directory, max_bytes=_home.checkpoint_cap())
    return _STORES[directory]


def last_error() -> str | None:
    """The store's last refused / failed checkpoint message, if any."""
    s = _STORES.get(_home.checkpoints_dir())
    return getattr(s, "last_error", None) if s is not None else None
