"""A row's n highest order keys in one CUDA launch, as ascending ids: QSA's decode choice
of blocks (models/qsa.py, decode_tokens) and Quest's choice of pages (kv/quest.py,
top_pages).

Why: on the op path QSA's choice after its block scores is a top-k (a block sort), its
minimum, two compares, two casts, a sum, a cumulative sum, a mask, a second sort, the token
expansion and a concatenation: 13 launches of the ~67 a QSA layer runs on the H200 (ncu,
benchmarks/results/h200/flash_step_kernels_4l_s31.json), and a Flash-Next step is bound by
its launches' host time. Quest's top-k past 1,024 pages is two rounds of block sorts and
gathers, ~0.05 ms a layer at 131K (session 30).

One block of THREADS threads per row. Every candidate has a unique uint64 order key: (the
score's order-preserving bits) << 32 | ~id, so ordering keys is ordering by score, then by
lower id (QSA's tie rule, qsa.top_blocks; Quest's keys, quest.order_keys, are built the
same way and come in as they are). A radix select walks the keys' bytes from the top: per
byte, a shared-memory histogram of the keys still in play, a scan over its 256 bins from
the highest, and the bin holding the n-th largest key; it stops once every key of that bin
is taken (after four bytes unless scores tie across the boundary). The chosen keys are then
exactly those at or above the prefix found; each thread counts the chosen ones in its own
contiguous run, a block-wide scan gives its first output slot, and the ids come out
ascending (QSA: each block's `RATIO` token ids, then the causal tail). No arithmetic on the
scores, so the choice equals the op path's bit for bit; `qsa_available()` and
`top_available()` check it once per shape (ties, masked candidates, tails) before a step
uses the kernel.
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx

from .jit import cuda_kernel
from .switch import switched

THREADS = 1024
WARPS = THREADS // 32

# Template constants: N_SEL (ids to choose), RATIO (ids written per chosen one), TAIL (tail
# values copied after them). __KEY_OF__ / __N__ / __TAIL__: the two inputs' forms below.
_SOURCE = """
    constexpr int WARPS = __WARPS__;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int row = blockIdx.y;
    const int n = __N__;
    int* out = tokens + (long long)row * (N_SEL * RATIO + TAIL);
    __shared__ int hist[256];
    __shared__ int sums[WARPS];
    __shared__ unsigned long long chosen_prefix;
    __shared__ int chosen_need, chosen_done;

    auto key_of = [&](int i) -> unsigned long long {
        __KEY_OF__
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
            for (int r = 0; r < RATIO; ++r) out[slot * RATIO + r] = i * RATIO + r;
            ++slot;
        }
    }
    __TAIL__
"""
# QSA: fp32 scores [NB] made keys here, and the causal tail after the tokens
_FROM_SCORES = {
    "__KEY_OF__": """
        const unsigned bits = __float_as_uint(scores[i] + 0.0f);  // -0.0 -> +0.0
        const unsigned ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
        return ((unsigned long long)ordered << 32) | (0xFFFFFFFFull - (unsigned)i);""",
    "__N__": "scores_shape[0]",
    "__TAIL__": "for (int j = tid; j < TAIL; j += __THREADS__) out[N_SEL * RATIO + j] = tail[j];",
}
# Quest: uint64 order keys [rows, n] as they are
_FROM_KEYS = {
    "__KEY_OF__": "return keys[(long long)row * n + i];",
    "__N__": "keys_shape[1]",
    "__TAIL__": "",
}


@functools.cache
def _kernel(from_keys: bool):
    source = _SOURCE
    for mark, text in (_FROM_KEYS if from_keys else _FROM_SCORES).items():
        source = source.replace(mark, text)
    source = source.replace("__WARPS__", str(WARPS)).replace("__THREADS__", str(THREADS))
    return cuda_kernel(
        name="qwen38_top_keys" if from_keys else "qwen38_qsa_select",
        input_names=["keys"] if from_keys else ["scores", "tail"],
        output_names=["tokens"],
        source=source,
    )


def decode_tokens(scores: mx.array, tail: mx.array, n_blocks: int, ratio: int) -> mx.array:
    """int32 [n_blocks * ratio + len(tail)]: the tokens of the n_blocks best blocks by fp32
    `scores` [NB] (ties: the lower block id), ascending, then `tail` (int32)."""
    width = tail.shape[0]
    return _kernel(False)(
        inputs=[scores, tail if width else mx.zeros((1,), mx.int32)],
        template=[("N_SEL", n_blocks), ("RATIO", ratio), ("TAIL", width)],
        grid=(THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(n_blocks * ratio + width,)],
        output_dtypes=[mx.int32],
    )[0]


def top_ids(keys: mx.array, n_select: int) -> mx.array:
    """int32 [rows, n_select]: per row of unique uint64 order keys [rows, n] (n > n_select),
    the ids of the n_select largest, ascending (quest.top_pages)."""
    rows = keys.shape[0]
    return _kernel(True)(
        inputs=[keys],
        template=[("N_SEL", n_select), ("RATIO", 1), ("TAIL", 0)],
        grid=(THREADS, rows, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, n_select)],
        output_dtypes=[mx.int32],
    )[0]


def supported() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def probe_scores(n: int, visible: int, seed: int) -> mx.array:
    """Scores with the cases a selection must get right: many exact ties (values on a coarse
    grid, +-0.0 among them), -inf past `visible` blocks (as decode_tokens masks them)."""
    grid = mx.round(4 * mx.random.normal((n,), key=mx.random.key(seed))) / 4
    grid = mx.where(mx.arange(n) % 7 == 0, -0.0, grid)
    return mx.where(mx.arange(n) < visible, grid, -mx.inf).astype(mx.float32)


@functools.cache
def qsa_available(n_blocks: int, ratio: int) -> bool:
    """True when the kernel runs here and chooses as the op path does (qsa.top_blocks) on
    tied, masked scores, with and without a tail, some forcing ties at the boundary; else
    False with a warning. QWEN38_QSA_SELECT_KERNEL: auto (the default) | off | force (no
    probe)."""
    from qwen38_backend.models.qsa import op_decode_tokens

    decided = switched("QWEN38_QSA_SELECT_KERNEL", supported)
    if decided is not None:
        return decided
    # the second tail: a step's causal tail, or (ratio 1: block ids) the tail's block
    cases = [
        (n_blocks + 256, n_blocks + 100, 0),
        (4 * n_blocks + 300, 3 * n_blocks, max(ratio - 1, 1)),
    ]

    def check() -> None:
        for seed, (n, visible, width) in enumerate(cases):
            scores = probe_scores(n, visible, seed)
            tail = mx.arange(width, dtype=mx.int32) + 4 * visible
            got = decode_tokens(scores, tail, n_blocks, ratio)
            if not mx.array_equal(got, op_decode_tokens(scores, tail, n_blocks, ratio)).item():
                raise ValueError(f"{n} blocks: the kernel chose other tokens than the op path")

    return _probed("QSA selection kernel", check)


@functools.cache
def top_available(n_select: int) -> bool:
    """True when the kernel runs here and picks the pages quest.top_pages does (one round
    and two, a shared row and per-head rows, tied scores, dead pages); else False with a
    warning. QWEN38_QUEST_TOP_KERNEL: auto (the default) | off | force (no probe)."""
    from qwen38_backend.kv.quest import order_keys, top_pages

    decided = switched("QWEN38_QUEST_TOP_KERNEL", supported)
    if decided is not None:
        return decided

    def check() -> None:
        for seed, (rows, n) in enumerate([(1, n_select + 200), (4, 3 * n_select + 1500)]):
            scores = mx.stack([probe_scores(n, n - 50, seed + r) for r in range(rows)])
            keys = order_keys(scores)
            got, want = top_ids(keys, n_select), top_pages(keys, n_select)
            if not mx.array_equal(got, want).item():
                raise ValueError(f"{rows} x {n} pages: the kernel chose other pages than top_pages")

    return _probed("Quest top-k kernel", check)


def _probed(what: str, check) -> bool:
    try:
        check()
    except Exception as e:  # noqa: BLE001 - any failure means: use the op path
        warnings.warn(f"{what} unavailable ({e}); using the op path", stacklevel=3)
        return False
    return True
