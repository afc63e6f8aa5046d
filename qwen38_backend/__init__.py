"""qwen38_backend: local long-context inference for the Qwen3.8 models on MLX."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .blas import use_system_openblas
from .cuda_graphs import use_graph_defaults
from .loading.paths import keep_kernel_cache

__version__ = "0.1.0"

use_system_openblas()  # before anything imports MLX (see blas.py)
keep_kernel_cache()  # compiled CUDA kernels outlive a reboot (see loading/paths.py)
use_graph_defaults()  # a decode token's launches in fewer, cached CUDA graphs (cuda_graphs.py)

if TYPE_CHECKING:
    import mlx.core as mx

    from .engine import Model


def load(
    path_or_name: str,
    dtype: str | None = None,
    keep_quantized: bool | None = None,
    group: mx.distributed.Group | None = None,
) -> Model:
    """Load a model by registry name (e.g. 'qwen38-demo') or path (HF directory or .gguf).

    dtype: compute dtype ('float32', 'bfloat16', 'float16'); default fp32 on CPU, the
    weights' own float dtype on GPU.
    keep_quantized: keep 4/8-bit weights packed (default: yes on GPU; on CPU they are
    dequantized when that fits in a quarter of RAM, since MLX's x86 quantized matmul is slow).
    group: an `mx.distributed` group (e.g. `mx.distributed.init()` under `mlx.launch`): the
    model is split over its ranks (tensor parallel, experts split on Flash-Next); every rank
    runs the same calls and gets the same logits. A size-1 group (or None) loads it whole.
    """
    from .loader import load_model

    return load_model(path_or_name, dtype, keep_quantized, group)


__all__ = ["load", "__version__"]
