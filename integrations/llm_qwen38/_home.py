"""Where the plugin keeps its data, read without importing MLX (stdlib, llm, the registry).

Models are shared with the `qwen38` command and ChatQwen38: the registry and the weights
cache (the demo model) are the engine's own (`qwen38_backend.loading.paths`: QWEN38_HOME, or
the platform's user data and cache directories), never a copy under llm's directory.

Under `llm.user_dir()/qwen38` (LLM_USER_PATH moves it) the plugin keeps only what belongs
to llm's conversations: the prefix store of state files that `llm -c` resumes from (beside
llm's own logs.db, whose conversations they continue) and the plugin's settings.

Older plugin versions kept a registry and a demo copy there too; `ensure_home()` imports
that registry into the shared one once and moves the demo copy into the shared cache.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import llm

HOME_ENV = "QWEN38_HOME"
DEMO_NAME = "qwen38-demo"
DEFAULT_ALIAS = "qwen38"
SETTINGS_FILE = "llm-plugin.json"
LEGACY_REGISTRY = "registry.json"  # where plugin versions before the shared home kept it
LEGACY_IMPORTED = "registry.json.imported"
DEFAULT_PREFIX_STORE_CAP = 20 * 1024**3  # bytes of state files kept (LRU beyond)
CAP_ENV = "QWEN38_PREFIX_STORE_MAX_BYTES"
OLD_CAP_ENV = "QWEN38_CHECKPOINT_MAX_BYTES"  # before the rename; still read, with a note
CAP_KEY = "prefix_store_max_bytes"
OLD_CAP_KEY = "checkpoint_max_bytes"  # settings written before the rename; still read


def plugin_dir() -> Path:
    return llm.user_dir() / "qwen38"


def ensure_home() -> Path:
    """The engine's data directory (registry), shared with `qwen38` and ChatQwen38.

    On the first call after an upgrade, imports the registry an older plugin left under
    the llm user dir (see `import_legacy`).
    """
    from qwen38_backend.loading import paths

    home = paths.data_dir()
    legacy = plugin_dir() / LEGACY_REGISTRY
    if legacy.is_file():
        import_legacy(legacy, home)
    return home


def import_legacy(legacy: Path, home: Path) -> list[str]:
    """Import an older plugin's registry into the shared one, once; return the names.

    Names the shared registry lacks are copied (a name in both keeps the shared entry);
    the old demo copy is moved into the shared cache when that has none, else left (and
    named as safe to delete). The old file is renamed `registry.json.imported` so this runs
    once. Nothing here may break an `llm` start-up: failures leave everything as it was.
    """
    from qwen38_backend.errors import Qwen38Error
    from qwen38_backend.loading import demo
    from qwen38_backend.loading.registry import REGISTRY_FILE, Registry

    shared = Registry(home / REGISTRY_FILE)
    try:
        if legacy.resolve() == shared.path.resolve():  # QWEN38_HOME is the plugin dir
            return []
        names = shared.import_from(legacy)
    except (Qwen38Error, OSError):
        return []
    old_demo = legacy.parent / "cache" / "demo" / Path(demo.GGUF_MEMBER).name
    moved = demo.adopt(old_demo) if old_demo.exists() else None
    if moved is not None:
        for d in (old_demo.parent, old_demo.parent.parent):
            try:
                d.rmdir()
            except OSError:
                break
    try:
        os.replace(legacy, legacy.with_name(LEGACY_IMPORTED))
    except OSError:
        pass  # another process got there first
    lines = [f"qwen38: models now live in {shared.path} (shared with `qwen38` and ChatQwen38)"]
    if names:
        lines.append(f"qwen38: imported {', '.join(names)} from {legacy}")
    if moved is not None:
        lines.append(f"qwen38: moved the demo model from {old_demo} to {moved}")
    elif old_demo.exists():
        lines.append(f"qwen38: {old_demo} is an old copy of the demo model; you may delete it")
    sys.stderr.write("\n".join(lines) + "\n")
    return names


def state_files_dir() -> Path:
    """The plugin's prefix store (state files `llm -c` resumes from). The directory keeps its
    name from before the rename to "state files", so files stored by earlier versions stay found."""
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


def prefix_store_cap() -> int:
    """Byte cap of the prefix store: env QWEN38_PREFIX_STORE_MAX_BYTES, settings, or default."""
    env = os.environ.get(CAP_ENV)
    if not env and os.environ.get(OLD_CAP_ENV):
        env = os.environ[OLD_CAP_ENV]
        _note_once(f"qwen38: {OLD_CAP_ENV} is deprecated; set {CAP_ENV} instead")
    if env:
        try:
            return parse_size(env)
        except ValueError:
            pass
    saved = settings()
    cap = saved.get(CAP_KEY, saved.get(OLD_CAP_KEY))
    return int(cap) if isinstance(cap, int) and cap >= 0 else DEFAULT_PREFIX_STORE_CAP


_NOTED: set[str] = set()


def _note_once(line: str) -> None:
    if line not in _NOTED:
        _NOTED.add(line)
        sys.stderr.write(line + "\n")


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
