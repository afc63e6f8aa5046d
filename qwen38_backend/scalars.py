"""Small int32 arrays made once per value, for a decode step's per-layer inputs.

A step asks for the same few small values in every layer (its position, a page count, a
tail block): made once per value, the host builds and writes one array where it built one
per layer. On CUDA, MLX also keeps every array of 8 bytes or less in one managed-memory pool
advised read-mostly, so each new one is a host write into pages the device reads its other
scalars from (whether that costs the device time is for a GPU run to measure).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx


@lru_cache(maxsize=64)
def int32(value: int) -> mx.array:
    """An int32 scalar array of `value` (shape ())."""
    return mx.array(value, dtype=mx.int32)


@lru_cache(maxsize=64)
def int32s(values: tuple[int, ...]) -> mx.array:
    """An int32 array of `values` (shape (len(values),))."""
    return mx.array(values, dtype=mx.int32)
