"""Split-KV (flash-decoding) attention of one query token over stored K/V, for CUDA.

Why: on the H200, `mx.fast.scaled_dot_product_attention` with one query token reads the KV
at ~0.4 TB/s (issue 15: 131K tokens cost ~21 ms more per token than 4K), far from the
4.8 TB/s bound, and GQA makes it read each KV head once per query head.

Two launches:
- partial: one block per (split of the sequence, KV head). The block streams its rows in
  tiles of TILE through a STAGES-deep cp.async pipeline in shared memory (16-byte copies;
  views whose strides do not allow them are copied element by element), and serves all
  G = Hq / Hkv query heads of its group from each tile, so K and V are read once per group.
  Scores, the running max / sum and the unnormalised output are fp32. Two forms: with
  half-precision q and K/V the products run on the tensor cores, each warp streaming its
  own share of the split (`_PARTIAL_MMA`); otherwise fp32 FMAs (`_PARTIAL`). A group too
  large for a form (the tensor cores serve 8 heads a block) is split into equal parts, each
  its own row of blocks (`head_parts`).
- combine: one block per query head rescales the splits' outputs by exp(m_s - max) and
  divides by the rescaled sum (the log-sum-exp merge), writing the query's dtype.

K/V may be strided views ([1, Hkv, L, D] slices of a larger buffer, the paged pool's
head-major view): shapes and strides reach the kernel as arguments, so L varies without
recompiling and nothing is copied first. `available()` probes the kernel once per
(dtypes, head_dim, group) against mx.fast.scaled_dot_product_attention on random views; any
error or disagreement disables it with a warning (the MLX op then runs).
"""

from __future__ import annotations

import functools
import math
import warnings

import mlx.core as mx

from .jit import cuda_kernel
from .switch import kernel_switch

THREADS = 256  # the partial kernel's block: 8 warps
TILE = 32  # rows per pipeline stage (one per lane in the softmax step)
STAGES = 3  # tiles in flight per block
SMS = 132  # streaming multiprocessors of an H100 / H200 SXM (only the split count uses it)
BLOCKS_PER_SM = 1  # bf16 D=256, G=6: 154 registers x 256 threads (ptxas) leave room for one
MIN_SPLIT_ROWS = 64  # below this a split's partial output costs more than its rows
# The tensor-core form's least rows a split: a Quest budget's 2,048 rows (27B layer, paged)
# took 11.0 us a call in 8 splits against 18.4 in 16 and 32.1 in 32 (H200, calls chained as
# a step's layers are, benchmarks/results/h200/decode_attention_sweep_s33.json): past a
# few tiles a warp, more splits cost more in their outputs and the combine than they save.
MMA_MIN_SPLIT_ROWS = 256
HEAD_DIMS = (32, 64, 128, 256)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
MAX_Q_REGISTERS = 64  # fp32 query values per thread (G * D / lanes per row)
# The tensor-core kernel (half-precision K/V): warps per block, each with its own
# ring of STAGES tiles of 16 rows (4 x 3 x 16 KB at D 256: one block per SM, as above).
# False: every call runs the fp32-FMA kernel (benchmarks compare the two in one run).
TENSOR_CORES = True
MMA_WARPS = 4
MMA_STAGES = 3
MMA_SMEM = 192 * 1024  # the rings' shared memory at most (an H200 SM has 227 KB for a block)
# Its blocks per call at depth: fewer than the SMs. Each block keeps ~128 KB of K/V in
# flight, and one wave of 132 of them read less than half as many (H200, 27B layer, splits
# per KV head swept, benchmarks/results/h200/decode_attention_splits_*.json: at 262K 16
# splits 4.47 TB/s, 33 splits 3.61; at 131K 3.58 vs 2.91; at 32K 1.72 vs 1.67).
MMA_BLOCKS = 64

# Device helpers, in three parts so that a kernel's source holds only the ones it uses (its
# length is host time per launch: jit.py). ASYNC_COPIES serves kernels/rows_matmul.py too.
VECTORS = """
namespace qwen38_dattn {
// 16 bytes of T -> floats (u by value: a reference bound to memory would be read piecewise)
template <typename T> struct Vec;
template <> struct Vec<float> {
  static constexpr int N = 4;
  static __device__ __forceinline__ void to_float(const uint4 u, float* f) {
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
  }
};
template <> struct Vec<__nv_bfloat16> {
  static constexpr int N = 8;
  static __device__ __forceinline__ void to_float(const uint4 u, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 t = __bfloat1622float2(h[i]);
      f[2 * i] = t.x; f[2 * i + 1] = t.y;
    }
  }
};
template <> struct Vec<__half> {
  static constexpr int N = 8;
  static __device__ __forceinline__ void to_float(const uint4 u, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float2 t = __half22float2(h[i]);
      f[2 * i] = t.x; f[2 * i + 1] = t.y;
    }
  }
};
}  // namespace qwen38_dattn
"""
ASYNC_COPIES = """
namespace qwen38_dattn {
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" :: "r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\\n" :: "n"(N) : "memory");
}
}  // namespace qwen38_dattn
"""
_NEG_INF = """
namespace qwen38_dattn {
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
}  // namespace qwen38_dattn
"""
_ATTENTION_HELPERS = """
namespace qwen38_dattn {

// 16 bytes, or 16 zero bytes where !live (a tile's rows past the range)
__device__ __forceinline__ void cp_async16_or_zero(void* smem, const void* gmem, bool live) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  int n = live ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n"
               :: "r"(s), "l"(gmem), "r"(n) : "memory");
}

// four 8x8 b16 matrices from shared memory (lanes 8i..8i+7 give matrix i's row addresses)
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const void* p) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}

// c += a (16x16, row) * b (16x8, col), fp32 accumulators, half-precision inputs
template <typename T> struct Mma;
template <> struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4],
                                             unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // (lo, hi) -> one register, lo in the low half; and what rounding x lost
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
  }
  static __device__ __forceinline__ float rest(float x) {
    return x - __bfloat162float(__float2bfloat16_rn(x));
  }
};
template <> struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&c)[4], const unsigned (&a)[4],
                                             unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
  }
  static __device__ __forceinline__ float rest(float x) {
    return x - __half2float(__float2half_rn(x));
  }
};

}  // namespace qwen38_dattn
"""
_HEADER = VECTORS + ASYNC_COPIES + _NEG_INF + _ATTENTION_HELPERS

# Both partial launches: this block's split of its query row's keys, [start, end), and the
# K/V views it reads them through.
_SPLIT_AND_VIEWS = """
    // query row qt (of NQ) is the position L - NQ + qt: it reads the first L_row keys in
    // its own n_splits splits, as a one-row call of that length does
    // blockIdx.y: this block's part of a KV group's query heads (SUB parts of G heads each
    // per KV head), so its query heads are vh * G .. vh * G + G - 1 of the row's
    const int split = blockIdx.x, vh = blockIdx.y, kvh = vh / SUB, qt = blockIdx.z;
    const int NQ = gridDim.z;
    const int n_splits = splits[qt];
    if (split >= n_splits) return;                 // the whole block: no barrier is skipped
    // paged (P > 0): the keys are the first n_keys[0] logical rows of a page list, row r
    // at pool row pages[kvh][r / P] * P + r % P; else the rows of k themselves
    const int L = (P > 0 ? n_keys[0] : k_shape[2]) - (NQ - 1 - qt);
    const int chunk = (L + n_splits - 1) / n_splits;
    const int start = min(split * chunk, L);
    const int end = min(start + chunk, L);

    const T* kb = k + kvh * k_strides[1];
    const T* vb = v + kvh * v_strides[1];
    const long long krs = k_strides[2], vrs = v_strides[2];
    const long long kds = k_strides[3], vds = v_strides[3];
    // 16-byte copies need unit element stride, vector-aligned row/head strides and base
    constexpr int VEC16 = Vec<T>::N;
    const bool vec_ok = kds == 1 && vds == 1 && krs % VEC16 == 0 && vrs % VEC16 == 0 &&
        k_strides[1] % VEC16 == 0 && v_strides[1] % VEC16 == 0 &&
        (reinterpret_cast<unsigned long long>(k) & 15) == 0 &&
        (reinterpret_cast<unsigned long long>(v) & 15) == 0;

    const int* page_row = P > 0 ? pages + kvh * pages_strides[0] : pages;
    auto pool_row = [&](int r) -> long long {
        if constexpr (P > 0) {
            return (long long)page_row[(r / P) * pages_strides[1]] * P + r % P;
        } else {
            return r;
        }
    };"""

# Template constants from the call: T (K/V dtype), D (head dim), G (query heads a block
# serves), SUB (blocks a KV group's query heads are split over: G * SUB per KV head), P.
_PARTIAL = """
    using namespace qwen38_dattn;
    constexpr int THREADS = __THREADS__, TILE = __TILE__, STAGES = __STAGES__;
    constexpr int WARPS = THREADS / 32;
    constexpr int VEC = Vec<T>::N;                 // elements per 16-byte vector
    constexpr int NV = D / VEC;                    // vectors per row
    constexpr int NVL = NV < 32 ? NV : 32;         // lanes sharing a row
    constexpr int PER = NV / NVL;                  // vectors per lane
    constexpr int RPB = THREADS / NVL;             // rows the block works on at once
    constexpr int LOG_GP = G <= 1 ? 0 : G <= 2 ? 1 : G <= 4 ? 2 : G <= 8 ? 3 : G <= 16 ? 4 : 5;
    constexpr int GP = 1 << LOG_GP;                // G padded to a power of two
    constexpr int LOG_NVL = NVL == 32 ? 5 : NVL == 16 ? 4 : NVL == 8 ? 3 : NVL == 4 ? 2 : 1;
    constexpr int TILE_ELEMS = TILE * D;
    static_assert(NV * VEC == D && NV % NVL == 0 && TILE % RPB == 0 && GP <= NVL &&
                  (1 << LOG_NVL) == NVL, "unsupported shape");

    extern __shared__ __align__(16) unsigned char smem_dyn[];
    __shared__ float s_s[G * TILE];                // scores, then probabilities, of a tile
    __shared__ float m_s[G], l_s[G], a_s[G];       // running max, sum, this tile's rescale

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
__SPLIT_AND_VIEWS__
    const int n_tiles = (end - start + TILE - 1) / TILE;

    auto load_tile = [&](int t) {
        T* ks = reinterpret_cast<T*>(smem_dyn) + (t % STAGES) * 2 * TILE_ELEMS;
        T* vs = ks + TILE_ELEMS;
        const int row0 = start + t * TILE;
        const int rows = min(TILE, end - row0);
        if (vec_ok) {
            for (int i = tid; i < TILE * NV; i += THREADS) {
                const int r = i / NV, c = i % NV;
                if (r < rows) {
                    const long long pr = pool_row(row0 + r);
                    cp_async16(ks + r * D + c * VEC, kb + pr * krs + c * VEC);
                    cp_async16(vs + r * D + c * VEC, vb + pr * vrs + c * VEC);
                }
            }
        } else {
            for (int i = tid; i < TILE_ELEMS; i += THREADS) {
                const int r = i / D, c = i % D;
                if (r < rows) {
                    const long long pr = pool_row(row0 + r);
                    ks[i] = kb[pr * krs + c * kds];
                    vs[i] = vb[pr * vrs + c * vds];
                }
            }
        }
    };

    // this thread: rows rg, rg + RPB, ... of a tile; vectors c0, c0 + NVL, ... of a row
    const int rg = tid / NVL, c0 = tid % NVL;
    float qr[G][PER * VEC];
    float acc[G][PER * VEC];
#pragma unroll
    for (int h = 0; h < G; ++h)
#pragma unroll
        for (int j = 0; j < PER; ++j)
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                qr[h][j * VEC + e] = q[(qt * (long long)gridDim.y * G + vh * G + h) *
                    q_strides[0] + ((c0 + NVL * j) * VEC + e) * q_strides[1]];
                acc[h][j * VEC + e] = 0.0f;
            }
    if (tid < G) { m_s[tid] = neg_inf(); l_s[tid] = 0.0f; }

#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
        if (t < n_tiles) load_tile(t);
        cp_async_commit();
    }
    for (int t = 0; t < n_tiles; ++t) {
        // the stage refilled here was last read in iteration t - 1 (synced at its end)
        if (t + STAGES - 1 < n_tiles) load_tile(t + STAGES - 1);
        cp_async_commit();
        cp_async_wait<STAGES - 1>();               // tile t's copies have landed
        __syncthreads();
        const T* ks = reinterpret_cast<const T*>(smem_dyn) + (t % STAGES) * 2 * TILE_ELEMS;
        const T* vs = ks + TILE_ELEMS;
        const int rows = min(TILE, end - (start + t * TILE));

        // scores: the row's lanes reduce G dot products, scattering one head per lane
#pragma unroll
        for (int i = 0; i < TILE / RPB; ++i) {
            const int r = rg + RPB * i;
            float part[GP];
#pragma unroll
            for (int h = 0; h < GP; ++h) part[h] = 0.0f;
#pragma unroll
            for (int j = 0; j < PER; ++j) {
                float kf[VEC];
                if (r < rows) {
                    Vec<T>::to_float(
                        *reinterpret_cast<const uint4*>(ks + r * D + (c0 + NVL * j) * VEC), kf);
                } else {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) kf[e] = 0.0f;
                }
#pragma unroll
                for (int h = 0; h < G; ++h)
#pragma unroll
                    for (int e = 0; e < VEC; ++e) part[h] += qr[h][j * VEC + e] * kf[e];
            }
            int idx = 0;
#pragma unroll
            for (int step = 0; step < LOG_NVL; ++step) {
                const int o = NVL >> (step + 1);
                if (step < LOG_GP) {  // halve the values: keep one half, add the partner's
                    const int half = GP >> (step + 1);
                    const bool upper = (lane & o) != 0;
#pragma unroll
                    for (int x = 0; x < half; ++x) {
                        const float send = upper ? part[x] : part[x + half];
                        const float keep = upper ? part[x + half] : part[x];
                        part[x] = keep + __shfl_xor_sync(0xffffffffu, send, o);
                    }
                    if (upper) idx += half;
                } else {
                    part[0] += __shfl_xor_sync(0xffffffffu, part[0], o);
                }
            }
            if (idx < G && c0 % (NVL / GP) == 0)
                s_s[idx * TILE + r] = r < rows ? part[0] : neg_inf();
        }
        __syncthreads();

        // online softmax per head: a warp per head, a lane per row
        for (int h = warp; h < G; h += WARPS) {
            const float s = s_s[h * TILE + lane];
            float tmax = s;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
            const float m_old = m_s[h];
            const float m_new = fmaxf(m_old, tmax);  // finite: every tile has a row
            const float p = expf(s - m_new);
            float sum = p;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            s_s[h * TILE + lane] = p;
            __syncwarp();
            if (lane == 0) {
                const float a = expf(m_old - m_new);
                a_s[h] = a;
                l_s[h] = l_s[h] * a + sum;
                m_s[h] = m_new;
            }
        }
        __syncthreads();

        // values: rescale, then add p * v for this thread's rows
#pragma unroll
        for (int h = 0; h < G; ++h) {
            const float a = a_s[h];
#pragma unroll
            for (int e = 0; e < PER * VEC; ++e) acc[h][e] *= a;
        }
#pragma unroll
        for (int i = 0; i < TILE / RPB; ++i) {
            const int r = rg + RPB * i;
            if (r < rows) {
#pragma unroll
                for (int j = 0; j < PER; ++j) {
                    float vf[VEC];
                    Vec<T>::to_float(
                        *reinterpret_cast<const uint4*>(vs + r * D + (c0 + NVL * j) * VEC), vf);
#pragma unroll
                    for (int h = 0; h < G; ++h) {
                        const float p = s_s[h * TILE + r];
#pragma unroll
                        for (int e = 0; e < VEC; ++e) acc[h][j * VEC + e] += p * vf[e];
                    }
                }
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();
    __syncthreads();

    // sum the row groups' outputs in a fixed order (deterministic), write the split's part
    float* red = reinterpret_cast<float*>(smem_dyn);
#pragma unroll
    for (int h = 0; h < G; ++h)
#pragma unroll
        for (int j = 0; j < PER; ++j)
#pragma unroll
            for (int e = 0; e < VEC; ++e)
                red[(rg * G + h) * D + (c0 + NVL * j) * VEC + e] = acc[h][j * VEC + e];
    __syncthreads();
    const int max_splits = gridDim.x;
    const long long base = (((long long)qt * gridDim.y + vh) * max_splits + split) * G;
    for (int x = tid; x < G * D; x += THREADS) {
        float sum = 0.0f;
        for (int r = 0; r < RPB; ++r) sum += red[r * G * D + x];
        o_part[base * D + x] = sum;
    }
    if (tid < G) {
        m_part[base + tid] = m_s[tid];
        l_part[base + tid] = l_s[tid];
    }
"""

# The same partial outputs from the tensor cores (K/V and q in float16 / bfloat16, G <= 8 a block):
# the fp32-FMA kernel above issues ~0.2 warp instructions per K/V byte (G heads x 2 FMAs per
# element), as many as an SM issues at the bandwidth bound, so it reads ~1.3 TB/s. Here a
# warp takes 16 rows at a time with mma.sync m16n8k16 (fp32 accumulators):
# - scores S = Q K^T: Q (the G heads padded to 16 rows) stays in registers as A fragments;
#   K comes through ldmatrix from a swizzled shared tile (conflict-free rows of 512 bytes);
# - O^T += V^T P^T: V^T through ldmatrix.trans; the scores' accumulator layout is the B
#   fragment this needs, so probabilities never leave registers. P goes in as two half
#   precision terms (rounded, then what rounding lost), so P V keeps ~16 bits of P, not 8.
# Each warp streams its own share of the split through its own STAGES-deep cp.async ring
# (no block barriers in the loop); the block merges its warps' (max, sum, output) once.
# Template constants: T (K/V and q dtype), D, G, SUB, P (page rows, 0: not paged).
_PARTIAL_MMA = """
    using namespace qwen38_dattn;
    constexpr int WARPS = __WARPS__, STAGES = __STAGES__, TILE = 16;
    constexpr int CH = D / 8;                      // 16-byte chunks of a row
    constexpr int SWZ = (CH < 8 ? CH : 8) - 1;     // chunk c of row r sits at c ^ (r & SWZ)
    constexpr int KSTEPS = D / 16;                 // k-steps of S = Q K^T, m-tiles of O^T
    constexpr int TILE_ELEMS = TILE * D;
    static_assert(D % 32 == 0 && G <= 8 && sizeof(T) == 2, "unsupported shape");
    static_assert(TILE * CH % 32 == 0, "a tile's chunks are whole rounds of the warp");

    extern __shared__ __align__(16) unsigned char smem_dyn[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gid = lane >> 2, tig = lane & 3;     // the mma fragments' row / column group
__SPLIT_AND_VIEWS__
    // this warp's share: whole tiles of the split, in order
    const int per_warp = ((end - start + TILE - 1) / TILE + WARPS - 1) / WARPS;
    const int wstart = min(start + warp * per_warp * TILE, end);
    const int wend = min(wstart + per_warp * TILE, end);
    const int n_tiles = (wend - wstart + TILE - 1) / TILE;

    T* ring = reinterpret_cast<T*>(smem_dyn) + warp * STAGES * 2 * TILE_ELEMS;
    auto load_tile = [&](int t) {
        T* ks = ring + (t % STAGES) * 2 * TILE_ELEMS;
        T* vs = ks + TILE_ELEMS;
        const int row0 = wstart + t * TILE;
        // paged: lane j < TILE reads row j's page once, the copies take it by shuffle (every
        // lane runs each loop below as often); one page-list round trip a tile, not one per
        // four rows
        const long long mine = P > 0 && lane < TILE && row0 + lane < wend ?
            pool_row(row0 + lane) : 0;
        auto tile_row = [&](int r) -> long long {
            if constexpr (P > 0) {
                return __shfl_sync(0xffffffffu, mine, r);
            } else {
                return row0 + r;
            }
        };
        if (vec_ok) {
            // unrolled whole: each lane's chunks of the tile at compile-time rows / columns
#pragma unroll
            for (int j = 0; j < TILE * CH / 32; ++j) {
                const int i = lane + 32 * j, r = i / CH, c = i % CH;
                const bool live = row0 + r < wend;
                const long long found = tile_row(r);
                const long long pr = live ? found : 0;
                const int at = r * D + (c ^ (r & SWZ)) * 8;
                cp_async16_or_zero(ks + at, kb + pr * krs + c * 8, live);
                cp_async16_or_zero(vs + at, vb + pr * vrs + c * 8, live);
            }
        } else {
            for (int i = lane; i < TILE_ELEMS; i += 32) {
                const int r = i / D, col = i % D;
                const int at = r * D + ((col / 8) ^ (r & SWZ)) * 8 + col % 8;
                const bool live = row0 + r < wend;
                const long long found = tile_row(r);
                const long long pr = live ? found : 0;
                ks[at] = live ? kb[pr * krs + col * kds] : T(0.0f);
                vs[at] = live ? vb[pr * vrs + col * vds] : T(0.0f);
            }
        }
    };

    // Q as A fragments: rows gid (< G) of each k-step, columns tig * 2 (+ 8); rows gid + 8
    // are the padding (zero)
    unsigned qa[KSTEPS][2];
    const T* qrow = q + ((long long)qt * gridDim.y * G + vh * G + (gid < G ? gid : 0)) * D;
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s)
#pragma unroll
        for (int half = 0; half < 2; ++half)
            qa[s][half] = gid < G ?
                *reinterpret_cast<const unsigned*>(qrow + s * 16 + half * 8 + tig * 2) : 0u;
    const float sc = scale[0];

    float o[KSTEPS][4];                            // O^T: d = 16i + gid (+ 8), h = tig * 2 (+ 1)
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[i][e] = 0.0f;
    float m_run = neg_inf(), l_run = 0.0f;         // of head gid

#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
        if (t < n_tiles) load_tile(t);
        cp_async_commit();
    }
    for (int t = 0; t < n_tiles; ++t) {
        if (t + STAGES - 1 < n_tiles) load_tile(t + STAGES - 1);
        cp_async_commit();
        cp_async_wait<STAGES - 1>();               // tile t has landed (this lane's copies)
        __syncwarp();                              // and every lane's
        const T* ks = ring + (t % STAGES) * 2 * TILE_ELEMS;
        const T* vs = ks + TILE_ELEMS;
        const int rows = min(TILE, wend - (wstart + t * TILE));

        // S: rows 0-7 and 8-15 of the tile; s[j][0..1] = head gid, rows 8j + tig * 2 (+ 1)
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int kk = 0; kk < KSTEPS; kk += 2) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                unsigned b[4];
                const int r = j * 8 + (lane & 7), c = 2 * kk + (lane >> 3);
                ldsm_x4(b, ks + r * D + (c ^ (r & SWZ)) * 8);
                const unsigned a0[4] = {qa[kk][0], 0u, qa[kk][1], 0u};
                const unsigned a1[4] = {qa[kk + 1][0], 0u, qa[kk + 1][1], 0u};
                Mma<T>::run(s[j], a0, b[0], b[1]);
                Mma<T>::run(s[j], a1, b[2], b[3]);
            }
        }

        // online softmax of head gid over the tile's rows (the 4 lanes of a group share it)
        float x[4] = {s[0][0], s[0][1], s[1][0], s[1][1]};
        const int r0 = tig * 2;
        float tmax = neg_inf();
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = r0 + (e & 1) + (e >> 1) * 8;
            x[e] = r < rows ? x[e] * sc : neg_inf();
            tmax = fmaxf(tmax, x[e]);
        }
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 1));
        tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, 2));
        const float m_new = fmaxf(m_run, tmax);    // finite: every tile has a row
        const float alpha = expf(m_run - m_new);
        float sum = 0.0f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            x[e] = expf(x[e] - m_new);
            sum += x[e];
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        l_run = l_run * alpha + sum;
        m_run = m_new;

        // P^T as B fragments (k = row, n = head gid): rounded, and what rounding lost
        const unsigned ph0 = Mma<T>::pack(x[0], x[1]), ph1 = Mma<T>::pack(x[2], x[3]);
        const unsigned pl0 = Mma<T>::pack(Mma<T>::rest(x[0]), Mma<T>::rest(x[1]));
        const unsigned pl1 = Mma<T>::pack(Mma<T>::rest(x[2]), Mma<T>::rest(x[3]));
        // this lane's output columns are heads tig * 2 and tig * 2 + 1
        const float a_even = __shfl_sync(0xffffffffu, alpha, tig * 8);
        const float a_odd = __shfl_sync(0xffffffffu, alpha, tig * 8 + 4);
#pragma unroll
        for (int i = 0; i < KSTEPS; ++i) {
            o[i][0] *= a_even; o[i][1] *= a_odd; o[i][2] *= a_even; o[i][3] *= a_odd;
            unsigned a[4];
            const int r = (lane >> 4) * 8 + (lane & 7), c = 2 * i + ((lane >> 3) & 1);
            ldsm_x4_trans(a, vs + r * D + (c ^ (r & SWZ)) * 8);
            Mma<T>::run(o[i], a, ph0, ph1);
            Mma<T>::run(o[i], a, pl0, pl1);
        }
        __syncwarp();                              // the stage is refilled next iteration
    }
    cp_async_wait<0>();
    __syncthreads();

    // merge the warps in a fixed order (deterministic) and write the split's part
    float* red = reinterpret_cast<float*>(smem_dyn);   // [WARPS][G][D]
    float* m_w = red + WARPS * G * D;                  // [WARPS][G]
    float* l_w = m_w + WARPS * G;
    float* f_w = l_w + WARPS * G;                      // each warp's weight in the merge
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int h = tig * 2 + (e & 1), d = 16 * i + gid + (e >> 1) * 8;
            if (h < G) red[(warp * G + h) * D + d] = o[i][e];
        }
    if (tig == 0 && gid < G) {
        m_w[warp * G + gid] = m_run;
        l_w[warp * G + gid] = l_run;
    }
    __syncthreads();
    const long long base = (((long long)qt * gridDim.y + vh) * gridDim.x + split) * G;
    // a head's warp weights once (not once per output value: with a few tiles a warp, the
    // merge was a large share of the block's instructions)
    if (threadIdx.x < G) {
        const int h = threadIdx.x;
        float m_max = neg_inf();
        for (int w = 0; w < WARPS; ++w) m_max = fmaxf(m_max, m_w[w * G + h]);
        float den = 0.0f;
        for (int w = 0; w < WARPS; ++w) {
            const float m = m_w[w * G + h];
            const float f = m == neg_inf() ? 0.0f : expf(m - m_max);  // a warp with no rows
            f_w[w * G + h] = f;
            den += f * l_w[w * G + h];
        }
        m_part[base + h] = m_max;
        l_part[base + h] = den;
    }
    __syncthreads();
    for (int x = threadIdx.x; x < G * D; x += blockDim.x) {
        const int h = x / D;
        float num = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) num += f_w[w * G + h] * red[(w * G + h) * D + x % D];
        o_part[base * D + x] = num;
    }
"""

# Template constants: O (output dtype), D, G (query heads per part of a KV group). One block
# per (query row, query head), a thread per dim; the row's own split count.
_COMBINE = """
    using namespace qwen38_dattn;
    const int HQ = m_part_shape[1] * G;
    const int qt = blockIdx.x / HQ, hq = blockIdx.x % HQ, vh = hq / G, g = hq % G;
    const int S = splits[qt];
    const long long row = (((long long)qt * m_part_shape[1] + vh) * m_part_shape[2]) * G + g;
    // unrolled: the splits' loads go out together (each loop is carried over S, and rolled
    // it waited for every load in turn: ~11 us a layer on the H200 at 16 splits)
    float m_max = neg_inf();
#pragma unroll 8
    for (int s = 0; s < S; ++s) m_max = fmaxf(m_max, m_part[row + (long long)s * G]);
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float num = 0.0f, den = 0.0f;
#pragma unroll 8
        for (int s = 0; s < S; ++s) {
            const long long at = row + (long long)s * G;
            const float w = expf(m_part[at] - m_max);  // 0 for an empty split (m = -inf)
            den += w * l_part[at];
            num += w * o_part[at * D + d];
        }
        out[((long long)qt * HQ + hq) * D + d] = O(num / den);
    }
"""


def _fill(source: str, **values: int) -> str:
    source = source.replace("__SPLIT_AND_VIEWS__", _SPLIT_AND_VIEWS)
    for name, value in values.items():
        source = source.replace(f"__{name}__", str(value))
    return source


def _vec(dtype: mx.Dtype) -> int:
    return 16 // dtype.size


def _lanes(dtype: mx.Dtype, head_dim: int) -> int:
    """Lanes sharing one K/V row in the partial kernel."""
    return min(head_dim // _vec(dtype), 32)


def _smem_bytes(dtype: mx.Dtype, head_dim: int, group: int) -> int:
    """Dynamic shared memory: the pipeline, reused at the end for the row groups' outputs."""
    pipeline = STAGES * 2 * TILE * head_dim * dtype.size
    reduction = (THREADS // _lanes(dtype, head_dim)) * group * head_dim * 4
    return max(pipeline, reduction)


@functools.cache
def _partial_kernel(dtype: mx.Dtype, head_dim: int, group: int):
    return cuda_kernel(
        name="qwen38_decode_attention_partial",
        input_names=["q", "k", "v", "splits", "pages", "n_keys"],
        output_names=["o_part", "m_part", "l_part"],
        source=_fill(_PARTIAL, THREADS=THREADS, TILE=TILE, STAGES=STAGES),
        header=_HEADER,
        ensure_row_contiguous=False,
        shared_memory=_smem_bytes(dtype, head_dim, group),
    )


@functools.cache
def _partial_kernel_mma(dtype: mx.Dtype, head_dim: int, group: int, warps: int = MMA_WARPS):
    stages = mma_stages(head_dim, warps)
    return cuda_kernel(
        name="qwen38_decode_attention_partial_mma",
        input_names=["q", "k", "v", "splits", "pages", "n_keys", "scale"],
        output_names=["o_part", "m_part", "l_part"],
        source=_fill(_PARTIAL_MMA, WARPS=warps, STAGES=stages),
        header=_HEADER,
        ensure_row_contiguous=False,
        shared_memory=_mma_smem_bytes(head_dim, group, warps, stages),
    )


def mma_stages(head_dim: int, warps: int) -> int:
    """Tiles in flight per warp of the tensor-core kernel: MMA_STAGES where the warps' rings
    fit MMA_SMEM (one block per SM), else fewer."""
    tile = 2 * 16 * head_dim * 2  # a K and a V tile of 16 half-precision rows
    stages = min(MMA_STAGES, MMA_SMEM // (warps * tile))
    if stages < 1:
        raise ValueError(f"decode attention: {warps} warps of head_dim {head_dim} do not fit")
    return stages


def _mma_smem_bytes(head_dim: int, group: int, warps: int, stages: int) -> int:
    """Dynamic shared memory of the tensor-core kernel: each warp's ring of K and V tiles,
    reused at the end for the warps' outputs, maxima, sums and merge weights."""
    rings = warps * stages * 2 * 16 * head_dim * 2
    merge = warps * group * (head_dim + 3) * 4
    return max(rings, merge)


def uses_tensor_cores(q: mx.array, k: mx.array) -> bool:
    """Whether decode_attention runs the tensor-core kernel for these inputs (else the
    fp32-FMA one): q and K/V in one half-precision dtype."""
    return _tensor_cores(k.shape[3], q.dtype, k.dtype, TENSOR_CORES)


def _tensor_cores(d: int, q_dtype: mx.Dtype, k_dtype: mx.Dtype, on: bool) -> bool:
    return on and q_dtype == k_dtype and k_dtype in (mx.float16, mx.bfloat16) and d in HEAD_DIMS


@functools.cache
def head_parts(group: int, d: int, k_dtype: mx.Dtype, tensor_cores: bool) -> int:
    """Blocks a KV group's `group` query heads are split over (each reads the group's K/V,
    the second time mostly from L2): the fewest that divide the group into parts the form
    takes. Tensor cores serve up to 8 heads a block (one m16 fragment's rows, with the other
    8 left for the padding); the fp32-FMA form holds a head's query in MAX_Q_REGISTERS and
    pads the heads to a power of two within a row's lanes. Flash-Next's 12 heads a KV head
    run as two parts of 6."""
    if tensor_cores:
        most = 8
    else:
        lanes = _lanes(k_dtype, d)
        most = min(MAX_Q_REGISTERS * lanes // d, lanes)
    # one head a part always fits (most >= 1: lanes >= 8, head_dim <= 256)
    return next(s for s in range(1, group + 1) if group % s == 0 and group // s <= most)


@functools.cache
def _scalar(value: float) -> mx.array:
    return mx.array([value], dtype=mx.float32)


@functools.cache
def _combine_kernel():
    return cuda_kernel(
        name="qwen38_decode_attention_combine",
        input_names=["o_part", "m_part", "l_part", "splits"],
        output_names=["out"],
        source=_COMBINE,
        header=_NEG_INF,
    )


def n_splits(length: int, kv_heads: int, tensor_cores: bool = False) -> int:
    """Splits of the sequence: about one wave of blocks over the SMs (the tensor-core form:
    MMA_BLOCKS blocks), none shorter than MIN_SPLIT_ROWS (the tensor-core form:
    MMA_MIN_SPLIT_ROWS; short contexts: fewer partial outputs to write and merge)."""
    blocks = MMA_BLOCKS if tensor_cores else SMS * BLOCKS_PER_SM
    least = MMA_MIN_SPLIT_ROWS if tensor_cores else MIN_SPLIT_ROWS
    return max(min(math.ceil(length / least), blocks // kv_heads), 1)


def check_shapes(q: mx.array, k: mx.array, v: mx.array) -> None:
    """ValueError naming what the kernel cannot take (before any work)."""
    qs, ks = q.shape, k.shape  # one read each: a step checks each attention call twice
    if len(ks) != 4 or ks[0] != 1:
        raise ValueError(f"decode attention: k must be [1, Hkv, L, D], got {ks}")
    if len(qs) != 4 or qs[0] != 1 or not 1 <= qs[2] <= max(ks[2], 1):
        raise ValueError(f"decode attention: q must be [1, Hq, T, D] (T <= L), got {qs}")
    if v.shape != ks:
        raise ValueError(f"decode attention: v {v.shape} must have k's shape {ks}")
    if ks[2] < 1:
        raise ValueError("decode attention: no keys (L = 0)")
    # the rest once per signature (these heads, widths and dtypes come step after step)
    _check_heads(qs[1], ks[1], qs[3], ks[3], q.dtype, k.dtype, v.dtype, TENSOR_CORES)


@functools.lru_cache(maxsize=64)
def _check_heads(
    hq: int, hkv: int, d: int, dk: int, q_dtype, k_dtype, v_dtype, tensor_cores: bool
) -> None:
    if dk != d:
        raise ValueError(f"decode attention: q head_dim {d} != k head_dim {dk}")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"decode attention: {hq} query heads not a multiple of {hkv} KV heads")
    if k_dtype != v_dtype or k_dtype not in DTYPES or q_dtype not in DTYPES:
        raise ValueError(
            f"decode attention: dtypes q {q_dtype}, k {k_dtype}, v {v_dtype}: K and V must "
            "share one of float16, bfloat16, float32"
        )
    if _tensor_cores(d, q_dtype, k_dtype, tensor_cores):
        return
    lanes = _lanes(k_dtype, d)  # the fp32-FMA form's limits
    if d not in HEAD_DIMS or lanes < 8:
        raise ValueError(f"decode attention: head_dim {d} with {k_dtype} is not supported")


@functools.lru_cache(maxsize=512)
def _int32s(values: tuple[int, ...]) -> mx.array:
    """A call's small int32 input (split counts, a paged length), made once per value: a
    decode step asks for the same few every layer, and each new array is host work and a
    copy to the device."""
    return mx.array(values, dtype=mx.int32)


@functools.cache
def _unpaged() -> tuple[mx.array, mx.array]:
    """The `pages` and `length` inputs of a call without pages (the kernel reads neither)."""
    return mx.zeros((1, 1), dtype=mx.int32), mx.zeros((1,), dtype=mx.int32)


def check_pages(pages: mx.array, page_tokens: int, length: int, k: mx.array) -> None:
    """ValueError naming what a paged call cannot take (before any work)."""
    if pages.ndim != 2 or pages.shape[0] != k.shape[1] or pages.dtype != mx.int32:
        raise ValueError(
            f"decode attention: pages must be int32 [Hkv={k.shape[1]}, n], got "
            f"{pages.dtype} {pages.shape}"
        )
    if page_tokens < 1 or not 1 <= length <= pages.shape[1] * page_tokens:
        raise ValueError(
            f"decode attention: length {length} must be in [1, {pages.shape[1]} pages x "
            f"{page_tokens} rows]"
        )


def decode_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    splits: int | None = None,
    pages: mx.array | None = None,
    page_tokens: int = 0,
    length: int = 0,
    warps: int | None = None,
) -> mx.array:
    """softmax(q k^T * scale) v for the newest T positions, as mx.fast.scaled_dot_product_
    attention with a causal mask: row t of q is the position L - T + t and reads the first
    L - T + 1 + t keys, in the splits a one-row call of that length uses (so each row has
    the bits of that call: a decode step's, whatever T).

    q: [1, Hq, T, D]; k, v: [1, Hkv, L, D] (strided views are read in place); Hq a multiple
    of Hkv (GQA). Returns [1, Hq, T, D] in q's dtype. splits: blocks per KV head for one row
    (default `n_splits`); warps: the tensor-core kernel's warps a block (default MMA_WARPS);
    benchmarks sweep both.

    Paged (one row): `pages` int32 [Hkv, n] (a broadcast view is fine) lists pool pages of
    `page_tokens` rows of k / v (the whole pool, [1, Hkv, slots * page_tokens, D]); the keys
    are the first `length` rows of that list, read in place: the bits of a call on those rows
    gathered into a contiguous copy."""
    check_shapes(q, k, v)
    _, hq, rows, d = q.shape
    _, hkv, length_k, _ = k.shape
    group = hq // hkv
    if pages is None:
        length, page_tokens = length_k, 0
        page_list, length_arg = _unpaged()
    else:
        if rows != 1:
            raise ValueError("decode attention: a paged call takes one query row")
        check_pages(pages, page_tokens, length, k)
        page_list, length_arg = pages, _int32s((length,))
    mma = uses_tensor_cores(q, k)  # one decision per call: the split count and the kernel
    sub = head_parts(group, d, k.dtype, mma)
    parts, group = hkv * sub, group // sub  # block rows, query heads a block serves
    if splits is None:
        counts = [n_splits(length - rows + 1 + t, parts, mma) for t in range(rows)]
    elif rows == 1 and 1 <= splits <= length:
        counts = [splits]
    else:
        raise ValueError(f"decode attention: splits={splits} must be in [1, L={length}], one row")
    most = max(counts)
    per_row = _int32s(tuple(counts))
    if mma:
        # query rows [T * Hq, D] in their own dtype, row-contiguous
        q_rows = mx.contiguous(q.transpose(0, 2, 1, 3).reshape(rows * hq, d))
        warps = warps or MMA_WARPS
        kernel, threads = _partial_kernel_mma(k.dtype, d, group, warps), warps * 32
        inputs = [q_rows, k, v, per_row, page_list, length_arg, _scalar(scale)]
    else:
        # fp32 scaled query rows [T * Hq, D] as a fresh array (row-contiguous, its own buffer)
        qf = (q.astype(mx.float32) * scale).transpose(0, 2, 1, 3).reshape(rows * hq, d)
        kernel, threads = _partial_kernel(k.dtype, d, group), THREADS
        inputs = [qf, k, v, per_row, page_list, length_arg]
    o_part, m_part, l_part = kernel(
        inputs=inputs,
        template=[("T", k.dtype), ("D", d), ("G", group), ("SUB", sub), ("P", page_tokens)],
        grid=(most * threads, parts, rows),
        threadgroup=(threads, 1, 1),
        output_shapes=[
            (rows, parts, most, group, d),
            (rows, parts, most, group),
            (rows, parts, most, group),
        ],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    (out,) = _combine_kernel()(
        inputs=[o_part, m_part, l_part, per_row],
        template=[("O", q.dtype), ("D", d), ("G", group)],
        grid=(rows * hq * d, 1, 1),
        threadgroup=(d, 1, 1),
        output_shapes=[(rows * hq, d)],
        output_dtypes=[q.dtype],
    )
    return out.reshape(1, rows, hq, d).transpose(0, 2, 1, 3)


def enabled() -> str:
    """QWEN38_DECODE_ATTN_KERNEL: auto (probe), off, force (skip the probe)."""
    return kernel_switch("QWEN38_DECODE_ATTN_KERNEL")


def supported(q: mx.array, k: mx.array, v: mx.array) -> bool:
    """Whether this device and these shapes can run the kernel at all (no probe)."""
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        return False
    try:
        check_shapes(q, k, v)
    except ValueError:
        return False
    return True


def usable(q: mx.array, k: mx.array, v: mx.array, page_tokens: int = 0) -> bool:
    """Run the kernel for this call: supported, not switched off, and the probe passed
    (page_tokens > 0: the paged call's probe too)."""
    choice = enabled()
    if choice == "off" or not supported(q, k, v):
        return False
    if choice == "force":
        return True
    group = q.shape[1] // k.shape[1]
    if not available(q.dtype, k.dtype, k.shape[3], group):
        return False
    return page_tokens == 0 or paged_available(q.dtype, k.dtype, k.shape[3], group, page_tokens)


def _tolerance(dtype: mx.Dtype) -> float:
    return {mx.float32: 1e-4, mx.float16: 2.0**-9, mx.bfloat16: 2.0**-7}[dtype]


def mismatch(got: mx.array, want: mx.array) -> float:
    """Error of `got` against `want`, in units of the output dtype's tolerance (<= 1 agrees):
    fp32 elementwise, half precision relative to the output's norm (the paths sum in
    different orders, so a value may round an ulp apart). NaN anywhere counts as infinite."""
    g, w = got.astype(mx.float32), want.astype(mx.float32)
    if got.dtype == mx.float32:
        err = (mx.abs(g - w).max() / mx.maximum(mx.abs(w).max(), 1.0)).item()
    else:
        err = (mx.linalg.norm(g - w) / mx.linalg.norm(w)).item()
    return err / _tolerance(got.dtype) if math.isfinite(err) else math.inf


def probe_cases(
    q_dtype: mx.Dtype, kv_dtype: mx.Dtype, head_dim: int, group: int
) -> list[tuple[mx.array, mx.array, mx.array, float]]:
    """Random (q, k, v, scale) as the stores pass them: a prefix view of a larger buffer
    (contiguous store, paged pool), a view starting past row 0, a fresh gather; lengths
    with a partial last tile, one row, and several splits."""
    hkv, hq = 2, 2 * group
    keys = mx.random.split(mx.random.key(11), 3)
    cap = 1100
    big_k = mx.random.normal((1, hkv, cap, head_dim), key=keys[0]).astype(kv_dtype)
    big_v = mx.random.normal((1, hkv, cap, head_dim), key=keys[1]).astype(kv_dtype)
    q = mx.random.normal((1, hq, 1, head_dim), key=keys[2]).astype(q_dtype)
    scale = head_dim**-0.5
    cases = []
    for length in (1, 77, 1000):
        cases.append((q, big_k[:, :, :length], big_v[:, :, :length], scale))
    cases.append((q, big_k[:, :, 40:1040], big_v[:, :, 40:1040], scale))
    rows = mx.arange(3, 300)
    cases.append((q, mx.take(big_k, rows, axis=2), mx.take(big_v, rows, axis=2), scale))
    # rows not 16-byte aligned: the element-by-element copy path
    wide_k = mx.concatenate([big_k, big_k[..., :1]], axis=-1)
    wide_v = mx.concatenate([big_v, big_v[..., :1]], axis=-1)
    cases.append((q, wide_k[:, :, :77, 1:], wide_v[:, :, :77, 1:], scale))
    return cases


def rows_are_steps(q: mx.array, k: mx.array, v: mx.array, scale: float, rows: int = 3) -> bool:
    """Whether `rows` query rows in one call give, bit for bit, the one-row calls at their
    positions (what a speculative verify needs; the probe checks it)."""
    qs = mx.concatenate([q] * rows, axis=2) * mx.arange(1, rows + 1, dtype=q.dtype)[:, None]
    many = decode_attention(qs, k, v, scale)
    length = k.shape[2]
    for t in range(rows):
        n = length - rows + 1 + t
        one = decode_attention(qs[:, :, t : t + 1], k[:, :, :n], v[:, :, :n], scale)
        if not mx.array_equal(many[:, :, t : t + 1], one).item():
            return False
    return True


@functools.cache
def available(q_dtype: mx.Dtype, kv_dtype: mx.Dtype, head_dim: int, group: int) -> bool:
    """True when the kernel runs here and agrees with mx.fast.scaled_dot_product_attention
    on `probe_cases` (probed once per dtypes, head_dim and group); else False, with a
    warning when it ran but failed or disagreed."""
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        return False
    try:
        worst = 0.0
        for q, k, v, scale in probe_cases(q_dtype, kv_dtype, head_dim, group):
            got = decode_attention(q, k, v, scale)
            want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
            worst = max(worst, mismatch(got, want))
        if not rows_are_steps(*probe_cases(q_dtype, kv_dtype, head_dim, group)[2]):
            worst = math.inf
    except Exception as e:  # noqa: BLE001 - any failure means: use the MLX op
        warnings.warn(
            f"decode attention kernel unavailable ({e}); using mx.fast."
            "scaled_dot_product_attention",
            stacklevel=2,
        )
        return False
    if not worst <= 1.0:
        warnings.warn(
            f"decode attention kernel disagrees with mx.fast.scaled_dot_product_attention "
            f"({q_dtype}/{kv_dtype}, D={head_dim}, G={group}: {worst:.3g} x tolerance); "
            "using the MLX op",
            stacklevel=2,
        )
        return False
    return True


def paged_matches(q: mx.array, k: mx.array, v: mx.array, scale: float, page_tokens: int) -> bool:
    """Whether paged calls over k / v (as a pool of pages) give, bit for bit, the call on
    the same rows gathered into a contiguous copy: a shared page list in scrambled order
    (a broadcast view), a list per KV head, and a partial last page."""
    P, hkv = page_tokens, k.shape[1]
    n_slots = k.shape[2] // P
    pool_k, pool_v = k[:, :, : n_slots * P], v[:, :, : n_slots * P]
    order = mx.array([(7 * i + 3) % n_slots for i in range(n_slots)], dtype=mx.int32)
    per_head = mx.stack([mx.roll(order, h) for h in range(hkv)])
    for pages in (mx.broadcast_to(order[:5], (hkv, 5)), per_head[:, : n_slots // 2]):
        for length in (1, pages.shape[1] * P - P // 2, pages.shape[1] * P):
            got = decode_attention(q, pool_k, pool_v, scale, None, pages, P, length)
            rows = (pages[:, :, None] * P + mx.arange(P, dtype=mx.int32)).reshape(hkv, -1)
            heads = mx.arange(hkv)[:, None]
            keys = pool_k.squeeze(0)[heads, rows[:, :length]][None]
            values = pool_v.squeeze(0)[heads, rows[:, :length]][None]
            if not mx.array_equal(got, decode_attention(q, keys, values, scale)).item():
                return False
    return True


@functools.cache
def paged_available(
    q_dtype: mx.Dtype, kv_dtype: mx.Dtype, head_dim: int, group: int, page_tokens: int
) -> bool:
    """True when paged calls run here and equal gathered ones (`paged_matches` on the probe's
    pool-shaped case), probed once per shape; else False, with a warning (the store then
    gathers the selected rows first)."""
    if not available(q_dtype, kv_dtype, head_dim, group):
        return False
    q, k, v, scale = probe_cases(q_dtype, kv_dtype, head_dim, group)[2]
    try:
        ok = paged_matches(q, k, v, scale, page_tokens)
    except Exception as e:  # noqa: BLE001 - any failure means: gather first
        warnings.warn(f"paged decode attention unavailable ({e}); gathering rows", stacklevel=2)
        return False
    if not ok:
        warnings.warn(
            "paged decode attention differs from gathered rows; gathering rows", stacklevel=2
        )
    return ok
