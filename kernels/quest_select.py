"""Quest page keys on CUDA in one launch (kv/quest.py's selection, before its top-k).

Why: the op path scores a decode step's pages with two fp32 matmuls over the page metadata,
so every step casts the whole bf16 metadata [Hkv, capacity, D] to fp32 twice (at 262,144
tokens ~100 MB of traffic per attention layer and token), then masks the dead and forced
pages and builds the order keys in ~10 more launches per layer.

One warp per (row, page): the block first sums relu(q) and min(q, 0) over each KV group's
query heads into shared memory; each warp then reads its page's bf16 min / max rows in place
(coalesced across the lanes), converts in registers, reduces the bound over the dims (and
over the KV heads for a shared selection) in a fixed order, and writes the page's uint64
order key: (the bound's order-preserving bits) << 32 | ~page id, +inf for forced pages
(sinks, the recent window, the open page), -inf past the live pages. The bound sums in
another order than the op path's matmuls (fp32 rounding apart); kv/quest.py probes the
selection against the op path once per shape before it uses the kernel (this module imports
nothing of the package).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from .jit import cuda_kernel

THREADS = 256  # 8 warps: 8 pages per block

_KEYS = """
    constexpr int WARPS = __THREADS__ / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int hkv = kmax_shape[0], capacity = kmax_shape[1];
    const int group = q_shape[0] / hkv;
    const int row = blockIdx.y;  // SHARED: 0 (every KV head summed), else the KV head
    const int page = blockIdx.x * WARPS + warp;
    __shared__ float qs[2 * HKV * D];  // [relu(q) | min(q, 0)] summed per KV group

    for (int i = threadIdx.x; i < HKV * D; i += __THREADS__) {
        const int h = i / D, d = i % D;
        float pos = 0.0f, neg = 0.0f;
        for (int g = 0; g < group; ++g) {
            const float x = static_cast<float>(q[(h * group + g) * D + d]);
            pos += fmaxf(x, 0.0f);
            neg += fminf(x, 0.0f);
        }
        qs[i] = pos;
        qs[HKV * D + i] = neg;
    }
    __syncthreads();
    if (page >= capacity) return;

    const int h0 = SHARED ? 0 : row, h1 = SHARED ? hkv : row + 1;
    float acc = 0.0f;
    for (int h = h0; h < h1; ++h) {
        const long long at = ((long long)h * capacity + page) * D;
        for (int d = lane; d < D; d += 32) {
            acc += qs[h * D + d] * static_cast<float>(kmax[at + d]);
            acc += qs[HKV * D + h * D + d] * static_cast<float>(kmin[at + d]);
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane != 0) return;

    const int n_pages = counts[0];
    const int first_recent = max(n_pages - 1 - RECENT, 0);
    const bool live = page < n_pages;
    const bool forced = live && (page < SINKS || page >= first_recent);
    const float inf = __int_as_float(0x7f800000);
    const float score = !live ? -inf : forced ? inf : acc;
    const unsigned bits = __float_as_uint(score + 0.0f);  // -0.0 -> +0.0
    const unsigned ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    keys[(long long)row * capacity + page] =
        ((unsigned long long)ordered << 32) | (0xFFFFFFFFull - (unsigned long long)page);
"""


@functools.cache
def _keys_kernel():
    return cuda_kernel(
        name="qwen38_quest_page_keys",
        input_names=["q", "kmin", "kmax", "counts"],
        output_names=["keys"],
        source=_KEYS.replace("__THREADS__", str(THREADS)),
    )


def page_keys(
    q: mx.array,
    kmin: mx.array,
    kmax: mx.array,
    n_pages: mx.array,
    sink_pages: int,
    recent_pages: int,
    shared: bool,
) -> mx.array:
    """uint64 order keys [rows, capacity] of every page slot (rows: 1 when `shared`, else
    Hkv): quest.order_keys of the Quest bound of q [Hq, D] over kmin / kmax [Hkv, capacity,
    D], +inf for the forced pages and -inf past n_pages (an int32 scalar array)."""
    hkv, capacity, d = kmax.shape
    rows = 1 if shared else hkv
    warps = THREADS // 32
    (keys,) = _keys_kernel()(
        inputs=[q, kmin, kmax, n_pages.reshape(1)],
        template=[
            ("HKV", hkv),
            ("D", d),
            ("SINKS", sink_pages),
            ("RECENT", recent_pages),
            ("SHARED", int(shared)),
        ],
        grid=(-(-capacity // warps) * THREADS, rows, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, capacity)],
        output_dtypes=[mx.uint64],
    )
    return keys


def supported(q: mx.array, kmin: mx.array, kmax: mx.array) -> bool:
    """Whether this device and shapes can run the kernel at all (no probe): the summed
    query rows fit the block's 48 KiB of static shared memory."""
    return (
        mx.default_device() == mx.gpu
        and mx.cuda.is_available()
        and kmin.shape == kmax.shape
        and kmax.ndim == 3
        and q.ndim == 2
        and q.shape[1] == kmax.shape[2]
        and q.shape[0] % kmax.shape[0] == 0
        and 2 * kmax.shape[0] * kmax.shape[2] * 4 <= 48 * 1024
    )
