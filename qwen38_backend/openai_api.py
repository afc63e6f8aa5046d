"""The OpenAI chat-completions wire format, both ways, without the engine (no MLX here).

`qwen38 serve` reads a request body into the arguments of the one engine path
(`request.build_request`): OpenAI's fields are translated, the engine's own options (top_k,
kv_*, context, enable_thinking, chat_template_kwargs, reasoning, tool_style, ...) pass
through by name and the engine refuses any it does not know. Engine events become a
`chat.completion` object or `chat.completion.chunk`s; usage carries the prompt tokens the
prefix store supplied as `prompt_tokens_details.cached_tokens`. Reasoning travels as
`reasoning_content` (the field vLLM and DeepSeek's API use). `qwen38_backend.client` reads
the same format back into events.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidOptionError, ModelNotFoundError
from .events import Event

DEFAULT_ALIAS = "qwen38"  # "the default model": on a server, the one it serves

# OpenAI fields the engine has no use for, accepted at their neutral value only
NEUTRAL = {
    "n": (1,),
    "logprobs": (False,),
    "top_logprobs": (0,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
}
IGNORED = frozenset({"user", "parallel_tool_calls", "metadata", "store"})  # no effect on tokens
# build_request's keyword arguments besides **options
CALL_KEYS = frozenset({"tool_choice", "tool_style", "response_format", "reasoning"})
NOT_OVER_HTTP = frozenset({"logits_processors"})  # Python callables


@dataclass
class ChatCall:
    """One chat request, as build_request's arguments (JSON, so other ranks can get it)."""

    model: str
    stream: bool
    include_usage: bool
    args: dict[str, Any] = field(default_factory=dict)  # prompt, tools, tool_choice, ..., options


def parse_chat_request(body: Any, served: str) -> ChatCall:
    """A chat-completions body -> ChatCall; InvalidOptionError / ModelNotFoundError name what
    is wrong (the server answers 400 / 404 before any work)."""
    if not isinstance(body, dict):
        raise InvalidOptionError("the request body must be a JSON object")
    body = dict(body)
    model = body.pop("model", None)
    if model not in (None, served, DEFAULT_ALIAS):
        raise ModelNotFoundError(f"model {model!r} is not served here; this server has {served!r}")
    messages = body.pop("messages", None)
    if not isinstance(messages, list) or not messages:
        raise InvalidOptionError("messages must be a non-empty list of chat messages")
    stream = body.pop("stream", False)
    if not isinstance(stream, bool):
        raise InvalidOptionError(f"stream={stream!r}: must be true or false")
    stream_options = body.pop("stream_options", None) or {}
    if not isinstance(stream_options, dict):
        raise InvalidOptionError("stream_options must be an object")
    include_usage = bool(stream_options.get("include_usage", False))

    for name, neutral in NEUTRAL.items():
        value = body.pop(name, None)
        if value is not None and value not in neutral:
            raise InvalidOptionError(
                f"{name}={value!r} is not supported (only {neutral[0]!r}); leave it unset"
            )
    for name in IGNORED:
        body.pop(name, None)
    refused = sorted(NOT_OVER_HTTP & set(body))
    if refused:
        raise InvalidOptionError(f"{', '.join(refused)} cannot be sent over HTTP")

    limit = body.pop("max_completion_tokens", None)
    if limit is not None:
        if body.get("max_tokens") not in (None, limit):
            raise InvalidOptionError("max_tokens and max_completion_tokens differ; send one")
        body["max_tokens"] = limit
    if isinstance(body.get("stop"), str):
        body["stop"] = [body["stop"]]
    response_format = body.pop("response_format", None)
    if isinstance(response_format, dict) and response_format.get("type") == "text":
        response_format = None
    tools = body.pop("tools", None) or None
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) and "function" in t for t in tools)
    ):
        raise InvalidOptionError('tools must be a list of {"type": "function", "function": {...}}')
    args: dict[str, Any] = {
        "prompt": [_message(m, i) for i, m in enumerate(messages)],
        "tools": tools,
        "response_format": response_format,
        # unset sampling options follow the model's generation_config, as locally in llm
        "model_sampling": True,
    }
    args.update({k: body.pop(k) for k in CALL_KEYS & set(body)})
    args.update({k: v for k, v in body.items() if v is not None})  # the engine checks names
    return ChatCall(
        model=served, stream=stream, include_usage=include_usage or not stream, args=args
    )


def _message(m: Any, i: int) -> dict[str, Any]:
    """An OpenAI message -> the engine's message dict (text content, arguments as mappings)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise InvalidOptionError(f"messages[{i}] must be an object with a 'role'")
    role = "system" if m["role"] == "developer" else m["role"]
    if role not in ("system", "user", "assistant", "tool"):
        raise InvalidOptionError(f"messages[{i}]: unknown role {m['role']!r}")
    out = {k: v for k, v in m.items() if k not in ("role", "content", "tool_calls")}
    out["role"] = role
    out["content"] = _text(m.get("content"), i)
    calls = m.get("tool_calls")
    if calls:
        out["tool_calls"] = [_call(c, i) for c in calls]
    return out


def _text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidOptionError(f"messages[{i}]: a {kind!r} part; this model reads text")
        return "".join(parts)
    raise InvalidOptionError(f"messages[{i}].content must be a string or a list of text parts")


def _call(call: Any, i: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidOptionError(f"messages[{i}].tool_calls: each needs function.name")
    arguments = fn.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise InvalidOptionError(
                f"messages[{i}].tool_calls: arguments of {fn['name']!r} are not JSON ({e})"
            ) from e
    # templates iterate over the arguments: a mapping, not OpenAI's JSON string
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": fn["name"], "arguments": arguments},
    }


# ----- engine events -> responses -----------------------------------------------------------


def usage_of(done: Event) -> dict[str, Any]:
    u = done.usage or {}
    prompt, generated = u.get("prompt", 0), u.get("generated", 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": u.get("cached", 0)},
    }


def tool_call_json(event: Event, index: int) -> dict[str, Any]:
    call = event.tool_call
    assert call is not None
    return {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
    }


class Reply:
    """Builds the answer to one call from its events: chunks as they come, or the whole."""

    def __init__(self, model: str):
        self.model = model
        self.id = "chatcmpl-" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.done: Event | None = None
        self.extra: dict[str, Any] = {}  # the engine's own figures, under "qwen38"

    def _chunk(self, delta: dict, finish: str | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    def first_chunk(self) -> dict[str, Any]:
        return self._chunk({"role": "assistant", "content": ""})

    def feed(self, event: Event) -> list[dict[str, Any]]:
        """Record an event; return the stream chunks it makes (the done event: none, see
        `last_chunks`)."""
        if event.type == "text":
            self.text.append(event.text)
            return [self._chunk({"content": event.text})]
        if event.type == "reasoning":
            self.reasoning.append(event.text)
            return [self._chunk({"reasoning_content": event.text})]
        if event.type == "tool_call":
            call = tool_call_json(event, len(self.calls))
            self.calls.append(call)
            return [self._chunk({"tool_calls": [call]})]
        self.done = event
        return []

    @property
    def finish_reason(self) -> str | None:
        reason = self.done.finish_reason if self.done else None
        return "tool_calls" if self.calls and reason == "stop" else reason

    def _qwen38(self) -> dict[str, Any]:
        incomplete = self.done.incomplete if self.done else None
        return {**self.extra, "incomplete": incomplete}

    def last_chunks(self, include_usage: bool) -> list[dict[str, Any]]:
        last = self._chunk({}, self.finish_reason)
        last["qwen38"] = self._qwen38()
        out = [last]
        if include_usage and self.done is not None:
            usage = {**self._chunk({}), "choices": [], "usage": usage_of(self.done)}
            out.append(usage)
        return out

    def completion(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self.text)}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [
                {k: v for k, v in c.items() if k != "index"} for c in self.calls
            ]
            message["content"] = message["content"] or None
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason}],
            "usage": usage_of(self.done) if self.done else None,
            "qwen38": self._qwen38(),
        }


def error_body(message: str, kind: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def models_body(model: str, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "qwen38"}],
    }
