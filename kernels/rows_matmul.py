"""Row-invariant products for the few rows of a step, for CUDA: y = x @ w.T for x [R, K]
(R <= 16), each row computed by the same instructions in the same order whatever R is, with
the weights read once for all rows.

Why: speculative verify rows must equal plain steps bit for bit (rows.py). MLX on CUDA
computes a one-row product with a gemv kernel and several rows with cuBLAS, which round
differently, so the rows of a verify were padded to 8 and every plain step with them: on the
H200 that cost plain 27B decode 18% (benchmarks/results/h200/decode_padding.json). Here one
kernel serves 1..8 rows per launch (more rows: more launches), so nothing is padded.

Each warp computes NW outputs (rows of w) for all R rows of x, as MLX's gemv does for one:
its lanes stride over K in units of 4 elements, accumulating in fp32 with fmaf in ascending
order, then a warp butterfly; for a narrow product KS warps share the outputs, each walking
every KS-th stretch of K, their sums added in a fixed order. Nothing in a row's arithmetic
depends on R or on the other rows (R only changes how many outputs a warp takes and how
many loads it batches; KS depends on w's shape alone).
A launch may also normalise its input (the zero-centred RMSNorm whose output the product
reads) and add the residual that follows it (rows.project's `norm` and `residual`): a 27B
step's norms were three launches each (cast up, norm, cast back) and its adds one each,
about half its kernels, each a node for the host to encode.
`available()` probes the kernel once per dtype, plain and with both fused: rows equal to
one-row launches bit for bit and close to an fp32 reference; any error or disagreement
disables it with a warning (the padded MLX product then runs).
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx

from .decode_attention import _HEADER as VECTORS  # cp.async helpers
from .switch import kernel_switch

THREADS = 256
ROWS_PER_LAUNCH = 8
UNIT = 4  # elements a lane loads at once (UNITS)
LOADS = 8  # units a lane has in flight (outputs per warp x unroll), as MLX's gemv unrolls
DTYPES = (mx.float16, mx.bfloat16, mx.float32)

# A lane's unit: 4 elements of T loaded at once (8 bytes in half precision, 16 in fp32), as
# MLX's one-row gemv loads them: measured on the H200, a 27B step's one-row products read
# at 3.19 TB/s with 16-byte units vs MLX's gemv at 3.81 (results/h200/gemv_variants_16l.json).
UNITS = """
namespace qwen38_rows {
template <typename T> struct Unit;
template <> struct Unit<float> {
  using type = uint4;
  static __device__ __forceinline__ void to_float(const uint4& u, float* f) {
    f[0] = __uint_as_float(u.x); f[1] = __uint_as_float(u.y);
    f[2] = __uint_as_float(u.z); f[3] = __uint_as_float(u.w);
  }
};
template <> struct Unit<__nv_bfloat16> {
  using type = uint2;
  static __device__ __forceinline__ void to_float(const uint2& u, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
    float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
  }
};
template <> struct Unit<__half> {
  using type = uint2;
  static __device__ __forceinline__ void to_float(const uint2& u, float* f) {
    const __half2* h = reinterpret_cast<const __half2*>(&u);
    float2 a = __half22float2(h[0]), b = __half22float2(h[1]);
    f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
  }
};
// one unit from global to shared memory, asynchronously (through L1: .cg takes 16 bytes only)
template <int BYTES> __device__ __forceinline__ void cp_async_unit(void* smem, const void* gmem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\\n" :: "r"(s), "l"(gmem), "n"(BYTES)
               : "memory");
}
}  // namespace qwen38_rows
"""

# Template constants from the call: T (dtype), R (rows), NW (outputs per warp), KS (warps
# per output), U (units a lane loads per output before using them) or S (the staged walk's
# steps). Dynamic shared memory holds, in order, the normalised rows (a fused norm) and the
# staged walk's copies.
_HEAD = """
    using namespace qwen38_dattn;
    using namespace qwen38_rows;
    using Load = typename Unit<T>::type;
    constexpr int WARPS = __THREADS__ / 32;
    constexpr int E = 4;                            // elements per unit
    const int KV = x_shape[1] / E;                  // units per row (K % 4 == 0)
    extern __shared__ __align__(16) unsigned char smem_dyn[];
    unsigned char* smem_free = smem_dyn;
"""
# The kernel's set-up, sums and reduction, kept apart from its per-unit step: the warp's
# outputs (NW from n0, of N = w's rows) and fp32 sums per (row, output), and the lanes' walk
# over the units w[n][c] (`wv`, `KV` of them per output) in ascending order, U loads in
# flight before their `accumulate(wr, c)`, then a warp butterfly per sum and, where KS warps
# split the units of the same outputs (warp ks of them walks ks * 32 + lane, then every
# 32 * KS), their sums added in ks order, into y.
ACCUMULATORS = """
    const int N = w_shape[0];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int ks = warp % KS, first = ks * 32 + lane, stride = 32 * KS;
    const long long n0 = ((long long)blockIdx.x * (WARPS / KS) + warp / KS) * NW;
    const Load* wv = reinterpret_cast<const Load*>(w);
    const Load* xv = reinterpret_cast<const Load*>(x);
    float acc[R][NW];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NW; ++j) acc[r][j] = 0.0f;
"""
WALK = """
    auto load = [&](Load (&wr)[NW], int c) {
#pragma unroll
        for (int j = 0; j < NW; ++j) wr[j] = n0 + j < N ? wv[(n0 + j) * KV + c] : Load{};
    };
    int c = first;
    for (; c + stride * (U - 1) < KV; c += stride * U) {
        Load wr[U][NW];
#pragma unroll
        for (int u = 0; u < U; ++u) load(wr[u], c + stride * u);
#pragma unroll
        for (int u = 0; u < U; ++u) accumulate(wr[u], c + stride * u);
    }
    for (; c < KV; c += stride) {
        Load wr[1][NW];
        load(wr[0], c);
        accumulate(wr[0], c);
    }
"""
# The same walk with the weight units copied ahead through shared memory (cp.async, S - 1
# steps in flight per lane, each lane reading back only its own copies): the bytes in
# flight no longer cost registers, which a step of several rows needs for its sums.
STAGED_WALK = """
    Load* slots = reinterpret_cast<Load*>(smem_free) + warp * (S * NW * 32);
    const int steps = (KV - first + stride - 1) / stride;  // units first + stride i < KV
    auto issue = [&](int i) {
        if (i < steps) {
            Load* slot = slots + (i % S) * NW * 32;
            const int c = first + stride * i;
#pragma unroll
            for (int j = 0; j < NW; ++j)
                if (n0 + j < N)
                    cp_async_unit<sizeof(Load)>(slot + j * 32 + lane, wv + (n0 + j) * KV + c);
        }
        cp_async_commit();                          // empty past the end: the count stays
    };
#pragma unroll
    for (int i = 0; i < S - 1; ++i) issue(i);
    for (int i = 0; i < steps; ++i) {
        cp_async_wait<S - 2>();                     // step i's copies have landed
        // refill the slot read in the step before (its values are in registers by now)
        issue(i + S - 1);
        const Load* slot = slots + (i % S) * NW * 32;
        Load wr[NW];
#pragma unroll
        for (int j = 0; j < NW; ++j) wr[j] = n0 + j < N ? slot[j * 32 + lane] : Load{};
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
            if (KS == 1) {
                if (lane == 0 && n0 + j < N) put(r, n0 + j, v);
            } else if (lane == 0) {
                split_sums[(r * NW + j) * WARPS + warp] = v;
            }
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
                    if (n0 + j < N) put(r, n0 + j, v);
                }
        }
    }
"""
_ACCUMULATE = """
    // lane's units first, first + stride, ... ascending for every (row, output): the loads
    // of U of them are issued before their products (the order of the sums is fixed)
    // (the weights are widened once per unit, not once per row)
    auto accumulate = [&](const Load (&wr)[NW], int c) {
        float wf[NW][E];
#pragma unroll
        for (int j = 0; j < NW; ++j) Unit<T>::to_float(wr[j], wf[j]);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float xf[E];
            load_x(r, c, xf);
#pragma unroll
            for (int j = 0; j < NW; ++j)
#pragma unroll
                for (int e = 0; e < E; ++e) acc[r][j] = fmaf(xf[e], wf[j][e], acc[r][j]);
        }
    };
"""

# How a lane reads x: as it is, or normalised (a norm fused into the product that reads its
# output): each row's RMS by the whole block in a fixed order (thread t sums the squares of
# units t, t + THREADS, ..., then a warp butterfly, then the warps' sums in warp order),
# then x * inv * scale rounded to T as the norm's output would be, written once per block to
# shared memory, which the walk reads. The same steps whatever R is, so rows stay invariant.
X_PLAIN = """
    auto load_x = [&](int r, int c, float (&xf)[E]) {
        Unit<T>::to_float(xv[(long long)r * KV + c], xf);
    };
"""
X_NORMED = """
    __shared__ float norm_sums[R * WARPS];
    __shared__ float row_inv[R];
    Load* xs = reinterpret_cast<Load*>(smem_free);
    smem_free += (long long)R * KV * sizeof(Load);
    for (int r = 0; r < R; ++r) {
        float ss = 0.0f;
        for (int c = threadIdx.x; c < KV; c += __THREADS__) {
            float f[E];
            Unit<T>::to_float(xv[(long long)r * KV + c], f);
#pragma unroll
            for (int e = 0; e < E; ++e) ss = fmaf(f[e], f[e], ss);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, off);
        if (lane == 0) norm_sums[r * WARPS + warp] = ss;
    }
    __syncthreads();
    if (threadIdx.x < R) {
        float total = 0.0f;
        for (int q = 0; q < WARPS; ++q) total += norm_sums[threadIdx.x * WARPS + q];
        row_inv[threadIdx.x] = rsqrtf(total / static_cast<float>(x_shape[1]) + eps[0]);
    }
    __syncthreads();
    const float4* sv = reinterpret_cast<const float4*>(scale);
    for (int r = 0; r < R; ++r) {
        const float inv = row_inv[r];
        for (int c = threadIdx.x; c < KV; c += __THREADS__) {
            float f[E];
            Unit<T>::to_float(xv[(long long)r * KV + c], f);
            const float4 s = sv[c];
            Load out;
            T* o = reinterpret_cast<T*>(&out);
            o[0] = static_cast<T>(f[0] * inv * s.x);
            o[1] = static_cast<T>(f[1] * inv * s.y);
            o[2] = static_cast<T>(f[2] * inv * s.z);
            o[3] = static_cast<T>(f[3] * inv * s.w);
            xs[r * KV + c] = out;
        }
    }
    __syncthreads();
    auto load_x = [&](int r, int c, float (&xf)[E]) { Unit<T>::to_float(xs[r * KV + c], xf); };
"""
# Where an output goes: y = T(sum), or with a residual fused (the add that follows the
# product) y = T(res + T(sum)), the add's own rounding.
Y_PLAIN = """
    auto put = [&](int r, long long n, float v) { y[(long long)r * N + n] = T(v); };
"""
Y_RESIDUAL = """
    auto put = [&](int r, long long n, float v) {
        const long long i = (long long)r * N + n;
        y[i] = T(static_cast<float>(res[i]) + static_cast<float>(T(v)));
    };
"""


@functools.cache
def _kernel(staged: bool, normed: bool, residual: bool, shared_bytes: int):
    """The product with the register walk, or the staged walk; `normed`: x goes through an
    RMSNorm first (inputs scale [K] fp32 and eps [1]); `residual`: y adds a residual (input
    res [R, N]); `shared_bytes` of dynamic shared memory (in the name: MLX sets a kernel's
    shared memory limit once, when it first loads it)."""
    source = (
        _HEAD
        + ACCUMULATORS
        + (X_NORMED if normed else X_PLAIN)
        + (Y_RESIDUAL if residual else Y_PLAIN)
        + _ACCUMULATE
        + (STAGED_WALK if staged else WALK)
        + REDUCE
    )
    name = "qwen38_rows_matmul" + "_staged" * staged + "_normed" * normed
    name += "_residual" * residual + f"_{shared_bytes}" * bool(shared_bytes)
    inputs = ["x", "w"] + ["scale", "eps"] * normed + ["res"] * residual
    return mx.fast.cuda_kernel(
        name=name,
        input_names=inputs,
        output_names=["y"],
        source=source.replace("__THREADS__", str(THREADS)),
        header=VECTORS + UNITS,
        shared_memory=shared_bytes,
    )


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
# Warps that split one output's units, for products of at most SPLIT_K_MAX_N outputs:
# the 27B's 5120-wide ones otherwise run as few warps with long walks (at 4 outputs a warp,
# 160 blocks for 132 SMs), each waiting on its loads. A function of the weight's shape only
# (never of the rows), so rows stay invariant; it changes the order of a row's sums, so a
# plain step's bits differ from the kernel without it (both are fp32-accumulated products).
SPLIT_K = 4
SPLIT_K_MAX_N = 8192


def _split(n: int) -> int:
    return SPLIT_K if n <= SPLIT_K_MAX_N else 1


def _shape(rows: int) -> tuple[int, int]:
    """(outputs per warp, weight units a lane loads per output before using them)
    for a launch of `rows` rows."""
    nw = OUTPUTS_PER_WARP.get(rows, WIDE_OUTPUTS)
    return nw, max(LOADS // nw, 1)


def rows_matmul(
    x: mx.array,
    w: mx.array,
    norm: tuple[mx.array, float] | None = None,
    residual: mx.array | None = None,
) -> mx.array:
    """x [R, K] @ w[N, K].T -> [R, N] in x's dtype (fp32 accumulation), R >= 1, every row
    computed as a one-row call computes it. x and w share a dtype; K % (16 bytes) == 0.

    `norm` = (scale [K] fp32, eps): x is an RMSNorm's input, normalised inside the product
    (T(x * rsqrt(mean(x^2) + eps) * scale) per row, as the norm would output it), so the
    norm is no launch of its own. `residual` [R, N] in x's dtype: returns T(residual + y),
    the add that follows the product, in the same launch."""
    n = w.shape[0]
    normed, added = norm is not None, residual is not None
    operands = [w] + ([norm[0], _eps(norm[1])] if normed else [])
    per_row = [residual] if added else []
    return launch_in_parts(
        lambda rows: _launch(rows, w, normed, added), x, operands, n, [("T", x.dtype)], per_row
    )


@functools.cache
def _eps(eps: float) -> mx.array:
    return mx.array([eps], dtype=mx.float32)


def _launch(rows: int, w: mx.array, normed: bool = False, residual: bool = False) -> tuple:
    """(kernel, template constants) of a launch of `rows` rows with weight w."""
    nw, loads = _shape(rows)
    n, k = w.shape
    shape = [("R", rows), ("NW", nw), ("KS", _split(n))]
    normed_bytes = rows * k * w.dtype.size if normed else 0
    if rows >= STAGED_FROM:
        staged_bytes = THREADS * STAGES * nw * UNIT * w.dtype.size
        kernel = _kernel(True, normed, residual, normed_bytes + staged_bytes)
        return kernel, [*shape, ("S", STAGES)]
    return _kernel(False, normed, residual, normed_bytes), [*shape, ("U", loads)]


def launch_in_parts(
    launch, x: mx.array, operands: list, n: int, template: list, per_row: list = ()
) -> mx.array:
    """A row-invariant product over x [R, ...]'s rows, at most ROWS_PER_LAUNCH per launch:
    `launch(rows)` -> (kernel, its row constants: R, NW, KS and the walk's), inputs
    [part, *operands, *the same rows of each per_row array], `template` first, output
    [rows, n]."""
    outs = []
    for start in range(0, x.shape[0], ROWS_PER_LAUNCH):
        # no slice where one launch takes every row: a slice is a graph node to encode
        whole = x.shape[0] <= ROWS_PER_LAUNCH
        cut = slice(start, start + ROWS_PER_LAUNCH)
        part = x if whole else x[cut]
        rows = part.shape[0]
        kernel, constants = launch(rows)
        shape = dict(constants)
        per_block = shape["NW"] * THREADS // 32 // shape.get("KS", 1)
        outs.append(
            kernel(
                inputs=[part, *operands, *(a if whole else a[cut] for a in per_row)],
                template=[*template, *constants],
                grid=(-(-n // per_block) * THREADS, 1, 1),
                threadgroup=(THREADS, 1, 1),
                output_shapes=[(rows, n)],
                output_dtypes=[x.dtype],
            )[0]
        )
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def probe_rows(fn, x: mx.array, want: mx.array, slack: float, what: str) -> bool:
    """Whether fn(x, 0) computes each row of x as fn(that row, its index) alone, bit for
    bit, and close to the fp32 product `want` (within 2 ulp of x's dtype, plus `slack`); a
    failure to run or a disagreement warns, naming `what`."""
    try:
        together = fn(x, 0)
        alone = mx.concatenate([fn(x[i : i + 1], i) for i in range(x.shape[0])])
        mx.eval(together, alone, want)
    except Exception as e:  # noqa: BLE001 - any failure means: the fallback runs
        warnings.warn(f"{what} unavailable ({e})", stacklevel=3)
        return False
    same = mx.array_equal(together, alone).item()
    dtype = x.dtype
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


def fits(x: mx.array, w: mx.array) -> bool:
    """Whether rows_matmul takes these operands (shapes and dtypes; not the probe)."""
    vec = 16 // x.dtype.size
    return (
        x.ndim == 2
        and w.ndim == 2
        and x.dtype == w.dtype
        and x.dtype in DTYPES
        and x.shape[1] == w.shape[1]
        and x.shape[1] % vec == 0
    )


def supported() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


@functools.cache
def available(dtype: mx.Dtype) -> bool:
    """True when the kernel runs here, its rows equal one-row launches bit for bit and it
    agrees with an fp32 product (probed once per dtype); else False, with a warning when it
    ran but disagreed. QWEN38_ROWS_KERNEL: auto | off | force (skip the probe)."""
    choice = kernel_switch("QWEN38_ROWS_KERNEL")
    if choice == "off" or dtype not in DTYPES or not supported():
        return False
    if choice == "force":
        return True
    kx, kw = mx.random.split(mx.random.key(11))
    rows, k, n = 11, 1000 * (16 // dtype.size), 203  # two launches; a partial last block
    x = mx.random.normal((rows, k), key=kx).astype(dtype)
    w = (mx.random.normal((n, k), key=kw) / k**0.5).astype(dtype)
    want = x.astype(mx.float32) @ w.astype(mx.float32).T
    plain = probe_rows(lambda part, _: rows_matmul(part, w), x, want, 1e-4, "rows matmul kernel")
    if not plain:
        return False
    # the fused norm and residual: rows still alone, close to the norm, product and add
    # done one after another (the norm's sum may round its last bit otherwise: the slack)
    scale = 1.0 + 0.1 * mx.random.normal((k,), key=kx)
    res = mx.random.normal((rows, n), key=kw).astype(dtype)
    xf = x.astype(mx.float32)
    normed = (xf * mx.rsqrt(mx.mean(xf * xf, axis=-1, keepdims=True) + 1e-6) * scale).astype(dtype)
    want = res.astype(mx.float32) + normed.astype(mx.float32) @ w.astype(mx.float32).T
    return probe_rows(
        lambda part, i: rows_matmul(part, w, (scale, 1e-6), res[i : i + part.shape[0]]),
        x,
        want,
        1e-2,
        "rows matmul kernel with a fused norm and residual",
    )
