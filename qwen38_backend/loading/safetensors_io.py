"""Safetensors weights: single file or sharded, loaded lazily with `mx.load`."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import mlx.core as mx

from ..errors import WeightsError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024


def validate_header(path: Path) -> dict[str, dict]:
    """Parse and sanity-check a safetensors header; return its tensor entries.

    Catches garbage bytes and truncated files before `mx.load` (whose reads are lazy and
    would otherwise fail, or read garbage, only at eval time).
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise WeightsError(f"{path}: not a safetensors file ({size} bytes, no header)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(_MAX_HEADER, size - 8):
                raise WeightsError(
                    f"{path}: corrupt safetensors header (declared header length {header_len}, "
                    f"file size {size} bytes)"
                )
            header_bytes = f.read(header_len)
    except OSError as e:
        raise WeightsError(f"{path}: cannot read safetensors file: {e}") from e
    try:
        header = json.loads(header_bytes)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise WeightsError(f"{path}: corrupt safetensors header ({e})") from e
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    _check_extent(path, tensors, size - 8 - header_len)
    return tensors


def _check_extent(path: Path, tensors: dict[str, dict], data_size: int) -> None:
    """Every tensor's byte range must lie inside the file's data section."""
    for name, info in tensors.items():
        try:
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightsError(f"{path}: corrupt safetensors header entry for {name!r}") from e
        if not 0 <= start <= end or end > data_size:
            raise WeightsError(
                f"{path}: truncated or corrupt: tensor {name!r} needs bytes {start}..{end} of the "
                f"data section, which has {data_size} bytes"
            )


def load_file(path: Path) -> dict[str, mx.array]:
    """Load one safetensors file lazily (memory-mapped by MLX; nothing is evaluated)."""
    validate_header(path)
    try:
        arrays = mx.load(str(path), format="safetensors")
    except Exception as e:  # MLX raises RuntimeError / ValueError on bad files
        raise WeightsError(f"{path}: cannot load safetensors file: {e}") from e
    return dict(arrays)


def load_sharded(directory: Path) -> dict[str, mx.array]:
    """Load the shards named by `model.safetensors.index.json`."""
    index_path = directory / INDEX_FILE
    weight_map = _read_weight_map(index_path)
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    weights: dict[str, mx.array] = {}
    for shard, names in sorted(by_shard.items()):
        shard_path = directory / shard
        if not shard_path.is_file():
            raise WeightsError(
                f"{index_path}: shard {shard!r} is missing from {directory} "
                f"(it holds {len(names)} tensors, e.g. {names[0]!r})"
            )
        arrays = load_file(shard_path)
        missing = [n for n in names if n not in arrays]
        if missing:
            raise WeightsError(
                f"{shard_path}: {len(missing)} tensors listed in {INDEX_FILE} are not in this "
                f"shard: {', '.join(sorted(missing)[:10])}"
            )
        weights.update({n: arrays[n] for n in names})
    return weights


def _read_weight_map(index_path: Path) -> dict[str, str]:
    try:
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("weight_map is empty or not an object")
    except OSError as e:
        raise WeightsError(f"{index_path}: cannot read: {e}") from e
    except (ValueError, KeyError, TypeError) as e:
        raise WeightsError(f"{index_path}: invalid index ({e!s})") from e
    return {str(k): str(v) for k, v in weight_map.items()}


def load_directory(directory: Path) -> dict[str, mx.array]:
    """Load `model.safetensors`, the sharded index, or a lone `*.safetensors` set."""
    if (directory / INDEX_FILE).is_file():
        return load_sharded(directory)
    if (directory / SINGLE_FILE).is_file():
        return load_file(directory / SINGLE_FILE)
    files = sorted(directory.glob("*.safetensors"))
    if files:
        weights: dict[str, mx.array] = {}
        for f in files:
            weights.update(load_file(f))
        return weights
    present = sorted(p.name for p in directory.iterdir())[:20]
    raise WeightsError(
        f"{directory}: no weights found: looked for {SINGLE_FILE}, {INDEX_FILE} and "
        f"*.safetensors (directory holds: {', '.join(present) or 'nothing'})"
    )
