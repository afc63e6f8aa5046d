"""Use the system's OpenBLAS for MLX's CPU matmuls when the MLX wheel bundles reference BLAS.

MLX's Linux CPU wheel links a reference BLAS that runs fp32 matmul ~17x slower than OpenBLAS
(measured on this 2-core x86 machine: 242 ms vs 14 ms for 512x576 @ 576x1536). Loading
OpenBLAS with RTLD_GLOBAL before MLX's library is loaded makes MLX's cblas calls bind to it,
the same effect as LD_PRELOAD. Nothing is downloaded: a machine without OpenBLAS (e.g.
Debian's libopenblas0-pthread) keeps the bundled BLAS. QWEN38_BLAS=off disables the lookup,
QWEN38_BLAS=/path/to/libopenblas.so picks a library.
"""

from __future__ import annotations

import ctypes
import os
import sys

ENV = "QWEN38_BLAS"
CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

loaded: str | None = None  # the library in use, for `qwen38 info` and benchmarks


def use_system_openblas() -> str | None:
    """Load OpenBLAS globally if MLX is not loaded yet (Linux only); return its path."""
    global loaded
    choice = os.environ.get(ENV, "").strip()
    if loaded or not sys.platform.startswith("linux") or choice.lower() in ("off", "0", "no"):
        return loaded
    if "mlx.core" in sys.modules:
        return None  # too late: MLX has bound its BLAS already
    for path in (choice,) if choice else CANDIDATES:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            loaded = path
            break
    return loaded
