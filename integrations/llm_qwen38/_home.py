"""Where the plugin keeps its data, read without importing MLX (stdlib, llm, the registry).

Everything lives under `llm.user_dir()/qwen38` (so LLM_USER_PATH moves it): the model
registry and demo cache (as QWEN38_HOME, unless the user set QWEN38_HOME), the prefix
checkpoints, and the plugin's settings.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import llm

HOME_ENV = "QWEN38_HOME"
DEMO_NAME = "qwen38-demo"
DEFAULT_ALIAS = "qwen38"
SETTINGS_FILE = "llm-plugin.json"
DEFAULT_CHECKPOINT_CAP = 20 * 1024**3  # bytes of prefix checkpoints kept (LRU beyond)


def plugin_dir() -> Path:
    return llm.user_dir() / "qwen38"


def ensure_home() -> Path:
    """Point QWEN38_HOME into the llm user dir unless the user chose one; return it."""
    home = os.environ.get(HOME_ENV)
    if not home:
        home = str(plugin_dir())
        os.environ[HOME_ENV] = home
    return Path(home).expanduser()


def checkpoints_dir() -> Path:
    return plugin_dir() / "checkpoints"


def read_registry() -> dict[str, Any]:
    """The engine's registry as {"models": {name: entry}, "default": name or None}.

    qwen38_backend.loading.registry imports no MLX, so this stays cheap on every `llm`
    start-up; an unreadable registry lists nothing rather than breaking every command.
    """
    ensure_home()
    from qwen38_backend.errors import Qwen38Error
    from qwen38_backend.loading.registry import Registry

    try:
        reg = Registry()
        return {"models": reg.list(), "default": reg.default}
    except Qwen38Error:
        return {"models": {}, "default": None}


def registered_names() -> list[str]:
    return sorted(read_registry()["models"])


def default_name() -> str | None:
    return read_registry()["default"]


def settings() -> dict[str, Any]:
    try:
        data = json.loads((plugin_dir() / SETTINGS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_settings(data: dict[str, Any]) -> None:
    path = plugin_dir() / SETTINGS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


def checkpoint_cap() -> int:
    """Byte cap of the prefix store: env QWEN38_CHECKPOINT_MAX_BYTES, settings, or default."""
    env = os.environ.get("QWEN38_CHECKPOINT_MAX_BYTES")
    if env:
        try:
            return parse_size(env)
        except ValueError:
            pass
    cap = settings().get("checkpoint_max_bytes")
    return int(cap) if isinstance(cap, int) and cap >= 0 else DEFAULT_CHECKPOINT_CAP


_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2}
_UNITS |= {"g": 1024**3, "gb": 1024**3, "t": 1024**4, "tb": 1024**4}


def parse_size(text: str) -> int:
    """'500MB', '2g', '1024' -> bytes (binary units)."""
    s = str(text).strip().lower().replace("ib", "b").replace(" ", "")
    num = s.rstrip("kmgtb")
    unit = s[len(num) :]
    if unit not in _UNITS or not num:
        raise ValueError(f"invalid size {text!r}: use e.g. 500MB, 2GB or a byte count")
    try:
        value = float(num)
    except ValueError as e:
        raise ValueError(f"invalid size {text!r}: use e.g. 500MB, 2GB or a byte count") from e
    if value < 0:
        raise ValueError(f"invalid size {text!r}: must be >= 0")
    return int(value * _UNITS[unit])


def format_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
