"""The q/k norms and RoPE of a step's few rows in one CUDA launch: from the fused q/k/v
projection's rows [T, q | k | v] to roped q [1, H, T, D] and k [1, Hkv, T, D] (and the
output gate [T, H * D] of a gated attention, q's heads being [q | gate] pairs).

Why: on the op path each attention layer of a step spends nine launches here (two
zero-centred norms, each cast up, normed and cast back; two RoPEs; the gate's copy): 144 of
a 64-layer 27B step's 663 kernels, and on the H200 the host's time per launch bounds the
step as much as the device does (docs/INTERNALS.md, session 25).

Arithmetic follows the op path (layers.Attention.project_qkv with a zero-centred RMSNorm and
mx.fast.rope): per head, x in fp32, the norm's scale (1 + w, fp32) * (x * rsqrt(mean(x^2) +
eps)) rounded to the model's dtype, then the first `dims` features rotated in fp32 at
position offset + t (inverse frequency exp2(-(p / (dims / 2)) * log2(base)), as MLX's
kernel computes it) and rounded again. The mean's order of sums is this kernel's own (a warp
butterfly, then the warps in order), so a row may differ from the op path by an ulp where
the two normalisers round apart; every row is computed alone (one block per row and head),
so a verify's rows equal plain steps bit for bit. `available()` probes both against the op
path once per layout.
"""

from __future__ import annotations

import functools
import hashlib
import math
import warnings
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .jit import cuda_kernel, float32_literal
from .switch import switched


@dataclass(frozen=True)
class HeadLayout:
    """What the kernel is built for: heads, their width, the gate, the norms' eps and the
    rotation (rotary dims, base, position scale, interleaved pairs)."""

    heads: int
    kv_heads: int
    head_dim: int
    gated: bool
    eps: float
    dims: int
    base: float
    scale: float
    interleaved: bool

    def q_width(self) -> int:
        return self.heads * self.head_dim * (2 if self.gated else 1)


# Block b: row t = b / (H + HK), head h = b % (H + HK) (q heads first); thread i: feature i.
_SOURCE = """
    constexpr int D = __D__, H = __H__, HK = __HK__, DIMS = __DIMS__, HALF = DIMS / 2;
    constexpr bool GATED = __GATED__, INTERLEAVED = __INTERLEAVED__;
    const int i = threadIdx.x;
    const int t = blockIdx.x / (H + HK), h = blockIdx.x % (H + HK);
    const int T_ = qkv_shape[0], width = qkv_shape[1];
    const bool is_q = h < H;
    const long long row = (long long)t * width;
    const long long col = is_q ? (long long)h * (GATED ? 2 * D : D) + i
                               : (long long)H * (GATED ? 2 * D : D) + (long long)(h - H) * D + i;
    const float x = static_cast<float>(qkv[row + col]);
    __GATE_COPY__
    __shared__ float parts[D / 32];
    __shared__ float normed[D];
    float ss = x * x;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, off);
    if ((i & 31) == 0) parts[i >> 5] = ss;
    __syncthreads();
    float total = parts[0];
#pragma unroll
    for (int w = 1; w < D / 32; ++w) total += parts[w];
    const float inv = rsqrtf(total / static_cast<float>(D) + __EPS__);
    const float* scale = is_q ? q_scale : k_scale;
    normed[i] = static_cast<float>(static_cast<T>(scale[i] * (x * inv)));
    __syncthreads();
    float y = normed[i];
    if (i < DIMS) {
        const int p = INTERLEAVED ? i / 2 : i % HALF;
        const bool first = INTERLEAVED ? (i % 2 == 0) : i < HALF;
        const float x1 = normed[INTERLEAVED ? 2 * p : p];
        const float x2 = normed[INTERLEAVED ? 2 * p + 1 : p + HALF];
        const float d = static_cast<float>(p) / static_cast<float>(HALF);
        const float inv_freq = exp2f(-d * __LOG2_BASE__);
        const float theta = (__ROPE_SCALE__ * static_cast<float>(offset[0] + t)) * inv_freq;
        const float c = cosf(theta), s = sinf(theta);
        y = first ? x1 * c - x2 * s : x1 * s + x2 * c;
    }
    if (is_q) q[((long long)h * T_ + t) * D + i] = static_cast<T>(y);
    else k[((long long)(h - H) * T_ + t) * D + i] = static_cast<T>(y);
"""


@functools.cache
def _kernel(layout: HeadLayout):
    constants = {
        "__D__": str(layout.head_dim),
        "__H__": str(layout.heads),
        "__HK__": str(layout.kv_heads),
        "__DIMS__": str(layout.dims),
        "__GATED__": "true" if layout.gated else "false",
        "__INTERLEAVED__": "true" if layout.interleaved else "false",
        "__EPS__": float32_literal(layout.eps),
        # MLX passes log2(base) computed in fp32 on the host
        "__LOG2_BASE__": float32_literal(math.log2(float(np.float32(layout.base)))),
        "__ROPE_SCALE__": float32_literal(layout.scale),
    }
    # an ungated build has no `gate` output to name, even in a discarded branch
    gate_copy = "if (is_q) gate[((long long)t * H + h) * D + i] = qkv[row + col + D];"
    constants["__GATE_COPY__"] = gate_copy if layout.gated else ""
    source = _SOURCE
    for name, value in constants.items():
        source = source.replace(name, value)
    # one name per build (MLX's compiled-kernel cache goes by name)
    tag = hashlib.sha1(" ".join(constants.values()).encode()).hexdigest()[:10]
    return cuda_kernel(
        name=f"qwen38_qk_norm_rope_{tag}",
        input_names=["qkv", "q_scale", "k_scale", "offset"],
        output_names=["q", "k", "gate"] if layout.gated else ["q", "k"],
        source=source,
    )


def qk_norm_rope(
    qkv: mx.array,
    q_scale: mx.array,
    k_scale: mx.array,
    offset: mx.array,
    layout: HeadLayout,
) -> tuple[mx.array, mx.array, mx.array | None]:
    """(q [1, H, T, D], k [1, Hkv, T, D], gate [T, H * D] or None) of a fused projection's
    rows qkv [T, q_width + 2 * Hkv * D] (its v columns are not read), normed by the fp32
    scales (1 + w) and roped at positions offset + t (offset: an int32 scalar array)."""
    rows, d = qkv.shape[0], layout.head_dim
    shapes = [(1, layout.heads, rows, d), (1, layout.kv_heads, rows, d)]
    if layout.gated:
        shapes.append((rows, layout.heads * d))
    if offset.dtype != mx.int32:
        offset = offset.astype(mx.int32)
    outs = _kernel(layout)(
        inputs=[qkv, q_scale, k_scale, offset],
        template=[("T", qkv.dtype)],
        grid=(rows * (layout.heads + layout.kv_heads) * d, 1, 1),
        threadgroup=(d, 1, 1),
        output_shapes=shapes,
        output_dtypes=[qkv.dtype] * len(shapes),
    )
    return outs[0], outs[1], outs[2] if layout.gated else None


def supported(layout: HeadLayout) -> bool:
    """Whether this device and layout can run the kernel at all (no probe)."""
    return (
        mx.default_device() == mx.gpu
        and mx.cuda.is_available()
        and layout.head_dim % 32 == 0
        and 32 <= layout.head_dim <= 1024
        and layout.dims % 2 == 0
        and 0 < layout.dims <= layout.head_dim
    )


def reference(
    qkv: mx.array, q_scale: mx.array, k_scale: mx.array, offset: mx.array, layout: HeadLayout
) -> tuple[mx.array, mx.array, mx.array | None]:
    """The op path's arithmetic for the same outputs (what the probe and tests compare)."""
    rows, h, d = qkv.shape[0], layout.heads, layout.head_dim
    q = qkv[:, : layout.q_width()]
    k = qkv[:, layout.q_width() : layout.q_width() + layout.kv_heads * d]
    gate = None
    if layout.gated:
        q = q.reshape(rows, h, 2 * d)
        q, gate = q[..., :d], q[..., d:].reshape(rows, h * d)

    def norm_rope(x: mx.array, scale: mx.array, heads: int) -> mx.array:
        x = x.reshape(1, rows, heads, d)
        x = mx.fast.rms_norm(x, scale, layout.eps).astype(qkv.dtype)
        return mx.fast.rope(
            x.transpose(0, 2, 1, 3),
            layout.dims,
            traditional=layout.interleaved,
            base=layout.base,
            scale=layout.scale,
            offset=offset,
        )

    return norm_rope(q, q_scale, h), norm_rope(k, k_scale, layout.kv_heads), gate


@functools.cache
def available(layout: HeadLayout, dtype: mx.Dtype) -> bool:
    """True when the kernel runs here, its rows equal one-row launches bit for bit and it
    agrees with the op path within two ulps of `dtype` (probed once per layout and dtype);
    else False, with a warning when it ran but disagreed. QWEN38_QK_KERNEL: auto | off |
    force (skip the probe)."""
    dtypes = (mx.float16, mx.bfloat16, mx.float32)
    decided = switched("QWEN38_QK_KERNEL", lambda: dtype in dtypes and supported(layout))
    if decided is not None:
        return decided
    keys = mx.random.split(mx.random.key(17), 3)
    rows, d = 5, layout.head_dim
    width = layout.q_width() + 2 * layout.kv_heads * d
    qkv = (3 * mx.random.normal((rows, width), key=keys[0])).astype(dtype)
    q_scale = 1 + 0.2 * mx.random.normal((d,), key=keys[1])
    k_scale = 1 + 0.2 * mx.random.normal((d,), key=keys[2])
    offset = mx.array(4093, dtype=mx.int32)
    try:
        got = qk_norm_rope(qkv, q_scale, k_scale, offset, layout)
        alone = [
            qk_norm_rope(qkv[t : t + 1], q_scale, k_scale, offset + t, layout) for t in range(rows)
        ]
        want = reference(qkv, q_scale, k_scale, offset, layout)
        mx.eval(got, alone, want)
    except Exception as e:  # noqa: BLE001 - any failure means: the op path runs
        warnings.warn(f"q/k norm + RoPE kernel unavailable ({e}); using the op path", stacklevel=2)
        return False
    same_rows = all(
        mx.array_equal(got[j][..., t : t + 1, :] if j < 2 else got[j][t : t + 1], part[j]).item()
        for t, part in enumerate(alone)
        for j in range(3 if layout.gated else 2)
    )
    close = all(within_ulps(g, w, 2) for g, w in zip(got, want, strict=True) if w is not None)
    if not (same_rows and close):
        warnings.warn(
            f"q/k norm + RoPE kernel disagrees (rows equal to one-row launches: {same_rows}, "
            f"within two ulps of the op path: {close}); using the op path",
            stacklevel=2,
        )
        return False
    return True


def within_ulps(got: mx.array, want: mx.array, ulps: int) -> bool:
    """Whether every element of `got` is within `ulps` ulps of `want`'s dtype of `want`,
    relative to the larger of |want| and the tensor's rms (a rotated value near zero carries
    the ulps of its inputs)."""
    ulp = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7, mx.float32: 2.0**-23}[want.dtype]
    g, w = got.astype(mx.float32), want.astype(mx.float32)
    rms = mx.sqrt(mx.mean(w * w))
    return bool((mx.abs(g - w) <= ulps * ulp * mx.maximum(mx.abs(w), rms)).all().item())
