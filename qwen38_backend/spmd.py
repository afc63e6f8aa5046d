"""Keeping the ranks of one `mlx.launch` job in step while they serve (SPMD).

Every rank runs the same engine calls; only rank 0 talks to clients. What rank 0 decides
(the next request) reaches the others through `mx.distributed` itself: a length, then the
bytes, each an `all_sum` where only the sending rank contributes (no home-made transport).
What a rank decides on its own (admission against its own memory, a state file it found,
a cancel) is agreed on before it changes the work, so no rank runs a forward pass (and, on a
sharded model, waits in its all-reduce) that the others skip.

A group of one rank makes every method local: no collective runs.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import mlx.core as mx
import numpy as np

from . import errors


class Ranks:
    """The ranks of one job (`mx.distributed.init()`), or one process when size() is 1."""

    def __init__(self, group: Any | None = None):
        self.group = group
        self.rank = group.rank() if group is not None else 0
        self.size = group.size() if group is not None else 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _sum(self, values: np.ndarray) -> np.ndarray:
        out = mx.distributed.all_sum(mx.array(values), group=self.group)
        mx.eval(out)
        return np.array(out)

    def broadcast_bytes(self, data: bytes | None, root: int = 0) -> bytes:
        """`data` from rank `root` on every rank (the others pass None)."""
        if self.size == 1:
            return data or b""
        mine = self.rank == root
        if mine and data is None:
            raise ValueError("the sending rank must pass its bytes")
        n = int(self._sum(np.array([len(data) if mine else 0], dtype=np.int64))[0])
        if n == 0:
            return b""
        payload = np.frombuffer(data, dtype=np.uint8) if mine else np.zeros(n, np.uint8)
        return self._sum(payload).tobytes()

    def broadcast_json(self, obj: Any = None, root: int = 0) -> Any:
        """A JSON value from rank `root` on every rank."""
        data = json.dumps(obj).encode() if self.rank == root else None
        return json.loads(self.broadcast_bytes(data, root))

    def gather_int(self, value: int) -> list[int]:
        """Every rank's `value`, in rank order."""
        if self.size == 1:
            return [int(value)]
        slots = np.zeros(self.size, dtype=np.int64)
        slots[self.rank] = int(value)
        return [int(v) for v in self._sum(slots)]

    def agree(self, error: BaseException | None) -> None:
        """Raise on every rank if any rank failed (its `error`), else return on all.

        The first failing rank's error is rebuilt everywhere with its class (a qwen38 error
        keeps its type, so rank 0 answers an admission refusal as one) and its message,
        prefixed with the rank that refused."""
        if self.size == 1:
            if error is not None:
                raise error
            return
        failed = self.gather_int(0 if error is None else 1)
        if not any(failed):
            return
        root = failed.index(1)
        mine = None
        if self.rank == root:
            assert error is not None
            mine = {"type": type(error).__name__, "message": str(error)}
        sent = self.broadcast_json(mine, root=root)
        if self.rank == root:
            raise error  # type: ignore[misc]
        cls = getattr(errors, sent["type"], None)
        if not (isinstance(cls, type) and issubclass(cls, errors.Qwen38Error)):
            cls = errors.Qwen38Error
        raise cls(f"rank {root} of {self.size}: {sent['message']}")


class RankCancel:
    """A cancel flag all ranks read alike: rank 0's event, agreed on every `every`-th check.

    The engine checks `is_set()` between prefill chunks and after each token, at the same
    points on every rank (same calls, same tokens), so a check can be one small all_sum of
    rank 0's flag and every rank stops at the same token. Each collective also waits for the
    step in flight (it ends the host/device overlap of that step), so only every `every`-th
    check meets the other ranks: a cancel lands within that many tokens.
    """

    def __init__(self, ranks: Ranks, event: threading.Event | None = None, every: int = 8):
        self.ranks = ranks
        self.event = event if event is not None else threading.Event()
        self.every = max(int(every), 1)
        self._checks = 0
        self._agreed = False

    def set(self) -> None:
        self.event.set()

    def is_set(self) -> bool:
        mine = self.ranks.leader and self.event.is_set()
        if self.ranks.size == 1:
            return mine
        if not self._agreed and self._checks % self.every == 0:
            self._agreed = sum(self.ranks.gather_int(1 if mine else 0)) > 0
        self._checks += 1
        return self._agreed
