"""Quest page keys on CUDA in one launch (kv/quest.py's selection, before its top-k).

Why: the op path scores a decode step's pages with two fp32 matmuls over the page metadata,
so every step casts the whole bf16 metadata [Hkv, capacity, D] to fp32 twice (at 262,144
tokens ~100 MB of traffic per attention layer and token), then masks the dead and forced
pages and builds the order keys in ~10 more launches per layer.

One warp per (row, page). Each lane first issues its 16-byte loads of the page's bf16 min /
max rows (they need nothing of the query, so they are in flight while the block sums relu(q)
and min(q, 0) over each KV group's query heads into shared memory, every load of that sum
issued at once); then it converts in registers, and the warp reduces the bound over the dims
(and over the KV heads for a shared selection) in a fixed order and writes the page's uint64
order key: (the bound's order-preserving bits) << 32 | ~page id, +inf for forced pages
(sinks, the recent window, the open page), -inf past the live pages (their rows are not
read: the metadata's capacity grows ahead of the pages). The bound sums in another order
than the op path's matmuls (fp32 rounding apart); kv/quest.py probes the selection against
the op path once per shape before it uses the kernel (this module imports nothing of the
package).

Under ncu on the H200 (27B heads, session 32) the previous form took 15 / 30 / 41 us a layer
at 4K / 131K / 262K: its query sums looped over the group at run time, one L2 round trip per
query head, before any page row was read, and every lane loaded 2 bytes at a time.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from .decode_attention import VECTORS
from .jit import cuda_kernel

THREADS = 256  # 8 warps: 8 pages per block

# Template constants: M (metadata dtype), HKV, D, GROUP (query heads per KV head), SINKS,
# RECENT (pages), SHARED (1: one row, every KV head summed).
_KEYS = """
    using namespace qwen38_dattn;
    constexpr int WARPS = __THREADS__ / 32;
    constexpr int VEC = Vec<M>::N;                 // metadata values per 16-byte load
    constexpr int H = SHARED ? HKV : 1;            // KV heads a row's bound sums
    constexpr int HEAD_CHUNKS = D / VEC;           // 16-byte chunks of one head's min row
    constexpr int CHUNKS = H * HEAD_CHUNKS;
    constexpr int PER_LANE = (CHUNKS + 31) / 32;
    constexpr int SUMS = (H * D + __THREADS__ - 1) / __THREADS__;
    static_assert(D % VEC == 0, "head_dim must be a multiple of a 16-byte vector");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int capacity = kmax_shape[1];
    const int row = blockIdx.y;  // SHARED: 0 (every KV head summed), else the KV head
    const int h0 = SHARED ? 0 : row;
    const int page = blockIdx.x * WARPS + warp;
    const int n_pages = counts[0];
    const bool live = page < n_pages && page < capacity;
    __shared__ float qs[2 * H * D];  // [relu(q) | min(q, 0)] summed per KV group

    // this lane's chunks of the page's rows: chunk c is head h0 + c / HEAD_CHUNKS
    uint4 lo[PER_LANE], hi[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        const int c = lane + 32 * i;
        if (live && c < CHUNKS) {
            const long long at = ((long long)(h0 + c / HEAD_CHUNKS) * capacity + page) * D +
                (c % HEAD_CHUNKS) * VEC;
            lo[i] = *reinterpret_cast<const uint4*>(kmin + at);
            hi[i] = *reinterpret_cast<const uint4*>(kmax + at);
        }
    }
#pragma unroll
    for (int j = 0; j < SUMS; ++j) {
        const int i = threadIdx.x + j * __THREADS__;
        if (i < H * D) {
            const int h = h0 + i / D, d = i % D;
            float pos = 0.0f, neg = 0.0f;
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float x = static_cast<float>(q[(h * GROUP + g) * D + d]);
                pos += fmaxf(x, 0.0f);
                neg += fminf(x, 0.0f);
            }
            qs[i] = pos;
            qs[H * D + i] = neg;
        }
    }
    __syncthreads();
    if (page >= capacity) return;

    float acc = 0.0f;
    if (live) {
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int c = lane + 32 * i;
            if (c < CHUNKS) {
                float fl[VEC], fh[VEC];
                Vec<M>::to_float(lo[i], fl);
                Vec<M>::to_float(hi[i], fh);
                const float* pos = qs + (c / HEAD_CHUNKS) * D + (c % HEAD_CHUNKS) * VEC;
#pragma unroll
                for (int e = 0; e < VEC; ++e) {
                    acc += pos[e] * fh[e];
                    acc += pos[H * D + e] * fl[e];
                }
            }
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane != 0) return;

    const int first_recent = max(n_pages - 1 - RECENT, 0);
    const bool forced = live && (page < SINKS || page >= first_recent);
    const float inf = __int_as_float(0x7f800000);
    const float score = !live ? -inf : forced ? inf : acc;
    const unsigned bits = __float_as_uint(score + 0.0f);  // -0.0 -> +0.0
    const unsigned ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    keys[(long long)row * capacity + page] =
        ((unsigned long long)ordered << 32) | (0xFFFFFFFFull - (unsigned long long)page);
"""


@functools.cache
def _keys_kernel(threads: int = THREADS):
    return cuda_kernel(
        name="qwen38_quest_page_keys",
        input_names=["q", "kmin", "kmax", "counts"],
        output_names=["keys"],
        source=_KEYS.replace("__THREADS__", str(threads)),
        header=VECTORS,
    )


def page_keys(
    q: mx.array,
    kmin: mx.array,
    kmax: mx.array,
    n_pages: mx.array,
    sink_pages: int,
    recent_pages: int,
    shared: bool,
    threads: int = THREADS,
) -> mx.array:
    """uint64 order keys [rows, capacity] of every page slot (rows: 1 when `shared`, else
    Hkv): quest.order_keys of the Quest bound of q [Hq, D] over kmin / kmax [Hkv, capacity,
    D], +inf for the forced pages and -inf past n_pages (an int32 scalar array). `threads`
    a block (a multiple of 32: the launch a fused one's phase takes, kernels/fused.py): a
    warp a page whatever the block, so the same bits."""
    hkv, capacity, d = kmax.shape
    rows = 1 if shared else hkv
    warps = threads // 32
    (keys,) = _keys_kernel(threads)(
        inputs=[q, kmin, kmax, n_pages.reshape(1)],
        template=[
            ("M", kmax.dtype),
            ("HKV", hkv),
            ("GROUP", q.shape[0] // hkv),
            ("D", d),
            ("SINKS", sink_pages),
            ("RECENT", recent_pages),
            ("SHARED", int(shared)),
        ],
        grid=(-(-capacity // warps) * threads, rows, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(rows, capacity)],
        output_dtypes=[mx.uint64],
    )
    return keys


def supported(q: mx.array, kmin: mx.array, kmax: mx.array) -> bool:
    """Whether this device and shapes can run the kernel at all (no probe): one metadata
    dtype the 16-byte loads convert, rows a whole number of them, and the summed query rows
    within the block's 48 KiB of static shared memory."""
    return (
        mx.default_device() == mx.gpu
        and mx.cuda.is_available()
        and kmin.shape == kmax.shape
        and kmin.dtype == kmax.dtype
        and kmax.dtype in (mx.bfloat16, mx.float16, mx.float32)
        and kmax.shape[2] % (16 // kmax.dtype.size) == 0
        and kmax.ndim == 3
        and q.ndim == 2
        and q.shape[1] == kmax.shape[2]
        and q.shape[0] % kmax.shape[0] == 0
        and 2 * kmax.shape[0] * kmax.shape[2] * 4 <= 48 * 1024
    )
