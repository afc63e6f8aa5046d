"""The heavy half of the plugin: loaded models, live sessions, and the engine worker thread.

All MLX work (loading and generation) runs on the engine thread (qwen38_backend.worker):
MLX streams are thread-local, so sync and async callers must share one thread, and it never
exits (see worker.py). Events come back through a queue.
Per process:
- models are loaded once per resolved path;
- one Session per (model, conversation id) keeps its KV state between turns, so `llm chat`
  only prefills what is new;
- sessions use the prefix store in `llm.user_dir()/qwen38/checkpoints`, so a new process
  (`llm -c`) restores the saved prefix instead of prefilling it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
import warnings
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llm
from llm.parts import StreamEvent

from . import _home, _prefix

MAX_SESSIONS = 8  # live conversations kept per process (LRU)

_MODELS: dict[Path, Any] = {}
_SESSIONS: OrderedDict[tuple[Path, str], Any] = OrderedDict()


# ----- resolving and loading (engine thread) -------------------------------------------------


def resolve_target(target: str | None) -> Path:
    """Path of the weights for a model id's target (None: the user's default)."""
    from qwen38_backend.loading.registry import resolve

    if target is None:
        name = _home.default_name()
        if name is None:
            raise llm.ModelError(
                "no default qwen38 model is configured. Register local weights with "
                "`llm qwen38 add PATH --name NAME --default` (or pick one with "
                "`llm qwen38 default NAME`); meanwhile `llm -m qwen38-demo` works now "
                "(it fetches a 98 MB demo model once)."
            )
        target = name
    return Path(resolve(target)).resolve()


def served_target(target: str | None) -> tuple[str, str] | None:
    """(url, served model id) when the model id's target is a `qwen38 serve` entry."""
    from qwen38_backend.loading.registry import Registry

    name = target if target is not None else _home.default_name()
    return Registry().served(name) if name is not None else None


def load(path: Path) -> Any:
    model = _MODELS.get(path)
    if model is None:
        import qwen38_backend

        model = qwen38_backend.load(str(path))
        _MODELS[path] = model
    return model


def _new_session(model: Any, cache: bool) -> Any:
    if not cache:
        return model.session(cache=False)
    store = _prefix.store()
    return model.session(cache=store) if store is not None else model.session()


def session_for(model: Any, path: Path, conversation_id: str | None, cache: bool) -> Any:
    """The live Session of this conversation (a fresh one when caching is off)."""
    if not cache or conversation_id is None:
        return _new_session(model, cache)
    key = (path, conversation_id)
    session = _SESSIONS.get(key)
    if session is None:
        session = _new_session(model, cache)
        _SESSIONS[key] = session
        while len(_SESSIONS) > MAX_SESSIONS:
            _SESSIONS.popitem(last=False)
    _SESSIONS.move_to_end(key)
    return session


# ----- llm messages -> chat messages ---------------------------------------------------------


def chat_messages(prompt: llm.Prompt) -> list[dict]:
    """The whole conversation as chat-template messages, from `prompt.messages` only.

    (llm 0.36 passes the full history there; `conversation.responses` is empty on `llm -c`
    and `prompt.system` is empty on continued turns.)
    """
    from llm.parts import (
        AttachmentPart,
        ReasoningPart,
        TextPart,
        ToolCallPart,
        ToolResultPart,
    )

    out: list[dict] = []
    for message in prompt.messages:
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict] = []
        results: list[dict] = []
        for part in message.parts:
            if isinstance(part, TextPart):
                texts.append(part.text)
            elif isinstance(part, ReasoningPart):
                if part.text:
                    reasoning.append(part.text)
            elif isinstance(part, ToolCallPart):
                calls.append(
                    {
                        "type": "function",
                        "id": part.tool_call_id,
                        "function": {"name": part.name, "arguments": dict(part.arguments or {})},
                    }
                )
            elif isinstance(part, ToolResultPart):
                content = part.output
                if part.exception:
                    content = f"Error: {part.exception}"
                results.append(
                    {
                        "role": "tool",
                        "content": content,
                        "tool_call_id": part.tool_call_id,
                        "name": part.name,
                    }
                )
            elif isinstance(part, AttachmentPart):
                raise llm.ModelError("qwen38 models take text only (no attachments)")
        if message.role == "tool" or results:
            out.extend(results)
            continue
        entry: dict[str, Any] = {"role": message.role, "content": "".join(texts)}
        if message.role == "assistant":
            if reasoning:
                entry["reasoning_content"] = "".join(reasoning)
            if calls:
                entry["tool_calls"] = calls
        elif message.role == "system" and not entry["content"]:
            continue
        out.append(entry)
    if not out:
        raise llm.ModelError("empty prompt: nothing to send to the model")
    return out


def tool_specs(prompt: llm.Prompt) -> list[dict]:
    """OpenAI-style function specs for the chat template (and the tool-call grammar)."""
    specs = []
    for tool in prompt.tools:
        if not isinstance(tool, llm.Tool):
            continue
        specs.append(
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description or "",
                    "parameters": tool.input_schema or {"type": "object", "properties": {}},
                },
            }
        )
    return specs


# ----- one generation (engine thread) -------------------------------------------------------


@dataclass
class Request:
    """Everything a generation needs, captured on the caller's thread."""

    target: str | None
    model_id: str
    messages: list[dict]
    tools: list[dict]
    options: dict[str, Any]
    schema: dict | None
    conversation_id: str | None
    cancel: threading.Event = field(default_factory=threading.Event)


def build_request(model: Any, prompt: llm.Prompt, conversation: Any) -> Request:
    options = {k: v for k, v in prompt.options.model_dump().items() if v is not None}
    schema = prompt.schema
    if schema is not None and not isinstance(schema, dict):
        schema = json.loads(json.dumps(schema))
    return Request(
        target=model.target,
        model_id=model.model_id,
        messages=chat_messages(prompt),
        tools=tool_specs(prompt),
        options=options,
        schema=schema,
        conversation_id=getattr(conversation, "id", None),
    )


def run(request: Request, emit: Callable[[tuple], None]) -> None:
    """Generate on the engine thread; emit ("text"|"reasoning"|"tool_call"|"done", payload).

    Only translation happens here: llm's options map onto one Session.generate call, which
    decides reasoning, constraints, the window and max_tokens (qwen38_backend.request)."""
    path = resolve_target(request.target)
    model = load(path)
    opts = dict(request.options)
    cache = opts.pop("cache", True)
    session = session_for(model, path, request.conversation_id, cache)
    # messages (not ids): the request records the last message boundary, where models with
    # recurrent layers snapshot to reuse the conversation on the next turn
    shape = {
        "tool_choice": opts.pop("tool_choice", None),
        "tool_style": opts.pop("tool_style", None),
        "response_format": request.schema,
        "reasoning": opts.pop("think", None),
        "model_sampling": True,
    }
    req = session.request(request.messages, request.tools or None, **shape, **opts)
    from qwen38_backend.prefix_store import StateFileWarning

    if cache:
        _prefix.store().last_error = None  # report this call's state-file problems only
    incomplete = None
    with warnings.catch_warnings():
        # reported once, on its own line, by execute() (and in response_json)
        warnings.simplefilter("ignore", StateFileWarning)
        if cache and not req.kv and any(m.get("role") == "assistant" for m in request.messages):
            # `llm -c` repeats none of the first call's options: the conversation goes on
            # in the KV layout its state was computed in (Session.continued_kv)
            kv = session.continued_kv(req.ids)
            if kv:
                req = session.request(
                    request.messages, request.tools or None, **shape, **opts, **kv
                )
        events = session.generate(req, cancel=request.cancel)
        try:
            for event in events:
                if event.type == "done":
                    incomplete = event.incomplete  # usage comes from session.last_stats
                    continue
                if event.type == "tool_call":
                    emit(("tool_call", event.tool_call))
                elif event.text:
                    emit((event.type, event.text))
        finally:
            events.close()
    stats = session.last_stats
    info = {
        "model": request.model_id,
        "weights": str(path),
        "finish_reason": stats.finish_reason if stats else None,
        "prompt_tokens": stats.prompt_tokens if stats else len(req.ids),
        "cached_tokens": stats.cached_tokens if stats else 0,
        "state_file_error": _prefix.last_error() if cache else None,
        "generated_tokens": stats.generated_tokens if stats else 0,
        "prefill_tokens_per_second": round(stats.prefill_tokens_per_second, 2) if stats else 0,
        "decode_tokens_per_second": round(stats.decode_tokens_per_second, 2) if stats else 0,
        "prefill_seconds": round(stats.prefill_seconds, 4) if stats else 0,
        "decode_seconds": round(stats.decode_seconds, 4) if stats else 0,
        "kv": dict(stats.kv) if stats else {},
        "draft": stats.draft_stats() if stats else {},
        "constrained": req.constrained,
        "incomplete": incomplete,
    }
    emit(("done", info))


# ----- the worker bridge --------------------------------------------------------------------


class _Error:
    def __init__(self, exc: BaseException):
        self.exc = exc


_END = object()


class LoopQueue:
    """Items handed from a worker thread to the running event loop: `put` from any thread
    (the worker's protocol: items, then `_Error(exc)` if it failed, then `_END`), `items()`
    on the loop yields them and raises the error."""

    def __init__(self, fail: Callable[[BaseException], None] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.fail = fail or _raise  # how a worker's exception reaches the caller

    def put(self, item: Any) -> None:
        with contextlib.suppress(RuntimeError):  # loop closed: nobody is listening
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def items(self) -> AsyncIterator[Any]:
        while True:
            item = await self.queue.get()
            if item is _END:
                return
            if isinstance(item, _Error):
                self.fail(item.exc)
            yield item


def _engine() -> Any:
    from qwen38_backend.worker import engine_thread

    return engine_thread()


def _work(request: Request, put: Callable[[Any], None]) -> None:
    try:
        run(request, put)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
        put(_Error(exc))
    finally:
        put(_END)


def _raise(exc: BaseException) -> None:
    from qwen38_backend.errors import Qwen38Error

    if isinstance(exc, (llm.ModelError, ValueError)):
        raise exc
    if isinstance(exc, Qwen38Error):
        raise llm.ModelError(str(exc)) from exc
    raise exc


class _Translator:
    """Engine events -> llm StreamEvents, tool calls and usage on the response."""

    def __init__(self, response: Any):
        self.response = response

    def __call__(self, item: tuple) -> list[StreamEvent]:
        kind, payload = item
        if kind in ("text", "reasoning"):
            return [StreamEvent(type=kind, chunk=payload)]
        if kind == "tool_call":
            call_id = payload.id
            self.response.add_tool_call(
                llm.ToolCall(name=payload.name, arguments=payload.arguments, tool_call_id=call_id)
            )
            return [
                StreamEvent(type="tool_call_name", chunk=payload.name, tool_call_id=call_id),
                StreamEvent(
                    type="tool_call_args",
                    chunk=json.dumps(payload.arguments),
                    tool_call_id=call_id,
                ),
            ]
        if kind == "done":
            info = payload
            details = {"cached_tokens": info["cached_tokens"]}
            self.response.set_usage(
                input=info["prompt_tokens"], output=info["generated_tokens"], details=details
            )
            self.response.response_json = info
            return []
        raise AssertionError(f"unknown engine event {kind!r}")


def execute(model: Any, prompt: llm.Prompt, response: Any, conversation: Any) -> Iterator[Any]:
    """Stream one answer. The first Ctrl-C stops the engine at the next prefill chunk or token
    and ends the answer there (llm logs it, so `llm -c` continues after what was shown); a
    second Ctrl-C leaves at once (the engine thread still stops cleanly at exit)."""
    _home.ensure_home()
    request = build_request(model, prompt, conversation)
    engine = _engine()
    engine.cancel_at_exit(request.cancel)
    q: queue.Queue = queue.Queue()
    engine.submit(_work, request, q.put)
    from qwen38_backend.interrupts import first_sigint_cancels

    translate = _Translator(response)

    def interrupted() -> None:
        _note("interrupted: stopping at the next token (Ctrl-C again to quit now)")

    # the handler stays while llm prints a chunk between yields: a Ctrl-C there must stop the
    # engine, not abort llm
    try:
        with first_sigint_cancels(request.cancel, interrupted):
            while True:
                try:
                    item = q.get()
                except KeyboardInterrupt:  # off the main thread: no handler was set
                    if request.cancel.is_set():
                        raise
                    request.cancel.set()
                    interrupted()
                    continue
                if item is _END:
                    break
                if isinstance(item, _Error):
                    _raise(item.exc)
                yield from translate(item)
    finally:
        request.cancel.set()  # an abandoned stream stops the engine at the next token
        engine.forget_cancel(request.cancel)
    report(response.response_json or {})


def report(info: dict) -> None:
    """After an answer: state-file problems, a constraint cut short, a stop by Ctrl-C."""
    if info.get("state_file_error"):
        _note(info["state_file_error"])
    if info.get("incomplete"):
        what = {"tool_call": "tool call"}.get(info["incomplete"], "JSON")
        raise llm.ModelError(
            f"the answer was cut at max_tokens ({info['generated_tokens']} tokens) before the "
            f"{what} was complete (finish_reason: length): the output above is not valid; "
            "raise -o max_tokens"
        )
    if info.get("finish_reason") == "cancelled":
        _note(
            f"stopped after {info.get('generated_tokens', 0)} tokens; the partial answer is "
            "kept (`llm -c` continues after it)"
        )


def _note(text: str) -> None:
    """One line on stderr, on its own line (the answer may have stopped mid-line)."""
    import sys

    sys.stdout.flush()
    sys.stderr.write(f"\nqwen38: {text}\n")
    sys.stderr.flush()


async def execute_async(
    model: Any, prompt: llm.Prompt, response: Any, conversation: Any
) -> AsyncIterator[Any]:
    _home.ensure_home()
    request = build_request(model, prompt, conversation)
    bridge = LoopQueue()
    engine = _engine()
    engine.cancel_at_exit(request.cancel)
    engine.submit(_work, request, bridge.put)
    translate = _Translator(response)
    try:
        async for item in bridge.items():
            for event in translate(item):
                yield event
    finally:
        request.cancel.set()
        engine.forget_cancel(request.cancel)
