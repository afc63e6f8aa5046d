"""The engine: a loaded model, prefill, the decode loop, and chat sessions that stream events."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np

from . import drafts, speculative
from .admission import default_prefill_chunk
from .errors import Cancelled, InvalidOptionError
from .generation import GenerationStats, TokenStream, stop_reason
from .kv import KV_OPTION_KEYS, collect_kv_stats, make_kv_factory, prefilling
from .sampling import Sampler, SamplingParams
from .session import Session
from .settle import settle, settled
from .speculative import DraftOptions
from .state import SequenceState, collect_arrays


def state_arrays(state: SequenceState) -> list[mx.array]:
    """Every array a sequence's layers hold (nested stores included), for evaluating them
    after a prefill chunk so lazy graphs do not pile up across chunks."""
    out: list[mx.array] = []
    seen: set[int] = set()
    for layer in state.layers:
        collect_arrays(layer, out, seen)
    return out


def check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise Cancelled("generation cancelled")


class Model:
    """A loaded model: weights, tokenizer, and the generation entry points."""

    prefill_chunk = default_prefill_chunk()
    default_max_tokens = 4096  # when a call sets none (always cut to what the window leaves)

    def __init__(
        self,
        net,
        weights,
        dtype: mx.Dtype,
        name: str | None = None,
        group: mx.distributed.Group | None = None,
    ):
        self.net = net
        # the ranks this model is split over (None: whole); every rank runs the same calls
        self.group = group if group is not None and group.size() > 1 else None
        self.weights = weights  # loading.Weights (its tensors now live in net)
        self.dtype = dtype
        self.tokenizer = weights.tokenizer
        self.config = net.config
        self.generation_config = dict(weights.generation_config or {})
        self.name = name or Path(weights.source).name
        self.eos_token_ids = self._eos_ids()

    @property
    def checkpoint(self):
        """Deprecated name of `weights` (the `Weights` read from disk)."""
        warnings.warn(
            "Model.checkpoint is deprecated; use Model.weights", DeprecationWarning, stacklevel=2
        )
        return self.weights

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank()

    @property
    def world_size(self) -> int:
        return 1 if self.group is None else self.group.size()

    def _eos_ids(self) -> list[int]:
        ids = self.generation_config.get("eos_token_id")
        tokenizer_ids = list(getattr(self.tokenizer, "eos_token_ids", None) or [])
        if ids is None:
            ids = tokenizer_ids
        if isinstance(ids, int):
            ids = [ids]
        return list(dict.fromkeys(int(i) for i in list(ids) + tokenizer_ids))

    # ----- forward passes -----------------------------------------------------------------
    def new_state(self, **kv_options) -> SequenceState:
        """A fresh sequence; kv_options (kv_paged, kv_topk, ...) pick the KV store."""
        state = self.net.make_state(kv_factory=make_kv_factory(**kv_options))
        state.extras["kv_options"] = dict(kv_options)
        if getattr(self.net, "has_mtp", False):
            drafts.mtp_track(self, state)  # the head's history is part of the state (empty)
        return state

    def forward(self, ids: mx.array | list[int], state: SequenceState, last_only: bool = False):
        """Run ids [T] through the model at the state's position, advance it, return logits."""
        arr = ids if isinstance(ids, mx.array) else mx.array(ids, dtype=mx.int32)
        out = self.net(arr.reshape(-1), state, last_only=last_only)
        state.advance(ids)
        return out

    def forward_features(self, ids: mx.array | list[int], state: SequenceState) -> mx.array:
        """forward() up to the trunk's output rows (net.logits_from_features gives the same
        logits): what speculative decoding verifies and the MTP head reads."""
        arr = ids if isinstance(ids, mx.array) else mx.array(ids, dtype=mx.int32)
        out = self.net.features(arr.reshape(-1), state)
        state.advance(ids)
        return out

    def prefill(
        self,
        ids: list[int],
        state: SequenceState,
        chunk: int | None = None,
        cancel: threading.Event | None = None,
        observe: Callable[[mx.array, list[int], int], None] | None = None,
        then: int = 0,
        settle_layers: bool = False,
    ) -> mx.array:
        """Feed ids in chunks (bounded activation memory); return the last position's logits.
        `then`: tokens expected to follow (the decode budget), given room with the prompt.
        `settle_layers`: settle every layer and attention block, not only every chunk
        (settle.py: the least memory where the device releases late, at some speed).

        A set `cancel` raises Cancelled between chunks; the state then holds the chunks fed so
        far (a consistent, shorter prefix). `observe(features, chunk_ids, start)` sees every
        chunk's trunk features (the MTP head's history: speculative.prefill_observer)."""
        if not ids:
            raise InvalidOptionError("cannot prefill an empty prompt")
        self.check_ids(ids)
        chunk = chunk or self.prefill_chunk
        logits = None
        # dense attention however few rows a chunk has (kv/paged.py)
        with prefilling(), settled(settle_layers):
            for start in range(0, len(ids), chunk):
                check_cancel(cancel)
                part = ids[start : start + chunk]
                if observe is None:
                    logits = self.forward(part, state, last_only=True)
                else:
                    at = state.offset
                    feats = self.forward_features(part, state)
                    logits = self.net.logits_from_features(feats[-1:])
                    mx.eval(feats)
                    observe(feats, part, at)
                # the chunk's buffers released before the next chunk allocates (settle.py)
                settle(logits, *state_arrays(state))
                if start == 0 and len(ids) + then > len(part):
                    # The first chunk sized the stores; room for the rest of the prompt and
                    # the decode now, in one allocation, instead of growing (x1.5, copying).
                    state.reserve(len(ids) + then - len(part))
        return logits[-1]

    def check_ids(self, ids: list[int]) -> None:
        """Raise InvalidOptionError unless every id is a row of the embedding: MLX does not
        bounds-check a lookup, so an id past the vocabulary reads other memory (garbage
        logits, NaN, or a crash)."""
        if not ids:
            return
        vocab = self.net.config.vocab_size
        low, high = min(ids), max(ids)
        if low < 0 or high >= vocab:
            bad = low if low < 0 else high
            raise InvalidOptionError(
                f"token id {bad} (position {ids.index(bad)}) is outside this model's "
                f"vocabulary of {vocab} ids (0..{vocab - 1})"
            )

    def logits(self, token_ids: Iterable[int]) -> np.ndarray:
        """One full forward over token_ids with a fresh state: float32 [len, vocab]."""
        ids = [int(t) for t in token_ids]
        self.check_ids(ids)
        out = self.net(mx.array(ids, dtype=mx.int32), self.new_state())
        return np.array(out.astype(mx.float32))

    # ----- generation ---------------------------------------------------------------------
    def generate_tokens(
        self, prompt_ids: Iterable[int], max_tokens: int = 256, **sampling
    ) -> TokenStream:
        """Prefill prompt_ids into a fresh state and stream generated token ids."""
        kv_options = {k: sampling.pop(k) for k in list(sampling) if k in KV_OPTION_KEYS}
        spec = {k: sampling.pop(k) for k in list(sampling) if k in speculative.OPTION_KEYS}
        params = SamplingParams.from_options(max_tokens=max_tokens, **sampling)
        draft = speculative.resolve(speculative.parse_options(spec), self)
        ids = [int(t) for t in prompt_ids]
        return self.run(ids, self.new_state(**kv_options), params, draft)

    def run(
        self,
        ids: list[int],
        state: SequenceState,
        params: SamplingParams,
        draft: DraftOptions | None = None,
    ) -> TokenStream:
        """Prefill ids (the part of the prompt not already in `state`) then decode.
        `draft`: resolved draft options (speculative.resolve), None for plain decoding."""
        stats = GenerationStats(prompt_tokens=state.offset + len(ids), cached_tokens=state.offset)
        return TokenStream(self._run(ids, state, params, stats, draft), stats)

    def _run(self, ids, state, params, stats, draft=None) -> Iterator[int]:
        t0 = time.perf_counter()
        observer = speculative.prefill_observer(self, state, draft)
        logits = self.prefill(ids, state, observe=observer, then=params.max_tokens or 0)
        stats.prefill_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        try:
            yield from self.decode(logits, state, params, stats, draft=draft)
        finally:
            stats.decode_seconds = time.perf_counter() - t1
            stats.kv = collect_kv_stats(state)

    def decode(
        self,
        logits: mx.array,
        state: SequenceState,
        params: SamplingParams,
        stats,
        cancel: threading.Event | None = None,
        draft: DraftOptions | None = None,
    ) -> Iterator[int]:
        """Sample from `logits` (the last prefill position) and decode until a stop.

        A set `cancel` ends the stream after the current token (finish_reason "cancelled").
        `draft` (resolved: speculative.resolve) runs verified draft rounds, which give the
        plain stream token for token (speculative.py), unless constraints need every token
        first."""
        if speculative.applies(draft, params):
            yield from speculative.decode(self, logits, state, params, stats, draft, cancel)
            return
        # an explicit seed starts its own stream; otherwise continue the sequence's RNG
        key = None if params.seed is not None else state.extras.get("rng_key")
        sampler = Sampler(params, key=key)
        stop_ids = set(
            self.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
        )
        # Without logits processors the next step is queued before this token is read back
        # (mx.async_eval), so the host never waits idle; processors need the token first.
        pipelined = not params.logits_processors
        history: list[int] = []
        if params.max_tokens == 0:
            stats.finish_reason = "length"
            return
        y = sampler(logits, history)
        mx.async_eval(y)
        while True:
            n = len(history) + 1
            next_y = None
            if pipelined and n < params.max_tokens:
                next_logits = self.forward(y.reshape(1), state, last_only=True)
                next_y = sampler(next_logits[-1], history)
                mx.async_eval(next_y)
            token = int(y.item())
            history.append(token)
            stats.generated_tokens = n
            if sampler.key is not None:
                state.extras["rng_key"] = sampler.key
            yield token
            stats.finish_reason = stop_reason(token, n, params.max_tokens, stop_ids, cancel)
            if stats.finish_reason is not None:
                return
            if next_y is None:
                next_logits = self.forward([token], state, last_only=True)
                next_y = sampler(next_logits[-1], history)
                mx.async_eval(next_y)
            y = next_y

    def session(self, **options) -> Session:
        return Session(self, **options)
