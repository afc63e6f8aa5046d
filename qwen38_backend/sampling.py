"""Sampling parameters, their validation, and the token sampler (greedy or filtered random)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from numbers import Integral

import mlx.core as mx

from .errors import InvalidOptionError

# (token ids generated so far, logits [vocab]) -> logits; used for constrained decoding masks.
LogitsProcessor = Callable[[list[int], mx.array], mx.array]


@dataclass
class SamplingParams:
    """What to sample and when to stop. temperature 0 means greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] | None = None  # None: the model's eos ids
    logits_processors: list[LogitsProcessor] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise InvalidOptionError(f"stop={self.stop!r}: must be a string or a list of them")
        self.stop = list(self.stop or [])
        self.validate()

    @classmethod
    def from_options(cls, **options) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidOptionError(
                f"unknown sampling option(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return cls(**{k: v for k, v in options.items() if v is not None or k == "seed"})

    def validate(self) -> None:
        def bad(name: str, rule: str) -> InvalidOptionError:
            return InvalidOptionError(f"{name}={getattr(self, name)!r}: {rule}")

        if not _is_int(self.max_tokens) or self.max_tokens < 0:
            raise bad("max_tokens", "must be an integer >= 0")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 disables)")
        if not _is_number(self.min_p) or not 0 <= self.min_p < 1:
            raise bad("min_p", "must be in [0, 1)")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise bad("seed", "must be a non-negative integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        ids = self.stop_token_ids
        if ids is not None and (
            not isinstance(ids, (list, tuple)) or any(not _is_int(i) or i < 0 for i in ids)
        ):  # a string would stop on nothing, silently
            raise bad("stop_token_ids", "must be a list of non-negative integer token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x) -> bool:
    """An integer, not a bool (JSON `true` is not a token count)."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class Sampler:
    """Turns logits into a token id; carries its own RNG key so a seed reproduces a stream."""

    def __init__(self, params: SamplingParams, key: mx.array | None = None):
        self.params = params
        if key is None and not params.greedy:
            seed = (
                params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
            )
            key = mx.random.key(seed)
        self.key = key

    def __call__(self, logits: mx.array, history: Sequence[int] = ()) -> mx.array:
        """logits: [vocab] -> token id array of shape [] (lazy)."""
        p = self.params
        logits = logits.astype(mx.float32)
        for proc in p.logits_processors:
            logits = proc(list(history), logits)
        if p.greedy:
            return mx.argmax(logits, axis=-1)
        logprobs = logits / p.temperature
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1)
        logprobs = filter_logprobs(logprobs, p.top_k, p.top_p, p.min_p)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs, key=sub)


def filter_logprobs(logprobs: mx.array, top_k: int, top_p: float, min_p: float) -> mx.array:
    """Mask (to -inf) tokens outside top-k, outside the top-p nucleus, or below min_p * p_max."""
    neg = mx.array(-float("inf"), dtype=logprobs.dtype)
    vocab = logprobs.shape[-1]
    if 0 < top_k < vocab:
        kth = mx.sort(logprobs, axis=-1)[..., vocab - top_k]
        logprobs = mx.where(logprobs < kth, neg, logprobs)
    if min_p > 0:
        threshold = mx.max(logprobs, axis=-1, keepdims=True) + mx.log(mx.array(min_p))
        logprobs = mx.where(logprobs < threshold, neg, logprobs)
    if top_p < 1:
        order = mx.argsort(-logprobs, axis=-1)
        sorted_lp = mx.take_along_axis(logprobs, order, axis=-1)
        probs = mx.exp(sorted_lp)
        # keep a token if the mass strictly before it is < top_p (always keeps the best one)
        before = mx.cumsum(probs, axis=-1) - probs
        keep_sorted = before < top_p
        keep = mx.zeros_like(keep_sorted)
        keep = mx.put_along_axis(keep, order, keep_sorted, axis=-1)
        logprobs = mx.where(keep, logprobs, neg)
    return logprobs
