"""A step's expert routing on CUDA in one launch: the router logits' fp32 softmax, the top k
experts and their (renormalised) weights, for the few rows of a decode step or a verify.

Why: on the op path (moe.route) a Flash-Next layer's routing is a softmax, an argpartition
(a block sort on CUDA), the index slice's copy and cast, a take_along_axis, a sum and a
divide: ~7 launches of the ~77 a layer runs (ncu on the H200, flash_decode_kernels_4l.json),
and the step is bound by its launches' host time as much as by the device.

One warp per row: each lane holds every 32nd logit in fp32; a butterfly max and sum give
MLX's softmax per element (fast exp of x - max, times the sum's reciprocal; the sum is this
kernel's own order); then k rounds of a warp arg-max (the highest probability, the lowest
expert on ties, as torch.topk breaks them) pick the experts in descending order, and their
weights are divided by their sum (added in that order) where the model renormalises. Every
row is computed alone, so a verify's rows equal plain steps; `available()` probes the kernel
against the op path once per shape (the same experts, weights within 16 fp32 ulps).
On by default (QWEN38_ROUTE_KERNEL=auto; off: the op path): on the H200 a full Flash-Next
step decoded 43.7 tok/s with it and the stream kernels against 42.1 with the stream kernels
alone, 55.8 against 52.9 with the expert kernels too, the same tokens either way (session
30, five interleaved runs a set: flash_full_step_kernels_s30.json).
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx

from .jit import cuda_kernel
from .switch import switched

THREADS = 256  # the other step kernels' count, so a routing launch can fuse with them (fused.py)
WARPS = THREADS // 32
MAX_EXPERTS = 32 * 32  # 32 logits a lane in registers

# Template constants: T (the logits' dtype), E (experts), KT (experts a row), NORM (renormalise).
_SOURCE = """
    constexpr int PER = (E + 31) / 32;
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * __WARPS__ + (threadIdx.x >> 5);
    if (t >= logits_shape[0]) return;
    const float lowest = __int_as_float(0xff800000);
    float p[PER];
    float top = lowest;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        const int e = lane + 32 * i;
        p[i] = e < E ? static_cast<float>(logits[(long long)t * E + e]) : lowest;
        top = fmaxf(top, p[i]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        p[i] = lane + 32 * i < E ? __expf(p[i] - top) : 0.0f;
        sum += p[i];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float inv = 1.0f / sum;
#pragma unroll
    for (int i = 0; i < PER; ++i) p[i] = lane + 32 * i < E ? p[i] * inv : -1.0f;

    // k rounds of a warp arg-max; a taken (or absent) expert holds -1, below any probability
    float chosen[KT];
    int experts[KT];
#pragma unroll
    for (int j = 0; j < KT; ++j) {
        float best = -1.0f;
        int at = E;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            if (p[i] > best) {  // ascending experts: a tie keeps the lower one
                best = p[i];
                at = lane + 32 * i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float other = __shfl_xor_sync(0xffffffffu, best, o);
            const int other_at = __shfl_xor_sync(0xffffffffu, at, o);
            if (other > best || (other == best && other_at < at)) {
                best = other;
                at = other_at;
            }
        }
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            if (lane + 32 * i == at) p[i] = -1.0f;
        }
        chosen[j] = best;
        experts[j] = at;
    }
    if (lane != 0) return;
    float total = 0.0f;
#pragma unroll
    for (int j = 0; j < KT; ++j) total += chosen[j];
#pragma unroll
    for (int j = 0; j < KT; ++j) {
        inds[t * KT + j] = static_cast<uint32_t>(experts[j]);
        weights[t * KT + j] = NORM ? chosen[j] / total : chosen[j];
    }
"""


@functools.cache
def _kernel():
    return cuda_kernel(
        name="qwen38_moe_route",
        input_names=["logits"],
        output_names=["inds", "weights"],
        source=_SOURCE.replace("__WARPS__", str(WARPS)),
    )


def route(logits: mx.array, top_k: int, normalize: bool) -> tuple[mx.array, mx.array]:
    """(indices [T, k] uint32, weights [T, k] fp32) of router logits [T, E], as moe.route
    computes them; the k experts of a row in descending probability."""
    rows, n_experts = logits.shape
    return _kernel()(
        inputs=[logits],
        template=[("T", logits.dtype), ("E", n_experts), ("KT", top_k), ("NORM", normalize)],
        grid=(-(-rows // WARPS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, top_k), (rows, top_k)],
        output_dtypes=[mx.uint32, mx.float32],
    )


def fits(logits: mx.array, top_k: int) -> bool:
    """Whether these logits suit the kernel (not the probe): [T, E] in a float dtype, every
    lane's share in registers, at least k experts."""
    return (
        logits.ndim == 2
        and logits.dtype in (mx.float16, mx.bfloat16, mx.float32)
        and 0 < top_k <= logits.shape[1] <= MAX_EXPERTS
    )


def supported() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def same_routes(
    got: tuple[mx.array, mx.array], want: tuple[mx.array, mx.array], ulps: int = 16
) -> bool:
    """Whether two routings pick the same experts for every row (in any order) with weights
    within `ulps` fp32 ulps of each other, expert for expert."""
    (gi, gw), (wi, ww) = got, want
    g_order, w_order = mx.argsort(gi, axis=-1), mx.argsort(wi, axis=-1)
    gi, wi = mx.take_along_axis(gi, g_order, -1), mx.take_along_axis(wi, w_order, -1)
    gw, ww = mx.take_along_axis(gw, g_order, -1), mx.take_along_axis(ww, w_order, -1)
    close = mx.abs(gw - ww) <= ulps * 2.0**-23 * mx.maximum(mx.abs(ww), 2.0**-126)
    return bool(mx.array_equal(gi, wi).item() and close.all().item())


@functools.cache
def available(n_experts: int, top_k: int, normalize: bool, dtype: mx.Dtype) -> bool:
    """True when the kernel runs here, each row equals a one-row launch bit for bit, and it
    routes as the op path does (moe.route: the same experts, weights within 16 fp32 ulps:
    the softmax's sum is added in another order)
    on random logits of this shape (probed once per shape and dtype); else False, warning
    why. QWEN38_ROUTE_KERNEL: auto (the default) | off | force (no probe)."""
    from qwen38_backend.models.moe import route as op_route

    decided = switched("QWEN38_ROUTE_KERNEL", supported)
    if decided is not None:
        return decided
    rows = 6
    logits = (2 * mx.random.normal((rows, n_experts), key=mx.random.key(31))).astype(dtype)
    try:
        got = route(logits, top_k, normalize)
        alone = [route(logits[t : t + 1], top_k, normalize) for t in range(rows)]
        want = op_route(logits, top_k, normalize)
        mx.eval(got, alone, want)
    except Exception as e:  # noqa: BLE001 - any failure means: the op path runs
        warnings.warn(f"routing kernel unavailable ({e}); using the op path", stacklevel=2)
        return False
    same_rows = all(
        mx.array_equal(got[j][t : t + 1], part[j]).item()
        for t, part in enumerate(alone)
        for j in range(2)
    )
    agrees = same_routes(got, want)
    if not (same_rows and agrees):
        warnings.warn(
            f"routing kernel disagrees (rows equal to one-row launches: {same_rows}, the op "
            f"path's experts and weights: {agrees}); using the op path",
            stacklevel=2,
        )
        return False
    return True
