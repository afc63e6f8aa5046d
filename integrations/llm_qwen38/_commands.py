"""`llm qwen38 ...`: manage local models and the prefix store (state files).

Engine modules are imported inside each command, so `llm --help` stays fast.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from . import _home


def _fail(exc: BaseException) -> None:
    raise click.ClickException(str(exc))


def _registry():
    _home.ensure_home()
    from qwen38_backend.loading.registry import Registry

    return Registry()


@click.group()
def qwen38_group() -> None:
    """Local Qwen3.8 models: register weights, pick a default, manage the prefix store."""


@qwen38_group.command()
@click.argument("path", type=click.Path(path_type=Path), required=False)
@click.option(
    "--url", help="A `qwen38 serve` server instead of weights, e.g. http://127.0.0.1:8080"
)
@click.option("--model", "served_model", help="With --url: which served model (default: its only)")
@click.option("--name", "-n", help="Model name for `llm -m NAME` (default: the directory name)")
@click.option("--default", "make_default", is_flag=True, help="Also make it the `qwen38` model")
def add(
    path: Path | None,
    url: str | None,
    served_model: str | None,
    name: str | None,
    make_default: bool,
) -> None:
    """Register a model directory (HF or MLX layout), a .gguf file, or (--url) a model served
    by `qwen38 serve`, which stays loaded between `llm` calls.

    The registry is shared: `qwen38 run NAME` and ChatQwen38(model=NAME) find it too.
    """
    from qwen38_backend.errors import Qwen38Error

    _home.ensure_home()
    if (path is None) == (url is None):
        raise click.UsageError("give a PATH to weights or --url of a server (one of them)")
    if url is not None:
        from qwen38_backend.loading.registry import add_served

        try:
            name, url, model = add_served(url, name, served_model, make_default=make_default)
        except Qwen38Error as e:
            _fail(e)
        click.echo(f"added {name} -> {model} served at {url}")
    else:
        from qwen38_backend.loading.registry import add_weights

        try:
            name, target, weights = add_weights(path, name, make_default=make_default)
        except Qwen38Error as e:
            _fail(e)
        arch = weights.config.get("model_type", "?")
        click.echo(f"added {name} -> {target} ({arch}, {weights.format})")
    if make_default:
        click.echo(f"`llm -m qwen38` now uses {name}")


@qwen38_group.command(name="list")
def list_models() -> None:
    """List registered models (the default is marked *)."""
    data = _home.read_registry()
    default = data.get("default")
    click.echo(f"{_home.DEMO_NAME}  (embedded demo; fetched on first use)")
    for name, entry in sorted(data["models"].items()):
        if name == _home.DEMO_NAME:
            continue
        mark = "*" if name == default else " "
        if "url" in entry:
            click.echo(f"{mark} {name}  {entry.get('model')} at {entry['url']}")
            continue
        path = Path(entry.get("path", ""))
        missing = "" if path.exists() else "  [missing]"
        click.echo(f"{mark} {name}  {path}{missing}")
    if default is None:
        click.echo("no default: `llm qwen38 default NAME` makes `llm -m qwen38` use NAME")


@qwen38_group.command()
@click.argument("name")
def remove(name: str) -> None:
    """Forget a registered model (its files stay)."""
    from qwen38_backend.errors import Qwen38Error

    try:
        _registry().remove(name)
    except Qwen38Error as e:
        _fail(e)
    click.echo(f"removed {name}")


@qwen38_group.command()
@click.argument("name", required=False)
@click.option("--clear", is_flag=True, help="Unset the default")
def default(name: str | None, clear: bool) -> None:
    """Show or set the model `llm -m qwen38` uses."""
    from qwen38_backend.errors import Qwen38Error

    reg = _registry()
    try:
        if clear:
            reg.default = None
            click.echo("default cleared")
        elif name is None:
            click.echo(reg.default or "no default set")
        else:
            reg.default = name
            click.echo(f"`llm -m qwen38` now uses {name}")
    except Qwen38Error as e:
        _fail(e)


@qwen38_group.command()
@click.argument("name", required=False)
@click.option("--context", type=int, help="Also show the memory plan for this context")
def info(name: str | None, context: int | None) -> None:
    """Describe a model (default: the `qwen38` default) and where data is kept."""
    from qwen38_backend.errors import Qwen38Error
    from qwen38_backend.info import describe

    target = name or _home.default_name()
    if target is None:
        raise click.ClickException(
            "no model given and no default set; try `llm qwen38 info qwen38-demo`"
        )
    _home.ensure_home()
    try:
        click.echo(describe(target, context=context))
    except Qwen38Error as e:
        _fail(e)
    from qwen38_backend.loading import paths
    from qwen38_backend.loading.registry import Registry

    click.echo(f"registry      {Registry().path}")
    click.echo(f"weights cache {paths.cache_dir()}")
    click.echo(f"state files   {_home.state_files_dir()}")


@qwen38_group.command(name="fetch-demo")
def fetch_demo() -> None:
    """Download the demo model now (98 MB, verified)."""
    from qwen38_backend.errors import Qwen38Error
    from qwen38_backend.loading.demo import ensure_demo

    _home.ensure_home()
    try:
        path = ensure_demo(progress=True)
    except Qwen38Error as e:
        _fail(e)
    click.echo(f"{_home.DEMO_NAME}: {path}")


# ----- prefix store ------------------------------------------------------------------------


@qwen38_group.group()
def cache() -> None:
    """The prefix store: state files that let `llm -c` resume without re-prefilling."""


def _store():
    """The prefix store (None: an engine without one; then nothing is cached on disk)."""
    _home.ensure_home()
    from . import _prefix

    return _prefix.store()


@cache.command(name="list")
def cache_list() -> None:
    """List state files, most recently used first."""
    store = _store()
    entries = [e for e in store.entries() if e.tier == "disk"] if store is not None else []
    total = sum(e.nbytes for e in entries)
    for e in entries:
        stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.last_used))
        size = _home.format_size(e.nbytes)
        click.echo(f"{stamp}  {size:>10}  {e.n_tokens:>8} tokens  model {e.model_fingerprint[:12]}")
    cap = _home.format_size(_home.prefix_store_cap())
    click.echo(f"{len(entries)} state files, {_home.format_size(total)} (cap {cap})")
    click.echo(f"directory: {_home.state_files_dir()}")


@cache.command(name="prune")
@click.option("--max-bytes", "max_bytes", help="Keep at most this much, e.g. 2GB")
@click.option("--older-than-days", type=float, help="Also drop state files unused this long")
@click.option("--save", "save_cap", is_flag=True, help="Store --max-bytes as the cap")
def cache_prune(max_bytes: str | None, older_than_days: float | None, save_cap: bool) -> None:
    """Delete least-recently-used state files beyond the byte cap."""
    try:
        cap = _home.parse_size(max_bytes) if max_bytes is not None else _home.prefix_store_cap()
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--max-bytes") from e
    if older_than_days is not None and older_than_days < 0:
        raise click.BadParameter("must be >= 0", param_hint="--older-than-days")
    if save_cap:
        if max_bytes is None:
            raise click.UsageError("--save needs --max-bytes")
        _home.save_settings({**_home.settings(), _home.CAP_KEY: cap})
    store = _store()
    if store is None:
        click.echo("no prefix store in this engine version; nothing to prune")
        return
    older = older_than_days * 86400 if older_than_days is not None else None
    removed = store.prune(max_bytes=cap, older_than=older)
    click.echo(f"removed {len(removed)} state files; {_home.format_size(store.disk_bytes())} kept")


@cache.command(name="clear")
@click.option("--yes", "-y", is_flag=True, help="Do not ask")
def cache_clear(yes: bool) -> None:
    """Delete every state file."""
    store = _store()
    if store is None:
        click.echo("no prefix store in this engine version; nothing to clear")
        return
    n = len([e for e in store.entries() if e.tier == "disk"])
    if n and not yes:
        click.confirm(f"delete {n} state files?", abort=True)
    store.clear()
    click.echo(f"removed {n} state files")
