"""Read weights from disk (HF directory or GGUF): config, lazy tensors and tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from ..errors import ConfigError, ModelNotFoundError, WeightsError
from . import quant
from .gguf import load_gguf, quantization_of
from .safetensors_io import load_directory

__all__ = ["Weights", "read_weights"]


@dataclass
class Weights:
    """Everything read from a model's files on disk; tensors are lazy (memory-mapped) MLX arrays.

    `tensors` is consumed by `models.assign.assign_weights` (emptied once the module holds
    them); the rest (config, tokenizer, source, ...) stays for the loaded Model."""

    config: dict[str, Any]
    tensors: dict[str, mx.array]
    quantization: dict[str, tuple[int, int]]
    generation_config: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None
    source: Path = Path()
    format: str = "safetensors"
    rope_interleaved: bool = False


def read_weights(path: str | Path, *, tokenizer: bool = True) -> Weights:
    """Read a model directory (HF layout) or a `.gguf` file.

    With `tokenizer=False` the tokenizer is not loaded (`Weights.tokenizer` is None).
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(f"{p}: no such file or directory")
    if p.is_file():
        if p.suffix.lower() == ".gguf" or _is_gguf(p):
            return _read_gguf(p, tokenizer)
        raise WeightsError(f"{p}: not a model directory or .gguf file")
    ggufs = sorted(p.glob("*.gguf"))
    if not (p / "config.json").exists() and len(ggufs) == 1:
        return _read_gguf(ggufs[0], tokenizer)
    return _read_directory(p, tokenizer)


def _is_gguf(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def _read_json(path: Path, *, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ConfigError(f"{path}: missing (a model directory needs a config.json)")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{path}: invalid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def _read_directory(p: Path, want_tokenizer: bool) -> Weights:
    config = _read_json(p / "config.json", required=True)
    weights = load_directory(p)
    return Weights(
        config=config,
        tensors=weights,
        quantization=quant.collect(weights, config),
        generation_config=_read_json(p / "generation_config.json", required=False),
        tokenizer=_tokenizer_from_dir(p) if want_tokenizer else None,
        source=p,
        format="safetensors",
        rope_interleaved=False,
    )


def _read_gguf(p: Path, want_tokenizer: bool) -> Weights:
    config, weights, generation_config, metadata = load_gguf(p)
    return Weights(
        config=config,
        tensors=weights,
        quantization=quantization_of(weights),
        generation_config=generation_config,
        tokenizer=_tokenizer_from_gguf(metadata) if want_tokenizer else None,
        source=p,
        format="gguf",
        rope_interleaved=False,  # llama Q/K rows are un-permuted by load_gguf
    )


def _tokenizer_from_dir(p: Path) -> Any:
    from ..tokenizer import Tokenizer  # lazy: keeps loading usable without tokenizer deps

    return Tokenizer.from_dir(p)


def _tokenizer_from_gguf(metadata: dict[str, Any]) -> Any:
    from ..tokenizer import Tokenizer

    return Tokenizer.from_gguf_metadata(metadata)
