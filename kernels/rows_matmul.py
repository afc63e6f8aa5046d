"""Row-invariant products for the few rows of a step, for CUDA: y = x @ w.T for x [R, K]
(R <= 16), each row computed by the same instructions in the same order whatever R is, with
the weights read once for all rows.

Why: speculative verify rows must equal plain steps bit for bit (rows.py). MLX on CUDA
computes a one-row product with a gemv kernel and several rows with cuBLAS, which round
differently, so the rows of a verify were padded to 8 and every plain step with them: on the
H200 that cost plain 27B decode 18% (benchmarks/results/h200/decode_padding.json). Here one
kernel serves 1..8 rows per launch (more rows: more launches), so nothing is padded.

Each warp computes NW outputs (rows of w) for all R rows of x, as MLX's gemv does for one:
its lanes stride over K in 16-byte vectors, accumulating in fp32 with fmaf in ascending
order, then a warp butterfly; for a narrow product KS warps share the outputs, each walking
every KS-th stretch of K, their sums added in a fixed order. Nothing in a row's arithmetic
depends on R or on the other rows (R only changes how many outputs a warp takes and how
many loads it batches; KS depends on w's shape alone).
x may also be fp32 where w is half precision (what a zero-centred norm computes before its
cast back): each element is rounded to w's dtype as it is loaded, as the cast would round it,
so the norm's cast is one kernel fewer per product and the row's bits do not change. Such
rows are copied once per block into shared memory, rounded (X_SHARED): every warp reading
them through L1 in fp32 cost a 64-layer 27B step's products 1.2 ms at one row and 3.7 ms at
three (benchmarks/probe_gemv_gpu.py --orders, results/h200/gemv_orders_xshared_64l_s24.json).
`available()` probes the kernel once per dtype: rows equal to one-row launches bit for bit
and close to an fp32 reference, and fp32 rows equal to the same rows cast first; any error or
disagreement disables it with a warning (the padded MLX product then runs).
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .decode_attention import ASYNC_COPIES  # cp.async's commit and wait
from .jit import cuda_kernel, float32_literal
from .switch import switched

THREADS = 256
ROWS_PER_LAUNCH = 8
LOADS = 4  # 16 bytes of weights a lane has in flight, this many times (outputs x unroll)
# Bytes of a weight row a lane loads at once (its chunk): 16, or 8 as MLX's gemv does. A
# function of w's dtype only, so a row's order of sums never depends on the row count. On
# the H200 8 was no faster at one row (15.5-16.9 vs 15.6-16.8 ms a 64-layer step's products,
# two machines) and slower at 2-5 rows (gemv_orders_xshared_64l_s24.json; 4K decode 66.6 vs
# 66.0 tok/s, within noise: decode_4k_s24_*.json).
CHUNK_BYTES = 16
# x's rows are copied once per block into shared memory (as w's dtype) when they are fp32
# ("wide"), always ("all") or never ("none": read through L1), where a launch's rows take at
# most X_SHARED_MAX bytes there (fp32 rows wider than that are cast first). 32 KB: 3 rows of
# the 27B's 5120 (MTP's verify). With the staged walk's 64 KB a block of 5 such rows held
# 114 KB, one block per SM: a 27B step's products took 21.7 ms at 5 rows, as with the rows
# read through L1, against 17.7 for rows cast first (gemv_orders_xshared_64l_s24.json).
# (These choices were measured while the kernel loaded x element by element and was bound by
# its L1, fixed in session 26: ncu_products_s26.json. They may deserve a new measurement.)
X_SHARED = "wide"
X_SHARED_MAX = 32 * 1024
DTYPES = (mx.float16, mx.bfloat16, mx.float32)

# The kernel's set-up, sums and reduction, kept apart from its per-vector step: the warp's
# outputs (NW from n0, of N = w's rows) and fp32 sums per (row, output), and the lanes' walk
# over weight chunks w[n][c] (`wv`, `KV` of them per output) in ascending order, U
# loads in flight before their `accumulate(wr, c)`, then a warp butterfly per sum and, where
# KS warps split the vectors of the same outputs (warp ks of them walks ks * 32 + lane,
# then every 32 * KS), their sums added in ks order, into y.
ACCUMULATORS = """
    const int N = w_shape[0];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int ks = warp % KS, first = ks * 32 + lane, stride = 32 * KS;
    const long long n0 = ((long long)blockIdx.x * (WARPS / KS) + warp / KS) * NW;
    // the weight row of the warp's output j: n0 + j, or for SWIGLU (NW even) its pairs'
    // gate and up rows, q and q + N / 2 for q = (n0 + j) / 2 (MIX: ROWS["mix"])
    auto row = [&](int j) -> long long {
        return __ROW__;
    };
    const W* wv = reinterpret_cast<const W*>(w);
    float acc[R][NW];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NW; ++j) acc[r][j] = 0.0f;
"""
WALK = """
    auto load = [&](W (&wr)[NW], int c) {
#pragma unroll
        for (int j = 0; j < NW; ++j)
            wr[j] = n0 + j < N ? wv[row(j) * KV + c] : W{};
    };
    int c = first;
    // the first U chunks are on their way while the block copies (or norms) x's rows
    const bool ahead = c + stride * (U - 1) < KV;
    W first_wr[U][NW];
    if (ahead) {
#pragma unroll
        for (int u = 0; u < U; ++u) load(first_wr[u], c + stride * u);
    }
    __X_PROLOGUE__
    if (ahead) {
#pragma unroll
        for (int u = 0; u < U; ++u) accumulate(first_wr[u], c + stride * u);
        c += stride * U;
    }
    for (; c + stride * (U - 1) < KV; c += stride * U) {
        W wr[U][NW];
#pragma unroll
        for (int u = 0; u < U; ++u) load(wr[u], c + stride * u);
#pragma unroll
        for (int u = 0; u < U; ++u) accumulate(wr[u], c + stride * u);
    }
    for (; c < KV; c += stride) {
        W wr[1][NW];
        load(wr[0], c);
        accumulate(wr[0], c);
    }
"""
# The same walk with the weight vectors copied ahead through shared memory (cp.async, S - 1
# steps in flight per lane, each lane reading back only its own copies): the bytes in
# flight no longer cost registers, which a step of several rows needs for its sums.
STAGED_WALK = """
    W* slots = reinterpret_cast<W*>(smem_dyn) + warp * (S * NW * 32);
    const int steps = (KV - first + stride - 1) / stride;  // vectors first + stride i < KV
    auto copy_chunk = [](W* to, const W* from) { qwen38_rows::copy_async<sizeof(W)>(to, from); };
    auto issue = [&](int i) {
        if (i < steps) {
            W* slot = slots + (i % S) * NW * 32;
            const int c = first + stride * i;
#pragma unroll
            for (int j = 0; j < NW; ++j)
                if (n0 + j < N) copy_chunk(slot + j * 32 + lane, wv + row(j) * KV + c);
        }
        qwen38_dattn::cp_async_commit();            // empty past the end: the count stays
    };
#pragma unroll
    for (int i = 0; i < S - 1; ++i) issue(i);
    __X_PROLOGUE__  // (x's copy sits past the slots: the copies in flight do not touch it)
    for (int i = 0; i < steps; ++i) {
        qwen38_dattn::cp_async_wait<S - 2>();       // step i's copies have landed
        // refill the slot read in the step before (its values are in registers by now)
        issue(i + S - 1);
        const W* slot = slots + (i % S) * NW * 32;
        W wr[NW];
#pragma unroll
        for (int j = 0; j < NW; ++j)
            wr[j] = n0 + j < N ? slot[j * 32 + lane] : W{};
        accumulate(wr, first + stride * i);
    }
"""
REDUCE = """
    __shared__ float split_sums[KS > 1 ? R * NW * WARPS : 1];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NW; ++j) {
            float v = acc[r][j];
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffff, v, off);
            acc[r][j] = v;
            if (KS > 1 && lane == 0) split_sums[(r * NW + j) * WARPS + warp] = v;
        }
    if (KS > 1) {
        __syncthreads();
        if (ks == 0 && lane == 0) {
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int j = 0; j < NW; ++j) {
                    const float* part = split_sums + (r * NW + j) * WARPS + warp;
                    float v = part[0];
#pragma unroll
                    for (int q = 1; q < KS; ++q) v += part[q];
                    acc[r][j] = v;
                }
        }
    }
    if (ks == 0 && lane == 0) {
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int j = 0; j < NW; ++j) {
                if (n0 + j >= N) continue;
                const long long i = (long long)r * N + n0 + j;
                __STORE__
            }
    }
"""

# How a launch stores output j of row r (its fp32 sum acc[r][j], flat index i), by epilogue:
# plain; RESIDUAL: res + the product as T (then as O: the output's dtype), as an add of the
# product with res cast to T computes it; SWIGLU: silu(gate) * up from a warp's pair (gate at
# even j, up next to it), with MLX's own ops (its headers), as nn.silu(gate) * up computes it;
# GATES: a gated residual's low-rank gates from its fused down / inject product (template GL,
# its low rank, and GS, its streams): v = y / GS in T, then silu(v) for the first GL outputs
# and 2 sigmoid(v) for the rest, with MLX's ops, as models/hyper_connections.py's gate_down
# and gate_inject compute them (the stream kernels' `gates` launch, stored as the product is);
# MIX: a gated residual's block input from its up product (template MS, its streams, each a
# stretch of H = N / MS outputs): a warp's NW = MS outputs are output h of every stream
# (ROWS), and the store mixes them with the normed streams (input `streams` [R, N]) as the
# stream kernels' `mix` launch does, each output rounded to T first as a plain store would:
# x[r, h] = T(sum over s of sigmoid(T(y_s)) * streams[r, s * H + h], in fp32) * T(1 / MS).
STORES = {
    "": "y[i] = T(acc[r][j]);",
    "residual": "y[i] = static_cast<O>(mlx::core::cu::Add{}(static_cast<T>(res[i]), "
    "T(acc[r][j])));",
    "swiglu": """if (j & 1) continue;
const T g = T(acc[r][j]), u = T(acc[r][j + 1]);
using namespace mlx::core::cu;
y[i >> 1] = Multiply{}(Multiply{}(g, Sigmoid{}(g)), u);""",
    "gates": """using namespace mlx::core::cu;
const T v = Divide{}(T(acc[r][j]), static_cast<T>(static_cast<float>(GS)));
const T sig = Sigmoid{}(v);
y[i] = n0 + j < GL ? Multiply{}(v, sig) : Multiply{}(static_cast<T>(2.0f), sig);""",
    "mix": """if (j != 0) continue;
using namespace mlx::core::cu;
const long long H = N / MS, h = n0 / MS;
float total = 0.0f;
#pragma unroll
for (int s = 0; s < MS; ++s)
    total += static_cast<float>(Multiply{}(Sigmoid{}(T(acc[r][s])), streams[(r * MS + s) * H + h]));
y[r * H + h] = Multiply{}(static_cast<T>(total), static_cast<T>(1.0f / static_cast<float>(MS)));""",
}
# The weight row of a warp's output j, by epilogue (the rest: ROWS[""]).
ROWS = {
    "": "SWIGLU ? (n0 >> 1) + (j >> 1) + (j & 1) * (N >> 1) : n0 + j",
    "mix": "n0 / MS + j * (N / MS)",
}
EPILOGUE_HEADERS = {
    "": "",
    "residual": '#include "mlx/backend/cuda/device/binary_ops.cuh"\n',
    "swiglu": '#include "mlx/backend/cuda/device/unary_ops.cuh"\n'
    '#include "mlx/backend/cuda/device/binary_ops.cuh"\n',
}
EPILOGUE_HEADERS["gates"] = EPILOGUE_HEADERS["mix"] = EPILOGUE_HEADERS["swiglu"]

# A lane's chunk of a weight row: C elements of T as one 16- or 8-byte load, and as floats.
# (Kept short: MLX hashes a kernel's whole source at every launch it encodes.)
CHUNKS = """
namespace qwen38_rows {
template <int B> struct Bytes;
template <> struct Bytes<16> { using type = uint4; };
template <> struct Bytes<8> { using type = uint2; };
template <typename T, int C> struct Chunk {
  using type = typename Bytes<C * sizeof(T)>::type;
  // u by value: a reference bound to memory would be read element by element
  static __device__ __forceinline__ void to_float(const type u, float* f) {
    const T* t = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int e = 0; e < C; ++e) f[e] = static_cast<float>(t[e]);
  }
};
}  // namespace qwen38_rows
"""
# cp.async of one chunk (8-byte copies go through L1: .cg takes 16 bytes only).
COPY_CHUNK = """
namespace qwen38_rows {
template <int B> __device__ __forceinline__ void copy_async(void* smem, const void* gmem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (B == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" :: "r"(s), "l"(gmem) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\\n" :: "r"(s), "l"(gmem) : "memory");
}
}  // namespace qwen38_rows
"""

# x's C elements from element i as floats: x of w's dtype T as it is, fp32 x (X = float)
# rounded to T first, as casting x to T would round it (row r's vector c is at (r KV + c) VEC).
X_LOAD = """
template <typename T, typename X, int C>
__device__ __forceinline__ void load_x(const X* x, long long i, float* f) {
  using Load = qwen38_rows::Chunk<T, C>;
  if constexpr (sizeof(X) == sizeof(T)) {  // X is T
    Load::to_float(*reinterpret_cast<const typename Load::type*>(x + i), f);  // one load
  } else {                                 // X is float: C / 4 16-byte loads
    float4 u[C / 4];
#pragma unroll
    for (int q = 0; q < C / 4; ++q) u[q] = reinterpret_cast<const float4*>(x + i)[q];
    const float* g = reinterpret_cast<const float*>(u);
#pragma unroll
    for (int e = 0; e < C; ++e) f[e] = static_cast<float>(static_cast<T>(g[e]));
  }
}
"""

# A zero-centred RMSNorm of x's rows as the products' input: y = T(scale * (x * inv)) for inv =
# rsqrt(mean(x^2) + eps), the mean's sums in this block's fixed order (each thread's squares of
# its 4-element chunks ascending, a warp butterfly, the warps in order), so the product's
# prologue and the stand-alone kernel (NORM_SOURCE, for rows too wide for shared memory) give
# the same bits; `parts`: THREADS / 32 floats of shared memory.
NORM_ROWS = """
namespace qwen38_rows {
template <int THREADS, typename T, typename X, int ROWS>
__device__ __forceinline__ void normed_rows(
    const X* x, const float* scale, int K, float eps, T* y, float* parts) {
  for (int r = 0; r < ROWS; ++r) {
    const X* row = x + (long long)r * K;
    float ss = 0.0f;
    for (int i = threadIdx.x * 4; i < K; i += THREADS * 4) {
      float f[4];
      load_x<X, X, 4>(row, i, f);
#pragma unroll
      for (int e = 0; e < 4; ++e) ss = fmaf(f[e], f[e], ss);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, off);
    if ((threadIdx.x & 31) == 0) parts[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = parts[0];
#pragma unroll
    for (int w = 1; w < THREADS / 32; ++w) total += parts[w];
    __syncthreads();  // parts are the next row's
    const float inv = rsqrtf(total / static_cast<float>(K) + eps);
    for (int i = threadIdx.x * 4; i < K; i += THREADS * 4) {
      float f[4];
      load_x<X, X, 4>(row, i, f);
#pragma unroll
      for (int e = 0; e < 4; ++e)
        y[(long long)r * K + i + e] = static_cast<T>(scale[i + e] * (f[e] * inv));
    }
  }
}
}  // namespace qwen38_rows
"""
# XS: the block copies x's rows to shared memory before its first product, after it issued
# its first weight loads (they would otherwise wait for the copy, or the norm, to finish).
X_PROLOGUE = """
    if constexpr (XS) {
        __X_COPY__
        __syncthreads();
    }
"""
# How the block copies x's rows to shared memory (XS): as they are, rounded to T, or normed.
X_COPY = """
        for (int i = threadIdx.x * 4; i < R * x_shape[1]; i += __THREADS__ * 4) {
            float f[4];
            load_x<T, X, 4>(x, i, f);
#pragma unroll
            for (int e = 0; e < 4; ++e) xt[i + e] = static_cast<T>(f[e]);
        }
"""
X_COPY_NORMED = """
        __shared__ float norm_parts[__THREADS__ / 32];
        qwen38_rows::normed_rows<__THREADS__, T, X, R>(
            x, scale, x_shape[1], __EPS__, xt, norm_parts);
"""
# The stand-alone norm: block r norms row r into y (T), as the product's prologue would.
NORM_SOURCE = """
    __shared__ float parts[__THREADS__ / 32];
    const int K = x_shape[1];
    qwen38_rows::normed_rows<__THREADS__, T, X, 1>(
        x + (long long)blockIdx.x * K, scale, K, __EPS__, y + (long long)blockIdx.x * K, parts);
"""

# Template constants from the call: T (w's dtype), X (x's: T or float), C (elements of a
# chunk), R (rows), NW (outputs per warp), KS (warps per output), XS (x copied to shared
# memory at byte XO), then the walk's: U (chunks a lane loads per output before using them)
# or S (steps copied ahead).
_PRODUCT = (
    """
    constexpr int WARPS = __THREADS__ / 32;
    using Load = qwen38_rows::Chunk<T, C>;         // a lane's chunk: C elements of T
    using W = typename Load::type;
    const int KV = x_shape[1] / C;                 // chunks per row (K % C == 0)
    extern __shared__ __align__(16) unsigned char smem_dyn[];
    // XS: the block first copies x's rows to shared memory as T (rounded as a cast rounds),
    // and lanes read their x there: fp32 rows read through L1 by every warp would cost
    // twice the bytes of the weights they multiply
    T* xt = reinterpret_cast<T*>(smem_dyn + XO);

"""
    + ACCUMULATORS
    + """
    // lane's vectors first, first + stride, ... ascending for every (row, output): the
    // loads of U of them are issued before their products (the order of the sums is fixed)
    // (the weights are widened once per vector, not once per row)
    auto accumulate = [&](const W (&wr)[NW], int c) {
        float wf[NW][C];
#pragma unroll
        for (int j = 0; j < NW; ++j) Load::to_float(wr[j], wf[j]);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float xf[C];
            if constexpr (XS) load_x<T, T, C>(xt, ((long long)r * KV + c) * C, xf);
            else load_x<T, X, C>(x, ((long long)r * KV + c) * C, xf);
#pragma unroll
            for (int j = 0; j < NW; ++j)
#pragma unroll
                for (int e = 0; e < C; ++e) acc[r][j] = fmaf(xf[e], wf[j][e], acc[r][j]);
        }
    };
"""
)
_SOURCE = _PRODUCT + WALK + REDUCE
_STAGED_SOURCE = _PRODUCT + STAGED_WALK + REDUCE  # template S (steps copied ahead) for U


@functools.cache
def _kernel(staged: bool, shared_bytes: int, epilogue: str = "", eps: float | None = None):
    """The product with the register walk, or with the staged walk, and that much shared
    memory (the staged walk's copies, then x's copy), storing its outputs as `epilogue`
    says (STORES); with `eps`, x's rows are normed first (NORM_ROWS, a `scale` input)."""
    source = (_STAGED_SOURCE if staged else _SOURCE).replace("__X_PROLOGUE__", X_PROLOGUE)
    source = source.replace("__X_COPY__", X_COPY if eps is None else X_COPY_NORMED)
    source = source.replace("__THREADS__", str(THREADS))
    source = source.replace("__ROW__", ROWS.get(epilogue, ROWS[""]))
    parts = ["qwen38_rows_matmul", *(["staged"] if staged else []), epilogue]
    if eps is not None:
        parts.append("norm" + _eps_tag(eps))
    return cuda_kernel(
        name="_".join(p for p in parts if p),
        input_names=["x", "w"]
        + (["scale"] if eps is not None else [])
        + (["res"] if epilogue == "residual" else [])
        + (["streams"] if epilogue == "mix" else []),
        output_names=["y"],
        source=source.replace("__STORE__", STORES[epilogue]).replace(
            "__EPS__", float32_literal(eps or 0.0)
        ),
        header=EPILOGUE_HEADERS[epilogue]
        + CHUNKS
        + X_LOAD
        + NORM_ROWS
        + (ASYNC_COPIES + COPY_CHUNK if staged else ""),
        shared_memory=shared_bytes,
    )


@functools.cache
def _norm_kernel(eps: float):
    """The stand-alone norm of rows too wide for the product's shared memory (NORM_SOURCE)."""
    return cuda_kernel(
        name="qwen38_rows_norm" + _eps_tag(eps),
        input_names=["x", "scale"],
        output_names=["y"],
        source=NORM_SOURCE.replace("__THREADS__", str(THREADS)).replace(
            "__EPS__", float32_literal(eps)
        ),
        header=CHUNKS + X_LOAD + NORM_ROWS,
    )


def _eps_tag(eps: float) -> str:
    """A kernel-name-safe tag of eps's fp32 bits (one compiled kernel per eps)."""
    return "_e" + np.float32(eps).view(np.uint32).item().to_bytes(4, "big").hex()


# Outputs per warp by row count: more read x fewer times (a lane's loads of x per weight
# vector: rows / outputs) but hold more sums in registers; one keeps a one-row step a plain
# gemv. Measured in a 64-layer 27B step on the H200 (benchmarks/probe_round_host_gpu.py,
# benchmarks/results/h200/round_outputs_*.json): 2 beat 4 at 4 rows, tie at 5. Launches of
# STAGED_FROM rows or more copy the weights ahead through shared memory (STAGES - 1 steps in
# flight): at 5 rows 25.2-26.1 ms a 64-layer step vs 29.2 with the register walk and no
# SPLIT_K (round_walk_*.json, round_splitk*.json; with SPLIT_K the two walks measured
# within run-to-run noise). None of this changes a row's arithmetic whatever the row count
# (the probe checks it).
OUTPUTS_PER_WARP = {1: 1, 2: 2, 3: 2, 4: 2}
WIDE_OUTPUTS = 4  # 5..8 rows
STAGED_FROM = 2
STAGES = 4
# Warps that split one output's vectors, for products of at most SPLIT_K_MAX_N outputs:
# the 27B's 5120-wide ones otherwise run as few warps with long walks (at 4 outputs a warp,
# 160 blocks for 132 SMs), each waiting on its loads. A function of the weight's shape only
# (never of the rows), so rows stay invariant; it changes the order of a row's sums, so a
# plain step's bits differ from the kernel without it (both are fp32-accumulated products).
SPLIT_K = 4
SPLIT_K_MAX_N = 8192


def _split(n: int) -> int:
    return SPLIT_K if n <= SPLIT_K_MAX_N else 1


def _shape(rows: int, chunk_bytes: int, pairs: bool = False, group: int = 0) -> tuple[int, int]:
    """(outputs per warp, chunks a lane loads per output before using them) for a launch of
    `rows` rows: LOADS x 16 bytes in flight per lane; `pairs`: an even count of outputs;
    `group`: exactly that many (a mix's streams)."""
    nw = group or OUTPUTS_PER_WARP.get(rows, WIDE_OUTPUTS)
    nw += nw % 2 if pairs else 0
    return nw, max(LOADS * 16 // chunk_bytes // nw, 1)


def rows_matmul(
    x: mx.array,
    w: mx.array,
    *,
    residual: mx.array | None = None,
    dtype: mx.Dtype | None = None,
    swiglu: bool = False,
    norm: tuple[mx.array, float] | None = None,
    gates: tuple[int, int] | None = None,
    mix: tuple[mx.array, int] | None = None,
) -> mx.array:
    """x [R, K] @ w[N, K].T -> [R, N] in w's dtype (fp32 accumulation), R >= 1, every row
    computed as a one-row call computes it. x of w's dtype, or fp32 for a half-precision w
    (rounded to w's dtype as it is read); K % (16 bytes of w) == 0.

    `norm` (scale [K] fp32, eps): the product of x's rows zero-centred-RMS-normed first, each
    rounded to w's dtype (NORM_ROWS: in the product's prologue, or by a kernel of its own where
    the launch's rows are too wide for shared memory, the same bits either way).

    Epilogues (each output as the ops after the product would compute it, one launch
    instead of two): `residual` [R, N] (w's dtype, or fp32 holding values of it): residual
    + the product in w's dtype, then cast to `dtype` (default w's); `swiglu`: w's rows are a
    fused [gate; up] pair of N / 2 each, the output [R, N / 2] is silu(gate) * up; `gates`
    (low rank L, streams S): a gated residual's down / inject product, the output [R, N]
    silu(y / S) in its first L columns and 2 sigmoid(y / S) in the rest (GATES); `mix`
    (normed streams [R, N] of w's dtype, their count S): a gated residual's up product mixed
    into its block input, the output [R, N / S] as stream_mix.mix of the stored product and
    the streams (MIX)."""
    n, k, size = w.shape[0], w.shape[1], w.dtype.size
    copy_x = X_SHARED == "all" or (x.dtype != w.dtype and X_SHARED == "wide") or bool(norm)
    if copy_x and min(x.shape[0], ROWS_PER_LAUNCH) * k * size > X_SHARED_MAX:
        if norm is not None:  # too wide to copy: normed apart, as the prologue would
            x, norm = norm_rows(x, *norm, w.dtype), None
        elif x.dtype != w.dtype:  # too wide to copy: the cast, as the rows would be rounded
            x = x.astype(w.dtype)
        copy_x = False
    chunk = _chunk(w.dtype)
    epilogue = "swiglu" if swiglu else "residual" if residual is not None else ""
    template = [("T", w.dtype), ("X", x.dtype), ("C", chunk), ("SWIGLU", swiglu)]
    if gates is not None:
        epilogue = "gates"
        template += [("GL", gates[0]), ("GS", gates[1])]
    streams = 0
    if mix is not None:
        epilogue, streams = "mix", mix[1]
        template.append(("MS", streams))
    out_dtype = w.dtype
    if residual is not None:
        out_dtype = dtype or w.dtype
        template.append(("O", out_dtype))

    eps = None if norm is None else norm[1]

    def launch(rows: int) -> tuple:
        x_bytes = rows * k * size if copy_x else 0
        return _launch(rows, n, chunk * size, x_bytes, epilogue, eps, streams)

    by_rows = [] if residual is None else [residual]
    width = n // 2 if swiglu else n
    if mix is not None:
        by_rows, width = [mix[0]], n // streams
    operands = [w] if norm is None else [w, norm[0]]
    return launch_in_parts(launch, x, operands, n, template, out_dtype, by_rows, width)


def norm_rows(x: mx.array, scale: mx.array, eps: float, dtype: mx.Dtype) -> mx.array:
    """x [R, K]'s rows zero-centred-RMS-normed by the fp32 `scale` [K] and rounded to `dtype`,
    with the bits of rows_matmul's norm prologue (one block per row)."""
    return _norm_kernel(eps)(
        inputs=[x, scale],
        template=[("T", dtype), ("X", x.dtype)],
        grid=(x.shape[0] * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[dtype],
    )[0]


def _chunk(dtype: mx.Dtype) -> int:
    """Elements of a weight row a lane loads at once: CHUNK_BYTES of them (at least 4)."""
    return max(CHUNK_BYTES // dtype.size, 4)


def _launch(
    rows: int,
    n: int,
    chunk_bytes: int,
    x_bytes: int,
    epilogue: str = "",
    eps: float | None = None,
    streams: int = 0,
) -> tuple:
    """(kernel, template constants) of a launch of `rows` rows and `n` outputs, with x's
    rows copied to `x_bytes` of shared memory (0: read in place; normed with `eps`); a
    swiglu epilogue takes its outputs in pairs (an even count per warp), a mix one output of
    each of its `streams` per warp."""
    nw, loads = _shape(rows, chunk_bytes, epilogue == "swiglu", streams)
    shape = [("R", rows), ("NW", nw), ("KS", _split(n)), ("XS", x_bytes > 0)]
    if rows >= STAGED_FROM:
        stages = STAGES * 16 // chunk_bytes  # the same bytes in flight for either chunk
        slots = THREADS * stages * nw * chunk_bytes
        kernel = _kernel(True, slots + x_bytes, epilogue, eps)
        return kernel, [*shape, ("XO", slots), ("S", stages)]
    return _kernel(False, x_bytes, epilogue, eps), [*shape, ("XO", 0), ("U", loads)]


def launch_in_parts(
    launch,
    x: mx.array,
    operands: list,
    n: int,
    template: list,
    dtype: mx.Dtype | None = None,
    by_rows: list | None = None,
    width: int | None = None,
) -> mx.array:
    """A row-invariant product over x [R, ...]'s rows, at most ROWS_PER_LAUNCH per launch:
    `launch(rows)` -> (kernel, its row constants: R, NW, KS and the walk's), inputs
    [part, *operands, *the same rows of by_rows], `template` first, output [rows, width]
    (default n) of `dtype` (default x's); the grid covers n outputs."""
    outs = []
    for start in range(0, x.shape[0], ROWS_PER_LAUNCH):
        # one launch takes every row: no slice (a graph node the host encodes every step)
        whole = x.shape[0] <= ROWS_PER_LAUNCH
        part = x if whole else x[start : start + ROWS_PER_LAUNCH]
        rows_of = [a if whole else a[start : start + ROWS_PER_LAUNCH] for a in by_rows or []]
        rows = part.shape[0]
        kernel, constants = launch(rows)
        shape = dict(constants)
        per_block = shape["NW"] * THREADS // 32 // shape.get("KS", 1)
        outs.append(
            kernel(
                inputs=[part, *operands, *rows_of],
                template=[*template, *constants],
                grid=(-(-n // per_block) * THREADS, 1, 1),
                threadgroup=(THREADS, 1, 1),
                output_shapes=[(rows, width or n)],
                output_dtypes=[dtype or x.dtype],
            )[0]
        )
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def probe_rows(fn, x: mx.array, want: mx.array, slack: float, what: str) -> bool:
    """Whether fn(x) computes each row of x as fn of that row alone, bit for bit, and close
    to the fp32 product `want` (within 2 ulp of the output's dtype, plus `slack`); a failure
    to run or a disagreement warns, naming `what`."""
    try:
        together = fn(x)
        alone = mx.concatenate([fn(x[i : i + 1]) for i in range(x.shape[0])])
        mx.eval(together, alone, want)
    except Exception as e:  # noqa: BLE001 - any failure means: the fallback runs
        warnings.warn(f"{what} unavailable ({e})", stacklevel=3)
        return False
    same = mx.array_equal(together, alone).item()
    dtype = together.dtype  # (x may be wider: fp32 rows of a half-precision product)
    ulp = 2.0**-23 if dtype == mx.float32 else 2.0**-10 if dtype == mx.float16 else 2.0**-7
    err = mx.abs(together.astype(mx.float32) - want) - (2 * ulp * mx.abs(want) + slack)
    close = (err <= 0).all().item()
    if not (same and close):
        warnings.warn(
            f"{what} disagrees (rows equal to one-row launches: {same}, close to fp32: {close})",
            stacklevel=3,
        )
        return False
    return True


def fits(
    x: mx.array,
    w: mx.array,
    residual: mx.array | None = None,
    swiglu: bool = False,
    scale: mx.array | None = None,
    gates: bool = False,
    mix: tuple[mx.array, int] | None = None,
) -> bool:
    """Whether rows_matmul takes these operands (shapes and dtypes; not the probe); `scale`:
    a norm's; `gates`: the gates epilogue, `mix` the mix epilogue (no other)."""
    vec = 16 // w.dtype.size
    if scale is not None and (scale.shape != (x.shape[-1],) or scale.dtype != mx.float32):
        return False
    return (
        x.ndim == 2
        and w.ndim == 2
        and (x.dtype == w.dtype or (x.dtype == mx.float32 and w.dtype.size == 2))
        and w.dtype in DTYPES
        and x.shape[1] == w.shape[1]
        and x.shape[1] % vec == 0
        and (
            residual is None
            or (
                residual.shape == (x.shape[0], w.shape[0])
                and residual.dtype in (w.dtype, mx.float32)
            )
        )
        and (not swiglu or (residual is None and w.shape[0] % 2 == 0))
        and (not gates or (residual is None and not swiglu))
        and (mix is None or _mixes(x, w, *mix) and residual is None and not (swiglu or gates))
    )


def _mixes(x: mx.array, w: mx.array, streams: mx.array, count: int) -> bool:
    """Whether the mix epilogue takes normed `streams` of `count` for x @ w.T."""
    n = w.shape[0]
    return (
        count > 0
        and n % count == 0
        and streams.shape == (x.shape[0], n)
        and (streams.dtype == w.dtype)
    )


def supported() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


@functools.cache
def available(dtype: mx.Dtype) -> bool:
    """True when the kernel runs here, its rows equal one-row launches bit for bit and it
    agrees with an fp32 product (probed once per dtype); else False, with a warning when it
    ran but disagreed. QWEN38_ROWS_KERNEL: auto | off | force (skip the probe)."""
    decided = switched("QWEN38_ROWS_KERNEL", lambda: dtype in DTYPES and supported())
    if decided is not None:
        return decided
    kx, kw = mx.random.split(mx.random.key(11))
    rows, k, n = 11, 1000 * (16 // dtype.size), 203  # two launches; a partial last block
    x = mx.random.normal((rows, k), key=kx).astype(dtype)
    w = (mx.random.normal((n, k), key=kw) / k**0.5).astype(dtype)
    want = x.astype(mx.float32) @ w.astype(mx.float32).T
    if not probe_rows(lambda part: rows_matmul(part, w), x, want, 1e-4, "rows matmul kernel"):
        return False
    return dtype == mx.float32 or _wide_rows_agree(x, w)


@functools.cache
def epilogues_available(dtype: mx.Dtype) -> bool:
    """True when the product runs here (available) and its epilogues store what the ops
    after a plain product compute, bit for bit: residual + product (then cast to fp32) and
    silu(gate) * up (probed once per dtype; a disagreement warns). QWEN38_ROWS_EPILOGUES:
    auto | off | force (skip the probe)."""
    decided = switched("QWEN38_ROWS_EPILOGUES", lambda: available(dtype))
    if decided is not None:
        return decided
    kx, kw, kr = mx.random.split(mx.random.key(13), 3)
    rows, k, n = 3, 64 * (16 // dtype.size), 2 * 701  # odd pairs: a partial last warp
    x = mx.random.normal((rows, k), key=kx).astype(dtype)
    w = (mx.random.normal((n, k), key=kw) * k**-0.5).astype(dtype)
    res = (4 * mx.random.normal((rows, n), key=kr)).astype(dtype)

    def pairs() -> list[tuple[mx.array, mx.array]]:
        plain = rows_matmul(x, w)
        gate, up = mx.split(plain, 2, axis=-1)
        return [
            (rows_matmul(x, w, residual=res), res + plain),
            (
                rows_matmul(x, w, residual=res.astype(mx.float32), dtype=mx.float32),
                (res + plain).astype(mx.float32),
            ),
            (rows_matmul(x, w, swiglu=True), _swiglu(gate, up)),
        ]

    return _same_bits(pairs, "rows matmul epilogues", "the ops they replace")


@functools.cache
def gates_available(dtype: mx.Dtype) -> bool:
    """True when the product runs here (available) and its gates epilogue stores, bit for
    bit, what the gated residual's ops compute from the plain product (silu(y / S), 2
    sigmoid(y / S), as compiled in a step), probed once per dtype (a disagreement warns).
    QWEN38_GATES_KERNEL: auto | off | force (skip the probe)."""
    decided = switched("QWEN38_GATES_KERNEL", lambda: available(dtype))
    if decided is not None:
        return decided
    kx, kw = mx.random.split(mx.random.key(23))
    rows, k, low, streams = 3, 64 * (16 // dtype.size), 317, 4  # a partial last block
    x = mx.random.normal((rows, k), key=kx).astype(dtype)
    w = (4 * mx.random.normal((low + streams, k), key=kw) * k**-0.5).astype(dtype)

    def pairs() -> list[tuple[mx.array, mx.array]]:
        fused = rows_matmul(x, w, gates=(low, streams))
        alone = rows_matmul(x[1:2], w, gates=(low, streams))
        want = _gates(low, streams)(rows_matmul(x, w))
        return [(fused, want), (alone, fused[1:2])]

    return _same_bits(pairs, "rows matmul gates epilogue", "the gated residual's ops")


@functools.cache
def mix_available(dtype: mx.Dtype) -> bool:
    """True when the product runs here (available) and its mix epilogue stores, bit for bit,
    what the stream kernels' mix launch computes from the plain product (stream_mix.mix),
    probed once per dtype (a disagreement warns). QWEN38_MIX_KERNEL: auto | off | force
    (skip the probe)."""
    decided = switched("QWEN38_MIX_KERNEL", lambda: available(dtype))
    if decided is not None:
        return decided
    from .stream_mix import mix  # the launch the epilogue replaces

    kx, kw, ks = mx.random.split(mx.random.key(29), 3)
    rows, k, streams, hidden = 3, 40 * (16 // dtype.size), 4, 203  # a partial last block
    x = mx.random.normal((rows, k), key=kx).astype(dtype)
    w = (4 * mx.random.normal((streams * hidden, k), key=kw) * k**-0.5).astype(dtype)
    normed = mx.random.normal((rows, streams * hidden), key=ks).astype(dtype)

    def pairs() -> list[tuple[mx.array, mx.array]]:
        fused = rows_matmul(x, w, mix=(normed, streams))
        alone = rows_matmul(x[1:2], w, mix=(normed[1:2], streams))
        return [(fused, mix(rows_matmul(x, w), normed, streams)), (alone, fused[1:2])]

    return _same_bits(pairs, "rows matmul mix epilogue", "the stream kernels' mix")


@functools.cache
def _gates(low: int, streams: int):
    """The gated residual's gates as a step computes them (one compiled graph): silu(y / S)
    of the first `low` columns, 2 sigmoid(y / S) of the rest, side by side."""

    def gates(y: mx.array) -> mx.array:
        gate = nn.silu(y[:, :low] / streams)
        inject = 2.0 * mx.sigmoid(y[:, low:] / streams)
        return mx.concatenate([gate, inject], axis=1)

    return mx.compile(gates)


@functools.cache
def norm_available(dtype: mx.Dtype) -> bool:
    """True when the product's epilogues run here (epilogues_available) and its norm prologue
    gives each row the bits of that row alone, of the stand-alone norm kernel (rows too wide
    for shared memory) and close to the op path's norm then product (probed once per dtype; a
    disagreement warns). QWEN38_ROWS_NORM: off (the default) | auto | force (skip the probe).

    Off by default: every block recomputes its rows' norm before its weights stream, and on
    the H200 a 64-layer 27B step's device time grew 14.5 -> 15.2 ms with it (4K decode
    68.2 vs 64.9 tok/s, benchmarks/results/h200/decode_4k_s27_norm_{off,auto}.json)."""
    decided = switched("QWEN38_ROWS_NORM", lambda: epilogues_available(dtype), "off")
    if decided is not None:
        return decided
    kx, kw, ks = mx.random.split(mx.random.key(19), 3)
    # 5 rows of this width are normed apart (past X_SHARED_MAX), one row in the prologue
    rows, k, n = 5, X_SHARED_MAX // (4 * dtype.size), 203
    x = 3 * mx.random.normal((rows, k), key=kx)
    w = (mx.random.normal((n, k), key=kw) * k**-0.5).astype(dtype)
    scale = 1 + 0.2 * mx.random.normal((k,), key=ks)
    eps = 1e-6
    normed = mx.fast.rms_norm(x, scale, eps).astype(dtype).astype(mx.float32)
    want = normed @ w.astype(mx.float32).T

    def fused(part: mx.array) -> mx.array:
        return rows_matmul(part, w, norm=(scale, eps))

    if not probe_rows(fused, x, want, 1e-3, "rows matmul norm prologue"):
        return False
    return _same_bits(
        lambda: [(rows_matmul(norm_rows(x[:1], scale, eps, dtype), w), fused(x[:1]))],
        "rows matmul norm kernel",
        "the norm prologue",
    )


def _same_bits(pairs, what: str, reference: str) -> bool:
    """Whether each (got, want) of `pairs()` is equal bit for bit; a failure to run or a
    difference warns, naming `what` and its `reference` (the caller then runs ops)."""
    try:
        same = all(mx.array_equal(got, want).item() for got, want in pairs())
    except Exception as e:  # noqa: BLE001 - any failure means: the ops run instead
        warnings.warn(f"{what} unavailable ({e})", stacklevel=3)
        return False
    if not same:
        warnings.warn(f"{what}: not bit-equal to {reference}", stacklevel=3)
    return same


@mx.compile
def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


def _wide_rows_agree(x: mx.array, w: mx.array) -> bool:
    """Whether fp32 rows that round to x give x's products bit for bit (warns if not)."""
    # fp32 values between x's: each rounds to x's element (or a neighbour, as a cast would)
    noise = mx.random.uniform(-0.4, 0.4, x.shape, key=mx.random.key(12))
    wide = x.astype(mx.float32) * (1 + noise * 2.0**-8)
    try:
        same = mx.array_equal(rows_matmul(wide, w), rows_matmul(wide.astype(x.dtype), w)).item()
    except Exception as e:  # noqa: BLE001 - any failure means: the fallback runs
        warnings.warn(f"rows matmul kernel unavailable for fp32 rows ({e})", stacklevel=3)
        return False
    if not same:
        warnings.warn("rows matmul kernel rounds fp32 rows unlike a cast", stacklevel=3)
    return same
