"""The SSD tier: one sequence's sealed KV pages in a spill file, written behind.

One `SpillFile` per sequence (shared by its attention layers), one `SpillRegion` per layer.
The file is layer-major in extents: each layer's pages live in runs of `extent_pages`
consecutive pages (a page: K then V, [kv_heads, page_tokens, head_dim] each, the pool's
dtype), so reading a layer's consecutive pages is one sequential read. The file is created
on the first write, in `kv_spill_dir` (default: under the engine's cache dir), and removed
when the sequence closes or is garbage collected (and files of dead processes are removed
when a new one is created there).

Writes go to a background thread (complete-write loop: short writes and EINTR resumed). A
page may leave the pool only once its latest contents are on disk (`ensure_written` waits),
so a read never needs bytes that were not written; every page carries a CRC-32 checked on
read, so wrong bytes are never used either. The first I/O failure is recorded and every
later read raises it as a SpillError (SpillDiskFullError for a full disk); the writer never
raises into the process. After a failure nothing more is evicted: the sequence works on
resident-only while its context fits the pool, and a reset (truncate to 0, restore) clears
the failure once no layer holds pages on disk.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
import time
import weakref
import zlib
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..errors import SpillDiskFullError, SpillError

EXTENT_PAGES = 256
_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """pwrite every byte: short writes continue where they stopped, EINTR is retried."""
    view = memoryview(data).cast("B")
    while view:
        try:
            n = os.pwrite(fd, view, offset)
        except InterruptedError:
            continue
        if n <= 0:
            raise OSError(errno.EIO, "pwrite wrote 0 bytes")
        view = view[n:]
        offset += n


def read_all(fd: int, nbytes: int, offset: int) -> bytes:
    """pread exactly nbytes: short reads continue, EINTR is retried, EOF is an error."""
    parts = []
    while nbytes:
        try:
            chunk = os.pread(fd, nbytes, offset)
        except InterruptedError:
            continue
        if not chunk:
            raise OSError(errno.EIO, f"spill file ends early ({nbytes} bytes missing)")
        parts.append(chunk)
        nbytes -= len(chunk)
        offset += len(chunk)
    return b"".join(parts)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_stale(directory: Path) -> None:
    """Remove spill files left by processes that no longer run (a crash, a kill)."""
    try:
        entries = list(directory.glob("kv-*.spill"))
    except OSError:
        return
    for path in entries:
        try:
            pid = int(path.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            path.unlink(missing_ok=True)


class _SpillIO:
    """The file, its writer thread and the first failure; shared by a sequence's regions
    (not by the SpillFile facade, so the writer thread does not keep the file alive)."""

    _names = itertools.count()

    def __init__(self, directory: Path | None):
        self.directory = directory
        self.path: Path | None = None
        self.fd = -1
        self.end = 0  # bytes handed out to extents
        self.cond = threading.Condition()
        self.jobs: deque = deque()
        self.thread: threading.Thread | None = None
        self.reader: ThreadPoolExecutor | None = None
        self.closed = False
        self.error: SpillError | None = None
        self.live_pages = 0  # pages the regions track; 0 again after a reset
        self.versions = itertools.count(1)
        self.stats = {"writes": 0, "write_bytes": 0, "reads": 0, "read_bytes": 0}
        self.read_seconds = 0.0

    # ----- file ------------------------------------------------------------------------------
    def _open(self) -> None:
        if self.fd >= 0:
            return
        if self.directory is None:
            from .policy import spill_root

            self.directory = spill_root()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            remove_stale(self.directory)
            name = f"kv-{os.getpid()}-{next(self._names)}-{time.monotonic_ns()}.spill"
            path = self.directory / name
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            self.path = path
        except OSError as e:
            self.fail(e, f"cannot create a spill file in {self.directory}")

    def allocate(self, nbytes: int) -> int:
        with self.cond:
            offset = self.end
            self.end += nbytes
            return offset

    def fail(self, e: OSError, what: str) -> None:
        """Record the first failure (later ones are consequences)."""
        with self.cond:
            if self.error is None:
                cls = SpillDiskFullError if e.errno in _FULL else SpillError
                where = self.path or self.directory
                hint = (
                    "; free disk space or set kv_spill_dir to a roomier disk (the sequence "
                    "continues resident-only while its context fits kv_pool_tokens)"
                    if cls is SpillDiskFullError
                    else "; reset the sequence to continue"
                )
                self.error = cls(f"KV spill {what} ({where}): {e.strerror or e}{hint}")
            self.cond.notify_all()

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    # ----- writer ----------------------------------------------------------------------------
    def submit(self, job: tuple) -> None:
        self._open()
        with self.cond:
            self.jobs.append(job)
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._writer, name="qwen38-kv-spill", daemon=True
                )
                self.thread.start()
            self.cond.notify_all()

    def _writer(self) -> None:
        while True:
            with self.cond:
                while not self.jobs and not self.closed:
                    self.cond.wait()
                if self.closed and not self.jobs:
                    return
                region, page, version, offset, data = self.jobs[0]
                failed = self.error is not None or self.fd < 0
            ok = False
            if not failed:
                try:
                    # The checksum is taken here, off the decode's thread (zlib lets go of the
                    # GIL), from the very bytes written; a read needs the page clean, so it
                    # finds the checksum that _written records with the page's version.
                    crc = zlib.crc32(data)
                    write_all(self.fd, data, offset)
                    ok = True
                except OSError as e:
                    self.fail(e, "write failed")
                except Exception as e:  # never into the process: record as an I/O failure
                    self.fail(OSError(errno.EIO, repr(e)), "write failed")
            with self.cond:
                self.jobs.popleft()
                if ok:
                    region._written(page, version, crc)
                    self.stats["writes"] += 1
                    self.stats["write_bytes"] += len(data)
                self.cond.notify_all()
            # Idle with no reference to a region: it would keep the sequence's file alive.
            del region, data

    def wait(self, done) -> None:
        """Block until done() or a failure, or until nothing queued could make it true."""
        with self.cond:
            while not done() and self.error is None and self.jobs and not self.closed:
                self.cond.wait(1.0)

    # ----- reads -----------------------------------------------------------------------------
    def read(self, nbytes: int, offset: int) -> bytes:
        self.check()
        t = time.perf_counter()
        try:
            data = read_all(self.fd, nbytes, offset)
        except OSError as e:
            self.fail(e, "read failed")
            self.check()
        self.read_seconds += time.perf_counter() - t
        self.stats["reads"] += 1
        self.stats["read_bytes"] += nbytes
        return data

    def prefetch(self, fn, *args) -> Future:
        if self.reader is None:
            self.reader = ThreadPoolExecutor(1, thread_name_prefix="qwen38-kv-read")
        return self.reader.submit(fn, *args)

    def disk_bytes(self, directory: Path | None = None) -> int:
        """What the file takes on its disk (it is sparse: extents are placed ahead of their
        pages); 0 without a file or when `directory` lies on another file system."""
        if self.fd < 0:
            return 0
        st = os.fstat(self.fd)
        if directory is not None:
            try:
                if os.stat(directory).st_dev != st.st_dev:
                    return 0
            except OSError:
                return 0
        blocks = getattr(st, "st_blocks", None)  # not on Windows
        return st.st_size if blocks is None else blocks * 512

    # ----- end -------------------------------------------------------------------------------
    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.jobs.clear()
            self.cond.notify_all()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=30)
        if self.reader is not None:
            self.reader.shutdown(wait=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.path is not None:
            self.path.unlink(missing_ok=True)


class SpillFile:
    """A sequence's spill file (created on the first write; removed by close() or when the
    sequence's stores are gone)."""

    __slots__ = ("_io", "_finalizer", "__weakref__")

    def __init__(self, directory: str | Path | None = None):
        self._io = _SpillIO(Path(directory) if directory is not None else None)
        self._finalizer = weakref.finalize(self, self._io.close)

    def region(self) -> SpillRegion:
        """Pages of one more layer."""
        return SpillRegion(self._io, self)

    @property
    def path(self) -> Path | None:
        return self._io.path

    @property
    def error(self) -> SpillError | None:
        return self._io.error

    def stats(self) -> dict:
        return dict(self._io.stats)

    def disk_bytes(self, directory: Path | None = None) -> int:
        """Bytes the file takes on the disk of `directory` (_SpillIO.disk_bytes)."""
        return self._io.disk_bytes(directory)

    def close(self) -> None:
        self._finalizer()


class SpillRegion:
    """One layer's pages in the spill file: versions (a page rewritten after a rewind is a
    new version), completed writes, CRCs, and the extents it occupies."""

    __slots__ = (
        "io",
        "owner",
        "extent_pages",
        "extents",
        "version",
        "done",
        "pending",
        "crc",
        "shape",
        "page_bytes",
        "n_written",
    )

    def __init__(self, io: _SpillIO, owner: SpillFile | None = None):
        self.io = io
        self.owner = owner  # keeps the file open while a layer uses it
        self.extent_pages = EXTENT_PAGES
        self.extents: dict[int, int] = {}  # extent index -> file offset
        self.version: dict[int, int] = {}  # page -> version of its current contents
        self.done: dict[int, int] = {}  # page -> version known to be on disk
        self.pending: dict[int, int] = {}  # page -> version submitted
        self.crc: dict[int, int] = {}  # page -> crc32 of its version on disk (done[page])
        self.shape: tuple | None = None  # (k shape, v shape, numpy dtype) of one page
        self.page_bytes = 0
        self.n_written = 0

    # ----- bookkeeping -----------------------------------------------------------------------
    def dirty(self, page: int) -> None:
        """The page's contents are new (sealed): not on disk until written."""
        with self.io.cond:
            if page not in self.version:
                self.io.live_pages += 1
            self.version[page] = next(self.io.versions)
            self.done.pop(page, None)

    def is_clean(self, page: int) -> bool:
        with self.io.cond:
            return self._clean(page)

    def _clean(self, page: int) -> bool:
        # under io.cond
        v = self.version.get(page)
        return v is not None and self.done.get(page) == v

    def unqueued(self, pages: list[int]) -> list[int]:
        """Those of `pages` neither on disk nor queued in their current version (one lock)."""
        with self.io.cond:
            out = []
            for page in pages:
                v = self.version.get(page)
                if v is None or (self.done.get(page) != v and self.pending.get(page) != v):
                    out.append(page)
            return out

    def _written(self, page: int, version: int, crc: int) -> None:
        # writer thread, under io.cond: a stale version (rewound meanwhile) does not count
        self.n_written += 1
        if self.version.get(page) == version:
            self.done[page] = version
            self.crc[page] = crc

    def forget(self, first_page: int) -> None:
        """Pages from first_page on are gone (truncated or reset)."""
        with self.io.cond:
            gone = [p for p in self.version if p >= first_page]
            for p in gone:
                del self.version[p]
                self.done.pop(p, None)
                self.pending.pop(p, None)
                self.crc.pop(p, None)
            self.io.live_pages -= len(gone)
            if self.io.live_pages == 0 and not self.io.jobs:
                self.io.error = None  # a reset sequence may use the tier again

    @property
    def failed(self) -> bool:
        return self.io.error is not None

    # ----- writes ----------------------------------------------------------------------------
    def _offset(self, page: int) -> int:
        extent, index = divmod(page, self.extent_pages)
        if extent not in self.extents:
            self.extents[extent] = self.io.allocate(self.extent_pages * self.page_bytes)
        return self.extents[extent] + index * self.page_bytes

    def submit(self, page: int, k: np.ndarray, v: np.ndarray) -> None:
        """Queue the page's current contents for writing (host arrays [Hkv, P, D])."""
        if self.shape is None:
            self.shape = (k.shape, v.shape, k.dtype)
            self.page_bytes = k.nbytes + v.nbytes
        data = k.tobytes() + v.tobytes()
        with self.io.cond:
            version = self.version.get(page)
            if version is None or self.pending.get(page) == version:
                return
            self.pending[page] = version
        self.io.submit((self, page, version, self._offset(page), data))

    def ensure_written(self, page: int, k: np.ndarray, v: np.ndarray) -> bool:
        """Write the page if needed and wait for it; False when the tier has failed."""
        if self.failed:
            return False
        self.submit(page, k, v)
        return self.wait_written(page)

    def wait_written(self, page: int) -> bool:
        """Wait for the page's queued write; False when the tier has failed (or nothing
        queued could make it clean)."""
        self.io.wait(lambda: self.is_clean(page))
        return self.is_clean(page) and not self.failed

    # ----- reads -----------------------------------------------------------------------------
    def read(self, pages: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """Host K, V of spilled pages, read in runs of consecutive file offsets."""
        self.io.check()
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if not pages:
            return out
        k_shape, v_shape, dtype = self.shape
        k_bytes = int(np.prod(k_shape)) * np.dtype(dtype).itemsize
        order = sorted(pages)
        runs: list[list[int]] = [[order[0]]]
        for p in order[1:]:
            prev = runs[-1][-1]
            if p == prev + 1 and p // self.extent_pages == prev // self.extent_pages:
                runs[-1].append(p)
            else:
                runs.append([p])
        with self.io.cond:  # one lock for all: each page on disk in its current version
            crcs = {p: self.crc[p] for p in order if self._clean(p)}
        for p in order:
            if p not in crcs:
                raise SpillError(f"KV page {p} is not in the spill file")  # internal
        for run in runs:
            # a memoryview: pages are sliced out of the run's bytes without copies
            data = memoryview(self.io.read(len(run) * self.page_bytes, self._offset(run[0])))
            for i, p in enumerate(run):
                raw = data[i * self.page_bytes : (i + 1) * self.page_bytes]
                if zlib.crc32(raw) != crcs[p]:
                    self.io.fail(
                        OSError(errno.EIO, f"page {p} fails its checksum"), "read corrupt data"
                    )
                    self.io.check()
                k = np.frombuffer(raw[:k_bytes], dtype=dtype).reshape(k_shape)
                v = np.frombuffer(raw[k_bytes:], dtype=dtype).reshape(v_shape)
                out[p] = (k, v)
        return out

    def read_async(self, pages: list[int]) -> Future:
        """read() in the background (the next block of a walk, while this one computes)."""
        return self.io.prefetch(self.read, pages)
