"""Row-invariant quantized products for the few rows of a step, for CUDA: y = x @ W.T with W
in MLX's affine format (4 or 8 bits, packed in uint32, a scale and a bias per group of
`group_size` weights), x [R, K] (R <= 16): each row computed by the same instructions in the
same order whatever R is, with the packed weights read once for all rows.

Why: MLX's quantized product of 1..7 rows (qmv) computes each row alone but reads the weights
once per row, and 8 rows switch to another kernel; so a row-exact verify of a 4-bit model
either padded every plain step to 8 rows (26.2 vs 47.4 tok/s on the H200, 27B dims) or read
the weights once per verify row (a 5-row verify cost 3.0 plain steps:
benchmarks/results/h200/verify_4bit.json). The layout of the work follows rows_matmul.py:
each warp computes NW outputs for all R rows, its lanes stride over K in 16-byte vectors of
packed weights (32 weights at 4 bits) in ascending order, fp32 sums with fmaf (per vector:
scale * sum(x q) + bias * sum(x), the affine dequantisation folded in), then a warp
butterfly. `available()` probes the kernel once per (dtype, bits, group size): rows equal to
one-row launches bit for bit and close to an fp32 product of the dequantised weights.
It is off unless QWEN38_ROWS_QKERNEL=auto until it has been measured on a GPU (written in
session 10 with no device time left; compiled under NVRTC for sm_90 only):
`benchmarks/probe_rows_qmatmul_gpu.py` against MLX's product, then
`QWEN38_ROWS_QKERNEL=auto python benchmarks/bench_gpu_27b.py --bits 4` against the default.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from .decode_attention import _HEADER as VECTORS  # Vec<T>: 16 bytes of T -> floats
from .rows_matmul import (
    ACCUMULATORS,
    DTYPES,
    THREADS,
    WALK_AND_REDUCE,
    launch_in_parts,
    probe_rows,
    supported,
)
from .switch import kernel_switch

BITS = (4, 8)
DEFAULT = "off"  # until benchmarks/probe_rows_qmatmul_gpu.py measures it on a GPU (available)

# Template constants from the call: T (x's dtype), B (bits), R (rows), NW (outputs per
# warp), U (packed vectors a lane loads per output before using them).
_SOURCE = (
    """
    using namespace qwen38_dattn;
    constexpr int WARPS = __THREADS__ / 32;
    constexpr int EPV = 128 / B;                   // weights per 16-byte packed vector
    constexpr int PER_WORD = 32 / B;
    constexpr unsigned MASK = (1u << B) - 1u;
    constexpr int XN = Vec<T>::N;                  // x elements per 16-byte vector
    constexpr int XV = EPV / XN;                   // x vectors per packed vector
    const int KV = w_shape[1] / 4;                 // packed vectors per row of w
    const int G = scales_shape[1];                 // groups per row
    const int VPG = KV / G;                        // packed vectors per group

"""
    + ACCUMULATORS
    + """
    auto accumulate = [&](const uint4 (&wr)[NW], int c) {
        const int g = c / VPG;
#pragma unroll
        for (int j = 0; j < NW; ++j) {
            const long long n = n0 + j;
            const float s = n < N ? static_cast<float>(scales[n * G + g]) : 0.0f;
            const float b = n < N ? static_cast<float>(biases[n * G + g]) : 0.0f;
            float q[EPV];
            const unsigned* words = reinterpret_cast<const unsigned*>(&wr[j]);
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int e = 0; e < PER_WORD; ++e)
                    // exact for v < 2^23, and full-rate (an int-to-float cvt is not)
                    q[i * PER_WORD + e] =
                        __int_as_float(0x4B000000u | ((words[i] >> (B * e)) & MASK)) - 8388608.0f;
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float dot = 0.0f, sum = 0.0f;
#pragma unroll
                for (int v = 0; v < XV; ++v) {
                    float xf[XN];
                    Vec<T>::to_float(xv[((long long)r * KV + c) * XV + v], xf);
#pragma unroll
                    for (int e = 0; e < XN; ++e) {
                        dot = fmaf(xf[e], q[v * XN + e], dot);
                        sum += xf[e];
                    }
                }
                acc[r][j] = fmaf(s, dot, acc[r][j]);
                acc[r][j] = fmaf(b, sum, acc[r][j]);
            }
        }
    };
"""
    + WALK_AND_REDUCE
)


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="qwen38_rows_qmatmul",
        input_names=["x", "w", "scales", "biases"],
        output_names=["y"],
        source=_SOURCE.replace("__THREADS__", str(THREADS)),
        header=VECTORS,
    )


def rows_qmatmul(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int
) -> mx.array:
    """x [R, K] @ dequantize(w, scales, biases).T -> [R, N] in x's dtype (fp32 sums), every
    row computed as a one-row call computes it (`fits` says which operands it takes)."""
    template = [("T", x.dtype), ("B", bits)]
    return launch_in_parts(_kernel(), x, [w, scales, biases], w.shape[0], template)


def fits(
    x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, bits: int, group_size: int
) -> bool:
    """Whether rows_qmatmul takes these operands: x [R, K] in a kernel dtype, w uint32
    [N, K * bits / 32], scales and biases [N, K / group_size] in x's dtype, a group a whole
    number of 16-byte packed vectors."""
    per_vector = 128 // bits if bits in BITS else 0
    return (
        per_vector > 0
        and x.ndim == 2
        and w.ndim == 2
        and x.dtype in DTYPES
        and w.dtype == mx.uint32
        and scales.dtype == x.dtype
        and biases.dtype == x.dtype
        and w.shape[1] * 32 // bits == x.shape[1]
        and w.shape[1] % 4 == 0
        and group_size % per_vector == 0
        and x.shape[1] % group_size == 0
        and scales.shape == (w.shape[0], x.shape[1] // group_size)
        and biases.shape == scales.shape
    )


@functools.cache
def available(dtype: mx.Dtype, bits: int, group_size: int) -> bool:
    """True when the kernel runs here, its rows equal one-row launches bit for bit and it
    agrees with an fp32 product of the dequantised weights (probed once per dtype, bits and
    group size); else False, with a warning when it ran but disagreed.
    QWEN38_ROWS_QKERNEL: off (default: written without device time, it has not yet been
    measured against MLX's qmv, which a plain 4-bit step runs otherwise) | auto (probe) |
    force (skip the probe)."""
    choice = kernel_switch("QWEN38_ROWS_QKERNEL", DEFAULT)
    if choice == "off" or dtype not in DTYPES or bits not in BITS or not supported():
        return False
    if choice == "force":
        return True
    kx, kw = mx.random.split(mx.random.key(12))
    rows, k, n = 11, 8 * group_size * 4, 203  # two launches; a partial last block
    x = mx.random.normal((rows, k), key=kx).astype(dtype)
    weights = (mx.random.normal((n, k), key=kw) / k**0.5).astype(dtype)
    w, scales, biases = mx.quantize(weights, group_size=group_size, bits=bits)
    if not fits(x, w, scales, biases, bits, group_size):
        return False
    dense = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits)
    want = x.astype(mx.float32) @ dense.astype(mx.float32).T

    def product(part: mx.array) -> mx.array:
        return rows_qmatmul(part, w, scales, biases, bits)

    return probe_rows(product, x, want, 1e-3, "quantized rows kernel")
