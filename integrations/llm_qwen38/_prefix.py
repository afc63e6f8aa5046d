"""The plugin's prefix store: state files under `llm.user_dir()/qwen38/checkpoints` (the
directory keeps its pre-rename name so stored files stay found).

Sessions given this store look every prompt up in it (longest saved prefix, memory then
disk) and save state files after each turn, so `llm -c` in a new process restores the
conversation instead of prefilling it again. The store refuses corrupt or foreign state
files itself (the prompt is then recomputed, never wrong).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from . import _home

if TYPE_CHECKING:
    from qwen38_backend.prefix_store import PrefixStore

_STORES: dict[Path, PrefixStore] = {}


def store() -> PrefixStore:
    """The prefix store for the plugin's state-file directory (one per process)."""
    # imported here: the plugin's start-up (llm --help, llm models) must not import MLX
    from qwen38_backend.prefix_store import PrefixStore

    directory = _home.state_files_dir()
    if directory not in _STORES:
        _STORES[directory] = PrefixStore(directory, max_bytes=_home.prefix_store_cap())
    return _STORES[directory]


def last_error() -> str | None:
    """The store's last refused / failed state-file message, if any."""
    s = _STORES.get(_home.state_files_dir())
    return s.last_error if s is not None else None
