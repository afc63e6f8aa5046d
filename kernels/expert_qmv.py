"""A decode step's routed experts on CUDA in two launches, reading 4-bit (MLX affine) expert
weights in place: silu(gate) * up of every (row, expert) pair, then down and the routing
weights' sum over the pairs of each row.

Why: MLX 0.32.4's `gather_qmm` on CUDA gathered the chosen experts' packed weights, scales
and biases into fresh buffers and ran a batched qmm on the copies (ncu on the H200,
Flash-Next dims: ~20 gather launches and 0.27 ms per 4 layers, before the qmm's 0.2 ms:
benchmarks/results/h200/flash_decode_kernels_4l.json), and the routed sum took several more
launches. Here each warp streams its rows of the chosen experts straight from the stacks.

The down launch can also add the shared expert's gated output (sigmoid(gate) * shared, with
MLX's own device ops, as SparseMoE adds it), so a step's MoE ends in that launch rather than
two elementwise ones after it.

Every (row, expert) pair is computed alone, by the same instructions whatever the row count,
so a speculative verify's rows equal plain steps. The sums run in another order than MLX's
qmv (fp32 either way); `available()` probes the pair against the op path (gather_qmm, silu,
the weighted sum) once per shape and dtype. On by default (QWEN38_EXPERT_KERNEL=auto; off:
the op path): on the H200 a full Flash-Next step decoded 47.2 tok/s with them and the
routing and stream kernels against 40.9 without them, and 55.8 against 43.7 in a second
call (session 30, five interleaved runs a set: flash_full_step_kernels_s30*.json). The
random model's greedy tokens leave the op path's at a step whose two largest logits are
equal in bf16 (a gap of 0), where any other order of sums may pick the other one.
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx
import mlx.nn as nn

from qwen38_backend.models.moe import Experts, QuantizedExperts, weighted_experts

from .jit import cuda_kernel
from .switch import switched

THREADS = 256
WARPS = THREADS // 32

# A lane's share of a packed row: 32-bit words (8 four-bit values each) at lane, lane + 32,
# ...; x's matching 8 values as fp32 (`eight`: from fp32 values in shared memory, two float4,
# or from half-precision values in place, one 16-byte load: the same fp32 values either way).
# `dot` adds, per word, the scale times sum(x q) and the bias times sum(x) of its group (G
# values, G % 8 == 0).
_DOT = """
namespace qwen38_experts {
__device__ __forceinline__ void eight(const float* xs, int at, float* v) {
  const float4 a = reinterpret_cast<const float4*>(xs + at)[0];
  const float4 b = reinterpret_cast<const float4*>(xs + at)[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
template <typename X>
__device__ __forceinline__ void eight(const X* xs, int at, float* v) {
  const uint4 u = *reinterpret_cast<const uint4*>(xs + at);
  const X* h = reinterpret_cast<const X*>(&u);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = static_cast<float>(h[i]);
}
template <typename T, int K, int G, typename X>
__device__ __forceinline__ float dot(
    const uint32_t* row, const T* scales, const T* biases, const X* xs, int lane) {
  constexpr int WORDS = K / 8;
  float acc = 0.0f;
#pragma unroll
  for (int wd = lane; wd < WORDS; wd += 32) {
    const uint32_t q = row[wd];
    float xv[8];
    eight(xs, 8 * wd, xv);
    float qx = 0.0f, sx = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      qx = fmaf(xv[i], static_cast<float>((q >> (4 * i)) & 0xFu), qx);
      sx += xv[i];
    }
    const int g = wd * 8 / G;
    acc = fmaf(static_cast<float>(scales[g]), qx, acc);
    acc = fmaf(static_cast<float>(biases[g]), sx, acc);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  return acc;
}
// A half-precision row (the shared expert's) against x's values (as `dot` takes them): a
// lane's 16-byte chunks of the row at lane, lane + 32, ..., then the same butterfly.
template <typename T, int K, typename X>
__device__ __forceinline__ float dense_dot(const T* row, const X* xs, int lane) {
  constexpr int E = 16 / sizeof(T), CHUNKS = K / E;
  float acc = 0.0f;
  for (int c = lane; c < CHUNKS; c += 32) {
    const uint4 u = reinterpret_cast<const uint4*>(row)[c];
    const T* v = reinterpret_cast<const T*>(&u);
    float xv[E];
#pragma unroll
    for (int i = 0; i < E; i += 8) eight(xs, c * E + i, xv + i);
#pragma unroll
    for (int i = 0; i < E; ++i) acc = fmaf(xv[i], static_cast<float>(v[i]), acc);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  return acc;
}
}  // namespace qwen38_experts
"""

# Template constants: T (x's and the scales' dtype), H (hidden), I (intermediate), G (group
# size), KT (experts per row), PAIRS (KT, or KT + 1 where the shared expert runs here too:
# its pair last, its dense gate / up rows from `shared_gate_up`). Block (blockIdx.x, pair
# p = blockIdx.y): warp w takes output n = blockIdx.x * WARPS + w of pair j = p % PAIRS of
# row p / PAIRS (expert inds[row][j]): its gate row n and up row I + n, stored as
# silu(gate) * up rounded as MLX's ops round (each in T).
_UP = """
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int p = blockIdx.y, t = p / PAIRS, j = p % PAIRS;
    const int n = blockIdx.x * __WARPS__ + warp;
    __shared__ __align__(16) float xs[H];
    for (int i = threadIdx.x; i < H; i += __THREADS__) xs[i] = static_cast<float>(x[t * H + i]);
    __syncthreads();
    if (n >= I) return;
    float gate_sum, up_sum;
    if (j < KT) {
        const long long e = inds[t * KT + j];
        constexpr int WORDS = H / 8, GROUPS = H / G;
        const long long gate_row = e * 2 * I + n, up_row = gate_row + I;
        gate_sum = qwen38_experts::dot<T, H, G>(
            w + gate_row * WORDS, scales + gate_row * GROUPS, biases + gate_row * GROUPS, xs,
            lane);
        up_sum = qwen38_experts::dot<T, H, G>(
            w + up_row * WORDS, scales + up_row * GROUPS, biases + up_row * GROUPS, xs, lane);
    } else {
        __SHARED_UP__
    }
    if (lane == 0) {  // nn.silu(gate) * up with MLX's own device ops, as the op path's
        using namespace mlx::core::cu;
        const T gate = T(gate_sum), up = T(up_sum);
        h[(long long)p * I + n] = Multiply{}(Multiply{}(gate, Sigmoid{}(gate)), up);
    }
"""

# The shared expert's pair in the up kernel: its dense gate row n and up row I + n.
_SHARED_UP = """
        const T* gate_row = shared_gate_up + (long long)n * H;
        gate_sum = qwen38_experts::dense_dot<T, H>(gate_row, xs, lane);
        up_sum = qwen38_experts::dense_dot<T, H>(gate_row + (long long)I * H, xs, lane);"""

# Block (output n = blockIdx.x, row t = blockIdx.y), one warp per pair j of the row: expert
# inds[t][j]'s down row n against the pair's activations, read in place (product rounded to
# T, times its routing weight rounded to T, as `routed * weights` in T); thread 0 sums the
# experts' terms in order in fp32 and stores T (__STORE__: with the shared expert's output
# added where it is given or runs here, its pair's warp last). A warp per (output, pair)
# keeps each warp to one row's loads: 2,560 x 11 warps a Flash-Next step, where a warp per
# output walking its 10 experts in turn waited on each (37 us a layer under ncu, session 29).
_DOWN = """
    const int lane = threadIdx.x & 31, j = threadIdx.x >> 5;
    const int n = blockIdx.x, t = blockIdx.y;
    __shared__ float terms[PAIRS];
    constexpr int WORDS = I / 8, GROUPS = I / G;
    const T* hs = h + ((long long)t * PAIRS + j) * I;
    if (j < KT) {
        const long long row = (long long)inds[t * KT + j] * H + n;
        const float sum = qwen38_experts::dot<T, I, G>(
            w + row * WORDS, scales + row * GROUPS, biases + row * GROUPS, hs, lane);
        const float y = static_cast<float>(T(sum)), wt = static_cast<float>(T(weights[t * KT + j]));
        if (lane == 0) terms[j] = static_cast<float>(T(y * wt));
    }
    __SHARED_DOWN__
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
#pragma unroll
        for (int e = 0; e < KT; ++e) total += terms[e];
        const long long i = (long long)t * H + n;
        __STORE__
    }
"""
# How the down kernel stores output i, by where the shared expert's output comes from: none
# (the routed sum alone); "values" given; "weights": its down row n of the shared pair's
# activations, here. Added as SparseMoE's ops add it (routed + sigmoid(gate) * shared, each
# op MLX's own device op in T, so the bits are the ops').
_ADD_SHARED = """using namespace mlx::core::cu;
        out[i] = Add{}(T(total), Multiply{}(Sigmoid{}(shared_gate[t]), __SHARED__));"""
STORES = {
    "": "out[i] = T(total);",
    "values": _ADD_SHARED.replace("__SHARED__", "shared[i]"),
    "weights": _ADD_SHARED.replace("__SHARED__", "T(terms[KT])"),
}
_SHARED_DOWN = {
    "weights": "if (j == KT) {\n"
    "        const float shared_sum = qwen38_experts::dense_dot<T, I>(\n"
    "            shared_down + (long long)n * I, hs, lane);\n"
    "        if (lane == 0) terms[KT] = shared_sum;\n"
    "    }",
}
SHARED_INPUTS = {
    "": [],
    "values": ["shared_gate", "shared"],
    "weights": ["shared_gate", "shared_gate_up", "shared_down"],
}
MLX_OPS = (
    '#include "mlx/backend/cuda/device/unary_ops.cuh"\n'
    '#include "mlx/backend/cuda/device/binary_ops.cuh"\n'
)


def _source(body: str) -> str:
    return body.replace("__THREADS__", str(THREADS)).replace("__WARPS__", str(WARPS))


@functools.cache
def _up_kernel(shared: bool = False):
    """The up kernel; `shared`: with the shared expert's pair last (its weights run here)."""
    return cuda_kernel(
        name="qwen38_experts_up" + ("_shared" if shared else ""),
        input_names=["x", "inds", "w", "scales", "biases"] + (["shared_gate_up"] if shared else []),
        output_names=["h"],
        source=_source(_UP).replace("__SHARED_UP__", _SHARED_UP if shared else ""),
        header=MLX_OPS + _DOT,
    )


@functools.cache
def _down_kernel(shared: str = ""):
    """The down kernel; `shared`: with the shared expert's gated output added ("values"
    given, or its "weights" run on the up kernel's last pair)."""
    return cuda_kernel(
        name="qwen38_experts_down" + (f"_{shared}" if shared else ""),
        input_names=["h", "inds", "weights", "w", "scales", "biases"] + SHARED_INPUTS[shared],
        output_names=["out"],
        source=_source(_DOWN)
        .replace("__SHARED_DOWN__", _SHARED_DOWN.get(shared, ""))
        .replace("__STORE__", STORES[shared]),
        header=(MLX_OPS if shared else "") + _DOT,
    )


def routed_sum(
    x: mx.array,
    inds: mx.array,
    weights: mx.array,
    gate_up: dict,
    down: dict,
    group_size: int,
    shared: tuple[mx.array, mx.array] | None = None,
    shared_weights: tuple[mx.array, mx.array, mx.array] | None = None,
) -> mx.array:
    """sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) for e = inds[t, j]: x [T, H]
    (half precision), inds [T, k] (uint32), weights [T, k] (fp32), gate_up / down the
    experts' 4-bit affine stacks ({"weight", "scales", "biases"}: [E, 2I, H / 8] and
    [E, H, I / 8] words). Plus sigmoid(gate) * the shared expert's output in the same
    launches: `shared` (gate [T, 1], its output [T, H]) given, or `shared_weights` (gate
    [T, 1], its dense gate / up rows [2I, H] and down rows [H, I] in x's dtype) run as one
    more pair of each row. Returns [T, H] in x's dtype. Two launches: `activations`, then
    `summed`."""
    shared_gate_up = None if shared_weights is None else shared_weights[1]
    h = activations(x, inds, gate_up, group_size, shared_gate_up)
    return summed(h, inds, weights, down, group_size, x.shape[1], shared, shared_weights)


def activations(
    x: mx.array,
    inds: mx.array,
    gate_up: dict,
    group_size: int,
    shared_gate_up: mx.array | None = None,
) -> mx.array:
    """The up launch: silu(gate) * up of every (row, expert) pair [T * pairs, I], the shared
    expert's pair last where its dense gate / up rows are given."""
    T_, hidden = x.shape
    k = inds.shape[1]
    inter = gate_up["weight"].shape[1] // 2
    pairs = k + (shared_gate_up is not None)
    (h,) = _up_kernel(shared_gate_up is not None)(
        inputs=[x, inds, gate_up["weight"], gate_up["scales"], gate_up["biases"]]
        + ([] if shared_gate_up is None else [shared_gate_up]),
        template=_template(x.dtype, hidden, inter, group_size, k, pairs),
        grid=(-(-inter // WARPS) * THREADS, T_ * pairs, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(T_ * pairs, inter)],
        output_dtypes=[x.dtype],
    )
    return h


def summed(
    h: mx.array,
    inds: mx.array,
    weights: mx.array,
    down: dict,
    group_size: int,
    hidden: int,
    shared: tuple[mx.array, mx.array] | None = None,
    shared_weights: tuple[mx.array, mx.array, mx.array] | None = None,
) -> mx.array:
    """The down launch: each row's pairs' down products weighted and summed [T, hidden],
    the shared expert's gated output added (`shared` given, or `shared_weights`: its pair,
    last in h, run here)."""
    T_, k = inds.shape
    inter = h.shape[1]
    form = "weights" if shared_weights is not None else "values" if shared is not None else ""
    pairs = k + (form == "weights")
    extra = [*(shared_weights or shared or ())]  # the gate first, as SHARED_INPUTS names them
    (out,) = _down_kernel(form)(
        inputs=[h, inds, weights, down["weight"], down["scales"], down["biases"], *extra],
        template=_template(h.dtype, hidden, inter, group_size, k, pairs),
        grid=(hidden * pairs * 32, T_, 1),
        threadgroup=(pairs * 32, 1, 1),
        output_shapes=[(T_, hidden)],
        output_dtypes=[h.dtype],
    )
    return out


def _template(dtype: mx.Dtype, hidden: int, inter: int, group: int, k: int, pairs: int) -> list:
    return [("T", dtype), ("H", hidden), ("I", inter), ("G", group), ("KT", k), ("PAIRS", pairs)]


def fits(x: mx.array, experts, k: int) -> bool:
    """Whether these operands suit the kernels (shapes, dtypes, 4-bit affine; not the probe):
    x's and the scales' half precision, every row's words a whole number of lanes' float4
    pairs of x, groups of whole words, x's row in shared memory, a warp per pair in a
    block."""
    if getattr(experts, "bits", None) != 4 or getattr(experts, "mode", "affine") != "affine":
        return False
    gu, dn = experts.gate_up_proj, experts.down_proj
    hidden, inter, g = experts.hidden, experts.intermediate, experts.group_size
    return (
        x.ndim == 2
        and x.shape[1] == hidden
        and x.dtype in (mx.float16, mx.bfloat16)
        and gu["scales"].dtype == x.dtype
        and dn["scales"].dtype == x.dtype
        and g % 8 == 0
        and hidden % g == 0
        and inter % g == 0
        and hidden * 4 <= 48 * 1024
        and (k + 1) * 32 <= 1024
    )


def runs_shared(shared_expert, dtype: mx.Dtype) -> bool:
    """Whether a SwiGLU shared expert can run on the kernels' last pair: its gate / up fused
    (one [2I, H] weight, gate rows first) and its down [H, I], dense in `dtype`, no bias,
    every row whole 16-byte chunks."""
    gate_up, down = shared_expert.get("gate_up_proj"), shared_expert.get("down_proj")
    layers = (gate_up, down)
    if any(type(m) is not nn.Linear or "bias" in m for m in layers):
        return False
    width = 16 // dtype.size
    return all(m.weight.dtype == dtype and m.weight.shape[1] % width == 0 for m in layers)


def supported() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


@functools.cache
def available(hidden: int, inter: int, n_experts: int, k: int, group: int, dtype) -> bool:
    """True when the kernels run here, each row equals a one-row call bit for bit, and the
    result is close to the op path (gather_qmm, silu(gate) * up, the weighted sum; plus the
    shared expert's gated output, given or run on the last pair) on random experts of this
    shape (probed once per shape); else False, warning why.
    QWEN38_EXPERT_KERNEL: auto (the default) | off | force (skip the probe)."""
    decided = switched("QWEN38_EXPERT_KERNEL", supported)
    if decided is not None:
        return decided
    keys = mx.random.split(mx.random.key(23), 9)
    rows = 3
    x = mx.random.normal((rows, hidden), key=keys[0]).astype(dtype)
    experts = Experts(n_experts, hidden, inter)
    shapes = {
        "gate_up_proj": (n_experts, 2 * inter, hidden),
        "down_proj": (n_experts, hidden, inter),
    }
    for (name, shape), key in zip(shapes.items(), keys[1:3], strict=True):
        setattr(experts, name, (mx.random.normal(shape, key=key) * shape[-1] ** -0.5).astype(dtype))
    experts = QuantizedExperts(experts, group, 4)
    stacks = (experts.gate_up_proj, experts.down_proj)
    inds = mx.random.randint(0, n_experts, (rows, k), key=keys[3]).astype(mx.uint32)
    weights = mx.softmax(mx.random.normal((rows, k), key=keys[4]), axis=-1)
    gate = mx.random.normal((rows, 1), key=keys[5]).astype(dtype)
    values = mx.random.normal((rows, hidden), key=keys[6]).astype(dtype)
    shared_gate_up = (hidden**-0.5 * mx.random.normal((2 * inter, hidden), key=keys[7])).astype(
        dtype
    )
    shared_down = (inter**-0.5 * mx.random.normal((hidden, inter), key=keys[8])).astype(dtype)

    def forms(t: slice) -> mx.array:  # no shared expert, its output given, its weights run
        args = (x[t], inds[t], weights[t], *stacks, group)
        given = routed_sum(*args, shared=(gate[t], values[t]))
        run = routed_sum(*args, shared_weights=(gate[t], shared_gate_up, shared_down))
        return mx.stack([routed_sum(*args), given, run])

    try:
        together = forms(slice(0, rows))
        alone = mx.concatenate([forms(slice(i, i + 1)) for i in range(rows)], axis=1)
        routed = reference(x, inds, weights, experts)
        g, u = mx.split(x @ shared_gate_up.T, 2, axis=-1)
        shared = (nn.silu(g) * u) @ shared_down.T
        sig = mx.sigmoid(gate)
        want = mx.stack([routed, routed + sig * values, routed + sig * shared])
        mx.eval(together, alone, want)
    except Exception as e:  # noqa: BLE001 - any failure means: the op path runs
        warnings.warn(f"expert kernels unavailable ({e})", stacklevel=2)
        return False
    same = mx.array_equal(together, alone).item()
    err = max(
        (mx.linalg.norm((g - w).astype(mx.float32)) / mx.linalg.norm(w.astype(mx.float32))).item()
        for g, w in zip(together, want, strict=True)
    )
    if not same or err > 2.0**-7:
        warnings.warn(
            f"expert kernels disagree (rows equal to one-row calls: {same}, relative error "
            f"{err:.2e} vs the op path)",
            stacklevel=2,
        )
        return False
    return True


def reference(x: mx.array, inds: mx.array, weights: mx.array, experts) -> mx.array:
    """What routed_sum replaces: the MoE layer's own op path (moe.weighted_experts: one
    gather_qmm product per (row, expert) pair, silu(gate) * up, the weighted sum)."""
    return weighted_experts(experts, x, inds, weights)
