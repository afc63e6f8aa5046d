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
features. The track is not part of state files: after a restore the head's history starts at
the restored position (fewer keys to attend over; acceptance, not tokens).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from .state import SequenceState

if TYPE_CHECKING:
    from .engine import Model

MAX_NGRAM = 3
LOOKBACK = 8192  # tokens searched for an earlier occurrence of the suffix
FLUSH_ROWS = 64  # queued (features, token) pairs fed to the MTP head at once


def ngram_draft(tokens: list[int], k: int, max_n: int = MAX_NGRAM) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest
    suffix (n = max_n..1) of `tokens`; [] when no suffix occurred before."""
    return ngram_match(tokens, k, max_n)[0]


def ngram_match(tokens: list[int], k: int, max_n: int = MAX_NGRAM) -> tuple[list[int], int]:
    """(draft, n): ngram_draft's tokens and the length n of the suffix that matched (0: none).
    A match of one token only proposes one token (common tokens recur everywhere, and a
    rejected draft token costs a verify row); speculative.py throttles each n apart."""
    if k <= 0 or len(tokens) < 2:
        return [], 0
    start = max(len(tokens) - LOOKBACK, 0)
    arr = np.asarray(tokens[start:], dtype=np.int64)
    size = len(arr)
    for n in range(min(max_n, size - 1), 0, -1):
        suffix = arr[size - n :]
        # candidate starts j < size - n whose first token matches, most recent first
        cands = np.nonzero(arr[: size - n] == suffix[0])[0][::-1]
        for j in cands:
            if np.array_equal(arr[j : j + n], suffix):
                follow = arr[j + n : j + n + (k if n > 1 else 1)]
                if len(follow):
                    return [int(t) for t in follow], n
    return [], 0


@dataclass
class MTPTrack:
    """The MTP head's history for one sequence.

    `seen`: trunk positions whose features went by (== the sequence's offset while in step);
    `last`: features of trunk position seen - 1 (its next token is not known yet);
    `queue`: (features, next token) pairs not yet fed to the head; `positions`: the trunk
    position of each entry in the head's KV (gaps where positions went by unseen).
    """

    state: Any  # the family's MTP state (KV store + offset)
    seen: int = 0
    last: mx.array | None = None
    queue: list[tuple[mx.array, list[int]]] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)

    def sync(self, offset: int) -> None:
        """Follow a sequence that moved without us (rewind, restore, plain prefill): keep the
        head's entries for positions still in the sequence, forget the rest."""
        if self.seen == offset:
            return
        keep = sum(1 for p in self.positions if p < offset - 1)
        if keep < len(self.positions):
            self.state.truncate(keep)
            del self.positions[keep:]
        self.seen, self.last, self.queue = offset, None, []

    def observe(self, features: mx.array, ids: list[int], start: int) -> None:
        """Trunk features [T, ...] of positions start..start+T-1 (tokens `ids`)."""
        self.sync(start)
        if self.last is not None:
            self.queue.append((self.last, [ids[0]]))
        if len(ids) > 1:
            self.queue.append((features[:-1], ids[1:]))
        self.last = features[-1:]
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

    def draft(self, net: Any, next_token: int, k: int) -> tuple[list[int], int]:
        """k greedy draft tokens after `next_token` (the decided token at position seen);
        returns them and the head's entry count to cut back to after the verify."""
        self.flush(net)
        assert self.last is not None
        feats, token = self.last, next_token
        self.positions.append(self.seen - 1)
        keep = len(self.positions)
        out: list[int] = []
        for _ in range(k):
            feats = net.mtp_advance(feats, mx.array([token], dtype=mx.int32), self.state)
            token = int(mx.argmax(net.mtp_logits(feats)[-1].astype(mx.float32)).item())
            out.append(token)
        return out, keep

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
        queue is fed to the head every FLUSH_ROWS steps, so a long run of plain steps (drafting
        paused) does not keep every step's features alive."""
        if self.last is not None:
            self.queue.append((self.last, [token]))
        self.last = features[-1:]
        self.seen += 1
        if len(self.queue) >= FLUSH_ROWS:
            self.flush(net)


_TRACKS: weakref.WeakKeyDictionary[SequenceState, MTPTrack] = weakref.WeakKeyDictionary()


def mtp_track(model: Model, state: SequenceState) -> MTPTrack:
    """The MTP history of `state` (made on first use; follows rewinds and restores)."""
    track = _TRACKS.get(state)
    if track is None:
        track = _TRACKS[state] = MTPTrack(model.net.make_mtp_state())
    return track
