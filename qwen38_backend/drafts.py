"""Where draft tokens come from: n-gram lookup in the sequence's own tokens, or the model's MTP
head. Drafts only decide how much a verify forward may accept, never which tokens come out
(speculative.py checks every one), so a worse draft costs speed, not correctness.

MTP (27B `mtp.*`, Flash-Next `mtp.*`): the head at trunk position i reads the trunk's features
there (final-normed hidden / residual streams) and the embedding of token i+1, and predicts
token i+2; further draft tokens chain the head's own output features. The head attends over
its own KV history, one entry per trunk position it has seen, so `MTPTrack` feeds it every
(features, next token) pair of the sequence: the prompt during prefill (Model.prefill's
`observe`), then each decided token. Entries computed from chained (draft) features are
dropped after the verify, and the accepted positions are fed again from the trunk's own
features.

The track is part of the sequence's state (SequenceState.mtp, attached by Model.new_state):
snapshots, the prefix store and state files keep the head's KV, `positions`, `seen`, the
features `last` and the queued pairs not fed yet (a snapshot computes nothing), and a rewind
cuts it back with the sequence (a save point keeps the features of its position). So after a
restore or a rewind the head drafts as if the sequence had run on. A snapshot without it (an
older state file, a state that never drafted) restores an empty head, whose history then
starts at the restored position.
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from .state import RewindError, SequenceState, state_kind

if TYPE_CHECKING:
    from .engine import Model

MAX_NGRAM = 3
FLUSH_ROWS = 64  # queued (features, token) pairs fed to the MTP head at once
TOKEN_BITS = 21  # an n-gram's key packs its ids, TOKEN_BITS each (any vocabulary < 2M ids)
BULK_TOKENS = 32  # extend() keys a chunk at least this long with numpy, not token by token


def ngram_match(tokens: list[int], k: int, max_n: int = MAX_NGRAM) -> tuple[list[int], int]:
    """NgramIndex(tokens, max_n).match(k), for a one-off lookup (builds the index: O(len))."""
    return NgramIndex(tokens, max_n).match(k)


class NgramIndex:
    """Prompt-lookup drafts over a growing token list, the whole of it, O(1) per token.

    For each n = 1..max_n a dict maps an n-gram to the start of its most recent occurrence.
    Appending a token looks up the n-grams it ends before recording them: that previous
    start is the most recent EARLIER occurrence of the current suffix of length n (it may
    overlap the suffix), so match() is a few list reads.
    """

    def __init__(self, tokens: Iterable[int] = (), max_n: int = MAX_NGRAM) -> None:
        if max_n < 1:
            raise ValueError(f"max_n must be at least 1, not {max_n}")
        self.max_n = max_n
        self.tokens: list[int] = []  # the whole list (read it, append through the index)
        self._starts: list[dict[int, int]] = [{} for _ in range(max_n)]  # [n - 1]
        self._match = [-1] * max_n  # [n - 1]: earlier start of the current n-suffix, -1 none
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        token = _checked(token)
        tokens = self.tokens
        tokens.append(token)
        end, key = len(tokens), 0
        for n in range(1, min(self.max_n, end) + 1):
            key |= tokens[end - n] << (TOKEN_BITS * (n - 1))
            starts = self._starts[n - 1]
            self._match[n - 1] = starts.get(key, -1)
            starts[key] = end - n

    def extend(self, tokens: Iterable[int]) -> None:
        new = tokens if isinstance(tokens, list) else list(tokens)
        if len(new) < BULK_TOKENS or self.max_n * TOKEN_BITS > 63:  # int64 keys
            for token in new:
                self.append(token)
            return
        self._extend_bulk(new)

    def _extend_bulk(self, new: list[int]) -> None:
        """extend() for a long chunk (a prompt): each n's keys by numpy, then one dict update
        in order, so the most recent start of each n-gram is the one that stays."""
        ids = np.asarray(new)
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.min() < 0:
            raise ValueError(f"token ids must be integers in [0, 2**{TOKEN_BITS})")
        _checked(int(ids.max()))
        old = len(self.tokens)
        self.tokens.extend(ids.tolist())
        end = len(self.tokens)
        base = max(old - self.max_n + 1, 0)  # the earliest token a new n-gram starts at
        window = np.asarray(self.tokens[base:], dtype=np.int64)
        for n in range(1, min(self.max_n, end) + 1):
            first = max(old - n + 1, 0) - base  # new n-gram starts, in window coordinates
            count = len(window) - n + 1 - first
            keys = np.zeros(count, dtype=np.int64)
            for i in range(n):
                keys |= window[first + i : first + i + count] << (TOKEN_BITS * (n - 1 - i))
            keys_list = keys.tolist()
            starts, at = self._starts[n - 1], base + first
            starts.update(zip(keys_list[:-1], range(at, at + count - 1), strict=True))
            self._match[n - 1] = starts.get(keys_list[-1], -1)
            starts[keys_list[-1]] = end - n

    def match(self, k: int) -> tuple[list[int], int]:
        """(draft, n): up to k tokens that followed the most recent earlier occurrence of the
        longest suffix (n = max_n..1) that occurred before, and that n; ([], 0) when none did.
        A match of one token only proposes one token (common tokens recur everywhere, and a
        rejected draft token costs a verify row); speculative.py throttles each n apart."""
        if k <= 0:
            return [], 0
        for n in range(self.max_n, 0, -1):
            start = self._match[n - 1]
            if start >= 0:  # start + n < len: the suffix's start at the latest
                return self.tokens[start + n : start + n + (k if n > 1 else 1)], n
        return [], 0


def _checked(token: int) -> int:
    token = operator.index(token)  # a numpy integer is fine, a float is not
    if not 0 <= token < 1 << TOKEN_BITS:
        raise ValueError(f"token id {token} is not in [0, 2**{TOKEN_BITS})")
    return token


@dataclass
class MTPTrack:
    """The MTP head's history for one sequence (state.HeadHistory).

    `seen`: trunk positions whose features went by (== the sequence's offset while in step);
    `last`: features of trunk position seen - 1 (its next token is not known yet);
    `queue`: (features, next token) pairs not yet fed to the head, positions up to seen - 2;
    `positions`: the trunk position of each entry in the head's KV (gaps where positions went
    by unseen).
    """

    state_kind = "MTPTrack"
    state_version = 1  # snapshot keys: head.*, positions, seen, last, queue, queue_ids

    state: Any  # the family's MTP state (KV store + offset)
    seen: int = 0
    last: mx.array | None = None
    queue: list[tuple[mx.array, list[int]]] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return state_kind(self)

    def queued(self) -> int:
        return sum(len(ids) for _, ids in self.queue)

    def sync(self, offset: int) -> None:
        """Follow a sequence that moved without us (a plain prefill or decode, drafting off):
        the positions that went by unseen are a gap in the head's history."""
        if self.seen == offset:
            return
        if offset < self.seen:
            self.cut(offset)
            return
        self.seen, self.last, self.queue = offset, None, []

    def observe(self, features: mx.array, ids: list[int], start: int) -> None:
        """Trunk features [T, ...] of positions start..start+T-1 (tokens `ids`)."""
        self.sync(start)
        if self.last is not None:
            self.queue.append((self.last, [ids[0]]))
        if len(ids) > 1:
            self.queue.append((features[:-1], ids[1:]))
        self.last = mx.array(features[-1:])  # a copy: the chunk's features can go
        self.seen = start + len(ids)

    def flush(self, net: Any) -> None:
        """Feed the queued pairs to the head (its KV only: no logits)."""
        if not self.queue:
            return
        feats = mx.concatenate([f for f, _ in self.queue], axis=0)
        nxt = [t for _, ids in self.queue for t in ids]
        first = self.seen - 1 - len(nxt)  # the queue holds positions first..seen-2
        out = net.mtp_advance(feats, mx.array(nxt, dtype=mx.int32), self.state)
        mx.eval(out)
        self.positions.extend(range(first, first + len(nxt)))
        self.queue = []

    def draft(self, net: Any, next_token: int, k: int) -> tuple[mx.array, int]:
        """k greedy draft tokens after `next_token` (the decided token at position seen), as
        a device array [k]: not read back one by one (each read would stall the device),
        the verify takes them as they are and reads them with its own tokens. Returns them
        and the head's entry count to cut back to after the verify."""
        self.flush(net)
        assert self.last is not None
        feats, token = self.last, mx.array([next_token], dtype=mx.int32)
        self.positions.append(self.seen - 1)
        keep = len(self.positions)
        out: list[mx.array] = []
        for _ in range(k):
            feats = net.mtp_advance(feats, token, self.state)
            logits = net.mtp_logits(feats)[-1].astype(mx.float32)
            token = mx.argmax(logits, keepdims=True).astype(mx.int32)
            out.append(token)
        return mx.concatenate(out), keep

    def settle(self, keep: int, features: mx.array, fed: list[int]) -> None:
        """After a verify: drop the head's entries past `keep` (computed from chained draft
        features); the trunk kept positions seen..seen+len(fed)-1 (tokens `fed`, `features`
        rows). fed[0]'s pair was fed by the draft; the last row waits for the next token."""
        self.state.truncate(keep)
        del self.positions[keep:]
        if len(fed) > 1:
            self.queue.append((features[: len(fed) - 1], fed[1:]))
        self.last = features[len(fed) - 1 : len(fed)]
        self.seen += len(fed)

    def step(self, net: Any, features: mx.array, token: int) -> None:
        """A plain step fed `token` at position seen and produced `features` [1, ...]. The
        queue is fed to the head once it holds FLUSH_ROWS pairs, so a long run of plain steps
        (drafting paused) does not keep every step's features alive."""
        if self.last is not None:
            self.queue.append((self.last, [token]))
        self.last = features[-1:]
        self.seen += 1
        if self.queued() >= FLUSH_ROWS:  # rows, not entries: a restored queue is one entry
            self.flush(net)

    # ----- part of the sequence's state (state.HeadHistory) ---------------------------------
    def nbytes(self) -> int:
        return self.state.nbytes()

    def snapshot(self) -> dict[str, mx.array] | None:
        """The history as tensors (None when there is none): the head's state under `head.`,
        `positions`, `seen`, and the features `last` and `queue` (with `queue_ids`) copied,
        so a snapshot keeps no prefill chunk alive."""
        if not self.positions and self.last is None and not self.queue:
            return None
        out = {f"head.{k}": v for k, v in self.state.snapshot().items()}
        out["positions"] = mx.array(np.asarray(self.positions, dtype=np.int64))
        out["seen"] = mx.array(self.seen, dtype=mx.int64)
        if self.last is not None:
            out["last"] = mx.array(self.last)
        if self.queue:
            out["queue"] = mx.array(mx.concatenate([f for f, _ in self.queue], axis=0))
            out["queue_ids"] = mx.array([t for _, ids in self.queue for t in ids], dtype=mx.int64)
        return out

    def check(self, tensors: dict[str, mx.array], offset: int) -> None:
        """Refuse (RewindError) tensors that are not a history of an `offset`-token sequence."""
        why = _history_problem(tensors, offset)
        if why is not None:
            raise RewindError(f"MTP head history: {why}")

    def restore(self, tensors: dict[str, mx.array] | None) -> None:
        """Take a snapshot()'s tensors (checked first); None: an empty history."""
        tensors = tensors or {}
        self.state.restore({k[5:]: v for k, v in tensors.items() if k.startswith("head.")})
        self.positions = (
            [int(p) for p in np.asarray(tensors["positions"]).reshape(-1)] if tensors else []
        )
        self.seen = int(tensors["seen"].item()) if tensors else 0
        self.last = tensors.get("last")
        queue = tensors.get("queue")
        ids = tensors.get("queue_ids")
        self.queue = [] if queue is None or ids is None else [(queue, ids.tolist())]

    def mark(self, offset: int) -> mx.array | None:
        """What a save point at `offset` keeps: the features of position offset - 1, which a
        rewind there needs back (their pair waits for the token after them)."""
        return self.last if self.seen == offset else None

    def cut(self, length: int, mark: mx.array | None = None) -> None:
        """Follow the sequence back to `length` tokens: keep the head's entries and queued
        pairs of positions before length - 1; `mark` (a save point's) restores `last`."""
        if length >= self.seen:
            return  # nothing of ours lies past it (a round's verify: settle() cuts the head)
        keep = bisect.bisect_left(self.positions, length - 1)
        if keep < len(self.positions):
            self.state.truncate(keep)
            del self.positions[keep:]
        at, kept = self.seen - 1 - self.queued(), []
        for feats, ids in self.queue:
            n = min(len(ids), length - 1 - at)
            if n > 0:
                kept.append((feats[:n], ids[:n]))
            at += len(ids)
        self.queue, self.seen, self.last = kept, length, mark


def _history_problem(tensors: dict[str, mx.array], offset: int) -> str | None:
    """Why `tensors` are not an MTPTrack snapshot of an `offset`-token sequence (None: they
    are). The head's own tensors are its state class's business (and its kind's)."""
    for key in ("positions", "seen"):
        if key not in tensors or (key == "seen" and tensors[key].size != 1):
            return f"it has no {key!r}"
    positions = np.asarray(tensors["positions"]).reshape(-1)
    seen = int(tensors["seen"].item())
    last, queue, ids = (tensors.get(k) for k in ("last", "queue", "queue_ids"))
    rows = 0 if queue is None else queue.shape[0]
    entries = tensors.get("head.offset")
    if not 0 <= seen <= offset:
        return f"it has seen {seen} positions of a {offset}-token sequence"
    if positions.dtype.kind not in "iu" or np.any(np.diff(positions) <= 0):
        return "its positions are not increasing integers"
    if len(positions) and (positions[0] < 0 or positions[-1] >= seen - 1 - rows):
        return "its positions run past the pairs it was fed"
    if entries is not None and int(entries.item()) != len(positions):
        return f"its head holds {int(entries.item())} entries for {len(positions)} positions"
    if last is not None and (last.ndim != 2 or last.shape[0] != 1):
        return f"its last features have shape {tuple(last.shape)}"
    if (queue is None) != (ids is None) or (ids is not None and ids.size != rows):
        return "its queued features and token ids do not pair up"
    if queue is not None and (last is None or queue.shape[1:] != last.shape[1:]):
        return "its queued features do not fit its last ones"
    return None


def mtp_track(model: Model, state: SequenceState) -> MTPTrack:
    """The MTP history of `state` (SequenceState.mtp; made here for a state that has none)."""
    if state.mtp is None:
        state.mtp = MTPTrack(model.net.make_mtp_state())
    assert isinstance(state.mtp, MTPTrack)
    return state.mtp
