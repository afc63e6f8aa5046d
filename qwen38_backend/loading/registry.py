"""Named models: resolve a name or a path to weights, and register new weights.

The registry file itself (`Registry`, the reserved names) is `registry_file.py`, which the
demo module uses to register its copy; this module sits above both, so neither imports it
back. Its names are re-exported here for callers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import InvalidOptionError, ModelNotFoundError, TokenizerError
from . import demo
from .registry_file import (
    DEFAULT_ALIAS,
    DEMO_NAME,
    HOW_TO_ADD,
    REGISTRY_FILE,
    RESERVED_NAMES,
    Registry,
    served_not_weights,
    validate_name,
)

if TYPE_CHECKING:
    from .weights import Weights

__all__ = [
    "DEFAULT_ALIAS",
    "DEMO_NAME",
    "REGISTRY_FILE",
    "RESERVED_NAMES",
    "Registry",
    "add_served",
    "add_weights",
    "resolve",
    "validate_name",
]


def add_weights(
    path: str | Path, name: str | None = None, make_default: bool = False
) -> tuple[str, Path, Weights]:
    """Check that `path` loads (config, weights index, tokenizer), then register it.

    The one way both `qwen38 add` and `llm qwen38 add` register weights. `name` defaults to
    the directory name (or the .gguf file's stem). Returns (name, resolved path, Weights).
    Reads the weights, so it imports MLX.
    """
    from . import read_weights

    p = Path(path).expanduser()
    name = name or (p.stem if p.suffix.lower() == ".gguf" else p.name)
    if name in RESERVED_NAMES:
        raise InvalidOptionError(f"{name!r} is reserved; choose another --name")
    validate_name(name)
    weights = read_weights(p, tokenizer=True)  # refuse what cannot load before registering
    if weights.tokenizer is None:
        raise TokenizerError(f"{p}: no tokenizer found (tokenizer.json or GGUF vocab)")
    reg = Registry()
    target = reg.add(name, p)
    if make_default:
        reg.default = name
    return name, target, weights


def add_served(
    url: str, name: str | None = None, model: str | None = None, make_default: bool = False
) -> tuple[str, str, str]:
    """Register a model served by `qwen38 serve` at `url` under `name` (default: the
    served model's id). The server is asked which models it serves first, so a wrong URL or
    model is refused now. Returns (name, url, model id)."""
    from ..client import ServedModel, normalize_url

    url = normalize_url(url)
    served = ServedModel(url).models()
    if model is None:
        if len(served) != 1:
            raise InvalidOptionError(f"{url} serves {', '.join(served)}: pick one with --model")
        model = served[0]
    elif model not in served:
        raise ModelNotFoundError(f"{url} does not serve {model!r} (it serves {', '.join(served)})")
    name = name or model
    if name in RESERVED_NAMES:
        raise InvalidOptionError(f"{name!r} is reserved; choose another --name")
    reg = Registry()
    reg.add_url(name, url, model)
    if make_default:
        reg.default = name
    return name, url, model


def resolve(name_or_path: str | Path | None = None) -> Path:
    """Path of a model given as a path, a registered name, or `qwen38-demo`.

    An existing path wins; `None` means the registry default, else the demo model.
    The demo model is fetched on first use.
    """
    reg = Registry()
    if name_or_path is None:
        name_or_path = reg.default or DEMO_NAME
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    name = str(name_or_path)
    if name == DEMO_NAME:
        return demo.ensure_demo()
    models = reg.list()
    if name not in models:
        known = ", ".join(sorted({*models, DEMO_NAME}))
        raise ModelNotFoundError(
            f"{name!r} is neither an existing path nor a registered model name "
            f"(known in {reg.path}: {known}); {HOW_TO_ADD}"
        )
    if "path" not in models[name]:
        raise ModelNotFoundError(served_not_weights(name, models[name].get("url")))
    target = Path(models[name]["path"])
    if not target.exists():
        raise ModelNotFoundError(
            f"model {name!r} is registered at {target}, which no longer exists; "
            f"remove it or register it again"
        )
    return target
