"""SequenceState: everything one sequence has, acted on together.

Each layer contributes one `LayerState` (a KV store, a Gated DeltaNet state, ...); a model with
an MTP head adds the head's history (`HeadHistory`: drafts.MTPTrack). Snapshot, restore and
rewind act on every layer, that history and the token ids, so callers never see a sequence
whose parts disagree about how many tokens they hold.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx

from .errors import Qwen38Error
from .rows import STEP_MAX_ROWS
from .settle import settle, settling

# Prefill layers queued on the device ahead of the one the host waits for (layer_built).
# 1, measured on the H200 (64 layers, 27B dims, 32K, same run): peak over weights + KV
# 1.083x vs 1.113x with 2, prefill 4,436 vs 4,561 tok/s
# (benchmarks/results/h200/depth32k_ahead1.json, depth32k_ahead2.json).
PREFILL_LAYERS_AHEAD = 1
# Every this many prefill layers the host settles the layer it waits for (settle.py: the device
# also releases what finished work held) instead of only waiting for it; 0: never. On CUDA the
# late releases otherwise pile up within a chunk: H200, 27B dims, 64 layers, 262K, 2048 chunk,
# 128 MiB walk blocks, unsettled: 7.2 GB above weights + KV (1.101x), 1,131 tok/s; settling
# every 8th layer with 2048-key (384 MiB) blocks: 1.061x / 1.067x at 131K / 262K, the same
# within 0.2% in two runs, at 2,594-2,612 / 1,601 tok/s (results/h200/depth_settle8_*.json).
PREFILL_SETTLE_EVERY = 8

# Set while SequenceState.run_layers runs a step: a layer that attended on a guess may leave
# its check to the loop (PagedKV._attend_checked); elsewhere it checks at once.
_CHECKS_LATER: ContextVar[bool] = ContextVar("qwen38_checks_later", default=False)


def checks_later() -> bool:
    """Whether the running forward checks a layer's guess itself (run_layers)."""
    return _CHECKS_LATER.get()


@runtime_checkable
class LayerState(Protocol):
    """Per-layer, per-sequence state."""

    can_truncate: bool

    def nbytes(self) -> int: ...

    def snapshot(self) -> dict[str, mx.array]: ...

    def restore(self, tensors: dict[str, mx.array]) -> None: ...

    def truncate(self, length: int) -> None: ...


def state_kind(layer: object) -> str:
    """`name/vN` identifying a layer state's snapshot format, nested stores included.

    A class declares `state_kind: str` and `state_version: int` (defaults: the class name and
    1); bump the version whenever `snapshot()`'s keys, shapes or meaning change, so state files
    written by the old format are refused instead of restored wrongly. Wrapped stores (a QSA
    state's `kv`, a mixer's `ple`) are part of the kind, so contiguous and paged layouts differ.
    """
    cls = type(layer)
    kind = f"{getattr(cls, 'state_kind', cls.__name__)}/v{getattr(cls, 'state_version', 1)}"
    inner = [
        f"{name}={state_kind(value)}"
        for name, value in sorted(vars(layer).items())
        if hasattr(value, "snapshot") and hasattr(value, "restore") and not isinstance(value, type)
    ]
    return f"{kind}({','.join(inner)})" if inner else kind


class HeadHistory(Protocol):
    """A draft head's history of one sequence (drafts.MTPTrack): its own KV and which
    positions it has seen. It may lag the sequence (drafting off) but never leads it."""

    @property
    def kind(self) -> str: ...  # state_kind(): what a snapshot of it can be restored into

    def nbytes(self) -> int: ...

    def snapshot(self) -> dict[str, mx.array] | None: ...  # None: no history to keep

    def check(self, tensors: dict[str, mx.array], offset: int) -> None: ...  # RewindError

    def restore(self, tensors: dict[str, mx.array] | None) -> None: ...  # None: empty

    def mark(self, offset: int) -> Any: ...  # what a save point at `offset` keeps

    def cut(self, length: int, mark: Any = None) -> None: ...  # follow a rewind


class Replayable:
    """A recurrent layer state that keeps the input rows of its layer's last call while
    recording (a speculative verify), so that after a restore `replay(n)` runs the layer's
    own update over the first n of them (SequenceState.rollback) instead of the whole model.
    The layer calls `state.keep(layer, *rows)` first thing in its call."""

    recording = False
    _kept: tuple | None = None

    def set_record(self, on: bool) -> None:
        self.recording = on
        if not on:
            self._kept = None

    def keep(self, call: Callable[..., Any], *rows: Any) -> None:
        if self.recording:
            self._kept = (call, rows)

    def replay(self, n: int) -> None:
        assert self._kept is not None, "nothing recorded to replay"
        call, rows = self._kept
        call(*(r[:n] for r in rows), self)


def collect_arrays(value: Any, out: list[mx.array], seen: set[int]) -> None:
    """Append to `out` every array in `value` (a layer state: its attributes, lists, dicts
    and nested stores); `seen` holds the ids of the objects already walked."""
    # a module-level function, not a closure that calls itself: such a closure is a reference
    # cycle, which kept every collected array (old KV buffers too) alive until the next
    # garbage collection
    if isinstance(value, mx.array):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            collect_arrays(v, out, seen)
    elif isinstance(value, dict):
        for v in value.values():
            collect_arrays(v, out, seen)
    elif hasattr(value, "__dict__") and id(value) not in seen:
        seen.add(id(value))
        collect_arrays(vars(value), out, seen)


@dataclass
class StateSnapshot:
    """A consistent copy of a SequenceState at one position."""

    tokens: list[int]
    layers: Sequence[dict[str, mx.array]]  # a large state file's: read as restore() goes
    extras: dict[str, Any] = field(default_factory=dict)
    kinds: list[str] | None = None  # state_kind() per layer, for compatibility checks
    mtp: dict[str, mx.array] | None = None  # the MTP head's history (None: none kept)
    mtp_kind: str | None = None  # its HeadHistory.kind

    @property
    def offset(self) -> int:
        return len(self.tokens)


class RewindError(Qwen38Error):
    """A rewind that the state cannot perform (recurrent layers without a snapshot there)."""


@dataclass
class _SavePoint:
    layers: list[dict[str, mx.array] | None]  # snapshots of the non-truncatable layers
    mtp: Any = None  # HeadHistory.mark() there


class SequenceState:
    """Token ids, position and every layer's state for one sequence."""

    def __init__(self, layers: list[LayerState]):
        self.layers = layers
        self._tokens: list[int] = []
        self._pending: list[mx.array] = []  # fed but not yet read back (async decode)
        self._queued: deque[mx.array] = deque()  # prefill layers handed to the device
        self.extras: dict[str, Any] = {}  # e.g. sampler RNG key
        self.mtp: HeadHistory | None = None  # Model.new_state sets it for a model with a head
        # offset -> snapshots of the non-truncatable layers (None for truncatable ones) and
        # the head history's mark: the positions a rewind of recurrent state can return to.
        self._save_points: dict[int, _SavePoint] = {}

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
        elif self._pending:  # behind tokens not read back yet: keep the order, no sync
            self._pending.append(mx.array([int(i) for i in ids], dtype=mx.int32))
        else:
            self._tokens.extend(int(i) for i in ids)

    def _resolve(self) -> None:
        for p in self._pending:
            self._tokens.extend(p.tolist())
        self._pending.clear()

    def nbytes(self) -> int:
        head = self.mtp.nbytes() if self.mtp is not None else 0
        return sum(layer.nbytes() for layer in self.layers) + head

    def eager_layers(self, rows: int) -> int:
        """Every how many layers a forward of `rows` positions hands what it built to the
        device (mx.async_eval; 0: never), so the device runs layers while the host builds
        the next instead of idling until the whole graph is built: when a layer reads device
        results back part-way through (`reads_back`), and for a speculative verify (a step of
        several rows), which nothing else overlaps (plain steps overlap the next step). Every
        layer unless QWEN38_EAGER_LAYERS says otherwise (each hand-over costs host time; 0:
        never, the whole step goes at once)."""
        if not (1 < rows <= STEP_MAX_ROWS or self.reads_back()):
            return 0
        return max(int(os.environ.get("QWEN38_EAGER_LAYERS", "1")), 0)

    def layer_built(self, index: int, out: mx.array, rows: int, eager: int) -> None:
        """After layer `index` of a forward of `rows` positions is built (its output `out`).

        A prefill chunk (more than STEP_MAX_ROWS rows) hands the output and the layer's new
        state to the device at once (mx.async_eval): evaluated only with the whole chunk,
        each layer's state (a Gated DeltaNet's final recurrent state and conv rows, a KV
        write) came last in MLX's order, after every later layer, so the chunk-sized buffers
        it is computed from stayed alive through them all (issue 12: ~4.9 MB per chunk token
        above weights + KV on 64 layers). It then waits for the layer PREFILL_LAYERS_AHEAD
        before: a handed-over layer's buffers are allocated when it is queued, so a host
        running every layer ahead of the device held them all at once (the H200's ~12 GB above
        weights + KV at a 2048-token chunk), while one layer queued keeps the device busy.
        A step hands `out` over every `eager` layers (eager_layers)."""
        if rows > STEP_MAX_ROWS:
            arrays: list[mx.array] = []
            collect_arrays(self.layers[index], arrays, set())
            if settling() and self._queued:  # a settled prefill (settle.py)
                settle(*self._queued)
                self._queued.clear()
            mx.async_eval(out, *arrays)
            self._queued.append(out)
            if len(self._queued) > PREFILL_LAYERS_AHEAD:
                oldest = self._queued.popleft()
                if PREFILL_SETTLE_EVERY and (index + 1) % PREFILL_SETTLE_EVERY == 0:
                    settle(oldest)
                else:
                    mx.eval(oldest)
            if index >= len(self.layers) - 1:
                self._queued.clear()  # the chunk's end: evaluated with it, pinned by nothing
        elif eager and (index + 1) % eager == 0:
            mx.async_eval(out)

    def run_layers(
        self, blocks: Sequence[Callable], h: mx.array, offset: int, rows: int
    ) -> mx.array:
        """`h` through every layer (block i with self.layers[i]), each handed over as
        layer_built says.

        A step whose stores read back spilled pages (`reads_back`) lets a store attend on a
        guess (`guessed()` after its call: PagedKV._attend_checked) and checks the guess only
        before the next layer that cannot be put back (one without `mark()`: a store) or at
        the end. Meanwhile the host builds the layers in between (Gated DeltaNet layers, whose
        state is marked first) while the device runs them, instead of waiting for each
        attention layer's selection. A wrong guess (a selected page was on disk) has been
        fetched by `check_guess()`: the layers since get their marked state back and the
        loop runs again from the guessing layer, which then attends on the fetched pages.

        A block may hand the next one its output in a wider dtype that holds it exactly
        (layers.residual_step: fp32, so the next norm need not cast it): the last output is
        cast back to h's dtype."""
        if len(blocks) != len(self.layers):
            raise ValueError(f"{len(blocks)} layers for a state of {len(self.layers)}")
        eager = self.eager_layers(rows)
        dtype = h.dtype
        if rows != 1 or not self.reads_back():
            for i, block in enumerate(blocks):
                h = block(h, self.layers[i], offset)
                self.layer_built(i, h, rows, eager)
            return h.astype(dtype)
        token = _CHECKS_LATER.set(True)
        try:
            i, n = 0, len(blocks)
            guess = None  # (layer index, its input, [(layer, mark)] of the layers since)
            while True:
                layer = self.layers[i] if i < n else None
                if guess is not None and (layer is None or not hasattr(layer, "mark")):
                    at, h_in, marks = guess
                    guess = None
                    if not (eager and i % eager == 0):  # layer_built did not hand h over
                        mx.async_eval(h)  # the device runs what is built while the host checks
                    if not self.layers[at].check_guess():
                        for later, mark in marks:
                            later.back_to(mark)
                        i, h = at, h_in
                        continue
                if layer is None:
                    return h.astype(dtype)
                if guess is not None:
                    guess[2].append((layer, layer.mark()))
                h_in, h = h, blocks[i](h, layer, offset)
                self.layer_built(i, h, rows, eager)
                if getattr(layer, "guessed", None) is not None and layer.guessed():
                    guess = (i, h_in, [])
                i += 1
        finally:
            _CHECKS_LATER.reset(token)

    def reads_back(self) -> bool:
        """Whether some layer reads device results on the host part-way through a step (a
        paged store fetching the spilled pages of its selection, a PLE layer its token ids)."""
        for layer in self.layers:
            for store in (layer, getattr(layer, "kv", None)):
                probe = getattr(store, "reads_back", None)
                if callable(probe) and probe():
                    return True
        return False

    def spill_bytes(self, directory: Path | None = None) -> int:
        """What this sequence's spill file takes on the disk of `directory` (every disk when
        None): a follow-up that keeps the state keeps those bytes, one that replaces it frees
        them, so admission counts them as free either way (Session._admit)."""
        files = {}
        for layer in self.layers:
            for store in (layer, getattr(layer, "kv", None)):
                get = getattr(store, "spill_file", None)
                spill = get() if callable(get) else None
                if spill is not None:
                    files[id(spill)] = spill
        return sum(spill.disk_bytes(directory) for spill in files.values())

    def close(self) -> None:
        """Release what outlives the arrays: the spill file of a paged store (also nested in
        a QSA state). Idempotent; the state must not be used afterwards."""
        for layer in self.layers:
            for store in (layer, getattr(layer, "kv", None)):
                close = getattr(store, "close", None)
                if callable(close):
                    close()

    def __enter__(self) -> SequenceState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reserve(self, n: int) -> None:
        """Room for n more tokens in every layer that grows (KV, indexer keys) before they
        come: a speculative verify's k + 1 rows then append without moving live buffers."""
        for layer in self.layers:
            reserve = getattr(layer, "reserve", None)
            if reserve is not None:
                reserve(n)

    def kinds(self) -> list[str]:
        """state_kind() of every layer (what a snapshot of this sequence can be restored into)."""
        return [state_kind(layer) for layer in self.layers]

    def mtp_snapshot(self) -> tuple[dict[str, mx.array] | None, str | None]:
        """(tensors, kind) of the MTP head's history; (None, None) when there is none."""
        tensors = self.mtp.snapshot() if self.mtp is not None else None
        return (tensors, self.mtp.kind) if tensors is not None else (None, None)

    def snapshot(self) -> StateSnapshot:
        self._resolve()
        mtp, mtp_kind = self.mtp_snapshot()
        return StateSnapshot(
            tokens=list(self._tokens),
            layers=[layer.snapshot() for layer in self.layers],
            extras=dict(self.extras),
            kinds=self.kinds(),
            mtp=mtp,
            mtp_kind=mtp_kind,
        )

    def check_mtp(self, snap: StateSnapshot) -> None:
        """Refuse (RewindError) a snapshot whose MTP head history this sequence cannot take.
        A sequence that keeps no history (made outside Model.new_state) ignores it."""
        if snap.mtp is None or self.mtp is None:
            return
        if snap.mtp_kind != self.mtp.kind:
            raise RewindError(
                f"snapshot's MTP head history is {snap.mtp_kind}, this sequence keeps "
                f"{self.mtp.kind}"
            )
        self.mtp.check(snap.mtp, snap.offset)

    def restore(self, snap: StateSnapshot) -> None:
        if len(snap.layers) != len(self.layers):
            raise RewindError(
                f"snapshot has {len(snap.layers)} layers, this sequence has {len(self.layers)}"
            )
        if snap.kinds is not None and snap.kinds != self.kinds():
            bad = next(
                i for i, (a, b) in enumerate(zip(snap.kinds, self.kinds(), strict=False)) if a != b
            )
            raise RewindError(
                f"snapshot layer {bad} is {snap.kinds[bad]}, this sequence has {self.kinds()[bad]}"
            )
        self.check_mtp(snap)
        for layer, tensors in zip(self.layers, snap.layers, strict=True):
            layer.restore(tensors)
        if self.mtp is not None:
            self.mtp.restore(snap.mtp)  # a snapshot without one: the head starts empty
        self._tokens = list(snap.tokens)
        self._pending.clear()
        self._save_points.clear()  # they belonged to the history this restore replaced
        # the snapshot's extras (a sampler's key ...), but the KV options this state was built
        # with: a state of the same layout restored from another conversation's snapshot
        # (another Quest budget) must not be labelled, saved and continued as that one
        own = self.extras.get("kv_options")
        self.extras = dict(snap.extras)
        if own is not None:
            self.extras["kv_options"] = own

    # ----- rewind points for recurrent layers ---------------------------------------------
    def save_point(self) -> int:
        """Remember the non-truncatable layers here so a later rewind can return to this offset.

        Cheap for hybrid models: attention KV truncates, so only the fixed-size recurrent
        states (Gated DeltaNet, PLE) are kept. Returns the offset.
        """
        self._resolve()
        offset = len(self._tokens)
        self._save_points[offset] = _SavePoint(
            [None if layer.can_truncate else layer.snapshot() for layer in self.layers],
            self.mtp.mark(offset) if self.mtp is not None else None,
        )
        return offset

    @property
    def save_points(self) -> list[int]:
        return sorted(self._save_points)

    def drop_save_points(self, keep: int | None = None) -> None:
        """Forget rewind points (all, or all but the latest `keep`)."""
        if keep is None or keep <= 0:
            self._save_points.clear()
            return
        for offset in self.save_points[:-keep]:
            del self._save_points[offset]

    def can_rewind_to(self, length: int) -> bool:
        return 0 <= length <= self.offset and (
            length == self.offset or self.can_truncate or length in self._save_points
        )

    @property
    def can_truncate(self) -> bool:
        return all(layer.can_truncate for layer in self.layers)

    def rewind(self, n: int) -> None:
        """Drop the last n tokens (recurrent layers need a save point at the target)."""
        self.truncate(self.offset - n)

    def rollback(self, base: int, keep: int, replay: Callable[[LayerState], None]) -> None:
        """Keep the first `keep` tokens after a multi-token forward from `base` (a speculative
        verify): truncatable layers cut to `keep`; the others return to the save point at
        `base` and `replay(layer)` brings them to `keep` (without running the whole model)."""
        self._resolve()
        point = self._save_points[base]
        for i, layer in enumerate(self.layers):
            if layer.can_truncate:
                layer.truncate(keep)
            else:
                layer.restore(point.layers[i])  # type: ignore[arg-type]
                replay(layer)
        if self.mtp is not None:
            self.mtp.cut(keep)  # a round's head is at `base` still: its settle() cuts it
        del self._tokens[keep:]
        for offset in [o for o in self._save_points if o > keep]:
            del self._save_points[offset]

    def truncate(self, length: int) -> None:
        self._resolve()
        if not 0 <= length <= len(self._tokens):
            raise RewindError(f"cannot truncate a {len(self._tokens)}-token sequence to {length}")
        if length == len(self._tokens):
            return
        point = self._save_points.get(length)
        if not self.can_truncate and point is None:
            raise RewindError(
                f"this model has recurrent layers: rewinding to {length} tokens needs a save "
                f"point there (have: {self.save_points or 'none'})"
            )
        for i, layer in enumerate(self.layers):
            if layer.can_truncate:
                layer.truncate(length)
            else:
                layer.restore(point.layers[i])  # type: ignore[union-attr,arg-type]
        if self.mtp is not None:
            self.mtp.cut(length, point.mtp if point is not None else None)
        del self._tokens[length:]
        for offset in [o for o in self._save_points if o > length]:
            del self._save_points[offset]
