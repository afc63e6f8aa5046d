"""The package's CUDA kernels (`kernels/`, installed as `qwen38_backend.kernels`) where present."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


@functools.cache
def kernel_module(name: str) -> ModuleType | None:
    """qwen38_backend.kernels.<name>, or None in a source tree that was not installed (the
    package maps `kernels/` to `qwen38_backend.kernels` at install): callers then run the op
    path. Cached: steps ask per layer."""
    try:
        return importlib.import_module(f"qwen38_backend.kernels.{name}")
    except ImportError:
        return None
