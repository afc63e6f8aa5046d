"""Flash-Next's stream mixes (models/hyper_connections.GatedResidual.open / read) for the few
rows of a step on CUDA: three launches around its two products instead of about ten, and
the close before a gated residual in the same launch as its norm.

Why: a gated residual opens every mixer and every MoE of a Flash-Next layer. On the op path
its grouped norm is a cast, MLX's rms_norm and a scale-and-cast; the low-rank gates two
elementwise launches (silu(down / S), 2 sigmoid(inject / S)); the mix a sigmoid-product, a
column sum and the mean's scale. A step is bound by its launches' host time as much as by
the device (docs/INTERNALS.md, issue 14), and two gated residuals a layer make this ~20 of
a layer's ~77 launches.

The launches, each of T (the streams' half or single precision) in and out:
- `norm`: one block per (row, stream): x in fp32, x * rsqrt(mean(x^2) + eps) * (1 + w) in
  fp32 (as GroupedRMSNorm computes it), rounded to T. The mean's order of sums is the
  kernel's own (a warp butterfly, then the warps in order), so a value may differ from the
  op path by an ulp where the two normalisers round apart.
- `gates`: from the fused down / inject product's rows [T, L + S]: silu(y / S) [T, L] and,
  where the residual injects, 2 sigmoid(y / S) [T, S]; every op one of MLX's own device
  ops in T (what its compiled elementwise kernels call), so the bits are the ops'.
- `mix`: x[h] = mean over streams s of sigmoid(up[s H + h]) * normed[s H + h] (MLX's ops),
  the sum over the streams in order in fp32, then times 1 / S rounded to T (as mx.mean
  scales).
- `closed_norm`: `norm` of the streams closed with the block before (x + inj[s] * out with
  MLX's ops, as GatedResidual.close computes it), which it also stores: a layer's
  mixer close and its MoE's norm in one launch.
Every row is computed alone, so a verify's rows equal plain steps. `available()` probes the
launches against the op path once per shape and dtype (within `tolerance(T)` ulps of T: two
in half precision, where the roundings to T hide the order of fp32 sums, 64 in fp32, where
they do not; rows equal to one-row launches). On by default (QWEN38_STREAM_KERNEL=off
runs the op path): on the H200 a full Flash-Next step decoded 38.9 tok/s with them against
29.0 without (session 29, `flash_full_step_kernels_s29.json`).
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx
import numpy as np

from qwen38_backend.models.hyper_connections import (
    GroupedRMSNorm,
    gate_down,
    gate_inject,
    stream_close,
    stream_mean,
)

from .jit import cuda_kernel, float32_literal
from .qk_norm_rope import within_ulps
from .switch import switched

THREADS = 256
DTYPES = (mx.float16, mx.bfloat16, mx.float32)

# Block b: row t = b / S, stream s = b % S; template H (a stream's width), S. __VALUE__ is
# element i of the stream as the norm reads it (x's, or with CLOSED the closed stream's:
# x + inj[s] * out with MLX's device ops, also stored in `closed` by __KEEP__; on the H200
# that rounds once, as a compiled step's fused close does, where MLX's eager ops round the
# product first: session 30).
_NORM = """
    constexpr int WARPS = __THREADS__ / 32;
    const int t = blockIdx.x / S, s = blockIdx.x % S;
    const long long base = (long long)t * S * H + (long long)s * H;
    auto value = [&](int i) -> float { __VALUE__ };
    __shared__ float parts[WARPS];
    float ss = 0.0f;
    for (int i = threadIdx.x; i < H; i += __THREADS__) {
        const float v = value(i);
        __KEEP__
        ss = fmaf(v, v, ss);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) parts[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = parts[0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) total += parts[w];
    const float inv = rsqrtf(total / static_cast<float>(H) + __EPS__);
    for (int i = threadIdx.x; i < H; i += __THREADS__) {
        const float scale = 1.0f + static_cast<float>(weight[(long long)s * H + i]);
        y[base + i] = static_cast<T>((value(i) * inv) * scale);
    }
"""
_VALUES = {
    False: ("return static_cast<float>(x[base + i]);", ""),
    True: (
        """using namespace mlx::core::cu;
        const T add = Multiply{}(inj[(long long)t * S + s], out[(long long)t * H + i]);
        return static_cast<float>(Add{}(x[base + i], add));""",
        "closed[base + i] = static_cast<T>(v);",
    ),
}
# MLX's own device ops (what its compiled elementwise kernels call), so the elementwise steps
# round exactly as the op path's do
MLX_OPS = (
    '#include "mlx/backend/cuda/device/unary_ops.cuh"\n'
    '#include "mlx/backend/cuda/device/binary_ops.cuh"\n'
)

# Thread i of the grid: element i of [rows, L + INJ]; template L (low rank), S, INJ (S where
# the residual injects, else 0).
_GATES = """
    constexpr int WIDTH = L + INJ;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)y_shape[0] * WIDTH) return;
    const long long t = i / WIDTH;
    const int c = static_cast<int>(i % WIDTH);
    using namespace mlx::core::cu;
    const T v = Divide{}(y[i], static_cast<T>(static_cast<float>(S)));
    const T sig = Sigmoid{}(v);
    if (c < L) {
        mixed[t * L + c] = Multiply{}(v, sig);
    } else {
        __INJECT__
    }
"""
_INJECT = "inject[t * INJ + (c - L)] = Multiply{}(static_cast<T>(2.0f), sig);"

# Thread i of the grid: output i of [rows, H]; template H, S.
_MIX = """
    using namespace mlx::core::cu;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)up_shape[0] * H) return;
    const long long t = i / H, h = i % H;
    float total = 0.0f;
#pragma unroll
    for (int s = 0; s < S; ++s) {
        const long long at = (t * S + s) * H + h;
        total += static_cast<float>(Multiply{}(Sigmoid{}(up[at]), normed[at]));
    }
    x[i] = Multiply{}(static_cast<T>(total), static_cast<T>(1.0f / static_cast<float>(S)));
"""


@functools.cache
def _norm_kernel(eps: float, closes: bool = False):
    """The norm; `closes`: of the closed streams x + inj * out, which it also stores."""
    value, keep = _VALUES[closes]
    source = _NORM.replace("__VALUE__", value).replace("__KEEP__", keep)
    return cuda_kernel(
        # one kernel per eps (MLX caches compiled kernels by name): its fp32 bits
        name=f"qwen38_streams_{'closed_' if closes else ''}norm_"
        f"{np.float32(eps).view(np.uint32).item():08x}",
        input_names=["x", "weight"] + (["inj", "out"] if closes else []),
        output_names=["y", "closed"] if closes else ["y"],
        source=source.replace("__THREADS__", str(THREADS)).replace("__EPS__", float32_literal(eps)),
        header=MLX_OPS if closes else "",
    )


@functools.cache
def _gates_kernel(inject: bool):
    return cuda_kernel(
        name="qwen38_streams_gates" + ("_inject" if inject else ""),
        input_names=["y"],
        output_names=["mixed", "inject"] if inject else ["mixed"],
        source=_GATES.replace("__INJECT__", _INJECT if inject else ""),
        header=MLX_OPS,
    )


@functools.cache
def _mix_kernel():
    return cuda_kernel(
        name="qwen38_streams_mix",
        input_names=["up", "normed"],
        output_names=["x"],
        source=_MIX,
        header=MLX_OPS,
    )


def _grid(n: int) -> tuple[int, int, int]:
    return (-(-n // THREADS) * THREADS, 1, 1)


def norm(x: mx.array, weight: mx.array, streams: int, eps: float) -> mx.array:
    """GroupedRMSNorm of rows x [T, S * H] (S streams of H): each stream zero-centred
    RMS-normed by weight [S * H] (any float dtype; 1 + w in fp32), in x's dtype."""
    rows, width = x.shape
    (y,) = _norm_kernel(eps)(
        inputs=[x, weight],
        template=[("T", x.dtype), ("H", width // streams), ("S", streams)],
        grid=(rows * streams * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[x.dtype],
    )
    return y


def closed_norm(
    x: mx.array, inj: mx.array, out: mx.array, weight: mx.array, streams: int, eps: float
) -> tuple[mx.array, mx.array]:
    """(the closed streams x + inj[s] * out [T, S * H] as GatedResidual.close computes them,
    their norm as `norm` computes it) in one launch: inj [T, S], out [T, H]."""
    rows, width = x.shape
    y, closed = _norm_kernel(eps, True)(
        inputs=[x, weight, inj, out],
        template=[("T", x.dtype), ("H", width // streams), ("S", streams)],
        grid=(rows * streams * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[x.shape, x.shape],
        output_dtypes=[x.dtype, x.dtype],
    )
    return closed, y


def gates(y: mx.array, low_rank: int, streams: int, inject: bool) -> tuple:
    """(silu(down / S) [T, L], 2 sigmoid(inject / S) [T, S] or None) of the fused down /
    inject product's rows y [T, L (+ S)]."""
    rows = y.shape[0]
    extra = streams if inject else 0
    shapes = [(rows, low_rank)] + ([(rows, streams)] if inject else [])
    outs = _gates_kernel(inject)(
        inputs=[y],
        template=[("T", y.dtype), ("L", low_rank), ("S", streams), ("INJ", extra)],
        grid=_grid(rows * (low_rank + extra)),
        threadgroup=(THREADS, 1, 1),
        output_shapes=shapes,
        output_dtypes=[y.dtype] * len(shapes),
    )
    return outs[0], outs[1] if inject else None


def mix(up: mx.array, normed: mx.array, streams: int) -> mx.array:
    """mean over streams of sigmoid(up) * normed: up, normed [T, S * H] -> [T, H]."""
    rows, width = up.shape
    hidden = width // streams
    (x,) = _mix_kernel()(
        inputs=[up, normed],
        template=[("T", up.dtype), ("H", hidden), ("S", streams)],
        grid=_grid(rows * hidden),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, hidden)],
        output_dtypes=[up.dtype],
    )
    return x


def tolerance(dtype: mx.Dtype) -> int:
    """Ulps of `dtype` the kernels may differ from the op path by."""
    return 64 if dtype == mx.float32 else 2


def supported() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def reference(
    x: mx.array,
    weight: mx.array,
    y: mx.array,
    up: mx.array,
    out: mx.array,
    streams: int,
    low_rank: int,
    eps: float,
) -> tuple[mx.array, ...]:
    """The op path's outputs for the launches' (GatedResidual's own pieces): the normed
    rows of x, the gates of the fused product's rows y, the mix of up with the normed rows,
    and the streams x closed with the block output `out` and those gates' inject weights."""
    hc_norm = GroupedRMSNorm(x.shape[1], x.shape[1] // streams, eps)
    hc_norm.weight = weight
    normed = hc_norm(x)
    down, inject = y[:, :low_rank], y[:, low_rank:]
    inj = gate_inject(inject, streams)
    return (
        normed,
        gate_down(down, streams),
        inj,
        stream_mean(up, normed, streams),
        stream_close(x, inj, out),
    )


@functools.cache
def available(hidden: int, streams: int, low_rank: int, eps: float, dtype: mx.Dtype) -> bool:
    """True when the kernels run here, each row equals a one-row launch bit for bit,
    and each output is within tolerance(dtype) ulps of the op path (GatedResidual's ops) on
    random rows of this shape (probed once per shape and dtype); else False, warning why.
    QWEN38_STREAM_KERNEL: auto (the default) | off | force (no probe)."""
    decided = switched("QWEN38_STREAM_KERNEL", lambda: dtype in DTYPES and supported())
    if decided is not None:
        return decided
    keys = mx.random.split(mx.random.key(41), 5)
    rows, width = 5, hidden * streams
    x = (3 * mx.random.normal((rows, width), key=keys[0])).astype(dtype)
    weight = (0.2 * mx.random.normal((width,), key=keys[1])).astype(dtype)
    y = (2 * mx.random.normal((rows, low_rank + streams), key=keys[2])).astype(dtype)
    up = (2 * mx.random.normal((rows, width), key=keys[3])).astype(dtype)
    out = (2 * mx.random.normal((rows, hidden), key=keys[4])).astype(dtype)

    def launches(t: slice) -> tuple[mx.array, ...]:
        normed = norm(x[t], weight, streams, eps)
        silu, inj = gates(y[t], low_rank, streams, True)
        closed, closed_normed = closed_norm(x[t], inj, out[t], weight, streams, eps)
        return normed, silu, inj, mix(up[t], normed, streams), closed, closed_normed

    try:
        got = launches(slice(0, rows))
        alone = [launches(slice(t, t + 1)) for t in range(rows)]
        want = reference(x, weight, y, up, out, streams, low_rank, eps)
        mx.eval(got, alone, want)
    except Exception as e:  # noqa: BLE001 - any failure means: the op path runs
        warnings.warn(f"stream-mix kernels unavailable ({e}); using the op path", stacklevel=2)
        return False
    same_rows = all(
        mx.array_equal(g[t : t + 1], a).item()
        for t, part in enumerate(alone)
        for g, a in zip(got, part, strict=True)
    )
    # the mix and the close against the op path's on the kernels' own normed rows and
    # inject weights (their ulps would carry into them); the closed streams' norm is the
    # norm kernel's, bit for bit
    want = (*want[:3], stream_mean(up, got[0], streams), stream_close(x, got[2], out))
    ulps = tolerance(dtype)
    close = all(within_ulps(g, w, ulps) for g, w in zip(got[:5], want, strict=True))
    close = close and mx.array_equal(got[5], norm(got[4], weight, streams, eps)).item()
    if not (same_rows and close):
        warnings.warn(
            f"stream-mix kernels disagree (rows equal to one-row launches: {same_rows}, "
            f"within {ulps} ulps of the op path: {close}); using the op path",
            stacklevel=2,
        )
        return False
    return True
