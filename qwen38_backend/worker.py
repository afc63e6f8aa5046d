"""The one thread that runs the engine when callers live on other threads (integrations).

MLX binds lazily evaluated arrays to the thread (stream) that created them, so a session's
state built on one thread cannot be evaluated on another; and a thread that used MLX
(0.32, CPU) exiting at interpreter shutdown aborts the process ("terminate called without an
active exception"). So every integration submits its engine work to this single daemon
thread, which never exits, and which also serialises concurrent callers.
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class EngineThread:
    """A daemon thread running submitted jobs in order, for the life of the process.

    Interpreter exit while a job is inside MLX aborts the process (the daemon thread is torn
    down mid-C++: "terminate called without an active exception"), e.g. after Ctrl-C. So at
    exit every registered cancel event is set and the thread is given `exit_grace` seconds to
    go idle (jobs stop at the next prefill chunk or token); if it does not, the process ends
    with os._exit after flushing stdio, never with an abort.
    """

    exit_grace = 10.0

    def __init__(self, name: str = "qwen38-engine"):
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple, dict]] = (
            queue.SimpleQueue()
        )
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._count_lock = threading.Lock()
        self._cancels: set[threading.Event] = set()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()
        atexit.register(self._settle_at_exit)

    def _loop(self) -> None:
        while True:
            future, fn, args, kwargs = self._jobs.get()
            try:
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # noqa: BLE001 - delivered through the future
                    future.set_exception(e)
            finally:
                with self._count_lock:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.set()

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def cancel_at_exit(self, event: threading.Event) -> None:
        """Set `event` if the process exits while its job runs (see the class docstring)."""
        self._cancels.add(event)

    def forget_cancel(self, event: threading.Event) -> None:
        self._cancels.discard(event)

    def wait_idle(self, timeout: float | None = None) -> bool:
        return self._idle.wait(timeout)

    def _settle_at_exit(self) -> None:
        if not self.busy:
            return
        for event in list(self._cancels):
            event.set()
        deadline = time.monotonic() + self.exit_grace
        while self.busy and time.monotonic() < deadline:
            try:
                self._idle.wait(0.1)
            except KeyboardInterrupt:  # a further Ctrl-C: leave now, still without an abort
                break
        if self.busy:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(130)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run fn on the engine thread; the future carries its result or exception."""
        future: Future[T] = Future()
        with self._count_lock:
            self._pending += 1
            self._idle.clear()
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
