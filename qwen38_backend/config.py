"""Reading and validating config.json fields with errors that name the key and the model type."""

from __future__ import annotations

from typing import Any

from .errors import ConfigError, UnsupportedArchitectureError

DENSE_TYPES = ("llama", "qwen2", "qwen3")
QWEN38_TYPES = ("qwen3_5", "qwen4_exp")


def text_config(config: dict) -> dict:
    """The text part of a config: `text_config` for multimodal wrappers, else the config."""
    inner = config.get("text_config")
    if isinstance(inner, dict):
        merged = dict(inner)
        merged.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
        return merged
    return config


def model_family(config: dict) -> str:
    """'dense', 'qwen3_5' or 'qwen4_exp' from model_type (outer or text_config)."""
    mtype = str(config.get("model_type", ""))
    inner = text_config(config).get("model_type", mtype)
    for name in (mtype, inner):
        if name in DENSE_TYPES:
            return "dense"
        if name.startswith("qwen4_exp"):
            return "qwen4_exp"
        if name.startswith("qwen3_5"):
            return "qwen3_5"
    supported = ", ".join(DENSE_TYPES + QWEN38_TYPES)
    raise UnsupportedArchitectureError(
        f"model_type {mtype or '(missing)'!r} is not supported; supported: {supported}"
    )


_MISSING = object()


def field(cfg: dict, key: str, kind: type, default: Any = _MISSING, where: str = "config") -> Any:
    """cfg[key] checked against `kind`; a clear ConfigError when missing or mistyped."""
    if key not in cfg or cfg[key] is None:
        if default is _MISSING:
            raise ConfigError(f"{where}: required field {key!r} is missing")
        return default
    value = cfg[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(
            f"{where}: field {key!r} should be {kind.__name__}, "
            f"got {type(value).__name__} {value!r}"
        )
    if kind in (int, float) and value < 0:
        raise ConfigError(f"{where}: field {key!r} must not be negative, got {value}")
    return value
