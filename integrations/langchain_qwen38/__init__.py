"""LangChain integration for qwen38_backend: `ChatQwen38`, a local chat model."""

from __future__ import annotations

from .chat_models import ChatQwen38

__all__ = ["ChatQwen38"]
