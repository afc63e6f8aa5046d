"""Where qwen38 keeps its registry and cached downloads: one home for every entry point.

The `qwen38` command, the llm plugin and ChatQwen38 all use these two directories, so a
model registered through one is found by the others and the demo model is fetched once.
`QWEN38_HOME` moves both (registry in it, cache in `$QWEN38_HOME/cache`); otherwise they
are the platform's user data and cache directories (platformdirs), e.g. on Linux
`~/.local/share/qwen38` and `~/.cache/qwen38`, on macOS `~/Library/Application Support/qwen38`
and `~/Library/Caches/qwen38`.

MLX's CUDA backend compiles the fused kernels of compiled graphs (and our custom kernels) at
their first use and keeps them in a PTX cache, by default under /tmp (gone at reboot: measured
on an H200, a cold cache cost a 64-layer prefill tens of seconds). Unless MLX_PTX_CACHE_DIR
is set, qwen38 keeps that cache in its own cache directory, one folder per MLX version.
MLX finds a kernel there by name alone, so our kernels' names carry a digest of their text
(kernels/jit.py): an upgraded kernel compiles anew instead of running its old code.
"""

from __future__ import annotations

import os
from importlib import metadata
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


PTX_CACHE_ENV = "MLX_PTX_CACHE_DIR"


def keep_kernel_cache() -> None:
    """Point MLX's CUDA kernel cache at `cache_dir()/mlx-kernels/<mlx version>` unless the
    user chose one (MLX reads the variable at its first kernel compilation)."""
    if os.environ.get(PTX_CACHE_ENV):
        return
    try:
        version = metadata.version("mlx")
    except metadata.PackageNotFoundError:
        version = "unknown"
    os.environ[PTX_CACHE_ENV] = str(cache_dir() / "mlx-kernels" / version)
