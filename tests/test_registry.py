"""Model registry: add / remove / get / list / default / resolve, atomic JSON storage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qwen38_backend.errors import ConfigError, InvalidOptionError, ModelNotFoundError
from qwen38_backend.loading import paths
from qwen38_backend.loading.registry import DEMO_NAME, Registry, resolve


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("QWEN38_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("QWEN38_DEMO_WHEEL", raising=False)
    return tmp_path / "home"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "models" / "tiny"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    return d


def test_paths_follow_home(home: Path) -> None:
    assert paths.data_dir() == home
    assert paths.cache_dir() == home / "cache"


def test_add_get_list_remove(home: Path, model_dir: Path) -> None:
    reg = Registry()
    assert reg.list() == {}
    assert reg.add("tiny", model_dir) == model_dir.resolve()
    assert reg.get("tiny") == model_dir.resolve()
    assert "tiny" in reg and "other" not in reg
    data = json.loads((home / "registry.json").read_text())  # independent read of the file
    assert data["models"]["tiny"]["path"] == str(model_dir.resolve())
    listed = Registry().list()
    assert list(listed) == ["tiny"] and listed["tiny"]["default"] is False
    reg.remove("tiny")
    assert reg.list() == {}
    with pytest.raises(ModelNotFoundError, match="tiny"):
        reg.remove("tiny")
    assert not list(home.glob(".registry-*"))  # no temp files left behind


def test_add_errors(home: Path, model_dir: Path, tmp_path: Path) -> None:
    reg = Registry()
    for bad in ["", "a/b", "../x", " x", "-x", "x" * 65, "a b"]:
        with pytest.raises(InvalidOptionError):
            reg.add(bad, model_dir)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        reg.add("ghost", tmp_path / "nope")
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="gguf"):
        reg.add("bin", f)
    assert reg.list() == {}


def test_default(home: Path, model_dir: Path) -> None:
    reg = Registry()
    assert reg.default is None
    with pytest.raises(ModelNotFoundError):
        reg.default = "tiny"
    reg.add("tiny", model_dir)
    reg.default = "tiny"
    assert Registry().default == "tiny" and reg.list()["tiny"]["default"] is True
    assert resolve(None) == model_dir.resolve()
    reg.remove("tiny")
    assert reg.default is None


def test_resolve(home: Path, model_dir: Path, tmp_path: Path) -> None:
    assert resolve(model_dir) == model_dir  # an existing path wins
    Registry().add("tiny", model_dir)
    assert resolve("tiny") == model_dir.resolve()
    with pytest.raises(ModelNotFoundError) as e:
        resolve("nope")
    msg = str(e.value)
    assert "tiny" in msg and DEMO_NAME in msg and "add" in msg
    # a registered path that disappeared
    moved = tmp_path / "moved"
    model_dir.rename(moved)
    with pytest.raises(ModelNotFoundError, match="no longer exists"):
        resolve("tiny")


def test_existing_path_beats_registry_name(
    home: Path, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    Registry().add("tiny", other)
    monkeypatch.chdir(model_dir.parent)
    assert resolve("tiny") == Path("tiny")


def test_corrupt_registry(home: Path) -> None:
    home.mkdir(parents=True)
    (home / "registry.json").write_text("{oops")
    with pytest.raises(ConfigError, match="registry.json"):
        Registry().list()


def test_demo_name_resolves_through_ensure_demo(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qwen38_backend.loading import demo

    fake = tmp_path / "demo.gguf"
    fake.write_bytes(b"GGUF")
    calls = []
    monkeypatch.setattr(demo, "ensure_demo", lambda progress=True: calls.append(1) or fake)
    assert resolve(DEMO_NAME) == fake and calls == [1]
    assert resolve(None) == fake  # no default: the demo model


def test_import_from_keeps_existing_names_and_skips_the_demo(
    home: Path, model_dir: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    old = tmp_path / "old" / "registry.json"
    old.parent.mkdir()
    Registry(old).add("tiny", other)
    Registry(old).add("extra", other)
    Registry(old).add(DEMO_NAME, other)
    Registry(old).default = "extra"
    reg = Registry()
    reg.add("tiny", model_dir)
    assert reg.import_from(old) == ["extra"]
    assert reg.get("tiny") == model_dir.resolve() and reg.get("extra") == other.resolve()
    assert DEMO_NAME not in reg and reg.default == "extra"
    assert reg.import_from(old) == []  # nothing new the second time


def test_unknown_name_says_where_and_how(home: Path) -> None:
    with pytest.raises(ModelNotFoundError) as e:
        Registry().get("nope")
    msg = str(e.value)
    assert str(home / "registry.json") in msg
    assert "`qwen38 add PATH --name NAME`" in msg and "`llm qwen38 add PATH --name NAME`" in msg
