"""Typed errors: every bad input gets one of these with a message a user can act on."""

from __future__ import annotations


class Qwen38Error(Exception):
    """Base class for every error this package raises on purpose."""


class ModelNotFoundError(Qwen38Error):
    """A model name or path that does not resolve to weights."""


class ConfigError(Qwen38Error):
    """A config.json that is missing, unreadable, or describes something we do not support."""


class UnsupportedArchitectureError(ConfigError):
    """A model_type / architecture this engine does not implement."""


class WeightsError(Qwen38Error):
    """Missing, unexpected, mis-shaped or unreadable tensors."""


class TokenizerError(Qwen38Error):
    """A tokenizer or chat template that cannot be loaded or rendered."""


class DownloadError(Qwen38Error):
    """Fetching or verifying the demo model failed."""


class InvalidOptionError(Qwen38Error, ValueError):
    """A sampling or engine option with an invalid value."""


class AdmissionError(Qwen38Error):
    """A context or pool that does not fit in memory; the message carries the shortfall."""


class StateFileError(Qwen38Error):
    """A state file that is corrupt, truncated, foreign or from another format version."""


class Cancelled(Qwen38Error):
    """The caller stopped a generation (Ctrl-C, an abandoned stream) before it finished."""


class ContextWindowError(InvalidOptionError):
    """A prompt (plus max_tokens) that does not fit the model's window or the context option."""


class OutputCutError(Qwen38Error, ValueError):
    """A constrained answer (JSON schema, JSON mode, forced tool call) cut by max_tokens
    before it was complete: what was generated is not a valid value."""


class SpillError(Qwen38Error):
    """An I/O failure of the SSD spill tier (kv/spill.py), recorded when it happens and
    raised by the sequence's next read of spilled KV; reset the sequence to go on."""


class SpillDiskFullError(SpillError):
    """The spill file's disk is full (ENOSPC / EDQUOT); the sequence keeps working
    resident-only while its context fits the pool."""


class ShardingError(ConfigError):
    """A model cannot be split over the requested ranks (e.g. heads not divisible)."""


def __getattr__(name: str):
    if name == "CheckpointError":  # the name before "state file"; kept for callers that catch it
        import warnings

        warnings.warn(
            "qwen38_backend.errors.CheckpointError is deprecated; use StateFileError",
            DeprecationWarning,
            stacklevel=2,
        )
        return StateFileError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
