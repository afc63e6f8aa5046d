"""QSA: the Flash-Next trained block selector and the gated attention that uses it.

Selection (QWEN38.md, "QSA"): raw indexer keys are cached per token; every complete block of
`ratio` tokens gets a pooled key (fp32 mean of its raw keys, cast, zero-centred norm, RoPE at
the block's first position). Query p sees nvis = (p + 1) // ratio complete blocks: all of them
while nvis <= n_blocks (budget // ratio: dense), else the n_blocks best by
sum_h relu(q_h . k_b) / sqrt(d) in fp32, ties to the LOWER block id;
plus the causal tail 4 * nvis .. p. The functions here are pure so a
paged store can call them; `QSAState` keeps the indexer tensors beside a KV store.

Attention past the dense threshold reads each query's tokens (n_blocks * ratio selected
plus a causal tail of at most ratio - 1): a decode step on CUDA in place, through the
split-KV kernel's page lists with the store's blocks of `ratio` rows as pages
(`block_pool`), elsewhere GATHERED through the store's `gather(positions)`; either way its
cost per token does not grow with the context. Prefill queries go in groups sized so that one
group's gathered K/V and block scores stay near GATHER_BYTES; a query's token set is padded
to the fixed width n_blocks * ratio + ratio - 1 and the padding masked out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache, partial

import mlx.core as mx
import mlx.nn as nn

from .. import scalars
from ..kernel_import import kernel_module
from ..kv.one_token import attend_gathered, pages_in_place
from ..rows import STEP_MAX_ROWS, per_row
from ..state import RewindError
from .layers import Attention, RMSNorm, RopeSpec, compiled

# Scratch of one prefill query group: gathered K/V plus the block scores of its queries.
GATHER_BYTES = 64 << 20
# Live fp32 [G, NB] arrays per query while one group selects (scores, masked scores, the
# tie cumsum, the boolean choice): what admission counts per query of a group, besides the
# per-head scores [G, Hi, NB].
SELECT_ROWS_LIVE = 4


# ----- rope at arbitrary positions -------------------------------------------------------------
@cache
def _inv_freq(dims: int, theta: float) -> mx.array:
    """RoPE inverse frequencies, made once (a compiled decode step would recompute them)."""
    inv = 1.0 / (theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
    mx.eval(inv)
    return inv


def _arange(n: int) -> mx.array:
    """0..n-1 (int32): a slice of one made once per power of two, for the same reason."""
    return _arange_pow2(1 << max(n - 1, 0).bit_length())[:n]


def positions_after(offset: mx.array, n: int) -> mx.array:
    """offset + 0..n-1 (int32) for an `offset` array: in a compiled step the range is a
    constant, not an arange launch a layer."""
    return offset + _arange(n)


@cache
def _arange_pow2(n: int) -> mx.array:
    ids = mx.arange(n)
    mx.eval(ids)
    return ids


@cache
def _rope_lanes(dims: int, theta: float, width: int) -> tuple[mx.array, mx.array, mx.array]:
    """Per feature of a `width`-wide vector whose first `dims` rotate: (its frequency, the
    sign its partner's sine term takes, its partner's index), made once. Features past
    `dims` get frequency 0 and sign 0: cos 1 and no partner term, so they pass unchanged."""
    half = dims // 2
    inv = _inv_freq(dims, theta)
    rest = mx.zeros((width - dims,), mx.float32)
    freq = mx.concatenate([inv, inv, rest])
    sign = mx.concatenate([-mx.ones((half,)), mx.ones((half,)), rest])
    partner = mx.array(
        [j + half if j < half else j - half if j < dims else j for j in range(width)],
        dtype=mx.int32,
    )
    mx.eval(freq, sign, partner)
    return freq, sign, partner


def rope_at(
    x: mx.array, positions: mx.array, dims: int, theta: float, dtype: mx.Dtype | None = None
) -> mx.array:
    """NeoX rotate-half RoPE on the first `dims` features; x [N, ..., D], positions [N].

    x * cos + partner(x) * (+-sin) over every feature at once (x1 cos - x2 sin, x2 cos +
    x1 sin: the same products and sums as the halves written out), so a compiled step runs
    it as one gather (the partners) and one elementwise kernel instead of about ten
    launches (sine, cosine, the halves' products, their concatenation, the casts).

    `dtype`: x holds fp32 rows that are x rounded to `dtype` first (a norm's for_product):
    the rounding is done inside that elementwise kernel (the gather takes the fp32 rows; a
    cast commutes with it), one launch fewer than rounding first; the result is in `dtype`.
    The angles are formed in their broadcast shape (no reshape after the product), so they
    fuse into the same kernel."""
    dtype = dtype or x.dtype
    width = x.shape[-1]
    freq, sign, partner = _rope_lanes(dims, theta, width)
    ang = positions.reshape((-1,) + (1,) * (x.ndim - 1)).astype(mx.float32) * freq
    swapped = mx.take(x, partner, axis=-1).astype(dtype).astype(mx.float32)
    out = x.astype(dtype).astype(mx.float32) * mx.cos(ang) + swapped * (sign * mx.sin(ang))
    return out.astype(dtype)


# ----- selection ------------------------------------------------------------------------------
def pool_blocks(
    raw: mx.array, first_block: int | mx.array, ratio: int, norm, dims: int, theta: float
):
    """Pooled keys [n, D] for raw keys [n * ratio, D] of blocks first_block..first_block+n-1."""
    n = raw.shape[0] // ratio
    mean = raw[: n * ratio].astype(mx.float32).reshape(n, ratio, -1).mean(axis=1)
    kb = norm.for_product(mean.astype(raw.dtype))  # rounded to raw's dtype in rope_at
    pos = (_arange(n) + first_block) * ratio
    return rope_at(kb, pos, dims, theta, raw.dtype)


def block_scores(qi: mx.array, kb: mx.array) -> mx.array:
    """qi [T, Hi, D], kb [NB, D] -> [T, NB] fp32: sum over heads of relu(q . k) / sqrt(D)."""
    s = mx.matmul(qi.astype(mx.float32), kb.astype(mx.float32).T)  # [T, Hi, NB]
    return mx.maximum(s, 0.0).sum(axis=1) / math.sqrt(qi.shape[-1])


def top_blocks(scores: mx.array, n_blocks: int) -> mx.array:
    """Boolean [T, NB]: the n_blocks highest per row, ties broken towards the lower block id.

    Exact without a stable sort: everything strictly above the n_blocks-th value, then the
    first (lowest-id) entries equal to it until n_blocks are taken. Rows need at least n_blocks
    finite scores.
    """
    kth = mx.topk(scores, n_blocks, axis=-1).min(axis=-1, keepdims=True)
    above = scores > kth
    tie = scores == kth
    need = n_blocks - above.astype(mx.int32).sum(axis=-1, keepdims=True)
    return above | (tie & (mx.cumsum(tie.astype(mx.int32), axis=-1) <= need))


def select_blocks(scores: mx.array, positions: mx.array, ratio: int, n_blocks: int) -> mx.array:
    """Boolean [T, NB] of the blocks query p uses (all visible ones when nvis <= n_blocks)."""
    nb = scores.shape[-1]
    nvis = (positions + 1) // ratio  # [T]
    visible = mx.arange(nb)[None, :] < nvis[:, None]
    if nb <= n_blocks:
        return visible
    chosen = top_blocks(mx.where(visible, scores, -mx.inf), n_blocks)
    return mx.where((nvis <= n_blocks)[:, None], visible, chosen & visible)


def token_mask(blocks: mx.array, positions: mx.array, ratio: int, length: int) -> mx.array:
    """[T, length] boolean: tokens of chosen blocks plus the causal tail 4 * nvis .. p."""
    T, nb = blocks.shape
    tok = mx.repeat(blocks, ratio, axis=1)  # [T, nb * ratio]
    if nb * ratio < length:
        tok = mx.concatenate([tok, mx.zeros((T, length - nb * ratio), mx.bool_)], axis=1)
    tok = tok[:, :length]
    j = mx.arange(length)[None, :]
    start = ((positions + 1) // ratio * ratio)[:, None]
    return tok | ((j >= start) & (j <= positions[:, None]))


def token_ids(
    blocks: mx.array, positions: mx.array, ratio: int, n_blocks: int
) -> tuple[mx.array, mx.array]:
    """Each query's token ids as a fixed-width [T, n_blocks * ratio + ratio - 1] int32 array
    and its validity mask: the tokens of its chosen blocks (at most n_blocks True per row of
    `blocks` [T, NB]; fewer while a query is dense), then its causal tail 4 * nvis .. p.
    Invalid slots hold the query's own position p (a real row, masked out): a padding id in
    a page the query does not otherwise read would make a bounded pool hold one more page
    for it (admission counts its chosen blocks' pages and p's)."""
    T, nb = blocks.shape
    k = min(n_blocks, nb)
    # The chosen blocks sort first (key 0); a row with fewer than k takes unchosen ones too,
    # which the validity check drops.
    order = mx.argpartition((~blocks).astype(mx.int32), kth=k - 1, axis=-1)[:, :k]
    valid_b = mx.take_along_axis(blocks, order, axis=-1)
    steps = mx.arange(ratio, dtype=mx.int32)
    ids = (order.astype(mx.int32)[:, :, None] * ratio + steps).reshape(T, k * ratio)
    valid = mx.repeat(valid_b, ratio, axis=1)
    start = (positions + 1) // ratio * ratio
    tail = start[:, None].astype(mx.int32) + steps[None, : ratio - 1]
    tail_ok = tail <= positions[:, None]
    ids = mx.concatenate([ids, tail], axis=1)
    valid = mx.concatenate([valid, tail_ok], axis=1)
    return mx.where(valid, ids, positions[:, None].astype(mx.int32)), valid


def decode_tokens(
    qi: mx.array,
    pooled: mx.array,
    offset: mx.array,
    tail: mx.array,
    ratio: int,
    n_blocks: int,
    kernel: bool = False,
    per_block: int = 0,
) -> mx.array:
    """Token ids one decoding query at `offset` (past the dense threshold) gathers: its
    n_blocks best visible blocks in ascending order, then `tail` (its causal tail 4 * nvis..p).
    `per_block` 1: the blocks' ids instead of their tokens (the tail then its block's id).

    qi [1, Hi, D]; `pooled` is the whole pooled-key buffer (rows from the visible blocks on are
    masked out) and `offset` an array, so the shapes change only with the buffer's capacity and
    the tail's length: `decode_tokens_step` compiles it once per pair. `kernel`: the choice
    from the scores on runs as one CUDA launch (kernels/top_select.py, the same ids)."""
    cap = pooled.shape[0]
    visible = _arange(cap) < (offset + 1) // ratio
    scores = mx.where(visible, block_scores(qi, pooled), -mx.inf).reshape(cap)
    per_block = per_block or ratio
    if kernel:
        return kernel_module("top_select").decode_tokens(scores, tail, n_blocks, per_block)
    return op_decode_tokens(scores, tail, n_blocks, per_block)


def op_decode_tokens(scores: mx.array, tail: mx.array, n_blocks: int, ratio: int) -> mx.array:
    """The tokens of the n_blocks best blocks by `scores` [NB] (top_blocks' tie rule) in
    ascending order, then `tail`: decode_tokens' choice in MLX ops."""
    cap = scores.shape[0]
    ids = _arange(cap)
    chosen = top_blocks(scores.reshape(1, cap), n_blocks).reshape(cap)  # not [0]: a Gather
    # distinct keys, the chosen ones lowest: sorted, the first n_blocks are the chosen ids in
    # ascending order on every backend
    blocks = mx.sort(mx.where(chosen, ids, ids + cap))[:n_blocks]
    toks = (blocks[:, None] * ratio + _arange(ratio)[None, :]).reshape(-1).astype(mx.int32)
    return mx.concatenate([toks, tail]) if tail.size else toks


_DECODE_TOKENS: dict[tuple[int, int, bool, int], Callable] = {}


def decode_tokens_step(
    ratio: int, n_blocks: int, kernel: bool = False, per_block: int = 0
) -> Callable:
    """`decode_tokens` compiled: ~30 selection ops replayed as one graph per decode step."""
    key = (ratio, n_blocks, kernel, per_block)
    if key not in _DECODE_TOKENS:
        fn = partial(
            decode_tokens, ratio=ratio, n_blocks=n_blocks, kernel=kernel, per_block=per_block
        )
        _DECODE_TOKENS[key] = mx.compile(fn)
    return _DECODE_TOKENS[key]


def select_kernel(n_blocks: int, ratio: int, n_pooled: int) -> bool:
    """Whether a decode step's choice runs as kernels/top_select.py (where its probe passed)."""
    kernel = kernel_module("top_select")
    return kernel is not None and n_pooled >= n_blocks and kernel.qsa_available(n_blocks, ratio)


def query_bytes(
    kv_heads: int, head_dim: int, width: int, index_heads: int, n_blocks: int, kv_item: int
) -> int:
    """Scratch of one sparse prefill query: its gathered K and V rows, its per-head block
    scores and the selection's [NB]-wide rows (fp32)."""
    return 2 * kv_heads * width * head_dim * kv_item + (index_heads + SELECT_ROWS_LIVE) * (
        n_blocks * 4
    )


def group_queries(T: int, per_query: int) -> int:
    """Queries per gather group: their scratch near GATHER_BYTES (at least one query)."""
    return max(1, min(T, GATHER_BYTES // per_query))


# ----- per-sequence indexer state ----------------------------------------------------------------
class QSAState:
    """A KV store plus raw indexer keys per token and pooled keys per complete block.

    The store is any KV store with `attend`, `store` (append without attending), `gather`
    and `reserve` (kv/contiguous.py, kv/paged.py); on the paged store the indexer selects,
    so the store's own Quest selection and metadata are switched off. Raw keys are kept from
    `raw_base` on (every row of a live sequence, so a rewind can re-pool a block it cuts
    open); a snapshot keeps only the open block's raw rows and the completed pooled blocks,
    so a restored state holds raw rows from its open block on.
    """

    state_kind = "QSAState"
    state_version = 2  # v2: raw rows of the open block only
    step = 256

    def __init__(self, kv, ratio: int):
        if hasattr(kv, "quest"):
            kv.quest = False
        self.kv = kv
        self.ratio = ratio
        self.raw: mx.array | None = None  # [capacity, D]: row i is token raw_base + i
        self.raw_base = 0
        self.length = 0
        self.pooled: mx.array | None = None  # [capacity_blocks, D]
        self.n_blocks = 0

    @property
    def can_truncate(self) -> bool:  # type: ignore[override]
        return getattr(self.kv, "can_truncate", True)

    def _grown(self, buf: mx.array | None, used: int, need: int, like: mx.array) -> mx.array:
        cap = 0 if buf is None else buf.shape[0]
        if need <= cap:
            return buf
        # `need` rounded up to whole steps; the `used` rows are kept (as ContiguousKV)
        total = -(-need // self.step) * self.step
        grow = mx.zeros((total - used, like.shape[1]), like.dtype)
        return grow if buf is None else mx.concatenate([buf[:used], grow])

    def append_raw(self, keys: mx.array) -> None:
        used = self.length - self.raw_base
        end = used + keys.shape[0]
        self.raw = self._grown(self.raw, used, end, keys)
        self.raw[used:end] = keys
        self.length += keys.shape[0]

    def raw_rows(self, start: int, end: int) -> mx.array:
        """Raw keys of tokens [start, end) (start >= raw_base)."""
        return self.raw[start - self.raw_base : end - self.raw_base]

    def append_pooled(self, kb: mx.array) -> None:
        end = self.n_blocks + kb.shape[0]
        self.pooled = self._grown(self.pooled, self.n_blocks, end, kb)
        self.pooled[self.n_blocks : end] = kb
        self.n_blocks = end

    def blocks(self) -> mx.array:
        return self.pooled[: self.n_blocks]

    def reserve(self, n: int) -> None:
        """Room for n more tokens in every buffer, so that appending them (a speculative
        verify's rows) grows nothing and moves no live buffer."""
        self.kv.reserve(n)
        if self.raw is not None:
            used = self.length - self.raw_base
            self.raw = self._grown(self.raw, used, used + n, self.raw)
        if self.pooled is not None:
            need = (self.length + n) // self.ratio
            self.pooled = self._grown(self.pooled, self.n_blocks, need, self.pooled)

    def arrays(self) -> list[mx.array]:
        out = [a for a in (self.raw, self.pooled) if a is not None]
        kv_arrays = getattr(self.kv, "arrays", None)
        if kv_arrays is not None:
            return out + list(kv_arrays())
        return out + [v for v in vars(self.kv).values() if isinstance(v, mx.array)]

    def index_nbytes(self) -> int:
        """Bytes of the live raw rows and pooled blocks."""
        n = 0
        if self.raw is not None:
            n += (self.length - self.raw_base) * self.raw.shape[1] * self.raw.itemsize
        if self.pooled is not None:
            n += self.n_blocks * self.pooled.shape[1] * self.pooled.itemsize
        return n

    def nbytes(self) -> int:
        return self.kv.nbytes() + self.index_nbytes()

    def snapshot(self) -> dict[str, mx.array]:
        snap = {f"kv.{k}": v for k, v in self.kv.snapshot().items()}
        open_from = self.n_blocks * self.ratio  # == length // ratio * ratio
        if self.length > open_from:
            snap["index_raw"] = mx.array(self.raw_rows(open_from, self.length))
        if self.n_blocks:
            snap["index_pooled"] = mx.array(self.pooled[: self.n_blocks])
        return snap

    def restore(self, tensors: dict[str, mx.array]) -> None:
        self.kv.restore({k[3:]: v for k, v in tensors.items() if k.startswith("kv.")})
        self.raw, self.length, self.pooled, self.n_blocks = None, 0, None, 0
        if "index_pooled" in tensors:
            self.append_pooled(tensors["index_pooled"])
        self.raw_base = self.length = self.n_blocks * self.ratio
        if "index_raw" in tensors:
            self.append_raw(tensors["index_raw"])

    def truncate(self, length: int) -> None:
        length = min(self.length, length)
        cut = length // self.ratio * self.ratio
        if length > cut and cut < self.raw_base:
            raise RewindError(
                f"QSA layer restored at token {self.raw_base} holds no raw indexer keys "
                f"before it: cannot truncate to {length} (inside block {cut // self.ratio})"
            )
        self.kv.truncate(length)
        self.length = length
        self.raw_base = min(self.raw_base, cut)
        # a block cut open again is re-pooled when its last token comes back
        self.n_blocks = min(self.n_blocks, length // self.ratio)


# ----- the layer ----------------------------------------------------------------------------------
class Indexer(nn.Module):
    """`index_qk_proj` ([heads + 1] * dim outputs), `q_layernorm`, `k_layernorm`."""

    def __init__(self, hidden: int, n_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, head_dim
        self.index_qk_proj = nn.Linear(hidden, (n_heads + 1) * head_dim, bias=False)
        self.q_layernorm = RMSNorm(head_dim, eps, zero_centered=True)
        self.k_layernorm = RMSNorm(head_dim, eps, zero_centered=True)


class QSAAttention(Attention):
    """Gated GQA attention whose keys per query are the indexer's selection."""

    def __init__(
        self,
        hidden: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rope: RopeSpec,
        eps: float,
        *,
        index_heads: int,
        index_dim: int,
        budget: int,
        ratio: int,
    ):
        super().__init__(
            hidden,
            n_heads,
            n_kv_heads,
            head_dim,
            rope,
            qk_norm_eps=eps,
            zero_centered_norm=True,
            output_gate=True,
        )
        self.indexer = Indexer(hidden, index_heads, index_dim, eps)
        self.ratio, self.n_blocks = ratio, budget // ratio  # blocks a query may select

    @property
    def width(self) -> int:
        """Tokens one sparse query attends at most: its blocks plus the causal tail."""
        return self.n_blocks * self.ratio + self.ratio - 1

    def index_query(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array]:
        """(roped indexer queries [T, Hi, D], raw indexer keys [T, D]) of x at `positions`."""
        qk = per_row(self.indexer.index_qk_proj, x)  # a verify row = a plain step's (rows.py)
        return self.index_from(qk, positions)

    def index_from(self, qk: mx.array, positions: mx.array) -> tuple[mx.array, mx.array]:
        """index_query's outputs from the indexer's product qk [T, Hi * D + D]: the queries'
        norm and RoPE as ops (the selection is promised equal to the reference's)."""
        T, ix = qk.shape[0], self.indexer
        split = ix.n_heads * ix.head_dim
        qi = ix.q_layernorm.for_product(qk[:, :split].reshape(T, ix.n_heads, ix.head_dim))
        qi = rope_at(qi, positions, self.rope.dims, self.rope.theta, qk.dtype)
        return qi, qk[:, split:]

    def cache_keys(self, raw: mx.array, st: QSAState, compile: bool = False) -> None:
        """Cache raw indexer keys and pool every block they complete; `compile`: a single
        block (a decode step's) is pooled by one compiled graph."""
        st.append_raw(raw)
        complete = st.length // self.ratio
        if complete > st.n_blocks:
            first = st.n_blocks
            raw = st.raw_rows(first * self.ratio, complete * self.ratio)
            if compile and complete == first + 1:
                kb = compiled(self, "pool")(raw, mx.array(first, dtype=mx.int32))
            else:
                kb = self.pool(raw, first)
            st.append_pooled(kb)

    def pool(self, raw: mx.array, first: int | mx.array) -> mx.array:
        """Pooled keys of the blocks whose raw keys are `raw` (the first one block `first`)."""
        ix = self.indexer
        return pool_blocks(raw, first, self.ratio, ix.k_layernorm, self.rope.dims, self.rope.theta)

    def index(self, x: mx.array, st: QSAState, offset: int) -> tuple[mx.array, mx.array]:
        """Cache raw keys and new pooled blocks; return (roped queries [T, Hi, D], positions)."""
        positions = mx.arange(offset, offset + x.shape[0])
        qi, raw = self.index_query(x, positions)
        self.cache_keys(raw, st)
        return qi, positions

    def select(self, qi: mx.array, positions: mx.array, st: QSAState) -> mx.array:
        """Chosen blocks [T, NB] of queries qi [T, Hi, D] at `positions` (sparse regime)."""
        return select_blocks(block_scores(qi, st.blocks()), positions, self.ratio, self.n_blocks)

    def __call__(self, x: mx.array, st: QSAState, offset: int) -> mx.array:
        qi, positions = self.index(x, st, offset)
        q, k, v, gate = self.project_qkv(x, offset)
        return self.output(self.attend(q, k, v, qi, positions, st, offset), gate)

    def attend(
        self,
        q: mx.array,
        k: mx.array,
        v: mx.array,
        qi: mx.array,
        positions: mx.array | None,
        st: QSAState,
        offset: int,
    ) -> mx.array:
        """Store k/v and attend q over what the queries see: [1, Hq, T, D]; `positions` None:
        offset .. offset + T - 1, made only where read (a one-row step never reads them: a
        fresh array is host work every step)."""
        T = q.shape[2]
        if (offset + T) // self.ratio <= self.n_blocks:  # every query is dense
            return st.kv.attend(q, k, v, self.scale)
        if positions is None and T > 1:
            positions = mx.arange(offset, offset + T, dtype=mx.int32)
        if 1 < T <= STEP_MAX_ROWS:
            # a step's rows (a speculative verify) one by one, each as its plain step
            # attends: a one-query attention's bits are not those of a query among several
            # on a GPU (benchmarks/probe_rows_flash_gpu.py)
            outs = [
                self.attend(
                    q[:, :, i : i + 1],
                    k[:, :, i : i + 1],
                    v[:, :, i : i + 1],
                    qi[i : i + 1],
                    positions[i : i + 1],
                    st,
                    offset + i,
                )
                for i in range(T)
            ]
            return mx.concatenate(outs, axis=2)
        st.kv.store(k, v)
        return self._attend_selected(q, qi, positions, st, offset)

    def _attend_blocks(
        self, q: mx.array, qi: mx.array, st: QSAState, offset: int, at: mx.array, n_tail: int
    ) -> mx.array | None:
        """A decode step's attention over its chosen blocks and causal tail (n_tail rows)
        read in place: the blocks of `ratio` rows are the split-KV kernel's pages, the tail's
        block last (n_tail of its rows read; with no tail it is the query's own block, not
        read). None where the kernel does not read the store's pages in place (CPU, a
        spilled page, pages not whole blocks): the caller gathers. The same keys and values
        as the gather's, in the kernel's order of sums (its probe: equal to a gathered call)."""
        view = st.kv.block_pool(self.ratio)
        if view is None or not pages_in_place(q, view[0], view[1], self.ratio):
            return None
        keys, values, to_pool = view
        tail = scalars.int32s((offset // self.ratio,))
        kernel = select_kernel(self.n_blocks, 1, st.pooled.shape[0])
        select = decode_tokens_step(self.ratio, self.n_blocks, kernel, per_block=1)
        blocks = to_pool(select(qi, st.pooled, at, tail))
        pages = mx.broadcast_to(blocks[None], (keys.shape[1], blocks.shape[0]))
        length = self.n_blocks * self.ratio + n_tail
        return kernel_module("decode_attention").decode_attention(
            q, keys, values, self.scale, pages=pages, page_tokens=self.ratio, length=length
        )

    def _attend_selected(
        self, q: mx.array, qi: mx.array, positions: mx.array, st: QSAState, offset: int
    ) -> mx.array:
        """Each query over its gathered token set: [1, Hq, T, D]."""
        T = q.shape[2]
        if T == 1:  # decode: exactly n_blocks blocks plus a tail known on the host
            start = (offset + 1) // self.ratio * self.ratio
            at = scalars.int32(offset)  # an input of the compiled selection
            in_place = self._attend_blocks(q, qi, st, offset, at, offset + 1 - start)
            if in_place is not None:
                return in_place
            tail = mx.array(list(range(start, offset + 1)), dtype=mx.int32)
            kernel = select_kernel(self.n_blocks, self.ratio, st.pooled.shape[0])
            select = decode_tokens_step(self.ratio, self.n_blocks, kernel)
            idx = select(qi, st.pooled, at, tail)
            keys, values = st.kv.gather(idx)  # [Hkv, W, D]
            return attend_gathered(q, keys[None], values[None], self.scale)
        per_query = query_bytes(
            self.n_kv_heads,
            self.head_dim,
            self.width,
            self.indexer.n_heads,
            st.n_blocks,
            q.dtype.size,
        )
        G = group_queries(T, per_query)
        limit = getattr(st.kv, "gather_limit", None)
        pages = limit() if limit is not None else None
        if pages is not None:  # a bounded pool pins one group's pages at once
            G = max(1, min(G, pages // (self.n_blocks + 1)))
        hkv = self.n_kv_heads
        rep = self.n_heads // hkv
        outs = []
        for a in range(0, T, G):
            b = min(a + G, T)
            pos = positions[a:b]
            ids, valid = token_ids(self.select(qi[a:b], pos, st), pos, self.ratio, self.n_blocks)
            keys, values = st.kv.gather(ids)  # [Hkv, g, W, D]
            g = b - a
            # One batch row per query, its KV group's query heads as rows: [g, Hkv, rep, D]
            # (no GQA broadcast of the gathered keys to every query head).
            qg = q[0, :, a:b].swapaxes(0, 1).reshape(g, hkv, rep, -1)
            out = mx.fast.scaled_dot_product_attention(
                qg,
                keys.swapaxes(0, 1),
                values.swapaxes(0, 1),
                scale=self.scale,
                mask=valid[:, None, None, :],
            )
            outs.append(out.reshape(g, hkv * rep, -1).swapaxes(0, 1)[None])  # [1, Hq, g, D]
            if b < T:
                mx.eval(outs[-1])  # one group's scratch alive at a time (admission plans it)
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
