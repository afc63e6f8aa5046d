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
so the norm's cast is one kernel fewer per product and the row's bits do not change.
`available()` probes the kernel once per dtype: rows equal to one-row launches bit for bit
and close to an fp32 reference, and fp32 rows equal to the same rows cast first; any error or
disagreement disables it with a warning (the padded MLX product then runs).
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx

from .decode_attention import ASYNC_COPIES, VECTORS  # Vec<T>; cp.async
from .jit import cuda_kernel
from .switch import kernel_switch

THREADS = 256
ROWS_PER_LAUNCH = 8
LOADS = 4  # 16-byte weight vectors a lane has in flight (outputs per warp x unroll)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)

# The kernel's set-up, sums and reduction, kept apart from its per-vector step: the warp's
# outputs (NW from n0, of N = w's rows) and fp32 sums per (row, output), and the lanes' walk
# over 16-byte weight vectors w[n][c] (`wv`, `KV` of them per output) in ascending order, U
# loads in flight before their `accumulate(wr, c)`, then a warp butterfly per sum and, where
# KS warps split the vectors of the same outputs (warp ks of them walks ks * 32 + lane,
# then every 32 * KS), their sums added in ks order, into y.
ACCUMULATORS = """
    const int N = w_shape[0];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int ks = warp % KS, first = ks * 32 + lane, stride = 32 * KS;
    const long long n0 = ((long long)blockIdx.x * (WARPS / KS) + warp / KS) * NW;
    const uint4* wv = reinterpret_cast<const uint4*>(w);
    float acc[R][NW];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NW; ++j) acc[r][j] = 0.0f;
"""
WALK = """
    auto load = [&](uint4 (&wr)[NW], int c) {
#pragma unroll
        for (int j = 0; j < NW; ++j)
            wr[j] = n0 + j < N ? wv[(n0 + j) * KV + c] : make_uint4(0u, 0u, 0u, 0u);
    };
    int c = first;
    for (; c + stride * (U - 1) < KV; c += stride * U) {
        uint4 wr[U][NW];
#pragma unroll
        for (int u = 0; u < U; ++u) load(wr[u], c + stride * u);
#pragma unroll
        for (int u = 0; u < U; ++u) accumulate(wr[u], c + stride * u);
    }
    for (; c < KV; c += stride) {
        uint4 wr[1][NW];
        load(wr[0], c);
        accumulate(wr[0], c);
    }
"""
# The same walk with the weight vectors copied ahead through shared memory (cp.async, S - 1
# steps in flight per lane, each lane reading back only its own copies): the bytes in
# flight no longer cost registers, which a step of several rows needs for its sums.
STAGED_WALK = """
    extern __shared__ __align__(16) unsigned char smem_dyn[];
    uint4* slots = reinterpret_cast<uint4*>(smem_dyn) + warp * (S * NW * 32);
    const int steps = (KV - first + stride - 1) / stride;  // vectors first + stride i < KV
    auto issue = [&](int i) {
        if (i < steps) {
            uint4* slot = slots + (i % S) * NW * 32;
            const int c = first + stride * i;
#pragma unroll
            for (int j = 0; j < NW; ++j)
                if (n0 + j < N) cp_async16(slot + j * 32 + lane, wv + (n0 + j) * KV + c);
        }
        cp_async_commit();                          // empty past the end: the count stays
    };
#pragma unroll
    for (int i = 0; i < S - 1; ++i) issue(i);
    for (int i = 0; i < steps; ++i) {
        cp_async_wait<S - 2>();                     // step i's copies have landed
        // refill the slot read in the step before (its values are in registers by now)
        issue(i + S - 1);
        const uint4* slot = slots + (i % S) * NW * 32;
        uint4 wr[NW];
#pragma unroll
        for (int j = 0; j < NW; ++j)
            wr[j] = n0 + j < N ? slot[j * 32 + lane] : make_uint4(0u, 0u, 0u, 0u);
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
                if (lane == 0 && n0 + j < N) y[(long long)r * N + n0 + j] = T(v);
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
                    if (n0 + j < N) y[(long long)r * N + n0 + j] = T(v);
                }
        }
    }
"""

# x's VEC elements from element i as floats: x of w's dtype T as it is, fp32 x (X = float)
# rounded to T first, as casting x to T would round it (row r's vector c is at (r KV + c) VEC).
X_LOAD = """
template <typename A, typename B> struct same_type { static constexpr bool value = false; };
template <typename A> struct same_type<A, A> { static constexpr bool value = true; };

template <typename T, typename X>
__device__ __forceinline__ void load_x(const X* x, long long i, float* f) {
  if constexpr (same_type<T, X>::value) {
    qwen38_dattn::Vec<T>::to_float(*reinterpret_cast<const uint4*>(x + i), f);
  } else {
    const float4* v = reinterpret_cast<const float4*>(x + i);
#pragma unroll
    for (int q = 0; q < qwen38_dattn::Vec<T>::N / 4; ++q) {
      const float4 u = v[q];
      f[4 * q] = static_cast<float>(static_cast<T>(u.x));
      f[4 * q + 1] = static_cast<float>(static_cast<T>(u.y));
      f[4 * q + 2] = static_cast<float>(static_cast<T>(u.z));
      f[4 * q + 3] = static_cast<float>(static_cast<T>(u.w));
    }
  }
}
"""

# Template constants from the call: T (w's dtype), X (x's: T or float), R (rows), NW (outputs
# per warp), KS (warps per output), U (vectors a lane loads per output before using them).
_PRODUCT = (
    """
    using namespace qwen38_dattn;
    constexpr int WARPS = __THREADS__ / 32;
    constexpr int VEC = Vec<T>::N;                 // elements per 16-byte vector
    const int KV = x_shape[1] / VEC;               // vectors per row (K % VEC == 0)

"""
    + ACCUMULATORS
    + """
    // lane's vectors first, first + stride, ... ascending for every (row, output): the
    // loads of U of them are issued before their products (the order of the sums is fixed)
    // (the weights are widened once per vector, not once per row)
    auto accumulate = [&](const uint4 (&wr)[NW], int c) {
        float wf[NW][VEC];
#pragma unroll
        for (int j = 0; j < NW; ++j) Vec<T>::to_float(wr[j], wf[j]);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            float xf[VEC];
            load_x<T, X>(x, ((long long)r * KV + c) * VEC, xf);
#pragma unroll
            for (int j = 0; j < NW; ++j)
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[r][j] = fmaf(xf[e], wf[j][e], acc[r][j]);
        }
    };
"""
)
_SOURCE = _PRODUCT + WALK + REDUCE
_STAGED_SOURCE = _PRODUCT + STAGED_WALK + REDUCE  # template S (steps copied ahead) for U


@functools.cache
def _kernel(staged_bytes: int = 0):
    """The product with the register walk, or (staged_bytes > 0) with the staged walk and
    that much shared memory for its copies."""
    source = _STAGED_SOURCE if staged_bytes else _SOURCE
    return cuda_kernel(
        name="qwen38_rows_matmul_staged" if staged_bytes else "qwen38_rows_matmul",
        input_names=["x", "w"],
        output_names=["y"],
        source=source.replace("__THREADS__", str(THREADS)),
        header=VECTORS + (ASYNC_COPIES if staged_bytes else "") + X_LOAD,
        shared_memory=staged_bytes,
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
# Warps that split one output's vectors, for products of at most SPLIT_K_MAX_N outputs:
# the 27B's 5120-wide ones otherwise run as few warps with long walks (at 4 outputs a warp,
# 160 blocks for 132 SMs), each waiting on its loads. A function of the weight's shape only
# (never of the rows), so rows stay invariant; it changes the order of a row's sums, so a
# plain step's bits differ from the kernel without it (both are fp32-accumulated products).
SPLIT_K = 4
SPLIT_K_MAX_N = 8192


def _split(n: int) -> int:
    return SPLIT_K if n <= SPLIT_K_MAX_N else 1


def _shape(rows: int) -> tuple[int, int]:
    """(outputs per warp, 16-byte weight vectors a lane loads per output before using them)
    for a launch of `rows` rows."""
    nw = OUTPUTS_PER_WARP.get(rows, WIDE_OUTPUTS)
    return nw, max(LOADS // nw, 1)


def rows_matmul(x: mx.array, w: mx.array) -> mx.array:
    """x [R, K] @ w[N, K].T -> [R, N] in w's dtype (fp32 accumulation), R >= 1, every row
    computed as a one-row call computes it. x of w's dtype, or fp32 for a half-precision w
    (rounded to w's dtype as it is read); K % (16 bytes of w) == 0."""
    n = w.shape[0]
    template = [("T", w.dtype), ("X", x.dtype)]
    return launch_in_parts(lambda rows: _launch(rows, n), x, [w], n, template, w.dtype)


def _launch(rows: int, n: int) -> tuple:
    """(kernel, template constants) of a launch of `rows` rows and `n` outputs."""
    nw, loads = _shape(rows)
    shape = [("R", rows), ("NW", nw), ("KS", _split(n))]
    if rows >= STAGED_FROM:
        return _kernel(THREADS * STAGES * nw * 16), [*shape, ("S", STAGES)]
    return _kernel(), [*shape, ("U", loads)]


def launch_in_parts(
    launch, x: mx.array, operands: list, n: int, template: list, dtype: mx.Dtype | None = None
) -> mx.array:
    """A row-invariant product over x [R, ...]'s rows, at most ROWS_PER_LAUNCH per launch:
    `launch(rows)` -> (kernel, its row constants: R, NW, KS and the walk's), inputs
    [part, *operands], `template` first, output [rows, n] of `dtype` (default x's)."""
    outs = []
    for start in range(0, x.shape[0], ROWS_PER_LAUNCH):
        # one launch takes every row: no slice (a graph node the host encodes every step)
        part = x if x.shape[0] <= ROWS_PER_LAUNCH else x[start : start + ROWS_PER_LAUNCH]
        rows = part.shape[0]
        kernel, constants = launch(rows)
        shape = dict(constants)
        per_block = shape["NW"] * THREADS // 32 // shape.get("KS", 1)
        outs.append(
            kernel(
                inputs=[part, *operands],
                template=[*template, *constants],
                grid=(-(-n // per_block) * THREADS, 1, 1),
                threadgroup=(THREADS, 1, 1),
                output_shapes=[(rows, n)],
                output_dtypes=[dtype or x.dtype],
            )[0]
        )
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)


def probe_rows(fn, x: mx.array, want: mx.array, slack: float, what: str) -> bool:
    """Whether fn(x) computes each row of x as fn of that row alone, bit for bit, and close
    to the fp32 product `want` (within 2 ulp of x's dtype, plus `slack`); a failure to run
    or a disagreement warns, naming `what`."""
    try:
        together = fn(x)
        alone = mx.concatenate([fn(x[i : i + 1]) for i in range(x.shape[0])])
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
    vec = 16 // w.dtype.size
    return (
        x.ndim == 2
        and w.ndim == 2
        and (x.dtype == w.dtype or (x.dtype == mx.float32 and w.dtype.size == 2))
        and w.dtype in DTYPES
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
    if not probe_rows(lambda part: rows_matmul(part, w), x, want, 1e-4, "rows matmul kernel"):
        return False
    return dtype == mx.float32 or _wide_rows_agree(x, w)


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
