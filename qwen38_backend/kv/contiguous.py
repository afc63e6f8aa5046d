"""Contiguous per-sequence KV store: one growing buffer per layer (replaced by pages later)."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from ..rows import STEP_MAX_ROWS
from .blocked import BLOCK_TOKENS, attend_past, spans
from .one_token import attend_rows


class ContiguousKV:
    """K/V for one attention layer of one sequence, grown in steps to avoid per-token copies."""

    can_truncate = True
    step = 256
    block_tokens = BLOCK_TOKENS  # prefill walks a longer past in blocks (kv/blocked.py)

    def __init__(self) -> None:
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.length = 0

    def _reserve(self, k: mx.array, v: mx.array, need: int) -> None:
        cap = 0 if self.keys is None else self.keys.shape[2]
        if need <= cap:
            return
        # Only the first `length` rows are kept (after a truncate, length < cap), so the
        # new buffer is sized from them: `need` rounded up to whole steps.
        total = -(-need // self.step) * self.step
        B, H, _, Dk = k.shape
        new_k = mx.zeros((B, H, total - self.length, Dk), k.dtype)
        new_v = mx.zeros((B, H, total - self.length, v.shape[3]), v.dtype)
        if self.keys is None:
            self.keys, self.values = new_k, new_v
        else:
            self.keys = mx.concatenate([self.keys[..., : self.length, :], new_k], axis=2)
            self.values = mx.concatenate([self.values[..., : self.length, :], new_v], axis=2)

    def append(self, k: mx.array, v: mx.array) -> None:
        """k, v: [1, kv_heads, T, head_dim]."""
        start, end = self.length, self.length + k.shape[2]
        self._reserve(k, v, end)
        self.keys[..., start:end, :] = k
        self.values[..., start:end, :] = v
        self.length = end

    def store(self, k: mx.array, v: mx.array) -> None:
        """Append k/v [1, kv_heads, T, head_dim] without attending (QSA gathers after)."""
        self.append(k, v)

    def gather(self, positions: mx.array) -> tuple[mx.array, mx.array]:
        """K and V rows at `positions` (int array of any shape S, each < length) as
        [kv_heads, *S, head_dim]."""
        # squeeze, not [0]: indexing the first axis is a Gather that copies the whole buffer
        keys, values = self.keys.squeeze(0), self.values.squeeze(0)
        return mx.take(keys, positions, axis=1), mx.take(values, positions, axis=1)

    def block_pool(
        self, block_tokens: int
    ) -> tuple[mx.array, mx.array, Callable[[mx.array], mx.array]] | None:
        """The buffers [1, Hkv, capacity, D] whose rows, in blocks of block_tokens, the
        split-KV kernel reads as pages, and the map from the sequence's block ids to theirs
        (here the same ids); None before the first write."""
        if self.keys is None:
            return None
        return self.keys, self.values, lambda blocks: blocks

    def reserve(self, n: int) -> None:
        """Capacity for n more rows now, so appending them later moves no buffer."""
        if self.keys is not None:
            self._reserve(self.keys, self.values, self.length + n)

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """Append k/v, then causal attention of q (the newest T positions) over everything."""
        past = self.length
        self.append(k, v)

        def dense() -> tuple[mx.array, mx.array]:
            return self.keys[..., : self.length, :], self.values[..., : self.length, :]

        def blocks(block: int):
            for a, b in spans(past, block):
                yield self.keys[..., a:b, :], self.values[..., a:b, :]

        if q.shape[2] <= STEP_MAX_ROWS:  # a step: each row as a one-token step (rows.py)
            return attend_rows(q, *dense(), scale)
        return attend_past(q, past, blocks, k, v, scale, dense, self.block_tokens)

    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.length * (self.keys.nbytes + self.values.nbytes) // self.keys.shape[2]

    def snapshot(self) -> dict[str, mx.array]:
        if self.keys is None:
            return {}
        # Slices are copies in MLX semantics: later in-place writes do not reach them.
        return {
            "keys": mx.array(self.keys[..., : self.length, :]),
            "values": mx.array(self.values[..., : self.length, :]),
        }

    def restore(self, tensors: dict[str, mx.array]) -> None:
        self.keys = self.values = None
        self.length = 0
        if tensors:
            self.append(tensors["keys"], tensors["values"])

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)
