"""A model served by `qwen38 serve` (`llm qwen38 add --url URL --name NAME`): llm's prompt goes
to the server as one chat call, and the server's stream comes back as the engine's events
(qwen38_backend.client), translated by the same code as a local answer. The server keeps the
model loaded and its prefix store warm between `llm` processes, so `llm -c` shows the
conversation's cached tokens in response_json.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import llm

from ._runtime import (
    _END,
    LoopQueue,
    _Error,
    _note,
    _Translator,
    chat_messages,
    report,
    tool_specs,
)


def _options(prompt: llm.Prompt) -> dict[str, Any]:
    """llm's options under the server's (the engine's) names."""
    opts = {k: v for k, v in prompt.options.model_dump().items() if v is not None}
    if opts.pop("cache", True) is False:
        raise llm.ModelError(
            "-o cache false is not available for a served model (the server keeps its own "
            "prefix store)"
        )
    if "think" in opts:
        opts["reasoning"] = opts.pop("think")
    schema = prompt.schema
    if schema is not None:
        if not isinstance(schema, dict):
            schema = json.loads(json.dumps(schema))
        opts["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "schema", "schema": schema},
        }
    return opts


def _stream(model: Any, served: tuple[str, str], prompt: llm.Prompt, cancel: threading.Event):
    from qwen38_backend.client import ServedModel

    url, model_id = served
    client = ServedModel(url, model_id or None)
    messages, tools = chat_messages(prompt), tool_specs(prompt)
    events = client.generate(messages, tools or None, cancel=cancel, **_options(prompt))
    return client, events


def _done_info(model: Any, served: tuple[str, str], client: Any, event: Any) -> dict:
    usage = event.usage or {}
    return {
        **client.last,
        "model": model.model_id,
        "url": served[0],
        "served_model": served[1],
        "finish_reason": event.finish_reason,
        "prompt_tokens": usage.get("prompt", 0),
        "cached_tokens": usage.get("cached", 0),
        "generated_tokens": usage.get("generated", 0),
        "incomplete": event.incomplete,
    }


def _items(model: Any, served: tuple[str, str], client: Any, events: Iterator[Any]):
    """The engine's events as the (kind, payload) items `_Translator` reads."""
    for event in events:
        if event.type == "done":
            yield ("done", _done_info(model, served, client, event))
        elif event.type == "tool_call":
            yield ("tool_call", event.tool_call)
        elif event.text:
            yield (event.type, event.text)


def _raise(exc: BaseException) -> None:
    from qwen38_backend.errors import Qwen38Error

    if isinstance(exc, Qwen38Error):
        raise llm.ModelError(str(exc)) from exc
    raise exc


def execute(model: Any, served: tuple[str, str], prompt: llm.Prompt, response: Any) -> Iterator:
    """Stream the served answer; Ctrl-C drops the connection (the server stops generating)
    and keeps what was shown."""
    cancel = threading.Event()
    translate = _Translator(response)
    try:
        client, events = _stream(model, served, prompt, cancel)
        try:
            for item in _items(model, served, client, events):
                yield from translate(item)
        finally:
            events.close()
    except KeyboardInterrupt:
        _note("interrupted: the server stops this answer")
        return
    except Exception as exc:  # noqa: BLE001 - engine errors become llm errors
        _raise(exc)
    report(response.response_json or {})


async def execute_async(
    model: Any, served: tuple[str, str], prompt: llm.Prompt, response: Any
) -> AsyncIterator[Any]:
    """The same, read on a thread so the event loop never blocks on the socket."""
    bridge = LoopQueue(_raise)
    cancel = threading.Event()

    def work() -> None:
        try:
            client, events = _stream(model, served, prompt, cancel)
            try:
                for item in _items(model, served, client, events):
                    bridge.put(item)
            finally:
                events.close()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            bridge.put(_Error(exc))
        finally:
            bridge.put(_END)

    threading.Thread(target=work, name="qwen38-remote", daemon=True).start()
    translate = _Translator(response)
    try:
        async for item in bridge.items():
            for event in translate(item):
                yield event
    finally:
        cancel.set()
    report(response.response_json or {})
