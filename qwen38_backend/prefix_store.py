"""Prefix store: saved sequence states keyed by (model fingerprint, token ids).

Two tiers, both LRU under a byte cap:
- memory: recent StateSnapshots (no I/O; survives only the process);
- disk: state files (state_files.py) under `directory/<fingerprint[:16]>/`, named
  `<n_tokens>-<key>.ckpt.safetensors`. The directory is the index: no side file to get out
  of sync when several processes share it; a file's mtime is its last use.

Lookup finds the entry that saves the most prefill for a prompt. An entry whose tokens are a
prefix of the prompt is usable whole; when every layer can truncate (attention only) an entry
that merely shares a prefix with the prompt is usable up to that common prefix (truncated
after restore). Recurrent layers need the exact boundary, which is why sessions store
snapshots at message boundaries and at the prompt boundary.

A state file that fails verification is refused with a StateFileWarning naming the reason,
deleted (it would fail again), and the prompt is recomputed: never wrong output, never a crash.
"""

from __future__ import annotations

import hashlib
import os
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import StateFileError
from .state import StateSnapshot
from .state_files import SUFFIX, StateFileInfo, read_header, read_state_file, save_state_file

DEFAULT_DISK_BYTES = 20 * 1024**3
DEFAULT_MEMORY_BYTES = 1024**3


class StateFileWarning(UserWarning):
    """A state file that could not be written or was refused on load (the session goes on)."""


def default_directory() -> Path:
    """`data_dir()/checkpoints` (the name from before "state files", kept so stored files
    stay found; QWEN38_HOME or the platform's user data directory)."""
    from .loading.paths import data_dir

    return data_dir() / "checkpoints"


def prefix_key(fingerprint: str, tokens: list[int] | np.ndarray) -> str:
    """sha256 of the model fingerprint and the token ids (int32 little-endian)."""
    h = hashlib.sha256(fingerprint.encode() + b"\0")
    h.update(np.asarray(tokens, dtype="<i4").tobytes())
    return h.hexdigest()


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def snapshot_nbytes(snap: StateSnapshot) -> int:
    """Bytes of a snapshot's tensors: its layers and the MTP head's history."""
    head = sum(int(a.nbytes) for a in (snap.mtp or {}).values())
    return sum(int(a.nbytes) for layer in snap.layers for a in layer.values()) + head


@dataclass
class PrefixHit:
    """A usable entry: restore it, then truncate to `length` if it holds more."""

    length: int  # prompt tokens it provides
    n_tokens: int  # tokens the entry holds
    tier: str  # "memory" or "disk"
    key: str
    path: Path | None = None
    kv_options: dict = field(default_factory=dict)  # those of the entry's sequence


@dataclass
class EntryInfo:
    """One stored state file (for `qwen38 cache list`)."""

    key: str
    tier: str
    model_fingerprint: str
    n_tokens: int
    nbytes: int
    last_used: float
    path: Path | None = None


@dataclass
class _MemEntry:
    fingerprint: str
    tokens: np.ndarray
    snap: StateSnapshot
    nbytes: int
    kinds: list[str] | None
    last_used: float = field(default_factory=time.time)


class PrefixStore:
    """Longest-prefix lookup of saved states; memory LRU + on-disk LRU, each under a byte cap.

    directory: where state files live (default `data_dir()/checkpoints`); `disk=False`
    keeps everything in memory. max_bytes caps the disk tier, memory_bytes the memory tier.
    """

    def __init__(
        self,
        directory: str | Path | None = None,
        *,
        max_bytes: int = DEFAULT_DISK_BYTES,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        disk: bool = True,
    ):
        self.directory = Path(directory).expanduser() if directory else default_directory()
        self.max_bytes = int(max_bytes)
        self.memory_bytes = int(memory_bytes)
        self.disk = disk
        self._memory: OrderedDict[str, _MemEntry] = OrderedDict()
        self._headers: dict[str, tuple[int, int, StateFileInfo, np.ndarray]] = {}
        self.last_error: str | None = None

    # ----- paths and listing ----------------------------------------------------------------
    def _model_dir(self, fingerprint: str) -> Path:
        return self.directory / fingerprint[:16]

    def _path(self, fingerprint: str, key: str, n_tokens: int) -> Path:
        return self._model_dir(fingerprint) / f"{n_tokens:09d}-{key}{SUFFIX}"

    def _files(self, fingerprint: str | None = None) -> list[Path]:
        if not self.disk:
            return []
        dirs = (
            [self._model_dir(fingerprint)]
            if fingerprint
            else [d for d in self._iterdir(self.directory) if d.is_dir()]
        )
        return [p for d in dirs for p in self._iterdir(d) if p.name.endswith(SUFFIX)]

    @staticmethod
    def _iterdir(d: Path) -> list[Path]:
        try:
            return list(d.iterdir())
        except OSError:
            return []

    def _header(self, path: Path) -> tuple[StateFileInfo, np.ndarray] | None:
        """Cached header of a file (re-read when its size or mtime changed); None if bad."""
        try:
            st = path.stat()
        except OSError:
            return None
        cached = self._headers.get(str(path))
        if cached and cached[0] == st.st_mtime_ns and cached[1] == st.st_size:
            return cached[2], cached[3]
        try:
            info = read_header(path)
        except StateFileError as e:
            self._refuse(path, e)
            return None
        tokens = np.asarray(info.tokens, dtype=np.int64)
        self._headers[str(path)] = (st.st_mtime_ns, st.st_size, info, tokens)
        return info, tokens

    def entries(self) -> list[EntryInfo]:
        """Every stored entry, memory tier first, most recently used first within a tier."""
        out = [
            EntryInfo(k, "memory", e.fingerprint, len(e.tokens), e.nbytes, e.last_used)
            for k, e in reversed(self._memory.items())
        ]
        disk = []
        for path in self._files():
            try:
                st = path.stat()
            except OSError:
                continue
            n_tokens, _, key = path.name[: -len(SUFFIX)].partition("-")
            disk.append(
                EntryInfo(
                    key, "disk", path.parent.name, int(n_tokens), st.st_size, st.st_mtime, path
                )
            )
        disk.sort(key=lambda e: e.last_used, reverse=True)
        return out + disk

    list = entries  # `store.list()` for the CLI

    def disk_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries() if e.tier == "disk")

    def memory_used(self) -> int:
        return sum(e.nbytes for e in self._memory.values())

    # ----- lookup and load ------------------------------------------------------------------
    def lookup(
        self,
        fingerprint: str,
        ids: list[int],
        *,
        truncatable: bool,
        kinds: list[str] | None = None,
        limit: int | None = None,
    ) -> PrefixHit | None:
        """The entry that provides the longest usable prefix of `ids` (at most `limit` tokens).

        truncatable: whether the target state can cut an entry back to the common prefix;
        kinds: the target state's layer kinds (entries of another state layout are skipped).
        """
        want = np.asarray(ids, dtype=np.int64)
        limit = len(ids) if limit is None else min(limit, len(ids))
        best: PrefixHit | None = None

        def consider(
            tokens: np.ndarray, tier: str, key: str, path: Path | None, kv: dict | None
        ) -> None:
            nonlocal best
            c = common_prefix(tokens, want)
            if c == len(tokens) and c <= limit:
                usable = c
            elif truncatable:
                usable = min(c, limit)
            else:
                return
            if usable > 0 and (best is None or usable > best.length):
                best = PrefixHit(usable, len(tokens), tier, key, path, dict(kv or {}))

        for key, e in self._memory.items():
            if e.fingerprint == fingerprint and (kinds is None or e.kinds in (None, kinds)):
                consider(e.tokens, "memory", key, None, e.snap.extras.get("kv_options"))
        for path in self._files(fingerprint):
            header = self._header(path)
            if header is None:
                continue
            info, tokens = header
            if info.model_fingerprint != fingerprint:
                # a foreign file under this model's directory: refuse it loudly, once
                self._refuse(
                    path,
                    StateFileError(
                        f"state file {path} was written by a different model (fingerprint "
                        f"{info.model_fingerprint[:16]}..., this model {fingerprint[:16]}...)"
                    ),
                )
                continue
            if kinds is not None and info.kinds and info.kinds != kinds:
                continue  # another KV layout of the same model: valid, just not for this state
            key = path.name[: -len(SUFFIX)].partition("-")[2]
            if best is not None and best.tier == "memory" and best.key == key:
                continue  # the same state is already in memory: no I/O
            consider(tokens, "disk", key, path, info.kv_options)
        return best

    def load(self, hit: PrefixHit, model: Any) -> StateSnapshot:
        """The snapshot of a hit; a refused file is deleted and StateFileError re-raised."""
        if hit.tier == "memory":
            entry = self._memory[hit.key]
            self._memory.move_to_end(hit.key)
            entry.last_used = time.time()
            return entry.snap
        assert hit.path is not None
        try:
            # a large file's layers are read as the restore reaches them: a corrupt one is
            # refused then (deleted, warned about) as one found here would be
            snap = read_state_file(hit.path, model, on_error=lambda e: self._refuse(hit.path, e))
        except StateFileError as e:
            self._refuse(hit.path, e)
            raise
        try:
            os.utime(hit.path)  # mtime = last use, for LRU eviction
        except OSError:
            pass
        return snap

    def _refuse(self, path: Path, err: Exception) -> None:
        # one report: the warning (logging too would print it a second time, unconfigured)
        self.last_error = f"{err}; recomputing instead"
        warnings.warn(self.last_error, StateFileWarning, stacklevel=3)
        self._headers.pop(str(path), None)
        try:
            path.unlink()
        except OSError:
            pass

    # ----- store ----------------------------------------------------------------------------
    def put(
        self,
        model: Any,
        snap: StateSnapshot,
        *,
        fingerprint: str | None = None,
        disk: bool = True,
        supersede: bool = False,
    ) -> str:
        """Store a snapshot (memory tier, and disk unless disk=False); returns its key.

        supersede: the state is truncatable, so entries whose tokens are a prefix of this one
        are redundant (this entry serves every prompt they served) and are removed.
        A failed disk write (e.g. disk full) warns with StateFileWarning and is otherwise
        ignored: the session keeps working, nothing partial is left on disk.
        """
        from .state_files import model_fingerprint

        fp = fingerprint or model_fingerprint(model)
        tokens = np.asarray(snap.tokens, dtype=np.int64)
        key = prefix_key(fp, tokens)
        nbytes = snapshot_nbytes(snap)
        if supersede:
            self._drop_prefixes(fp, tokens, snap.kinds)
        if nbytes <= self.memory_bytes:
            self._memory[key] = _MemEntry(fp, tokens, snap, nbytes, snap.kinds)
            self._memory.move_to_end(key)
            self._evict_memory()
        if disk and self.disk and nbytes <= self.max_bytes:
            path = self._path(fp, key, len(tokens))
            if path.exists():
                os.utime(path)
            else:
                try:
                    save_state_file(path, snap, model)
                except StateFileError as e:
                    self.last_error = f"{e}; continuing without it"
                    warnings.warn(self.last_error, StateFileWarning, stacklevel=2)
                else:
                    self._evict_disk(keep=path)
        return key

    def _drop_prefixes(self, fp: str, tokens: np.ndarray, kinds: list[str] | None) -> None:
        for key in [
            k
            for k, e in self._memory.items()
            if e.fingerprint == fp
            and e.kinds == kinds
            and len(e.tokens) < len(tokens)
            and common_prefix(e.tokens, tokens) == len(e.tokens)
        ]:
            del self._memory[key]
        for path in self._files(fp):
            header = self._header(path)
            if header is None:
                continue
            info, old = header
            if (
                info.kinds == (kinds or [])
                and len(old) < len(tokens)
                and common_prefix(old, tokens) == len(old)
            ):
                self._remove(path)

    def _remove(self, path: Path) -> None:
        self._headers.pop(str(path), None)
        try:
            path.unlink()
        except OSError:
            pass

    def _evict_memory(self) -> None:
        while self._memory and self.memory_used() > self.memory_bytes:
            self._memory.popitem(last=False)

    def _evict_disk(self, keep: Path | None = None, max_bytes: int | None = None) -> list[Path]:
        cap = self.max_bytes if max_bytes is None else max_bytes
        files = []
        for p in self._files():
            try:
                st = p.stat()
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, p))
        files.sort(key=lambda t: t[0])  # least recently used first
        total = sum(size for _, size, _ in files)
        removed = []
        for _, size, p in files:
            if total <= cap:
                break
            if keep is not None and p == keep:
                continue
            self._remove(p)
            removed.append(p)
            total -= size
        return removed

    # ----- maintenance ----------------------------------------------------------------------
    def prune(
        self,
        max_bytes: int | None = None,
        older_than: float | None = None,
        model_fingerprint: str | None = None,
    ) -> list[Path]:
        """Remove disk entries: LRU down to max_bytes (default: the store's cap), entries
        unused for `older_than` seconds, and every entry of `model_fingerprint`. Returns them."""
        removed: list[Path] = []
        now = time.time()
        for p in self._files():
            try:
                mtime = p.stat().st_mtime
            except OSError:
                continue
            stale = older_than is not None and now - mtime > older_than
            foreign = model_fingerprint is not None and p.parent.name == model_fingerprint[:16]
            if stale or foreign:
                self._remove(p)
                removed.append(p)
        removed += self._evict_disk(max_bytes=max_bytes)
        for d in self._iterdir(self.directory):
            if d.is_dir() and not self._iterdir(d):
                try:
                    d.rmdir()
                except OSError:
                    pass
        return removed

    def clear(self) -> None:
        """Forget every entry, in memory and on disk (temp files of crashed writers too)."""
        self._memory.clear()
        self._headers.clear()
        if not self.disk:
            return
        for d in self._iterdir(self.directory):
            if not d.is_dir():
                continue
            for p in self._iterdir(d):
                if p.name.endswith(SUFFIX) or ".tmp-" in p.name:
                    try:
                        p.unlink()
                    except OSError:
                        pass
            try:
                d.rmdir()
            except OSError:
                pass


def __getattr__(name: str):
    if name == "CheckpointWarning":  # the name before "state file"; kept for warning filters
        import warnings

        warnings.warn(
            "qwen38_backend.prefix_store.CheckpointWarning is deprecated; use StateFileWarning",
            DeprecationWarning,
            stacklevel=2,
        )
        return StateFileWarning
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
