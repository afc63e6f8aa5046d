"""A conversation with a model: renders messages, reuses the computed prefix, streams events."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .engine import GenerationStats, Model
from .errors import InvalidOptionError
from .events import Event, StreamParser
from .kv import KV_OPTION_KEYS
from .sampling import SamplingParams
from .state import SequenceState

_SAMPLING_KEYS = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "logits_processors",
}


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
    """One conversation: keeps its SequenceState so a follow-up only prefills what is new."""

    def __init__(self, model: Model, cache: bool = True, **defaults: Any):
        self.model = model
        self.cache = cache
        self.defaults = defaults
        self.state: SequenceState | None = None
        self.last_stats: GenerationStats | None = None

    def _split_options(self, options: dict) -> tuple[SamplingParams, dict, dict]:
        """Sampling params, KV store options, and the rest (chat template kwargs)."""
        merged = {**self.defaults, **options}
        sampling = {k: v for k, v in merged.items() if k in _SAMPLING_KEYS}
        kv = {k: v for k, v in merged.items() if k in KV_OPTION_KEYS and v is not None}
        template = {
            k: v for k, v in merged.items() if k not in _SAMPLING_KEYS and k not in KV_OPTION_KEYS
        }
        return SamplingParams.from_options(**sampling), kv, template

    def render(self, prompt, tools=None, **template_kwargs) -> tuple[list[int], str]:
        """Token ids and text of a prompt given as messages, a string, or token ids."""
        tok = self.model.tokenizer
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list) or not prompt:
            raise InvalidOptionError("prompt must be a non-empty list of messages or token ids")
        if all(isinstance(p, int) for p in prompt):
            return list(prompt), tok.decode(list(prompt))
        if not all(isinstance(m, dict) and "role" in m for m in prompt):
            raise InvalidOptionError("every message must be a dict with a 'role'")
        text = tok.apply_chat_template(
            prompt, tools=tools, add_generation_prompt=True, tokenize=False, **template_kwargs
        )
        return tok.encode(text), text

    def _prepare_state(self, ids: list[int], kv: dict) -> SequenceState:
        """Keep the longest reusable prefix of the live state (at least one token left to run)."""
        state = self.state
        if not self.cache or state is None or state.extras.get("kv_options") != kv:
            return self.model.new_state(**kv)
        have = state.tokens
        common = 0
        limit = min(len(have), len(ids) - 1)
        while common < limit and have[common] == ids[common]:
            common += 1
        if common == len(have):
            return state
        if common > 0 and state.can_truncate:
            state.truncate(common)
            return state
        return self.model.new_state(**kv)

    def generate(self, prompt, tools=None, **options) -> Iterator[Event]:
        """Stream events (text, reasoning, tool_call) and a final `done` with usage."""
        params, kv, template_kwargs = self._split_options(options)
        ids, prompt_text = self.render(prompt, tools, **template_kwargs)
        state = self._prepare_state(ids, kv)
        self.state = state
        cached = state.offset
        stream = self.model.run(ids[cached:], state, params)
        self.last_stats = stream.stats
        yield from self._events(stream, prompt_text, params)

    def _events(self, stream, prompt_text: str, params: SamplingParams) -> Iterator[Event]:
        tok = self.model.tokenizer
        detok = tok.detokenizer()
        parser = StreamParser(start_in_reasoning=_opens_reasoning(prompt_text))
        stops = StopStringFilter(params.stop)
        stop_ids = set(
            self.model.eos_token_ids if params.stop_token_ids is None else params.stop_token_ids
        )
        for token in stream:
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
        yield Event(type="done", finish_reason=stats.finish_reason, usage=stats.usage())


def _opens_reasoning(prompt_text: str, open_tag: str = "<think>", close_tag: str = "</think>"):
    """True when the rendered prompt leaves a <think> block open (the model starts reasoning)."""
    i = prompt_text.rfind(open_tag)
    return i >= 0 and close_tag not in prompt_text[i:]
