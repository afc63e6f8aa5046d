"""The one thread that runs the engine when callers live on other threads (integrations).

MLX binds lazily evaluated arrays to the thread (stream) that created them, so a session's
state built on one thread cannot be evaluated on another; and a thread that used MLX
(0.32, CPU) exiting at interpreter shutdown aborts the process ("terminate called without an
active exception"). So every integration submits its engine work to this single daemon
thread, which never exits, and which also serialises concurrent callers.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class EngineThread:
    """A daemon thread running submitted jobs in order, for the life of the process."""

    def __init__(self, name: str = "qwen38-engine"):
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple, dict]] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            future, fn, args, kwargs = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                future.set_exception(e)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run fn on the engine thread; the future carries its result or exception."""
        future: Future[T] = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run fn on the engine thread and wait for its result (inline if already on it)."""
        if threading.current_thread() is self.thread:
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()


_SHARED: EngineThread | None = None
_LOCK = threading.Lock()


def engine_thread() -> EngineThread:
    """The process-wide engine thread, started on first use."""
    global _SHARED
    with _LOCK:
        if _SHARED is None:
            _SHARED = EngineThread()
        return _SHARED
