"""Loaded models shared across ChatQwen38 instances, and the sessions that keep their prefixes.

Weights load once per process per (model, dtype), on first use, whichever instance asks
first; every instance naming the same model then shares them. Each loaded model keeps a few
Sessions; a call goes to the one whose live state shares the longest token prefix with the
new prompt, so agent loops and chat histories only prefill what is new.

Shared models live for the process; the engine thread is idle between calls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from qwen38_backend.engine import Model
from qwen38_backend.session import Session
from qwen38_backend.session_pool import SessionPool
from qwen38_backend.worker import engine_thread

T = TypeVar("T")

__all__ = [
    "DEFAULT_MODEL",
    "SESSIONS_PER_MODEL",
    "SharedModel",
    "shared_model",
    "clear_shared_models",
]

DEFAULT_MODEL = "qwen38"  # the registry's default model, else the demo model
# Each live session holds a whole KV state, so keep few: enough for a conversation plus an
# interleaved side call (e.g. a structured-output helper) without evicting each other.
SESSIONS_PER_MODEL = 2


class SharedModel:
    """One loaded Model shared by every ChatQwen38 naming it, its sessions, and the one thread
    every use of it runs on.

    MLX binds lazily evaluated arrays to the thread (stream) that created them, so loading,
    rendering, constrained-decoding masks and generation all run on the process-wide engine
    thread (qwen38_backend.worker), one job at a time.
    """

    def __init__(self, name: str):
        self.name = name
        self.model: Model | None = None
        self._worker = engine_thread()
        self._pool: SessionPool | None = None

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Run fn on the engine thread."""
        return self._worker.submit(fn, *args, **kwargs)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run fn on the engine thread and wait for its result."""
        return self.submit(fn, *args, **kwargs).result()

    def model_request(self, prompt: Any, tools: list | None = None, **options: Any) -> Any:
        """The engine's decision for one call (qwen38_backend.request.build_request)."""
        from qwen38_backend.request import build_request

        assert self.model is not None
        return build_request(self.model, prompt, tools, **options)

    def acquire_session(self, ids: list[int]) -> Session:
        """The session that can reuse the most of `ids` (engine thread only)."""
        assert self.model is not None
        if self._pool is None:
            self._pool = SessionPool(self.model.session, SESSIONS_PER_MODEL)
        return self._pool.acquire(ids)

    def close(self) -> None:
        """Drop the model and live states (the engine thread stays, see worker.py)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            self.submit(pool.clear)
        self.model = None

    def reset(self) -> None:
        """Forget every live state (their memory is freed with them)."""
        if self._pool is not None:
            self.call(self._pool.clear)


_SHARED: dict[tuple[str, str | None], SharedModel] = {}
_LOAD_LOCKS: dict[tuple[str, str | None], threading.Lock] = {}
_REGISTRY_LOCK = threading.Lock()


def _resolve(model: str) -> str:
    """A path, a registered name, `qwen38-demo`, or DEFAULT_MODEL -> what load() accepts."""
    from qwen38_backend.loading.registry import Registry, resolve

    if model == DEFAULT_MODEL and not Path(model).exists() and model not in Registry():
        return str(resolve(None))
    return model


def shared_model(model: str, dtype: str | None = None) -> SharedModel:
    """The SharedModel for (model, dtype), loading it on first use (thread-safe)."""
    import qwen38_backend

    key = (model, dtype)
    with _REGISTRY_LOCK:
        shared = _SHARED.get(key)
        if shared is not None:
            return shared
        load_lock = _LOAD_LOCKS.setdefault(key, threading.Lock())
    # loading can take minutes: hold only this model's lock, not the registry's
    with load_lock:
        with _REGISTRY_LOCK:
            shared = _SHARED.get(key)
        if shared is None:
            shared = SharedModel(model)
            try:
                shared.model = shared.call(qwen38_backend.load, _resolve(model), dtype)
            except BaseException:
                shared.close()
                raise
            with _REGISTRY_LOCK:
                _SHARED[key] = shared
    return shared


def clear_shared_models() -> None:
    """Drop every loaded model (their memory is freed once nothing references them)."""
    with _REGISTRY_LOCK:
        models = list(_SHARED.values())
        _SHARED.clear()
        _LOAD_LOCKS.clear()
    for shared in models:
        shared.close()


def loaded_shared_models() -> dict[tuple[str, str | None], Any]:
    """Snapshot of the cache, for inspection and tests."""
    with _REGISTRY_LOCK:
        return dict(_SHARED)
