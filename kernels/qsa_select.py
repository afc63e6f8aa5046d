"""QSA's decode selection on CUDA in one launch: from the indexer's block scores to the token
ids the step gathers (models/qsa.py, decode_tokens).

Why: on the op path a decode step's selection after its scores is a top-k (a block sort),
its minimum, two compares, two casts, a sum, a cumulative sum, a mask, a second sort, the
token expansion and a concatenation: 12 launches of the ~67 a QSA layer runs on the H200
(ncu, benchmarks/results/h200/flash_step_kernels_4l_s31.json), and a Flash-Next step is
bound by its launches' host time.

One block of THREADS threads. Each block score becomes a unique uint64 order key, (the
score's order-preserving bits) << 32 | ~block id, so ordering the keys is ordering by score,
then by lower id: QSA's tie rule (qsa.top_blocks). A radix select walks the keys' bytes from
the top: per byte, a shared-memory histogram of the keys still in play, a scan over its 256
bins from the highest, and the bin holding the n-th largest key; it stops once every key of
that bin is taken (after four bytes unless scores tie across the boundary). The chosen keys
are then exactly those at or above the prefix found; each thread counts the chosen ones in
its own contiguous run of blocks, a block-wide scan gives its first output slot, and the
ids come out ascending, each block's `RATIO` token ids, then the causal tail. No arithmetic
on the scores: the selection equals the op path's bit for bit (`available()` checks it on
ties, masked blocks and both tail cases once per shape before a step uses it).
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx

from .jit import cuda_kernel
from .switch import switched

THREADS = 1024
WARPS = THREADS // 32

# Template constants: N_SEL (blocks to choose), RATIO (tokens a block), TAIL (tail tokens).
_SOURCE = """
    constexpr int WARPS = __WARPS__;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int n = scores_shape[0];
    __shared__ int hist[256];
    __shared__ int sums[WARPS];
    __shared__ unsigned long long chosen_prefix;
    __shared__ int chosen_need, chosen_done;

    auto key_of = [&](int i) -> unsigned long long {
        const unsigned bits = __float_as_uint(scores[i] + 0.0f);  // -0.0 -> +0.0
        const unsigned ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
        return ((unsigned long long)ordered << 32) | (0xFFFFFFFFull - (unsigned)i);
    };
    // inclusive sum over the block's threads in index order; `sums` is free again after
    auto block_scan = [&](int value) -> int {
        int incl = value;
        for (int o = 1; o < 32; o <<= 1) {
            const int other = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += other;
        }
        if (lane == 31) sums[warp] = incl;
        __syncthreads();
        for (int w = 0; w < warp; ++w) incl += sums[w];
        __syncthreads();
        return incl;
    };

    // Radix select: keys matching `prefix` under `mask` are in play; `need` of them are
    // still to choose (every key above the prefix is chosen already).
    unsigned long long prefix = 0ull, mask = 0ull;
    int need = N_SEL;
    for (int shift = 56; shift >= 0; shift -= 8) {
        if (tid < 256) hist[tid] = 0;
        __syncthreads();
        for (int i = tid; i < n; i += __THREADS__) {
            const unsigned long long k = key_of(i);
            if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255], 1);
        }
        __syncthreads();
        // thread t holds bin 255 - t, so its inclusive sum counts the keys in bins >= that one
        const int count = tid < 256 ? hist[255 - tid] : 0;
        const int at_or_above = block_scan(count);
        if (tid < 256 && at_or_above - count < need && at_or_above >= need) {
            chosen_prefix = prefix | ((unsigned long long)(255 - tid) << shift);
            chosen_need = need - (at_or_above - count);
            chosen_done = at_or_above == need;  // every key of the bin is chosen
        }
        __syncthreads();
        prefix = chosen_prefix;
        need = chosen_need;
        mask |= 0xFFull << shift;
        if (chosen_done) break;
    }

    // The chosen blocks, ascending: thread t's contiguous run, then a block-wide scan.
    const int per = (n + __THREADS__ - 1) / __THREADS__;
    const int lo = min(tid * per, n), hi = min(lo + per, n);
    int mine = 0;
    for (int i = lo; i < hi; ++i) mine += (key_of(i) & mask) >= prefix;
    int slot = block_scan(mine) - mine;
    for (int i = lo; i < hi; ++i) {
        if ((key_of(i) & mask) >= prefix) {
            for (int r = 0; r < RATIO; ++r) tokens[slot * RATIO + r] = i * RATIO + r;
            ++slot;
        }
    }
    for (int j = tid; j < TAIL; j += __THREADS__) tokens[N_SEL * RATIO + j] = tail[j];
"""


@functools.cache
def _kernel():
    source = _SOURCE.replace("__WARPS__", str(WARPS)).replace("__THREADS__", str(THREADS))
    return cuda_kernel(
        name="qwen38_qsa_select",
        input_names=["scores", "tail"],
        output_names=["tokens"],
        source=source,
    )


def decode_tokens(scores: mx.array, tail: mx.array, n_blocks: int, ratio: int) -> mx.array:
    """int32 [n_blocks * ratio + len(tail)]: the tokens of the n_blocks best blocks by fp32
    `scores` [NB] (ties: the lower block id), ascending, then `tail` (int32)."""
    width = tail.shape[0]
    return _kernel()(
        inputs=[scores, tail if width else mx.zeros((1,), mx.int32)],
        template=[("N_SEL", n_blocks), ("RATIO", ratio), ("TAIL", width)],
        grid=(THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(n_blocks * ratio + width,)],
        output_dtypes=[mx.int32],
    )[0]


def supported() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def fits(scores: mx.array, n_blocks: int) -> bool:
    """Whether these scores suit the kernel (not the probe): one fp32 row, at least n_blocks."""
    return scores.ndim == 1 and scores.dtype == mx.float32 and 0 < n_blocks <= scores.shape[0]


def probe_scores(n: int, visible: int, seed: int) -> mx.array:
    """Scores with the cases a selection must get right: many exact ties (values on a coarse
    grid, +-0.0 among them), -inf past `visible` blocks (as decode_tokens masks them)."""
    grid = mx.round(4 * mx.random.normal((n,), key=mx.random.key(seed))) / 4
    grid = mx.where(mx.arange(n) % 7 == 0, -0.0, grid)
    return mx.where(mx.arange(n) < visible, grid, -mx.inf).astype(mx.float32)


@functools.cache
def available(n_blocks: int, ratio: int) -> bool:
    """True when the kernel runs here and chooses as the op path does (qsa.top_blocks) on
    tied, masked scores, with and without a tail, some forcing ties at the boundary; else
    False with a warning. QWEN38_QSA_SELECT_KERNEL: auto (the default) | off | force (no
    probe)."""
    from qwen38_backend.models.qsa import op_decode_tokens

    decided = switched("QWEN38_QSA_SELECT_KERNEL", supported)
    if decided is not None:
        return decided
    cases = [(n_blocks + 256, n_blocks + 100, 0), (4 * n_blocks + 300, 3 * n_blocks, ratio - 1)]
    try:
        for seed, (n, visible, width) in enumerate(cases):
            scores = probe_scores(n, visible, seed)
            tail = mx.arange(width, dtype=mx.int32) + 4 * visible
            got = decode_tokens(scores, tail, n_blocks, ratio)
            want = op_decode_tokens(scores, tail, n_blocks, ratio)
            if not mx.array_equal(got, want).item():
                raise ValueError(f"{n} blocks: the kernel chose other tokens than the op path")
    except Exception as e:  # noqa: BLE001 - any failure means: use the op path
        warnings.warn(f"QSA selection kernel unavailable ({e}); using the op path", stacklevel=2)
        return False
    return True
