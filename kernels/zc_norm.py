"""The zero-centred RMSNorm of a half-precision input in one CUDA launch:
y = T(float(x) * rsqrt(mean(float(x)^2) + eps) * scale), scale = 1 + w in fp32.

Why: MLX's mx.fast.rms_norm with a bf16 x and an fp32 scale promotes x to fp32 first and
returns fp32, so every zero-centred norm of a step was three kernels (cast up, norm, cast
back). A Qwen3.8-27B decode step has 161 of them: 322 of its ~1,000 kernels were those casts,
and on the H200 a step is bound by the host's work per kernel
(benchmarks/probe_step_graph.py, results/h200/step_graph_64l.json).

One block per row (rows are independent: a row's bits never depend on the others): each
thread sums the squares of its strided elements in fp32, then the warps' sums are added in a
fixed order. The sum runs in another order than MLX's kernel (fp32 rounding apart);
`available()` probes the kernel once per (dtype, width) against the op path, to within one
unit in the last place of the output dtype; any error or disagreement disables it with a
warning (the op path then runs).
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx

from .switch import kernel_switch

THREADS = 256
DTYPES = (mx.float16, mx.bfloat16)

_SOURCE = """
    constexpr int WARPS = __THREADS__ / 32;
    __shared__ float partial[WARPS];
    const int D = x_shape[x_ndim - 1];
    const long long row = blockIdx.x;
    const T* xr = x + row * D;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < D; i += __THREADS__) {
        const float v = static_cast<float>(xr[i]);
        ss = fmaf(v, v, ss);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) total += partial[w];
    const float inv = rsqrtf(total / static_cast<float>(D) + eps[0]);
    for (int i = threadIdx.x; i < D; i += __THREADS__)
        y[row * D + i] = static_cast<T>(static_cast<float>(xr[i]) * inv * scale[i]);
"""


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(
        name="qwen38_zc_rms_norm",
        input_names=["x", "scale", "eps"],
        output_names=["y"],
        source=_SOURCE.replace("__THREADS__", str(THREADS)),
    )


@functools.cache
def _eps(eps: float) -> mx.array:
    return mx.array([eps], dtype=mx.float32)


def zc_rms_norm(x: mx.array, scale: mx.array, eps: float) -> mx.array:
    """x [..., D] (float16 / bfloat16) normalised over D and scaled by `scale` [D] (fp32,
    the zero-centred norm's 1 + w), in x's dtype."""
    d = x.shape[-1]
    (y,) = _kernel()(
        inputs=[x, scale, _eps(eps)],
        template=[("T", x.dtype)],
        grid=(x.size // d * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[x.dtype],
    )
    return y


def op_path(x: mx.array, scale: mx.array, eps: float) -> mx.array:
    """What the kernel replaces: MLX's norm in fp32, cast back."""
    return mx.fast.rms_norm(x, scale, eps).astype(x.dtype)


def supported(dtype: mx.Dtype) -> bool:
    return dtype in DTYPES and mx.default_device() == mx.gpu and mx.cuda.is_available()


@functools.cache
def available(dtype: mx.Dtype, width: int) -> bool:
    """True when the kernel runs here and agrees with `op_path` to one unit in the last place
    of `dtype` on random rows of `width` (probed once per dtype and width). QWEN38_NORM_KERNEL:
    auto | off | force (skip the probe)."""
    choice = kernel_switch("QWEN38_NORM_KERNEL")
    if choice == "off" or not supported(dtype):
        return False
    if choice == "force":
        return True
    why = mismatch(dtype, width)
    if why is not None:
        warnings.warn(f"zero-centred norm kernel {why}; using the op path", stacklevel=2)
    return why is None


def mismatch(dtype: mx.Dtype, width: int) -> str | None:
    """None when the kernel agrees with `op_path` (random rows, a large-magnitude row, a
    scale around 1), else what differs."""
    try:
        kx, kw = mx.random.split(mx.random.key(width))
        x = mx.random.normal((9, width), key=kx)
        x = mx.concatenate([x, 300.0 * x[:1]]).astype(dtype)
        scale = 1.0 + 0.1 * mx.random.normal((width,), key=kw)
        got, want = zc_rms_norm(x, scale, 1e-6), op_path(x, scale, 1e-6)
        mx.eval(got, want)
    except Exception as e:  # noqa: BLE001 - any failure means: use the op path
        return f"unavailable ({e})"
    ulp = 2.0**-7 if dtype == mx.bfloat16 else 2.0**-10
    g, w = got.astype(mx.float32), want.astype(mx.float32)
    if not (mx.abs(g - w) <= ulp * mx.abs(w)).all().item():
        return "differs from the op path by more than one unit in the last place"
    return None
