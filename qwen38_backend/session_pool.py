"""A few live sessions of one model, handed out by the longest shared token prefix.

Callers that see many conversations through one model (ChatQwen38's shared models,
`qwen38 serve`) keep a small pool: a call goes to the session whose live state shares the
longest prefix with its prompt, so chat histories and agent loops only prefill what is new;
the prefix store under each session finds older prefixes on disk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .session import common_prefix

if TYPE_CHECKING:
    from .session import Session


class SessionPool:
    """Up to `size` sessions made by `make()`; least recently used first in `sessions`."""

    def __init__(self, make: Callable[[], Session], size: int = 2):
        self.make = make
        self.size = size
        self.sessions: list[Session] = []

    def acquire(self, ids: list[int]) -> Session:
        """The session that can reuse the most of `ids` (a new or the least recently used
        one when none shares a prefix); it becomes the most recently used."""
        best, best_len = None, 0
        for s in self.sessions:
            if s.state is None:
                continue
            n = common_prefix(s.state.tokens, ids)
            if n > best_len:
                best, best_len = s, n
        if best is None:
            best = self.make() if len(self.sessions) < self.size else self.sessions.pop(0)
        else:
            self.sessions.remove(best)
        self.sessions.append(best)
        return best

    def clear(self) -> None:
        """Forget every live state (their memory is freed with them, spill files now)."""
        for session in self.sessions:
            session.close()
        self.sessions.clear()
