"""MLX's CUDA graph settings for decode: larger graphs, more of them cached.

MLX's CUDA backend records kernels into CUDA graphs of `MLX_MAX_OPS_PER_BUFFER` launches
(its default 20) and keeps `MLX_CUDA_GRAPH_CACHE_SIZE` instantiated graphs (its default 100).
A decode token is ~700 (Qwen3.8-27B) to ~1,700 (Flash-Next) launches, so with MLX's
defaults a token is cut into many small graphs and the cache cannot hold a token's worth:
graphs are instantiated again every token, host time a host-bound step pays in full.
Flash-Next (48 layers, 4-bit experts, H200) decoded 40.0 tok/s with 100 and 1,000 against
32.1 with MLX's defaults, and 42.0 against 37.6 on another machine with the package setting
them (benchmarks/results/h200/flash_graph_settings_s33{,b}.json); 200 launches a graph and
no CUDA graphs both measured below 100 (flash_graph_settings_s33c.json). The 27B at 4K:
69.9 against 68.0 tok/s (graph_settings_27b_s33.json).

MLX reads both at its first use of the GPU, so they are set when the package is imported,
only where the user has not set them, and only on Linux (MLX's GPU backend there is CUDA;
Metal's command buffers read the first variable too, unmeasured here).
"""

from __future__ import annotations

import os
import sys

GRAPH_DEFAULTS = {"MLX_MAX_OPS_PER_BUFFER": "100", "MLX_CUDA_GRAPH_CACHE_SIZE": "1000"}


def use_graph_defaults() -> None:
    """Set GRAPH_DEFAULTS in the environment where the user has not (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    for name, value in GRAPH_DEFAULTS.items():
        os.environ.setdefault(name, value)
