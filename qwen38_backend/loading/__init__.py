"""Reading weights: HF safetensors directories (plain or MLX-quantized) and GGUF files.

The registry and paths modules import no MLX, so light callers (the llm plugin at start-up)
can use them; `Weights` and `read_weights` load their heavy modules on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .weights import Weights, read_weights

__all__ = ["Weights", "read_weights"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import weights

        return getattr(weights, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
