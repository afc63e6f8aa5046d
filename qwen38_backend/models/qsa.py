"""QSA: the Flash-Next trained block selector and the gated attention that uses it.

Selection (QWEN38.md, "QSA"): raw indexer keys are cached per token; every complete block of
`ratio` tokens gets a pooled key (fp32 mean of its raw keys, cast, zero-centred norm, RoPE at
the block's first position). Query p sees nvis = (p + 1) // ratio complete blocks: all of them
while nvis <= n_blocks (budget // ratio: dense), else the n_blocks best by
sum_h relu(q_h . k_b) / sqrt(d) in fp32, ties to the LOWER block id;
plus the causal tail 4 * nvis .. p. The functions here are pure so a
paged store can call them; `QSAState` keeps the indexer tensors beside a KV store.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from .layers import Attention, RMSNorm, RopeSpec


# ----- rope at arbitrary positions -------------------------------------------------------------
def rope_at(x: mx.array, positions: mx.array, dims: int, theta: float) -> mx.array:
    """NeoX rotate-half RoPE on the first `dims` features; x [N, ..., D], positions [N]."""
    inv = 1.0 / (theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims))
    ang = positions.astype(mx.float32)[:, None] * inv[None, :]  # [N, dims/2]
    shape = (ang.shape[0],) + (1,) * (x.ndim - 2) + (dims // 2,)
    cos, sin = mx.cos(ang).reshape(shape), mx.sin(ang).reshape(shape)
    xf = x.astype(mx.float32)
    x1, x2 = xf[..., : dims // 2], xf[..., dims // 2 : dims]
    out = mx.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., dims:]], axis=-1)
    return out.astype(x.dtype)


# ----- selection ------------------------------------------------------------------------------
def pool_blocks(raw: mx.array, first_block: int, ratio: int, norm, dims: int, theta: float):
    """Pooled keys [n, D] for raw keys [n * ratio, D] of blocks first_block..first_block+n-1."""
    n = raw.shape[0] // ratio
    mean = raw[: n * ratio].astype(mx.float32).reshape(n, ratio, -1).mean(axis=1)
    kb = norm(mean.astype(raw.dtype))
    pos = (mx.arange(n) + first_block) * ratio
    return rope_at(kb, pos, dims, theta)


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


def token_indices(chosen: mx.array, position: int, ratio: int, n_blocks: int) -> mx.array:
    """One query's token ids (decode): chosen [NB] boolean with n_blocks True, then the tail."""
    nvis = (position + 1) // ratio
    if nvis <= n_blocks:
        return mx.arange(position + 1)
    blocks = mx.argpartition(1 - chosen.astype(mx.int32), kth=n_blocks - 1)[:n_blocks]
    toks = (blocks[:, None].astype(mx.int32) * ratio + mx.arange(ratio)[None, :]).reshape(-1)
    tail = mx.arange(nvis * ratio, position + 1)
    return mx.concatenate([toks, tail]) if tail.size else toks


# ----- per-sequence indexer state ----------------------------------------------------------------
class QSAState:
    """A KV store plus raw indexer keys per token and pooled keys per complete block."""

    step = 256

    def __init__(self, kv, ratio: int):
        self.kv = kv
        self.ratio = ratio
        self.raw: mx.array | None = None  # [capacity, D]
        self.length = 0
        self.pooled: mx.array | None = None  # [capacity_blocks, D]
        self.n_blocks = 0

    @property
    def can_truncate(self) -> bool:  # type: ignore[override]
        return getattr(self.kv, "can_truncate", True)

    def append_raw(self, keys: mx.array) -> None:
        end = self.length + keys.shape[0]
        cap = 0 if self.raw is None else self.raw.shape[0]
        if end > cap:
            grow = mx.zeros((-(-(end - cap) // self.step) * self.step, keys.shape[1]), keys.dtype)
            self.raw = grow if self.raw is None else mx.concatenate([self.raw[: self.length], grow])
        self.raw[self.length : end] = keys
        self.length = end

    def append_pooled(self, kb: mx.array) -> None:
        end = self.n_blocks + kb.shape[0]
        cap = 0 if self.pooled is None else self.pooled.shape[0]
        if end > cap:
            n = -(-(end - cap) // self.step) * self.step
            grow = mx.zeros((n, kb.shape[1]), kb.dtype)
            self.pooled = (
                grow
                if self.pooled is None
                else mx.concatenate([self.pooled[: self.n_blocks], grow])
            )
        self.pooled[self.n_blocks : end] = kb
        self.n_blocks = end

    def blocks(self) -> mx.array:
        return self.pooled[: self.n_blocks]

    def arrays(self) -> list[mx.array]:
        out = [a for a in (self.raw, self.pooled) if a is not None]
        kv_arrays = getattr(self.kv, "arrays", None)
        if kv_arrays is not None:
            return out + list(kv_arrays())
        return out + [v for v in vars(self.kv).values() if isinstance(v, mx.array)]

    def nbytes(self) -> int:
        n = self.kv.nbytes()
        if self.raw is not None:
            n += self.length * self.raw.shape[1] * self.raw.itemsize
        if self.pooled is not None:
            n += self.n_blocks * self.pooled.shape[1] * self.pooled.itemsize
        return n

    def snapshot(self) -> dict[str, mx.array]:
        snap = {f"kv.{k}": v for k, v in self.kv.snapshot().items()}
        if self.length:
            snap["index_raw"] = mx.array(self.raw[: self.length])
        if self.n_blocks:
            snap["index_pooled"] = mx.array(self.pooled[: self.n_blocks])
        return snap

    def restore(self, tensors: dict[str, mx.array]) -> None:
        self.kv.restore({k[3:]: v for k, v in tensors.items() if k.startswith("kv.")})
        self.raw, self.length, self.pooled, self.n_blocks = None, 0, None, 0
        if "index_raw" in tensors:
            self.append_raw(tensors["index_raw"])
        if "index_pooled" in tensors:
            self.append_pooled(tensors["index_pooled"])

    def truncate(self, length: int) -> None:
        self.kv.truncate(length)
        self.length = min(self.length, length)
        # a block cut open again is re-pooled when its last token comes back
        self.n_blocks = min(self.n_blocks, self.length // self.ratio)


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

    def index(self, x: mx.array, st: QSAState, offset: int) -> tuple[mx.array, mx.array]:
        """Cache raw keys and new pooled blocks; return (roped queries [T, Hi, D], positions)."""
        T = x.shape[0]
        ix = self.indexer
        qk = ix.index_qk_proj(x)
        split = ix.n_heads * ix.head_dim
        positions = mx.arange(offset, offset + T)
        qi = ix.q_layernorm(qk[:, :split].reshape(T, ix.n_heads, ix.head_dim))
        qi = rope_at(qi, positions, self.rope.dims, self.rope.theta)
        st.append_raw(qk[:, split:])
        complete = st.length // self.ratio
        if complete > st.n_blocks:
            first = st.n_blocks
            raw = st.raw[first * self.ratio : complete * self.ratio]
            st.append_pooled(
                pool_blocks(raw, first, self.ratio, ix.k_layernorm, self.rope.dims, self.rope.theta)
            )
        return qi, positions

    def selection(self, x: mx.array, st: QSAState, offset: int) -> tuple[mx.array, mx.array] | None:
        """(chosen blocks [T, NB], positions [T]), or None when every query is dense."""
        qi, positions = self.index(x, st, offset)
        T = x.shape[0]
        if (offset + T) // self.ratio <= self.n_blocks:
            return None
        scores = block_scores(qi, st.blocks())
        return select_blocks(scores, positions, self.ratio, self.n_blocks), positions

    def __call__(self, x: mx.array, st: QSAState, offset: int) -> mx.array:
        T = x.shape[0]
        sel = self.selection(x, st, offset)
        q, k, v, gate = self.project_qkv(x, offset)
        if sel is None:
            out = st.kv.attend(q, k, v, self.scale)
        else:
            blocks, positions = sel
            out = _attend_selected(st.kv, q, k, v, self.scale, blocks, positions, self)
        out = out.transpose(0, 2, 1, 3).reshape(T, -1)
        return self.o_proj(out * mx.sigmoid(gate))


def _attend_selected(kv, q, k, v, scale, blocks, positions, layer: QSAAttention) -> mx.array:
    """Append k/v to the contiguous store, attend each query over its selected tokens only."""
    T = q.shape[2]
    kv.append(k, v)
    keys, values = kv.keys[..., : kv.length, :], kv.values[..., : kv.length, :]
    if T == 1:
        idx = token_indices(blocks[0], kv.length - 1, layer.ratio, layer.n_blocks)
        return mx.fast.scaled_dot_product_attention(
            q, keys[..., idx, :], values[..., idx, :], scale=scale
        )
    mask = token_mask(blocks, positions, layer.ratio, kv.length)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
