"""SequenceState: everything one sequence has, acted on together.

Each layer contributes one `LayerState` (a KV store, a Gated DeltaNet state, ...). Snapshot,
restore and rewind act on every layer plus the token ids, so callers never see a sequence
whose layers disagree about how many tokens they hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

from .errors import Qwen38Error


@runtime_checkable
class LayerState(Protocol):
    """Per-layer, per-sequence state."""

    can_truncate: bool

    def nbytes(self) -> int: ...

    def snapshot(self) -> dict[str, mx.array]: ...

    def restore(self, tensors: dict[str, mx.array]) -> None: ...

    def truncate(self, length: int) -> None: ...


class NoState:
    """A layer that keeps nothing between calls (e.g. a pure MLP block)."""

    can_truncate = True

    def nbytes(self) -> int:
        return 0

    def snapshot(self) -> dict[str, mx.array]:
        return {}

    def restore(self, tensors: dict[str, mx.array]) -> None:
        pass

    def truncate(self, length: int) -> None:
        pass


@dataclass
class StateSnapshot:
    """A consistent copy of a SequenceState at one position."""

    tokens: list[int]
    layers: list[dict[str, mx.array]]
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def offset(self) -> int:
        return len(self.tokens)


class RewindError(Qwen38Error):
    """A rewind that the state cannot perform (recurrent layers without a snapshot there)."""


class SequenceState:
    """Token ids, position and every layer's state for one sequence."""

    def __init__(self, layers: list[LayerState]):
        self.layers = layers
        self._tokens: list[int] = []
        self._pending: list[mx.array] = []  # fed but not yet read back (async decode)
        self.extras: dict[str, Any] = {}  # e.g. sampler RNG key

    @property
    def offset(self) -> int:
        """Number of tokens the layers have consumed."""
        return len(self._tokens) + sum(int(p.size) for p in self._pending)

    @property
    def tokens(self) -> list[int]:
        self._resolve()
        return list(self._tokens)

    def advance(self, ids: mx.array | list[int]) -> None:
        """Record tokens the model has just consumed (ids may still be lazy)."""
        if isinstance(ids, mx.array):
            self._pending.append(ids.reshape(-1))
        else:
            self._tokens.extend(int(i) for i in ids)

    def _resolve(self) -> None:
        for p in self._pending:
            self._tokens.extend(p.tolist())
        self._pending.clear()

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def snapshot(self) -> StateSnapshot:
        self._resolve()
        return StateSnapshot(
            tokens=list(self._tokens),
            layers=[layer.snapshot() for layer in self.layers],
            extras=dict(self.extras),
        )

    def restore(self, snap: StateSnapshot) -> None:
        if len(snap.layers) != len(self.layers):
            raise RewindError(
                f"snapshot has {len(snap.layers)} layers, this sequence has {len(self.layers)}"
            )
        for layer, tensors in zip(self.layers, snap.layers):
            layer.restore(tensors)
        self._tokens = list(snap.tokens)
        self._pending.clear()
        self.extras = dict(snap.extras)

    @property
    def can_truncate(self) -> bool:
        return all(layer.can_truncate for layer in self.layers)

    def rewind(self, n: int) -> None:
        """Drop the last n tokens. Needs every layer to be truncatable."""
        self.truncate(self.offset - n)

    def truncate(self, length: int) -> None:
        self._resolve()
        if not 0 <= length <= len(self._tokens):
            raise RewindError(f"cannot truncate a {len(self._tokens)}-token sequence to {length}")
        if length == len(self._tokens):
            return
        if not self.can_truncate:
            raise RewindError(
                "this model has recurrent layers: rewinding needs a snapshot at the target position"
            )
        for layer in self.layers:
            layer.truncate(length)
        del self._tokens[length:]
