"""Speculative decoding, first slice: n-gram (prompt-lookup) drafts under greedy decoding.

A round drafts up to k tokens by looking the sequence's latest n-gram (n = 3..1) up earlier in
its own tokens (prompt + generated) and proposing what followed it there; one forward of
[last token, draft...] (k+1 positions) verifies them. The longest prefix of the draft that
equals the argmax at each position is accepted, plus the argmax after it (the bonus token), so
every round yields at least the token plain decoding would have. The token stream equals plain
greedy decoding: on the CPU a row of a matmul is computed the same with 1 or k+1 rows
(tests/test_speculative.py compares the streams).

Rejected positions are rolled back: attention KV truncates; recurrent layers (Gated DeltaNet)
cannot, so a save point taken before the verify pass is restored and the accepted tokens are
fed again. Keeping the per-position recurrent states of the verify pass would avoid that
re-run (a later slice, with MTP drafts and sampling).

Only greedy decoding without logits processors runs rounds, and only on dense KV selection:
under a sparse selector (kv_topk) a k+1-token verify reads through prefill attention while a
plain step reads the selected pages, so the streams could drift (the exactness gate of issue
13 is not built yet). Everything else decodes plainly.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from .errors import InvalidOptionError
from .generation import stop_reason
from .sampling import SamplingParams
from .state import SequenceState

if TYPE_CHECKING:
    from .engine import Model

SPECULATIVE_KEYS = frozenset({"speculative", "speculative_tokens"})
MODES = ("off", "ngram")
DEFAULT_TOKENS = 4
MAX_NGRAM = 3
LOOKBACK = 8192  # tokens searched for an earlier occurrence of the suffix


@dataclass(frozen=True)
class SpeculativeOptions:
    mode: str = "ngram"
    tokens: int = DEFAULT_TOKENS


def parse_options(options: dict[str, Any]) -> SpeculativeOptions | None:
    """`speculative` ("ngram", "off" / None) and `speculative_tokens` (k >= 1) -> options."""
    mode = options.get("speculative")
    k = options.get("speculative_tokens")
    if mode is None or mode is False:
        mode = "off"
    if mode is True:
        mode = "ngram"
    if mode not in MODES:
        raise InvalidOptionError(f"speculative={mode!r}: must be one of {', '.join(MODES)}")
    if k is None:
        k = DEFAULT_TOKENS
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 64:
        raise InvalidOptionError(f"speculative_tokens={k!r}: must be an integer in [1, 64]")
    return None if mode == "off" else SpeculativeOptions(mode=mode, tokens=k)


def ngram_draft(tokens: list[int], k: int, max_n: int = MAX_NGRAM) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest
    suffix (n = max_n..1) of `tokens`; [] when no suffix occurred before. A match of one
    token only proposes one token (common tokens recur everywhere; a 2-position verify costs
    about what a plain step does on the CPU, a 5-position one ~1.7x: measured, demo model)."""
    if k <= 0 or len(tokens) < 2:
        return []
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
                    return [int(t) for t in follow]
    return []


def speculation_allowed(params: SamplingParams, state: SequenceState) -> bool:
    """Greedy, unconstrained, dense selection: where rounds keep the plain token stream."""
    kv = state.extras.get("kv_options") or {}
    return params.greedy and not params.logits_processors and not kv.get("kv_topk")


def decode_greedy(
    model: Model,
    logits: mx.array,
    state: SequenceState,
    params: SamplingParams,
    stats,
    options: SpeculativeOptions,
    cancel: threading.Event | None = None,
) -> Iterator[int]:
    """Model.decode for greedy decoding with n-gram drafts: the same tokens, stops, length
    and cancel behaviour as plain decode (a token is yielded, then checked)."""
    stop_ids = set(model.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids)
    counters = {
        "mode": options.mode,
        "rounds": 0,
        "drafted": 0,
        "accepted": 0,
        "forwards": 0,
        "acceptance_rate": 0.0,
    }
    stats.speculative = counters
    if params.max_tokens == 0:
        stats.finish_reason = "length"
        return
    n = 0
    # `pending`: tokens decided but not yet yielded; all but the last are already in `state`
    pending = [int(mx.argmax(logits.astype(mx.float32), axis=-1).item())]
    limit = options.tokens  # draft length; 1 after a round whose first draft token failed
    while True:
        for token in pending:
            n += 1
            stats.generated_tokens = n
            yield token
            stats.finish_reason = stop_reason(token, n, params.max_tokens, stop_ids, cancel)
            if stats.finish_reason is not None:
                return
        last = pending[-1]
        # never decide more tokens than max_tokens still allows
        room = params.max_tokens - n - 1
        draft = ngram_draft(state.tokens + [last], min(limit, room)) if room > 0 else []
        pending = _round(model, state, last, draft, counters)
        if draft:
            limit = options.tokens if len(pending) > 1 else 1
        _finish_rate(counters)


def _round(
    model: Model, state: SequenceState, last: int, draft: list[int], counters: dict
) -> list[int]:
    """Feed `last` (plus a verified draft); return the newly decided tokens: the accepted
    draft (already in state) and the next token (not yet fed)."""
    counters["forwards"] += 1
    if not draft:
        out = model.forward([last], state, last_only=True)
        return [int(mx.argmax(out[-1].astype(mx.float32), axis=-1).item())]
    counters["rounds"] += 1
    counters["drafted"] += len(draft)
    base = state.offset
    recurrent = not state.can_truncate
    own_point = False
    if recurrent:
        own_point = base not in state.save_points  # never drop the session's own points
        state.save_point()
    out = model.forward([last, *draft], state, last_only=False)
    preds = mx.argmax(out.astype(mx.float32), axis=-1).tolist()
    accepted = 0
    while accepted < len(draft) and draft[accepted] == preds[accepted]:
        accepted += 1
    counters["accepted"] += accepted
    if accepted < len(draft):
        keep = base + 1 + accepted
        if recurrent:
            # recurrent states cannot be cut: back to the save point, then feed the accepted
            # tokens again (per-position GDN states from the verify pass would avoid this)
            state.truncate(base)
            counters["forwards"] += 1
            model.forward([last, *draft[:accepted]], state, last_only=True)
        else:
            state.truncate(keep)
    if own_point:
        state._save_points.pop(base, None)
    return [*draft[:accepted], int(preds[accepted])]


def _finish_rate(counters: dict) -> None:
    d = counters["drafted"]
    counters["acceptance_rate"] = counters["accepted"] / d if d else 0.0
