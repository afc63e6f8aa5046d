"""A grid-wide barrier for kernels launched through mx.fast.cuda_kernel, and a chain of
one-row products run as one persistent launch with it: the probe for fusing a decode step's
launches (issue 14).

Why: a full Flash-Next token is bound by the host, at ~10-15 us of MLX work for each of the
~1,000 launches it encodes (INTERNALS, session 35), and its launches are separate mostly
because each product needs the whole output of the one before: CUDA orders that at a launch
boundary or at a grid-wide barrier. MLX launches no cooperative kernels, so the barrier here
is software: every block adds one to an arrival count and waits until the count reaches the
grid's block count times the barriers passed. That is safe only while every block of the
grid is resident at once, so a persistent launch takes at most one block per SM (`blocks`,
from %nsmid), and a wait gives up after SPIN_LIMIT polls and raises the launch's error flag
instead of hanging (a result with the flag set is not to be used; `available()` refuses).

The count and the flag live in a uint32 [3] input made for each launch (`fresh_state()`: a
zeros op, one small fill kernel), which the kernel writes through a const_cast; `finish`,
at the end of a launch, reports [arrivals, gave up] in an output (the last block to get
there) and puts the state back to zeros. Not an init_value output: MLX fills every output
of a launch with init_value, one fill kernel an output (a fused launch has one for each
output of its phases). Not one buffer kept across launches either: MLX orders kernels in its
CUDA graphs by their data alone, so two launches with nothing between them (a step queued
after an abandoned one, a bench's independent calls) may run at once, and would share it.
(Zeroing it again at the end keeps it usable where MLX's compile merges two zeros ops of
one graph into one buffer: launches there are ordered by their data.)
A phase's input written by another SM in the phase before is read with ld.global.cg (L2,
not the SM's own L1, which another SM's writes do not update). Shared memory holds nothing
across a barrier (the CPU emulation runs the blocks as threads with their own shared
memory, but the rule keeps phases independent).

The chain: P phases y_p = W_p y_(p-1), alternating a [N, K] and a [K, N] weight, each output
computed by one warp (16-byte loads, fp32 fmaf in ascending order, a warp butterfly), so the
persistent launch and P separate launches (`chain_launches`) give the same bits, and
benchmarks/probe_grid_sync_gpu.py measures what P - 1 barriers cost against P launches, on
the device and on the host.
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx

from .jit import cuda_kernel
from .switch import switched

THREADS = 256
WARPS = THREADS // 32
SPIN_LIMIT = 1 << 22  # polls, 64 ns apart at least: a wait gives up after ~0.3 s

# Device code of the barrier (the emulation recognises kernels that use it by this name).
GRID_BARRIER = """
namespace qwen38_grid {
// Wait until every block of the grid has called this as often as this block has: `passed`
// counts this block's barriers (thread 0's copy is the one read). barrier[0] counts
// arrivals, barrier[1] is set when a wait gave up. Shared memory holds nothing across it.
__device__ __forceinline__ void sync(unsigned* barrier, unsigned& passed) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned blocks = gridDim.x * gridDim.y * gridDim.z;
        passed += 1;
        __threadfence();  // this block's writes before its arrival
        atomicAdd(barrier, 1u);
        volatile unsigned* arrived = barrier;
        unsigned polls = 0;
        while (arrived[0] < passed * blocks && !arrived[1]) {
            if (++polls > __SPIN_LIMIT__) {
                atomicExch(barrier + 1, 1u);
                break;
            }
            __nanosleep(64);
        }
        __threadfence();  // the other blocks' writes before this block's reads
    }
    __syncthreads();
}

// The end of a launch, reached by every thread: barrier[2] counts the blocks done; the last
// one (every other block has left its waits) writes [arrivals, gave up] to report and zeros
// the barrier for the next launch. True in that block's thread 0.
__device__ __forceinline__ bool finish(unsigned* barrier, unsigned* report) {
    __syncthreads();
    if (threadIdx.x != 0) return false;
    const unsigned blocks = gridDim.x * gridDim.y * gridDim.z;
    __threadfence();
    if (atomicAdd(barrier + 2, 1u) != blocks - 1) return false;
    __threadfence();
    volatile unsigned* seen = barrier;
    report[0] = seen[0];
    report[1] = seen[1];
    for (int i = 0; i < 3; ++i) atomicExch(barrier + i, 0u);
    __threadfence();
    return true;
}

// The persistent state a launch takes as its input `name` (inputs are const to MLX; the
// barrier writes it, and leaves it as it found it).
#define QWEN38_GRID_STATE(name) const_cast<unsigned*>(reinterpret_cast<const unsigned*>(name))
}  // namespace qwen38_grid
""".replace("__SPIN_LIMIT__", f"{SPIN_LIMIT}u")

# One warp's outputs of y = w v for w [N, K] (K a multiple of 16 bytes' values): outputs gw,
# gw + stride, ...; v read from L2 (another SM may have written it in the phase before).
_PRODUCT = """
namespace qwen38_chain {
template <typename T>
__device__ __forceinline__ void product(
    const T* w, const T* v, T* y, int N, int K, long long gw, long long stride) {
    constexpr int E = 16 / sizeof(T);
    const int lane = threadIdx.x & 31, chunks = K / E;
    const uint4* vv = reinterpret_cast<const uint4*>(v);
    for (long long n = gw; n < N; n += stride) {
        const uint4* row = reinterpret_cast<const uint4*>(w + n * K);
        float acc = 0.0f;
        for (int c = lane; c < chunks; c += 32) {
            const uint4 a = row[c];
            const uint4 b = __ldcg(vv + c);
            const T* av = reinterpret_cast<const T*>(&a);
            const T* bv = reinterpret_cast<const T*>(&b);
#pragma unroll
            for (int i = 0; i < E; ++i)
                acc = fmaf(static_cast<float>(av[i]), static_cast<float>(bv[i]), acc);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) y[n] = static_cast<T>(acc);
    }
}
}  // namespace qwen38_chain
"""

# Template constants: T, P (phases), N, K, WORK (false: the barriers alone). Phase p's output
# is ys[p] (N values for even p, K for odd; rows of max(N, K)).
_CHAIN = """
    const long long gw = (long long)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    const long long stride = (long long)gridDim.x * (blockDim.x / 32);
    constexpr int M = N > K ? N : K;
    unsigned passed = 0;
    const T* v = x;
    for (int p = 0; p < P; ++p) {
        T* y = ys + (long long)p * M;
        if (WORK) {
            const bool even = p % 2 == 0;
            qwen38_chain::product<T>(even ? wa : wb, v, y, even ? N : K, even ? K : N, gw, stride);
        }
        if (p + 1 < P) qwen38_grid::sync(QWEN38_GRID_STATE(barrier), passed);
        v = y;
    }
    qwen38_grid::finish(QWEN38_GRID_STATE(barrier), report);
"""

# One phase alone: the same warp arithmetic, one output a warp.
_PHASE = """
    const long long gw = (long long)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
    qwen38_chain::product<T>(w, v, y, w_shape[0], w_shape[1], gw, 1LL << 40);
"""

# The SM count as the device sees it (%nsmid: one more than the highest SM id).
_SMS = """
    unsigned n;
    asm volatile("mov.u32 %0, %%nsmid;" : "=r"(n));
    if (threadIdx.x == 0) sms[0] = n;
"""


@functools.cache
def _chain_kernel():
    return cuda_kernel(
        name="qwen38_grid_chain",
        input_names=["x", "wa", "wb", "barrier"],
        output_names=["ys", "report"],
        header=GRID_BARRIER + _PRODUCT,
        source=_CHAIN,
    )


@functools.cache
def _phase_kernel():
    return cuda_kernel(
        name="qwen38_grid_phase",
        input_names=["v", "w"],
        output_names=["y"],
        header=_PRODUCT,
        source=_PHASE,
    )


@functools.cache
def _sms_kernel():
    return cuda_kernel(name="qwen38_grid_sms", input_names=["x"], output_names=["sms"], source=_SMS)


@functools.cache
def sm_count() -> int:
    """The device's streaming multiprocessors (one launch, read back once)."""
    (n,) = _sms_kernel()(
        inputs=[mx.zeros((1,))],
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.uint32],
    )
    return int(n.item())


def check_chain(x: mx.array, wa: mx.array, wb: mx.array) -> None:
    """Raise ValueError unless x [K], wa [N, K] and wb [K, N] make a chain (one float dtype,
    rows of whole 16-byte vectors)."""
    if x.ndim != 1 or wa.ndim != 2 or wb.shape != wa.shape[::-1] or wa.shape[1] != x.shape[0]:
        raise ValueError(
            f"a chain takes x [K], wa [N, K], wb [K, N]: got {x.shape}, {wa.shape}, {wb.shape}"
        )
    if not (x.dtype == wa.dtype == wb.dtype) or x.dtype not in (
        mx.float16,
        mx.bfloat16,
        mx.float32,
    ):
        raise ValueError(f"a chain takes one float dtype: got {x.dtype}, {wa.dtype}, {wb.dtype}")
    per = 16 // x.dtype.size
    if any(d % per for d in wa.shape):
        raise ValueError(f"a chain's widths must be multiples of {per} values: {wa.shape}")


def chain(
    x: mx.array,
    wa: mx.array,
    wb: mx.array,
    phases: int,
    blocks: int,
    work: bool = True,
) -> tuple[mx.array, mx.array]:
    """(ys [phases, max(N, K)], report uint32 [2]: arrivals, gave up) of the chain as one
    launch of `blocks` blocks (all resident at once: a few an SM, `sm_count()`); report[1]
    != 0: a wait gave up, ys is not to be used. work=False: the barriers alone (ys then is
    not written)."""
    check_chain(x, wa, wb)
    n, k = wa.shape
    return _chain_kernel()(
        inputs=[x, wa, wb, fresh_state()],
        template=[("T", x.dtype), ("P", phases), ("N", n), ("K", k), ("WORK", work)],
        grid=(blocks * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(phases, max(n, k)), (2,)],
        output_dtypes=[x.dtype, mx.uint32],
    )


def fresh_state() -> mx.array:
    """A launch's barrier state: uint32 [3] of zeros, made for it (module docstring)."""
    return mx.zeros((3,), mx.uint32)


def chain_launches(x: mx.array, wa: mx.array, wb: mx.array, phases: int) -> list[mx.array]:
    """The chain's phase outputs as `phases` launches, one a phase."""
    check_chain(x, wa, wb)
    outs, v = [], x
    for p in range(phases):
        w = wa if p % 2 == 0 else wb
        (v,) = _phase_kernel()(
            inputs=[v, w],
            template=[("T", x.dtype)],
            grid=(-(-w.shape[0] // WARPS) * THREADS, 1, 1),
            threadgroup=(THREADS, 1, 1),
            output_shapes=[(w.shape[0],)],
            output_dtypes=[x.dtype],
        )
        outs.append(v)
    return outs


def supported() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def same_as_launches(ys: mx.array, launches: list[mx.array]) -> bool:
    """Whether a chain's rows equal the separate launches' outputs bit for bit."""
    return all(mx.array_equal(ys[p, : y.shape[0]], y).item() for p, y in enumerate(launches))


@functools.cache
def available(blocks: int | None = None) -> bool:
    """True when a persistent chain of `blocks` blocks (default: one an SM) runs here with no
    wait giving up and its phases equal separate launches bit for bit (a bf16 chain of 5
    phases, 1024 -> 320 -> 1024 ...); else False, warning why. QWEN38_GRID_SYNC: auto (the
    default) | off | force (no probe)."""
    decided = switched("QWEN38_GRID_SYNC", supported)
    if decided is not None:
        return decided
    key = mx.random.key(7)
    wa = (mx.random.normal((320, 1024), key=key) / 32).astype(mx.bfloat16)
    wb = (mx.random.normal((1024, 320), key=mx.random.split(key)[0]) / 18).astype(mx.bfloat16)
    x = mx.random.normal((1024,), key=mx.random.split(key)[1]).astype(mx.bfloat16)
    try:
        ys, barrier = chain(x, wa, wb, 5, blocks or sm_count())
        launches = chain_launches(x, wa, wb, 5)
        mx.eval(ys, barrier, launches)
    except Exception as e:  # noqa: BLE001 - any failure means: separate launches
        warnings.warn(f"grid barrier unavailable ({e}); launches stay separate", stacklevel=2)
        return False
    gave_up, same = int(barrier[1].item()) != 0, same_as_launches(ys, launches)
    if gave_up or not same:
        warnings.warn(
            f"grid barrier refused (a wait gave up: {gave_up}; phases equal to separate "
            f"launches: {same}); launches stay separate",
            stacklevel=2,
        )
        return False
    return True
