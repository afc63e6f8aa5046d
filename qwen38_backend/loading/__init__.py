"""Checkpoint loading: HF safetensors directories (plain or MLX-quantized) and GGUF files.

The registry and paths modules import no MLX, so light callers (the llm plugin at start-up)
can use them; `Checkpoint` and `read_checkpoint` load their heavy modules on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .checkpoint import Checkpoint, read_checkpoint

__all__ = ["Checkpoint", "read_checkpoint"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
