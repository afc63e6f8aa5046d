"""Where qwen38 keeps its registry and cached downloads."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

HOME_ENV = "QWEN38_HOME"


def data_dir() -> Path:
    """`$QWEN38_HOME` if set, else the platform's user data directory for qwen38."""
    home = os.environ.get(HOME_ENV)
    if home:
        return Path(home).expanduser()
    return Path(platformdirs.user_data_dir("qwen38"))


def cache_dir() -> Path:
    """`$QWEN38_HOME/cache` if QWEN38_HOME is set, else the platform's user cache directory."""
    home = os.environ.get(HOME_ENV)
    if home:
        return Path(home).expanduser() / "cache"
    return Path(platformdirs.user_cache_dir("qwen38"))
