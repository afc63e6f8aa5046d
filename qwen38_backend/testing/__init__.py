"""Test and demo helpers that ship with the package (`qwen38 make-tiny`): random tiny
weights in the real layouts, written with numpy + safetensors only (no torch)."""

from __future__ import annotations

from pathlib import Path

from ..errors import InvalidOptionError

ARCHES = ("qwen3_5", "qwen4_exp", "llama", "qwen2", "qwen3")


def make_tiny_weights(arch: str, directory: str | Path, seed: int = 0, **overrides) -> Path:
    """Write a complete random weights directory for `arch`; deterministic in `seed`.

    Returns the directory. `overrides` are passed to the per-architecture writer (e.g.
    `dtype="bfloat16"`, or for qwen3_5 `dims="27b", num_layers=4`).
    """
    directory = Path(directory)
    if arch == "qwen3_5":
        from .tiny_qwen3_5 import write_tiny_qwen3_5

        return write_tiny_qwen3_5(directory, seed, **overrides)
    if arch == "qwen4_exp":
        from .tiny_qwen4_exp import write_tiny_qwen4_exp

        return write_tiny_qwen4_exp(directory, seed, **overrides)
    if arch in ("llama", "qwen2", "qwen3"):
        raise InvalidOptionError(
            f"make_tiny_weights({arch!r}) is not available yet: the dense families have "
            "committed fixtures under tests/fixtures/dense (scripts/make_dense_fixtures.py)"
        )
    raise InvalidOptionError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHES)}")
