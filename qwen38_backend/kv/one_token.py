"""Attention of one query token over a store's K/V: the split-KV CUDA kernel
(kernels/decode_attention.py) where it runs and its probe agreed with MLX, else
mx.fast.scaled_dot_product_attention (CPU, Metal, a source tree without the kernels, a shape
the kernel does not take, QWEN38_DECODE_ATTN_KERNEL=off). A step of a few rows attends row
by row through it (`attend_rows`), so each row is what a one-token step computes (rows.py)."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx


def _kernel_module():
    """kernels/decode_attention.py, or None in a source tree that was not installed (the
    package maps `kernels/` to `qwen38_backend.kernels` at install)."""
    try:
        from ..kernels import decode_attention
    except ImportError:
        return None
    return decode_attention


def attend_one_token(q: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """q [1, Hq, 1, D] over keys / values [1, Hkv, L, D] (views are fine) -> [1, Hq, 1, D]."""
    kernel = _kernel_module()
    if kernel is not None and kernel.usable(q, keys, values):
        return kernel.decode_attention(q, keys, values, scale)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)


def attend_rows(
    q: mx.array, attend_one: Callable[[mx.array, int], mx.array], past: int
) -> mx.array:
    """Causal attention of q [1, Hq, T, D] (positions past .. past+T-1), row by row:
    `attend_one(q_row, t)` attends row t as a decode step at context past + t + 1 would."""
    rows = [attend_one(q[:, :, t : t + 1], t) for t in range(q.shape[2])]
    return rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=2)
