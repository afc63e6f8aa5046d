"""Attention of one query token over a store's K/V: the split-KV CUDA kernel
(kernels/decode_attention.py) where it runs and its probe agreed with MLX, else
mx.fast.scaled_dot_product_attention (CPU, Metal, a source tree without the kernels, a shape
the kernel does not take, QWEN38_DECODE_ATTN_KERNEL=off). A step of a few rows attends row
by row through it (`attend_rows`), so each row is what a one-token step computes (rows.py)."""

from __future__ import annotations

import mlx.core as mx

from ..kernel_import import kernel_module


def attend_one_token(q: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """q [1, Hq, 1, D] over keys / values [1, Hkv, L, D] (views are fine) -> [1, Hq, 1, D]."""
    return attend_rows(q, keys, values, scale)


def attend_gathered(q: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """One query token q [1, Hq, 1, D] over gathered keys / values [1, Hkv, W, D], every key
    visible (QSA's selected tokens): one MLX attention with each KV head's query heads as
    its rows, so no key is broadcast to every query head (on CUDA a ~25 MB copy a layer).

    Not the split-KV kernel: it takes at most 8 query heads a KV head (Flash-Next has 12);
    run on two halves of them it cost the same device time over ~2,051 keys (H200, session
    30: ~86 us a layer in 9 launches against ~100 us in 5) and more launches."""
    hkv, d = keys.shape[1], q.shape[-1]
    rows = q.reshape(1, hkv, q.shape[1] // hkv, d)
    out = mx.fast.scaled_dot_product_attention(rows, keys, values, scale=scale)
    return out.reshape(q.shape)


# False: the Quest path gathers its rows before the kernel even where the kernel could read
# the pages in place (benchmarks compare the two in one run).
READ_PAGES_IN_PLACE = True


def pages_in_place(q: mx.array, pool_k: mx.array, pool_v: mx.array, page_tokens: int) -> bool:
    """Whether attend_pages reads these pages in place (the CUDA kernel runs here for these
    shapes and its paged probe passed), rather than gathering their rows first."""
    kernel = kernel_module("decode_attention")
    return (
        READ_PAGES_IN_PLACE and kernel is not None and kernel.usable(q, pool_k, pool_v, page_tokens)
    )


def attend_pages(
    q: mx.array,
    pool_k: mx.array,
    pool_v: mx.array,
    pages: mx.array,
    length: int,
    page_tokens: int,
    scale: float,
    shared: bool = False,
) -> mx.array:
    """q [1, Hq, 1, D] over the first `length` rows of a page list: pages int32 [Hkv, n] of
    a pool [1, Hkv, slots * page_tokens, D] (`shared`: every row of pages is the same list).
    The CUDA kernel reads the pages in place; elsewhere the rows are gathered first (the
    same bits: the kernel's probe checks it)."""
    if pages.ndim != 2 or pages.shape[0] != pool_k.shape[1]:
        raise ValueError(f"pages must be [Hkv={pool_k.shape[1]}, n], got {pages.shape}")
    if pages_in_place(q, pool_k, pool_v, page_tokens):
        kernel = kernel_module("decode_attention")
        return kernel.decode_attention(
            q, pool_k, pool_v, scale, pages=pages, page_tokens=page_tokens, length=length
        )
    P = page_tokens
    offsets = mx.arange(P, dtype=mx.int32)
    # squeeze, not [0]: integer indexing is a gather in MLX (a copy of the whole pool)
    pool_k, pool_v = pool_k.squeeze(0), pool_v.squeeze(0)
    if shared:  # one page set: a plain gather of rows for every head
        rows = (pages[0, :, None] * P + offsets).reshape(-1)[:length]
        keys, values = pool_k[:, rows][None], pool_v[:, rows][None]
    else:
        rows = (pages[:, :, None] * P + offsets).reshape(pages.shape[0], -1)[:, :length]
        heads = mx.arange(pages.shape[0])[:, None]
        keys, values = pool_k[heads, rows][None], pool_v[heads, rows][None]
    return attend_one_token(q, keys, values, scale)


def attend_rows(q: mx.array, keys: mx.array, values: mx.array, scale: float) -> mx.array:
    """Causal attention of the newest T positions, q [1, Hq, T, D], over keys / values
    [1, Hkv, L, D]: row t reads the first L - T + 1 + t keys, with the bits of a one-token
    step at that length (the kernel takes every row in one call; elsewhere row by row)."""
    kernel = kernel_module("decode_attention")
    if kernel is not None and kernel.usable(q, keys, values):
        return kernel.decode_attention(q, keys, values, scale)
    rows, length = q.shape[2], keys.shape[2]
    outs = []
    for t in range(rows):
        n = length - rows + 1 + t
        q_row = q if rows == 1 else q[:, :, t : t + 1]
        k_row, v_row = (keys, values) if n == length else (keys[..., :n, :], values[..., :n, :])
        outs.append(mx.fast.scaled_dot_product_attention(q_row, k_row, v_row, scale=scale))
    return outs[0] if rows == 1 else mx.concatenate(outs, axis=2)
