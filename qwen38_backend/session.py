"""A conversation with a model: renders messages, reuses the computed prefix, streams events."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from . import speculative
from .admission import (
    MemoryPlan,
    admit,
    available_memory,
    memory_plan,
    prepare_spill_dir,
    settled_if_tight,
)
from .errors import Cancelled, StateFileError
from .events import Event, StreamParser
from .generation import GenerationStats, TokenStream
from .kv import KV_DEFAULTS, collect_kv_stats
from .prefix_store import PrefixStore
from .request import Request, build_request
from .sampling import SamplingParams
from .state import RewindError, SequenceState, StateSnapshot
from .state_files import check_compatible, model_fingerprint

if TYPE_CHECKING:
    from .engine import Model


class StopStringFilter:
    """Cuts streamed text at the first stop string; holds back text that may begin one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Return text safe to emit now; sets `stopped` when a stop string appears."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        cut = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Session:
    """One conversation: keeps its SequenceState so a follow-up only prefills what is new.

    cache=True (default) also looks prompts up in the prefix store (memory + disk) and stores
    state files there: at the last message boundary and the prompt boundary (models with
    recurrent layers, which cannot be cut back) and after generation. Pass a PrefixStore to
    use your own directory / caps. cache=False recomputes every prompt and stores nothing.
    Options besides sampling / KV / template ones: `memory_limit` (bytes; admission refuses
    prompts whose memory plan does not fit, default: what the OS reports available) and
    `admission=False` to skip that check.
    """

    max_save_points = 8  # rewind points kept in the live state (recurrent layers only cost)

    def __init__(self, model: Model, cache: bool | PrefixStore = True, **defaults: Any):
        self.model = model
        self.store: PrefixStore | None = None
        if isinstance(cache, PrefixStore):
            self.store, cache = cache, True
        self.cache = bool(cache)
        self.memory_limit: int | None = defaults.pop("memory_limit", None)
        self.admission: bool = bool(defaults.pop("admission", True))
        self.defaults = defaults
        self.state: SequenceState | None = None
        self.last_stats: GenerationStats | None = None
        self.last_plan: MemoryPlan | None = None

    def _get_store(self) -> PrefixStore:
        if self.store is None:
            self.store = default_store()
        return self.store

    def request(self, prompt, tools=None, **options) -> Request:
        """Decide one call (request.build_request) with this session's defaults under it."""
        return build_request(self.model, prompt, tools, **{**self.defaults, **options})

    def render(self, prompt, tools=None, **options) -> tuple[list[int], str]:
        """Token ids and text of a prompt given as messages, a string, or token ids."""
        req = self.request(prompt, tools, **options)
        return req.ids, req.text

    # ----- state selection ----------------------------------------------------------------
    def _live_reuse(self, ids: list[int], kv: dict, limit: int) -> int:
        """How many prompt tokens the live state can keep (0: none)."""
        state = self.state
        if state is None or state.extras.get("kv_options") != kv:
            return 0
        have = state.tokens
        common = min(common_prefix(have, ids), limit)
        if state.can_rewind_to(common):
            return common
        points = [p for p in state.save_points if p <= common]
        return max(points, default=0)

    def continued_kv(self, ids: list[int]) -> dict:
        """The KV options of the state (live, or a stored state file) holding the longest
        prefix of `ids`, when that is longer than what the default layout holds; else {}.
        For a caller that knows `ids` continue one conversation and was not given its
        options again (`llm -c` passes none of the first call's): passed to generate, the
        conversation goes on in the layout it was computed in (a bounded, spilling pool, a
        Quest budget) instead of being prefilled again in the default one. Not applied
        implicitly: another conversation that only shares a prefix (a system prompt) keeps
        the default layout and its exact decode."""
        kv: dict = {}
        if not self.cache:
            return kv
        limit = len(ids) - 1
        best, chosen = self._live_reuse(ids, kv, limit), kv
        own = self.state.extras.get("kv_options") if self.state is not None else None
        if own:
            live = self._live_reuse(ids, own, limit)
            if live > best:
                best, chosen = live, own
        hit = self._get_store().lookup(
            self._fingerprint(),
            ids,
            truncatable=self.model.new_state().can_truncate,
            kinds=None,  # any layout
            limit=limit,
        )
        if hit is not None and hit.length > best:
            chosen = hit.kv_options
        if chosen.get("kv_paged") == "off":
            # files written before choose_kv refused them name Quest options beside
            # kv_paged='off', where they did nothing
            return {k: v for k, v in chosen.items() if k not in KV_DEFAULTS}
        return dict(chosen)

    def _prepare_state(self, ids: list[int], kv: dict) -> SequenceState:
        """The state to continue from: the live one cut back, a stored state file, or fresh.

        At least one prompt token is always left to run (its logits start decoding).
        """
        if not self.cache:
            return self.model.new_state(**kv)
        limit = len(ids) - 1
        live = self._live_reuse(ids, kv, limit)
        fresh = self.model.new_state(**kv)
        store = self._get_store()
        hit = store.lookup(
            self._fingerprint(),
            ids,
            truncatable=fresh.can_truncate,
            kinds=fresh.kinds(),
            limit=limit,
        )
        if hit is not None and hit.length > live:
            try:
                snap = store.load(hit, self.model)
                check_compatible(snap, fresh)
                # The live state is replaced: it goes before the restore fills the new one,
                # so the two never hold memory and spill file at once (admission counted
                # the live state's bytes as free, Session._admit).
                self.close()
                live = 0
                fresh.restore(snap)
                if fresh.offset > hit.length:
                    fresh.truncate(hit.length)
                return fresh
            except (StateFileError, RewindError) as e:
                # refused (and reported by the store): fall back to what we have
                store.last_error = str(e)
                fresh = self.model.new_state(**kv)
        if live > 0:
            assert self.state is not None
            self.state.truncate(live)
            return self.state
        return fresh

    def _fingerprint(self) -> str:
        return model_fingerprint(self.model)

    # ----- admission ----------------------------------------------------------------------
    def _admit(self, ids: list[int], params: SamplingParams, kv: dict) -> None:
        if not self.admission:
            self.last_plan = None
            return
        context = len(ids) + params.max_tokens
        plan = memory_plan(self.model, context, prompt_tokens=len(ids), **kv)
        if self.memory_limit is not None:
            available = int(self.memory_limit)
        else:
            available = available_memory()
            if available is not None:
                # the live state is replaced or reused: its bytes count as available
                available += self.state.nbytes() if self.state is not None else 0
        # tight: a settled prefill (settle.py), one layer's scratch at a time
        plan = settled_if_tight(
            plan,
            available,
            lambda **o: memory_plan(self.model, context, prompt_tokens=len(ids), **kv, **o),
            include_weights=False,
        )
        self.last_plan = plan
        prepare_spill_dir(plan)
        if available is None:
            return
        # the live state is reused or dropped first (_prepare_state): its spill file's bytes
        # count as free, as its memory does above
        held = self.state.spill_bytes(plan.spill_dir) if plan.disk and self.state else 0
        # weights are already resident (loaded), so only per-sequence memory is new
        admit(plan, available, include_weights=False, disk_held=held)

    def close(self) -> None:
        """Drop the live state and its spill file (the prefix store's state files stay)."""
        if self.state is not None:
            self.state.close()
            self.state = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- generation ---------------------------------------------------------------------
    def rewind(self, n: int) -> None:
        """Drop the last n tokens of the live state (recurrent layers: to a save point)."""
        if self.state is None:
            raise RewindError("nothing to rewind: this session has not run yet")
        self.state.rewind(n)

    def generate(
        self, prompt, tools=None, cancel: threading.Event | None = None, **options
    ) -> Iterator[Event]:
        """Stream events (text, reasoning, tool_call) and a final `done` with usage.

        `prompt`: messages, a string, token ids, or a Request (build one with `request()`
        to see the token ids first; it is then not rendered again). Options: sampling, KV,
        `tool_choice`, `tool_style`, `response_format`, `reasoning`, `context`,
        `enable_thinking`, `chat_template_kwargs` (request.py decides them). Setting
        `cancel` (from any thread) stops the work at the next prefill chunk or token: the
        stream ends with finish_reason "cancelled" and the state keeps what was computed.
        """
        req = prompt if isinstance(prompt, Request) else self.request(prompt, tools, **options)
        ids, params, kv = req.ids, req.params, req.kv
        self._admit(ids, params, kv)
        state = self._prepare_state(ids, kv)
        if self.state is not None and self.state is not state:
            self.state.close()  # replaced: its spill file goes now, not at garbage collection
        self.state = state
        cached = state.offset
        recurrent = not state.can_truncate
        pending: list[StateSnapshot] = []
        stats = GenerationStats(prompt_tokens=len(ids), cached_tokens=cached)
        self.last_stats = stats
        tokens = self._run(
            ids, req.boundary, state, params, stats, pending, recurrent, cancel, req.draft
        )
        yield from self._events(TokenStream(tokens, stats), req, pending)

    def _run(
        self, ids, boundary, state, params, stats, pending, recurrent, cancel, draft=None
    ) -> Iterator[int]:
        """Engine.run with stops at the message and prompt boundaries to mark / snapshot."""
        t0 = time.perf_counter()
        observe = speculative.prefill_observer(self.model, state, draft)
        settle_layers = self.last_plan is not None and self.last_plan.settled
        try:
            then = params.max_tokens or 0  # reserved with the prompt (Model.prefill)
            if state.offset < boundary < len(ids):
                part = ids[state.offset : boundary]
                rest = len(ids) - boundary + then
                self.model.prefill(
                    part,
                    state,
                    cancel=cancel,
                    observe=observe,
                    then=rest,
                    settle_layers=settle_layers,
                )
                self._mark(state, pending, recurrent)
            logits = self.model.prefill(
                ids[state.offset :],
                state,
                cancel=cancel,
                observe=observe,
                then=then,
                settle_layers=settle_layers,
            )
        except Cancelled:
            stats.finish_reason = "cancelled"
            stats.prefill_seconds = time.perf_counter() - t0
            return
        self._mark(state, pending, recurrent)
        stats.prefill_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        try:
            yield from self.model.decode(logits, state, params, stats, cancel=cancel, draft=draft)
        finally:
            stats.decode_seconds = time.perf_counter() - t1
            stats.kv = collect_kv_stats(state)

    def _mark(self, state: SequenceState, pending: list[StateSnapshot], recurrent: bool) -> None:
        """A rewind point here; with recurrent layers also a snapshot for the prefix store."""
        state.save_point()
        state.drop_save_points(keep=self.max_save_points)
        if self.cache and recurrent:
            snap = state.snapshot()
            mx.eval(
                [a for layer in snap.layers for a in layer.values()],
                list((snap.mtp or {}).values()),
            )
            pending.append(snap)

    def _persist(self, state: SequenceState, pending: list[StateSnapshot]) -> None:
        """Store the boundary snapshots and the state after generation."""
        if not self.cache:
            return
        store = self._get_store()
        fp = self._fingerprint()
        for snap in pending:
            store.put(self.model, snap, fingerprint=fp)
        final = state.snapshot()
        if final.tokens:
            # attention-only states truncate, so the final state serves every shorter prefix
            store.put(self.model, final, fingerprint=fp, supersede=state.can_truncate)
        pending.clear()

    def _events(self, stream: TokenStream, req: Request, pending: list[StateSnapshot]):
        tok = self.model.tokenizer
        state = self.state
        params = req.params
        detok = tok.detokenizer()
        parser = StreamParser(start_in_reasoning=req.thinking, tools=req.tools)
        stops = StopStringFilter(params.stop)
        stop_ids = set(
            self.model.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
        )
        generated: list[int] = []
        for token in stream:
            generated.append(token)
            if token in stop_ids:
                continue
            yield from parser.feed(stops.feed(detok.add(token)))
            if stops.stopped:
                stream.close()
                stream.stats.finish_reason = "stop"
                break
        if not stops.stopped:
            yield from parser.feed(stops.feed(detok.flush()))
            if not stops.stopped:
                yield from parser.feed(stops.flush())
        yield from parser.finish()
        stats = stream.stats
        if state is not None:
            self._persist(state, pending)
        yield Event(
            type="done",
            finish_reason=stats.finish_reason,
            usage=stats.usage(),
            incomplete=_incomplete(req, stats.finish_reason, generated),
        )


def _incomplete(req: Request, finish_reason: str | None, generated: list[int]) -> str | None:
    """What a length cut left unfinished: the constraint, unless its grammar had already
    reached an end (e.g. a complete tool call followed by whitespace)."""
    if finish_reason != "length" or req.grammar is None:
        return None
    req.grammar.sync(generated)
    return None if req.grammar.is_accepting else req.constrained


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


_DEFAULT_STORES: dict[str, PrefixStore] = {}


def default_store() -> PrefixStore:
    """One PrefixStore per default directory (data_dir()/checkpoints), shared in-process."""
    from .prefix_store import default_directory

    directory = str(default_directory())
    store = _DEFAULT_STORES.get(directory)
    if store is None:
        store = _DEFAULT_STORES[directory] = PrefixStore(directory)
    return store
