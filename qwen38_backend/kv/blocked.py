"""Blocked attention over a long stored past: an fp32 online-softmax carry (flash style).

A prefill chunk's T queries attend over everything stored before the chunk plus the chunk
itself (causally). Materialising the scores of the chunk against the whole past takes
O(T x context) memory (measured: 121 GB peak at 131K tokens on the H200 for a 54 GB model),
so the past is walked block by block instead, keeping per query row a running max `m`, a
running sum `l` (`total`) of exp(s - m) and an fp32 accumulator of exp(s - m) @ V:

    m' = max(m, rowmax(s));  l' = l * exp(m - m') + rowsum(exp(s - m'))
    acc' = acc * exp(m - m') + exp(s - m') @ V

Peak memory is then O(T x block). The chunk's own keys come last, under the causal mask.
The result equals one-shot softmax attention up to fp32 rounding, in any block order (the
two matmuls run in the store's dtype: for a bf16 store, bf16 rounding of scores, as in the
fused SDPA).

Stores call `attend_past(q, past_len, blocks, k, v, scale, ...)`: when the past fits one
block (or the scores are small: ONE_SHOT_BYTES) it runs one `scaled_dot_product_attention`
over [past + chunk] (short prompts keep the fused path); otherwise it runs the carry over
`blocks(keys per block)`, an iterable of K/V blocks [1, Hkv, B, D]. Every block is handed to
the device as soon as it comes and the walk waits for the one before it, so at most two
blocks are alive whether they are views of the pool or read back from the spill file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import mlx.core as mx

from ..settle import settle, settling

# Keys per block of the walk, at most. Scores of one block are [Hq, T, block] fp32: 2048 keys
# with a 512-token chunk and 24 query heads are 96 MiB, small next to a long context's KV.
BLOCK_TOKENS = 2048
# A longer chunk walks shorter blocks so one block's scores stay within this, but never below
# MIN_BLOCK_TOKENS. 384 MiB: a 2048-token chunk of 24 heads walks 2048-key blocks. 128 MiB
# (672-key blocks) held the H200's unsettled peak lower at 131K but not at 262K (1.101x weights
# + KV) and cost 9-27% of prefill speed; with the prefill settled every 8 layers
# (state.PREFILL_SETTLE_EVERY) 384 MiB blocks peak at 1.061x / 1.067x at 131K / 262K
# (results/h200/depth_settle8_score384*.json, depth262k_score128.json).
BLOCK_SCORE_BYTES = 384 << 20
MIN_BLOCK_TOKENS = 256
# One-shot attention also runs when its scores [Hq, T, past + T] fp32 stay this small: the
# fused kernel is faster than the walk at short contexts, and the bound is still a constant.
ONE_SHOT_BYTES = 128 << 20
# The walk hands each block's carry to the device (mx.async_eval) and waits for the block
# before it: the device always has the next block queued, and the host never queues more
# (a queued block's scores are allocated when it is queued). Peak of a walk in units of one
# block's scores [Hq, T, block] fp32 (measured on the CPU, 4.5 in fp32 and 4.6 in bf16:
# scores, their exp, the block in flight); admission plans with it.
SCORE_BLOCKS_LIVE = 5
Block = tuple[mx.array, mx.array]


def walk_block(heads: int, rows: int, most: int = BLOCK_TOKENS, unit: int = 1) -> int:
    """Keys per walk block for `rows` query rows of `heads` heads: at most `most`, one block's
    fp32 scores within BLOCK_SCORE_BYTES when that leaves MIN_BLOCK_TOKENS, a multiple of
    `unit` (a store's page)."""
    fit = BLOCK_SCORE_BYTES // max(heads * rows * 4, 1)
    keys = min(most, max(fit, MIN_BLOCK_TOKENS))
    return max(keys // unit, 1) * unit


# The scores s stay in the store's dtype: the row max is taken on them (exact: the max of
# the fp32 casts is the cast of the max) and the cast to fp32 fuses into exp's kernel, so no
# fp32 copy of s is ever allocated (a block's walk held 6.6 blocks of fp32 scores with it, 4.6
# without; bf16, measured on the CPU, the same results bit for bit).
def _first(s: mx.array, vb: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The carry of a first block from its scores s [Hkv, G*T, B]."""
    m = s.max(axis=-1, keepdims=True).astype(mx.float32)
    p = mx.exp(s.astype(mx.float32) - m)
    return m, p.sum(axis=-1, keepdims=True), (p.astype(vb.dtype) @ vb).astype(mx.float32)


def _merge(
    s: mx.array, vb: mx.array, m: mx.array, total: mx.array, acc: mx.array
) -> tuple[mx.array, mx.array, mx.array]:
    """The carry (m, total, acc) after one more block of scores s."""
    m_new = mx.maximum(m, s.max(axis=-1, keepdims=True).astype(mx.float32))
    alpha = mx.exp(m - m_new)
    p = mx.exp(s.astype(mx.float32) - m_new)
    total = total * alpha + p.sum(axis=-1, keepdims=True)
    acc = acc * alpha + (p.astype(vb.dtype) @ vb).astype(mx.float32)
    return m_new, total, acc


# One fused graph per block shape: the elementwise chain is a few kernels, not a dozen (a
# GPU walk over a long past is otherwise bound by launches). On CUDA the fused kernels are
# compiled once per machine (MLX keeps them in its PTX cache, see loading/paths.py).
_first_compiled, _merge_compiled = mx.compile(_first), mx.compile(_merge)


def _carry_step(
    qs: mx.array,
    kb: mx.array,
    vb: mx.array,
    carry: tuple[mx.array, mx.array, mx.array] | None,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """One block into the carry. qs [Hkv, G*T, D] pre-scaled; kb, vb [Hkv, B, D].

    The two matmuls run in the store's dtype (tensor cores for bf16, as the fused SDPA of
    this backend does), the softmax carry in fp32; an fp32 store is fp32 throughout."""
    s = qs @ kb.swapaxes(1, 2)  # [Hkv, G*T, B]
    if mask is not None:
        s = mx.where(mask, s, mx.array(-mx.inf, s.dtype))
    if carry is None:
        return _first_compiled(s, vb)
    return _merge_compiled(s, vb, *carry)


def blocked_attention(
    q: mx.array, blocks: Iterable[Block], k: mx.array, v: mx.array, scale: float
) -> mx.array:
    """Causal attention of q [1, Hq, T, D] over the past `blocks` then the chunk k/v.

    k, v: [1, Hkv, T, D] (the chunk's own keys, attended causally: query i sees keys <= i).
    Blocks: K/V [1, Hkv, B, D] of the stored past in order (order does not change the
    result beyond rounding). Returns [1, Hq, T, Dv] in q's dtype; all math in fp32.
    """
    # squeeze, not [0]: integer indexing is a gather in MLX (a copy of the whole block)
    _, hq, T, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    # Queries of one KV group side by side: [Hkv, G*T, D], scaled once (in fp32, then
    # rounded to the keys' dtype for the matmuls).
    qs = (q.squeeze(0).astype(mx.float32) * scale).astype(k.dtype).reshape(hkv, group * T, d)
    # Everything queued before the walk (the layer before, on the device still) finishes and
    # frees its buffers before the first block's scores are allocated: otherwise they add up
    # (the H200: a Gated DeltaNet block's ~1.4 GiB on top of the walk's ~2.5 GiB at a
    # 2048-token chunk). The walk waits for every block anyway, so this costs one wait.
    mx.eval(qs)
    carry = queued = None
    for kb, vb in blocks:
        if kb.shape[2] == 0:
            continue
        carry = _carry_step(qs, kb.squeeze(0), vb.squeeze(0), carry)
        # A block read from the spill file is queued like any other (no sync per block: the
        # device keeps computing while the host reads and uploads the next one); waiting for
        # the block before bounds what is alive to two blocks.
        if settling():  # a settled prefill (settle.py): no two blocks alive, ever
            if queued is not None:
                settle(queued)  # the block before, released, before this one is allocated
            mx.async_eval(carry)
        else:
            mx.async_eval(carry)
            if queued is not None:
                mx.eval(queued)  # the block before: one block queued behind this one
        queued = carry
    # The chunk itself: query row r (position r % T within the chunk) sees keys <= r % T.
    rows = mx.arange(T)[:, None] >= mx.arange(T)[None, :]  # [T, T]
    mask = mx.broadcast_to(rows[None], (group, T, T)).reshape(1, group * T, T)
    _, total, acc = _carry_step(qs, k.squeeze(0), v.squeeze(0), carry, mask)
    out = (acc / total).reshape(1, hq, T, v.shape[3])
    return out.astype(q.dtype)


def attend_past(
    q: mx.array,
    past_len: int,
    blocks: Callable[[int], Iterator[Block]],
    k: mx.array,
    v: mx.array,
    scale: float,
    dense: Callable[[], tuple[mx.array, mx.array]],
    block_tokens: int = BLOCK_TOKENS,
    unit: int = 1,
) -> mx.array:
    """A chunk's causal attention over past + chunk: fused one-shot when the past fits one
    block or its scores fit ONE_SHOT_BYTES (`dense()` gives K/V of past + chunk
    [1, Hkv, past_len + T, D]), else blocked over `blocks(keys per block)` (walk_block: at
    most `block_tokens`, a multiple of `unit`)."""
    _, hq, T, _ = q.shape
    if past_len <= block_tokens or hq * T * (past_len + T) * 4 <= ONE_SHOT_BYTES:
        keys, values = dense()
        mask = "causal" if q.shape[2] > 1 else None
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    return blocked_attention(q, blocks(walk_block(hq, T, block_tokens, unit)), k, v, scale)


def spans(length: int, block_tokens: int) -> Iterator[tuple[int, int]]:
    """[start, end) row ranges of consecutive blocks covering [0, length)."""
    for start in range(0, length, block_tokens):
        yield start, min(start + block_tokens, length)
