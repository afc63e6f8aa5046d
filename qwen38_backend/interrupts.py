"""Ctrl-C during an answer: the first one asks the engine to stop, the second one quits.

A KeyboardInterrupt raised wherever the main thread happens to be (printing a chunk, inside
a host program's loop) aborts the program; a handler that only sets the turn's cancel event
lets the engine end the turn at its next prefill chunk or token, so the partial answer is
shown and kept (llm logs it; `llm -c` continues after it).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def first_sigint_cancels(
    cancel: threading.Event, notice: Callable[[], None] | None = None
) -> Iterator[threading.Event]:
    """Inside: the first SIGINT sets `cancel` (and calls `notice`), a further one raises
    KeyboardInterrupt as usual. Off the main thread (where handlers cannot be set) nothing
    changes. Leaving on another thread (a stream abandoned mid-answer and closed by the
    garbage collector, which runs on whichever thread allocates: `llm ... | head`) cannot put
    the previous handler back; the handler then passes every SIGINT on to it."""
    if threading.current_thread() is not threading.main_thread():
        yield cancel
        return
    left = threading.Event()

    def on_sigint(signum, frame):
        if left.is_set():
            return _pass_on(previous, signum, frame)
        if cancel.is_set():
            raise KeyboardInterrupt
        cancel.set()
        if notice is not None:
            notice()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield cancel
    finally:
        left.set()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)


def _pass_on(handler, signum: int, frame) -> None:
    """What `handler` (a signal.signal result) does with a signal."""
    if callable(handler):
        handler(signum, frame)
    elif handler != signal.SIG_IGN:
        raise KeyboardInterrupt  # SIG_DFL, or a handler not set from Python
