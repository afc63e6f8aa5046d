"""Speculative decoding: draft tokens (drafts.py: n-gram lookup or the MTP head), verify them
in one forward, keep the longest prefix the model agrees with plus the token after it.

A round at position p feeds [last, d_1..d_k] (k+1 rows) and decides its tokens row by row
with the same Sampler a plain step uses: row i gives the token plain decoding would give at
p+i, bit for bit (rows.py: a forward of a few rows is a step whose rows are computed as
one-row steps; on a GPU its projections are padded to a fixed row count, which bounds k:
`verify_rows`). d_{i+1} is accepted while it equals that token; the first disagreeing
row's token ends the round (the bonus when all agree).
Under sampling the Sampler's key chain advances once per decided token, exactly as in plain
decoding, so a seeded stream is the plain stream token for token, and its distribution is the
model's: for a draft that is a function of the context this is speculative rejection sampling in its
maximal-coupling form (accept d with probability p(d), else a token from p without d).

Rollback: attention KV and QSA indexer keys truncate; recurrent layers (Gated DeltaNet conv
and recurrent state, Flash-Next's PLE) return to a save point taken before the verify and
replay their own update over the kept rows of the inputs they recorded in the verify
(state.Replayable, SequenceState.rollback: no second forward of the model). The MTP head drops
the entries it computed from its own chained drafts (drafts.MTPTrack); its history is part of
the sequence's state (SequenceState.mtp), so snapshots, state files and rewinds carry it.

Exactness gate: a paged store under Quest (kv_topk) selects pages for a single decode step
but a multi-row verify attends densely, so a round runs only while every decode step through
the round's span plus one position of margin would read every page (PagedKV.dense_through);
past that decode goes on with plain tokens. QSA (Flash-Next) selects blocks per query row in
the verify as a single step would, so it needs no gate (tested past its dense threshold).

Throttle: a round costs more than a plain step (measured, demo model on this 2-core CPU with
OpenBLAS, ms per forward: 1 row 37, 2 rows 50, 5 rows 66: cost(T) ~ 1.22 + 0.14 (T - 1)
steps for T >= 2). Each round's gain is its tokens minus its cost in steps (and minus a
re-feed after a rejection where one is needed, and 0.1 step per MTP draft token); when 8
rounds (one window; windows do not overlap) together gained nothing, drafting pauses for 16
tokens, then 32, then 64 (MAX_PAUSE) each time, so a stream where drafts keep failing decodes
mostly plainly at a bounded loss, and one that turns (prose, then a copied span) is drafted
again within 64 tokens; a window that gained resets the pause to 16. n-gram drafts are
throttled apart by match length: in prose one-token matches keep failing while a copied span
(3-token matches) keeps paying off.
Draft length: each round drafts the k (up to draft_tokens) with the most tokens per step
spent for the stream's recent agreement rate (DraftLength). benchmarks/throttle_sim.py, H200
round costs measured end to end (verify_cost), 256 tokens, windows of 8 rounds (of 4): p
0.65 1.68x (1.61x), p 0.8 2.26x (2.24x), p alternating 0.2 / 0.9 every 64 tokens 1.36x
(1.22x), always losing at p 0.2 0.985x (0.989x); never pausing gives 1.69x at p 0.65 and
0.96x at p 0.2: a window of 4 paused a stream that wins on average after any unlucky run
(benchmarks/results/cpu/throttle_sim_window.json; with session 15's round costs the window
of 8 moved p 0.65 from 1.47x to 1.57x).
Steps without drafts run pipelined as Model.decode's (the next step queued before a token is
read back) for as long as no draft is coming: through a pause, after the gate closed, and in
n-gram mode until a lookup on the tokens read so far finds a draft (one token late: the step
in flight ends the run).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from . import drafts
from .errors import InvalidOptionError
from .generation import stop_reason
from .rows import STEP_MAX_ROWS, exact_rows, pad_rows, quantized_plan
from .sampling import Sampler, SamplingParams
from .state import SequenceState

if TYPE_CHECKING:
    from .engine import Model

DRAFT_KEYS = frozenset({"draft", "draft_tokens"})
DEPRECATED_KEYS = {"speculative": "draft", "speculative_tokens": "draft_tokens"}
OPTION_KEYS = DRAFT_KEYS | frozenset(DEPRECATED_KEYS)
MODES = ("auto", "mtp", "ngram", "off")
# k when draft_tokens is unset: lookup continues long copied spans; a chained MTP head's
# later tokens agree less often (the 27B head's figures are for one token)
DEFAULT_TOKENS = {"ngram": 4, "mtp": 2}
MAX_TOKENS = STEP_MAX_ROWS - 1  # a verify is a step (rows.py)

# the throttle (module docstring)
WINDOW = 8
FIRST_PAUSE = 16
MAX_PAUSE = 64  # drafts are tried again at least this often (a stream changes: prose, a copy)
MTP_STEP_COST = 0.1


def verify_cost(rows: int, gpu: bool | None = None, weights_per_row: bool = False) -> float:
    """A forward of `rows` positions in plain decode steps (measured: module docstring).

    On a GPU a round costs more than its verify's device time: plain steps are pipelined
    (the next step's graph is built while the device runs this one), a round waits for its
    tokens before it can build the next. Measured on the H200 end to end (64 layers of 27B
    dims, 4K, rounds whose drafts all agree so every forward is a round, against the plain
    run's time per token, 18.5 ms): rounds of 2 / 3 / 4 / 5 rows 1.22 / 1.33 / 1.44 / 1.45
    steps (benchmarks/results/h200/verify_e2e256_splitk.json, p 1.0; with the product kernel
    before session 16, verify_round_cost.json: 1.39 / 1.39 / 1.55 / 1.57).
    `weights_per_row`: a GPU verify whose quantized products read the weights once per row
    (rows.quantized_plan; 4-bit 27B, verify_4bit.json, against an 18.3 ms pipelined step:
    1.86 / 2.75 / 3.53 / 4.31 steps)."""
    if rows <= 1:
        return 1.0
    if gpu is None:
        gpu = mx.default_device().type == mx.DeviceType.gpu
    if gpu and weights_per_row:
        return 1.04 + 0.82 * (rows - 1)
    return 1.16 + 0.08 * (rows - 1) if gpu else 1.22 + 0.14 * (rows - 1)


def reads_weights_per_row(model: Model) -> bool:
    """Whether a verify of `model` here reads its quantized weights once per row (a GPU,
    MLX's quantized products unpadded: rows.quantized_plan)."""
    if mx.default_device().type != mx.DeviceType.gpu or pad_rows() <= 1:
        return False
    return quantized_plan(model.net, model.dtype)[0] == "unpadded"


@dataclass(frozen=True)
class DraftOptions:
    """`draft` ("auto", "mtp", "ngram", "off") and `draft_tokens` (k; None: the mode's
    default). `resolve` turns them into what a model will run."""

    mode: str = "auto"
    tokens: int | None = None


def parse_options(options: dict[str, Any]) -> DraftOptions:
    """`draft` / `draft_tokens` (or their deprecated names speculative / speculative_tokens,
    with a DeprecationWarning) -> DraftOptions; bad values refused by name."""
    given: dict[str, Any] = {}
    for old, new in DEPRECATED_KEYS.items():
        if options.get(old) is None:
            continue
        warnings.warn(
            f"the option {old!r} is deprecated; use {new!r}", DeprecationWarning, stacklevel=3
        )
        if options.get(new) is not None and options[new] != options[old]:
            raise InvalidOptionError(
                f"{old}={options[old]!r} and {new}={options[new]!r} disagree; set {new} only"
            )
        value = options[old]
        if old == "speculative" and isinstance(value, bool):
            value = "ngram" if value else "off"  # the old switch's meaning
        given[new] = value
    given.update({k: options[k] for k in DRAFT_KEYS if options.get(k) is not None})
    mode = given.get("draft", "auto")
    if mode is False:
        mode = "off"
    if mode not in MODES:
        raise InvalidOptionError(f"draft={mode!r}: must be one of {', '.join(MODES)}")
    k = given.get("draft_tokens")
    if k is not None and (
        not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_TOKENS
    ):
        raise InvalidOptionError(f"draft_tokens={k!r}: must be an integer in [1, {MAX_TOKENS}]")
    return DraftOptions(mode=mode, tokens=k)


def verify_rows(model: Model) -> int:
    """The most rows a verify forward of `model` may have here with every row bit-identical
    to the plain step at its position (rows.exact_rows)."""
    return exact_rows(model.net, model.dtype)


def resolve(options: DraftOptions | None, model: Model) -> DraftOptions | None:
    """What `model` runs: MTP for auto when it has a head (and a verify does not read the
    weights once per row here), else nothing; mtp without a head is
    refused before any work, and so is drafting where verify rows would not match plain
    steps (`verify_rows`; auto then decodes plainly) or more draft tokens than a row-exact
    verify takes here (an unset k is capped). None: plain decoding."""
    if options is None or options.mode == "off":
        return None
    limit = verify_rows(model) - 1
    if limit < 1:
        if options.mode == "auto":
            return None
        raise InvalidOptionError(
            f"draft={options.mode!r}: on this device a verify forward's rows of {model.name} "
            "are not bit-identical to plain decode steps, so drafted output could differ from "
            "plain decoding (use draft='off' here)"
        )
    if options.tokens is not None and options.tokens > limit:
        raise InvalidOptionError(
            f"draft_tokens={options.tokens}: on this device a verify of more than {limit + 1} "
            f"rows is not bit-identical to plain decode steps; use at most {limit}"
        )
    has_mtp = bool(getattr(model.net, "has_mtp", False))
    mode = options.mode
    if mode == "auto":
        # no head; or verify rows that each read the weights (verify_cost: even k 1 at full
        # acceptance, 2 tokens for ~1.9 steps, barely breaks even): plain decoding
        if not has_mtp or reads_weights_per_row(model):
            return None
        mode = "mtp"
    if mode == "mtp" and not has_mtp:
        raise InvalidOptionError(
            f"draft='mtp': {model.name} has no MTP head (no mtp.* weights); "
            "use draft='ngram' or 'off'"
        )
    default = 1 if reads_weights_per_row(model) else DEFAULT_TOKENS[mode]  # verify_cost
    return DraftOptions(mode=mode, tokens=options.tokens or min(default, limit))


def applies(options: DraftOptions | None, params: SamplingParams) -> bool:
    """Rounds keep the plain stream unless logits processors (constraints) need each token
    before the next row's logits mean anything."""
    return options is not None and not params.logits_processors


def prefill_observer(model: Model, state: SequenceState, options: DraftOptions | None):
    """For MTP drafts: Model.prefill's `observe`, feeding the prompt to the head's history."""
    if options is None or options.mode != "mtp":
        return None
    track = drafts.mtp_track(model, state)

    def observe(features: mx.array, ids: list[int], start: int) -> None:
        track.observe(features, ids, start)
        track.flush(model.net)

    return observe


def gate_open(state: SequenceState, through: int) -> bool:
    """Every paged attention store decodes densely up to `through` tokens (module docstring).
    Stores nested in a QSA state are skipped: QSA selects per verify row itself."""
    for layer in state.layers:
        dense = getattr(layer, "dense_through", None)
        if dense is not None and not dense(through):
            return False
    return True


class Throttle:
    """Pauses drafting while rounds lose against plain steps (module docstring)."""

    # the rule's choices (benchmarks/throttle_sim.py compares them switched off)
    window = WINDOW  # rounds per decision
    max_pause: int | None = MAX_PAUSE  # None: the pause doubles without bound
    reset_after_gain = True  # a window that gained starts the next pause at FIRST_PAUSE

    def __init__(self) -> None:
        self.gains: list[float] = []
        self.resume_at = 0
        self.pause = FIRST_PAUSE
        self.pauses = 0

    def allows(self, n: int) -> bool:
        return n >= self.resume_at

    def record(self, n: int, gain: float) -> None:
        """A round's gain; every `window` rounds (windows apart: a sliding window paused a
        stream that wins on average after any bad run, benchmarks/throttle_sim.py) decide
        whether drafting pauses."""
        self.gains.append(gain)
        if len(self.gains) < self.window:
            return
        if sum(self.gains) <= 0:
            self.resume_at = n + self.pause
            self.pause = 2 * self.pause
            if self.max_pause is not None:
                self.pause = min(self.pause, self.max_pause)
            self.pauses += 1
        elif self.reset_after_gain:  # drafting pays again (a copied span after prose)
            self.pause = FIRST_PAUSE
        self.gains.clear()


class DraftLength:
    """The next round's draft length: the k <= `most` with the most tokens per step spent,
    (1 - a^(k+1)) / (1 - a) tokens for verify_cost(k + 1) steps, for this stream's
    agreement rate a (the share of tested draft positions that agreed, recent rounds weighing
    most). It replaces a fixed rule (one token after a round whose first draft failed) that
    halved k where acceptance is independent of the last round: on the H200 a 5-row round
    costs little more than a 2-row one (verify_cost)."""

    decay = 0.8  # a round's weight after the next: ~5 rounds of memory
    prior = (1.6, 2.0)  # (agreed, tested): a = 0.8 before the first round, so k starts high

    def __init__(self, most: int, cost: Callable[[int], float]) -> None:
        self.most = most
        self.agreed, self.tested = self.prior
        self.cost = cost  # draft tokens -> the round's cost in plain steps

    def record(self, drafted: int, accepted: int) -> None:
        tested = accepted + (accepted < drafted)  # the first disagreeing position counts
        self.agreed = self.decay * self.agreed + accepted
        self.tested = self.decay * self.tested + tested

    @property
    def agreement(self) -> float:
        return self.agreed / self.tested

    def next(self) -> int:
        a = min(self.agreement, 0.999)

        def rate(k: int) -> float:
            return (1 - a ** (k + 1)) / (1 - a) / self.cost(k)

        return max(range(1, self.most + 1), key=rate)


class KeyChain:
    """The Sampler's keys after j splits, j = 0, 1, ...: what plain decoding stores as the
    sequence's RNG key after each token (None under greedy)."""

    def __init__(self, key: mx.array | None):
        self.keys = [key]

    def after(self, j: int) -> mx.array | None:
        if self.keys[0] is None:
            return None
        while len(self.keys) <= j:
            self.keys.append(mx.random.split(self.keys[-1])[0])
        return self.keys[j]


def decode(
    model: Model,
    logits: mx.array,
    state: SequenceState,
    params: SamplingParams,
    stats,
    options: DraftOptions,
    cancel: threading.Event | None = None,
) -> Iterator[int]:
    """Model.decode with drafts: the same tokens, stops, length, cancel and RNG key as plain
    decode (a token is yielded, then checked)."""
    stop_ids = set(model.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids)
    sampler = Sampler(params, key=None if params.seed is not None else state.extras.get("rng_key"))
    chain = KeyChain(sampler.key)
    stats.draft = options.mode
    if params.max_tokens == 0:
        stats.finish_reason = "length"
        return
    track = drafts.mtp_track(model, state) if options.mode == "mtp" else None
    if track is not None:
        track.sync(state.offset)
    history: list[int] = []
    # n-gram mode: the whole context (state.tokens + history), kept up to date as tokens are
    # decided, so a lookup is O(1) and reaches back to the first token
    index = drafts.NgramIndex(state.tokens) if options.mode == "ngram" else None
    start = len(index) if index is not None else 0
    throttles: dict[int, Throttle] = {}  # by n-gram match length (MTP: 0)
    replays = _can_replay(state)
    per_row = reads_weights_per_row(model)  # what a round costs (verify_cost)
    n = 0
    gate = True  # closes for good: a store that selects at some length selects beyond it
    # `pending`: tokens decided but not yet yielded (a list, or a plain run yielding them as
    # they are read back); once all are out, all but the last are in `state`
    pending = [int(sampler(logits, history).item())]
    mtp_cost = MTP_STEP_COST if track is not None else 0.0
    length = DraftLength(
        options.tokens, lambda k: verify_cost(k + 1, weights_per_row=per_row) + mtp_cost * k
    )
    while True:
        for token in pending:
            n += 1
            history.append(token)
            stats.generated_tokens = n
            key = chain.after(n + 1 if n < params.max_tokens else n)  # as plain decode stores
            if key is not None:
                state.extras["rng_key"] = key
            yield token
            stats.finish_reason = stop_reason(token, n, params.max_tokens, stop_ids, cancel)
            if stats.finish_reason is not None:
                stats.throttle_pauses = sum(t.pauses for t in throttles.values())
                return
        last = token  # pending's last (pending may be a plain run's generator)
        k = min(length.next(), params.max_tokens - n - 1)  # never past max_tokens
        draft: list[int] | mx.array = []  # the MTP head's stay on the device
        keep = kind = 0
        if k > 0 and gate:
            gate = gate_open(state, state.offset + k + 2)  # k+1 rows, one of margin
            if not gate:
                stats.gate_closed_at = state.offset
                track = None  # no more drafts: stop feeding the head (sync() catches up)
        run, ends = 0, None  # a plain run: its length, and what may end it early
        if k > 0 and gate:
            if index is not None:
                _catch_up(index, start, history)
                draft, kind = index.match(k)
                if not throttles.setdefault(kind, Throttle()).allows(n):
                    draft = []
                if not draft:  # plain until a lookup finds a draft its throttle allows
                    ends = _lookup_ends(index, start, history, k, throttles, stats)
                    run = params.max_tokens - n
            elif track is not None and track.last is not None:
                throttle = throttles.setdefault(0, Throttle())
                if throttle.allows(n):
                    draft, keep = track.draft(model.net, last, k)
                else:
                    run = throttle.resume_at - n
        if len(draft) == 0:
            # no drafts for a while: plain steps, pipelined as Model.decode's
            remaining = params.max_tokens - n
            run = min(run or (1 if gate and k > 0 else remaining), remaining)
            pending = _plain_run(model, state, last, sampler, history, run, stats, track, ends)
            continue
        pending = _round(model, state, last, draft, sampler, history, stats, track, keep, stop_ids)
        gain = len(pending) - verify_cost(len(draft) + 1, weights_per_row=per_row)
        if track is not None:
            gain -= MTP_STEP_COST * len(draft)
        if len(pending) <= len(draft) and not state.can_truncate and not replays:
            gain -= verify_cost(len(pending), weights_per_row=per_row)  # the re-feed
        throttles[kind].record(n, gain)
        length.record(len(draft), len(pending) - 1)


def _catch_up(index: drafts.NgramIndex, start: int, history: list[int]) -> None:
    """Append the tokens decided since the index last saw the stream: the context is the
    `start` tokens the state held when decode began, then `history` (every token since)."""
    index.extend(history[len(index) - start :])


def _lookup_ends(
    index: drafts.NgramIndex,
    start: int,
    history: list[int],
    k: int,
    throttles: dict[int, Throttle],
    stats,
) -> Callable[[int], bool]:
    """For a plain run in n-gram mode: after each token read back (in `history` by then),
    whether the context so far has a draft its throttle allows (the run then ends after the
    step already in flight, and the next lookup drafts from one token later)."""

    def ends(token: int) -> bool:
        _catch_up(index, start, history)
        draft, kind = index.match(k)
        return bool(draft) and throttles.setdefault(kind, Throttle()).allows(
            stats.generated_tokens + 1
        )

    return ends


def _plain_run(
    model: Model,
    state: SequenceState,
    last: int,
    sampler: Sampler,
    history: list[int],
    count: int,
    stats,
    track: drafts.MTPTrack | None,
    ends: Callable[[int], bool] | None = None,
) -> Iterator[int]:
    """Up to `count` tokens after `last` by plain steps, each next step queued before this
    token is read back (as Model.decode: the device does not wait for the host between
    steps). `ends(token)` True ends the run after the step already in flight. When the run
    ends, every token it gave but the last is in `state`; a consumer that stops early leaves
    the token it stopped at fed by the step in flight, as plain decoding does."""

    def queue(token) -> tuple[mx.array, mx.array | None]:
        ids = token.reshape(1) if isinstance(token, mx.array) else [token]
        if track is None:
            logits, feats = model.forward(ids, state, last_only=True), None
        else:
            feats = model.forward_features(ids, state)
            logits = model.net.logits_from_features(feats[-1:])
        y = sampler(logits[-1], history)
        mx.async_eval(y)
        return y, feats

    y, feats = queue(last)
    fed = last
    i = 0
    while True:
        more = i + 1 < count
        if more:
            following = queue(y)
        token = int(y.item())
        stats.forwards += 1  # counted when its token is used: the step in flight at a stop
        # is not (plain decoding pipelines the same way and reports one token per forward)
        if track is not None:
            track.step(model.net, feats, fed)
        yield token
        if not more:
            return
        if ends is not None and ends(token):
            count = i + 2
        (y, feats), fed, i = following, token, i + 1


def _round(
    model: Model,
    state: SequenceState,
    last: int,
    draft: list[int] | mx.array,
    sampler: Sampler,
    history: list[int],
    stats,
    track: drafts.MTPTrack | None,
    keep: int,
    stop_ids: set[int],
) -> list[int]:
    """Feed `last` and a draft, verified in one forward; return the newly decided tokens:
    the accepted draft (already in state) and the next token (not yet fed)."""
    stats.forwards += 1
    stats.drafted += len(draft)
    base = state.offset
    recurrent = not state.can_truncate
    own_point = replayable = False
    if recurrent:
        own_point = base not in state.save_points  # never drop the session's own points
        state.save_point()
        replayable = _record(state, True)
    # room for the round's rows first: appending them moves no live buffer (KV, indexer
    # keys), so a rejected round only cuts back
    state.reserve(len(draft) + 1)
    if isinstance(draft, mx.array):  # device drafts: read back with the verify's tokens
        ids = mx.concatenate([mx.array([last], dtype=mx.int32), draft])
    else:
        ids = [last, *draft]
    feats = model.forward_features(ids, state)
    logits = model.net.logits_from_features(feats)
    # greedy: every row's token in one read-back (the argmax a plain step takes, row-wise)
    picks = mx.argmax(logits.astype(mx.float32), axis=-1) if sampler.params.greedy else None
    mx.eval([a for a in (logits, picks, ids) if isinstance(a, mx.array)])
    picks = picks.tolist() if picks is not None else None
    draft = ids.tolist()[1:] if isinstance(ids, mx.array) else draft
    decided: list[int] = []
    for i in range(len(draft) + 1):
        if picks is not None:
            token = picks[i]
        else:
            token = int(sampler(logits[i], history + decided).item())
        decided.append(token)
        # a stop token ends the round unfed, so the state never runs past the answer's end
        # (a follow-up turn then reuses it whole, recurrent layers included)
        if i == len(draft) or token != draft[i] or token in stop_ids:
            break
    accepted = len(decided) - 1
    stats.accepted += accepted
    if accepted < len(draft):
        if replayable:
            # recurrent layers back to the save point, then their own update over the kept
            # rows of their recorded inputs (what a re-feed would compute, minus the rest)
            rows = 1 + accepted
            state.rollback(base, base + rows, lambda layer: layer.replay(rows))
        elif recurrent:
            # a recurrent state that cannot replay: back to the save point, feed again
            state.truncate(base)
            stats.forwards += 1
            model.forward([last, *draft[:accepted]], state, last_only=True)
        else:
            state.truncate(base + 1 + accepted)
    if recurrent:
        _record(state, False)
    if own_point:
        state._save_points.pop(base, None)
    if track is not None:
        track.settle(keep, feats, [last, *draft[:accepted]])
    return decided


def _can_replay(state: SequenceState) -> bool:
    """Every recurrent layer state can replay its recorded rows (state.Replayable)."""
    return all(hasattr(layer, "replay") for layer in state.layers if not layer.can_truncate)


def _record(state: SequenceState, on: bool) -> bool:
    """Switch row recording of the recurrent layers; False (and nothing switched) when some
    recurrent layer cannot replay."""
    if not _can_replay(state):
        return False
    for layer in state.layers:
        if not layer.can_truncate:
            layer.set_record(on)
    return True
