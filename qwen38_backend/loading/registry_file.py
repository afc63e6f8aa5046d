"""The registry file: model name -> weights path (or a served model's URL), a small JSON
file (`registry.json` in the data directory), every change written atomically.

One registry for every entry point: the `qwen38` command, the llm plugin and ChatQwen38 all
read and write `paths.data_dir()/registry.json`. This module knows names and paths only (no
demo fetching, no MLX); `registry.py` resolves names, fetching the demo on first use.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..errors import ConfigError, InvalidOptionError, ModelNotFoundError
from . import paths

REGISTRY_FILE = "registry.json"
DEMO_NAME = "qwen38-demo"
DEFAULT_ALIAS = "qwen38"  # `llm -m qwen38` / ChatQwen38(model="qwen38"): the default model
RESERVED_NAMES = (DEMO_NAME, DEFAULT_ALIAS)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
HOW_TO_ADD = (
    "register one with `qwen38 add PATH --name NAME` or `llm qwen38 add PATH --name NAME` "
    "(both write the one registry every integration reads)"
)


def validate_name(name: str) -> str:
    """Return `name` if it is a valid model name, else raise InvalidOptionError."""
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidOptionError(
            f"invalid model name {name!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def served_not_weights(name: str, url: str | None) -> str:
    return (
        f"{name!r} is a model served at {url} (`qwen38 serve`), not weights on this machine: "
        f"use it through `llm -m {name}` or ChatQwen38(model={name!r}), or register weights "
        "under another name"
    )


class Registry:
    """Model name -> path map stored as JSON; every change is written atomically."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path is not None else paths.data_dir() / REGISTRY_FILE

    def _read(self) -> dict[str, Any]:
        if not self.path.exists():
            return {"version": 1, "default": None, "models": {}}
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
                raise ValueError("expected an object with a 'models' object")
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{self.path}: unreadable model registry ({e}); fix or delete it"
            ) from e
        data.setdefault("default", None)
        return data

    def _write(self, data: dict[str, Any]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".registry-", suffix=".tmp")
        except OSError as e:
            raise ConfigError(f"cannot write the model registry {self.path}: {e}") from e
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            Path(tmp).unlink(missing_ok=True)
            raise ConfigError(f"cannot write the model registry {self.path}: {e}") from e
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def add(self, name: str, path: str | Path) -> Path:
        """Register `name` -> `path` (an existing model directory or .gguf file)."""
        validate_name(name)
        p = Path(path).expanduser().resolve()
        if not p.exists():
            raise ModelNotFoundError(f"cannot add {name!r}: {p} does not exist")
        if not (p.is_dir() or p.suffix.lower() == ".gguf"):
            raise ModelNotFoundError(
                f"cannot add {name!r}: {p} is neither a model directory nor a .gguf file"
            )
        data = self._read()
        added = datetime.now(timezone.utc).isoformat(timespec="seconds")
        data["models"][name] = {"path": str(p), "added": added}
        self._write(data)
        return p

    def add_url(self, name: str, url: str, model: str) -> None:
        """Register `name` -> the model `model` served at `url` (`qwen38 serve`)."""
        validate_name(name)
        data = self._read()
        added = datetime.now(timezone.utc).isoformat(timespec="seconds")
        data["models"][name] = {"url": url, "model": model, "added": added}
        self._write(data)

    def served(self, name: str) -> tuple[str, str] | None:
        """(url, model id) when `name` is a served model, else None (weights, or unknown)."""
        entry = self._read()["models"].get(name)
        if isinstance(entry, dict) and isinstance(entry.get("url"), str):
            return entry["url"], str(entry.get("model") or "")
        return None

    def remove(self, name: str) -> None:
        """Forget `name` (the files stay where they are)."""
        data = self._read()
        if name not in data["models"]:
            raise self._unknown(name, data)
        del data["models"][name]
        if data.get("default") == name:
            data["default"] = None
        self._write(data)

    def get(self, name: str) -> Path:
        """Path registered under `name`."""
        data = self._read()
        if name not in data["models"]:
            raise self._unknown(name, data)
        entry = data["models"][name]
        if "path" not in entry:
            raise ModelNotFoundError(served_not_weights(name, entry.get("url")))
        return Path(entry["path"])

    def list(self) -> dict[str, dict[str, Any]]:
        """All registered models: name -> {"path" or "url" and "model", "added", "default"}."""
        data = self._read()
        default = data.get("default")
        return {n: {**e, "default": n == default} for n, e in sorted(data["models"].items())}

    def __contains__(self, name: object) -> bool:
        return name in self._read()["models"]

    @property
    def default(self) -> str | None:
        """Name of the default model, or None."""
        return self._read().get("default")

    @default.setter
    def default(self, name: str | None) -> None:
        data = self._read()
        if name is not None and name not in data["models"]:
            raise self._unknown(name, data)
        data["default"] = name
        self._write(data)

    def import_from(self, other: Path) -> list[str]:
        """Copy the entries of another registry file whose names this one lacks.

        The demo entry is skipped (ensure_demo registers its own copy); the other registry's
        default becomes this one's when this one has none. Returns the names imported.
        """
        old = Registry(other)._read()
        data = self._read()
        imported = []
        for name, entry in sorted(old["models"].items()):
            ok = isinstance(entry, dict) and isinstance(entry.get("path"), str)
            if name == DEMO_NAME or name in data["models"] or not ok or not _NAME_RE.match(name):
                continue
            data["models"][name] = entry
            imported.append(name)
        if data.get("default") is None and old.get("default") in imported:
            data["default"] = old["default"]
        if imported:
            self._write(data)
        return imported

    def _unknown(self, name: str, data: dict[str, Any]) -> ModelNotFoundError:
        known = ", ".join(sorted(data["models"])) or "none"
        return ModelNotFoundError(
            f"unknown model {name!r} (registered in {self.path}: {known}); {HOW_TO_ADD}"
        )
