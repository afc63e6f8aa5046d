"""What one generation did (GenerationStats) and the stream of its token ids (TokenStream)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    """What one generation did: counts, why it stopped, and how fast."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    finish_reason: str | None = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    kv: dict = field(default_factory=dict)  # the KV store's counters (pages, bytes read, ...)
    # speculative decoding (option `draft`): the mode that ran ("mtp", "ngram"; None: plain
    # decode), draft tokens proposed and accepted, and decode forwards (verify, plain step or
    # re-feed; 0 under plain decode, which runs one per token)
    draft: str | None = None
    drafted: int = 0
    accepted: int = 0
    forwards: int = 0
    throttle_pauses: int = 0  # times drafting paused because rounds were losing
    gate_closed_at: int | None = None  # position where Quest selection stopped the rounds

    @property
    def prefill_tokens_per_second(self) -> float:
        n = self.prompt_tokens - self.cached_tokens
        return n / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # the first token comes from prefill logits; the rest each cost one decode step
        n = max(self.generated_tokens - 1, 0)
        return n / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0.0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens decided per decode forward (the first token comes from prefill); 1.0 under
        plain decoding."""
        if not self.forwards:
            return 1.0
        return max(self.generated_tokens - 1, 0) / self.forwards

    def draft_stats(self) -> dict[str, Any]:
        """What the drafts did, for response metadata (llm's response_json, LangChain)."""
        return {
            "mode": self.draft,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "forwards": self.forwards,
            "tokens_per_forward": round(self.tokens_per_forward, 4),
            "throttle_pauses": self.throttle_pauses,
            "gate_closed_at": self.gate_closed_at,
        }

    def usage(self) -> dict[str, int]:
        return {
            "prompt": self.prompt_tokens,
            "cached": self.cached_tokens,
            "generated": self.generated_tokens,
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.usage(),
            "finish_reason": self.finish_reason,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "prefill_tokens_per_second": self.prefill_tokens_per_second,
            "decode_tokens_per_second": self.decode_tokens_per_second,
            "kv": dict(self.kv),
            "draft": self.draft_stats(),
        }


class TokenStream:
    """Iterator over generated token ids; `stats` is complete once it is exhausted."""

    def __init__(self, tokens: Iterator[int], stats: GenerationStats):
        self._tokens = tokens
        self.stats = stats

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> int:
        return next(self._tokens)

    def close(self) -> None:
        self._tokens.close()


def stop_reason(token: int, n: int, max_tokens: int, stop_ids: set[int], cancel: Any) -> str | None:
    """Why a stream ends after yielding its n-th token `token` (None: it goes on)."""
    if token in stop_ids:
        return "stop"
    if n >= max_tokens:
        return "length"
    if cancel is not None and cancel.is_set():
        return "cancelled"
    return None
