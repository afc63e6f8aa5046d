"""A client of `qwen38 serve` (stdlib HTTP only, no MLX): the server's stream back as the
engine's own events, so the llm plugin and ChatQwen38 translate a served model's answer with
the code that translates a local one.

    client = ServedModel("http://127.0.0.1:8080")
    for event in client.generate(messages, tools, max_tokens=64): ...   # Event, as Session's

The done event's usage has the engine's keys (prompt, cached, generated); `last` keeps the
server's whole final figures (usage, finish_reason, speeds).
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from . import errors
from .events import Event, ToolCall, new_call_id

# the server's error codes -> the engine's error types (openai_api / serve.py)
ERROR_CODES = {
    "context_length_exceeded": errors.ContextWindowError,
    "invalid_option": errors.InvalidOptionError,
    "model_not_found": errors.ModelNotFoundError,
    "admission_refused": errors.AdmissionError,
}


class ServerError(errors.Qwen38Error):
    """The server could not be reached or answered with something other than the API."""


def normalize_url(url: str) -> str:
    """`http(s)://host:port` with no trailing slash or `/v1` (what the server is called by)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise errors.InvalidOptionError(
            f"server URL {url!r} must start with http:// or https:// (e.g. http://127.0.0.1:8080)"
        )
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


class ServedModel:
    """One model behind a `qwen38 serve` URL (`model`: its id; None: the server's own)."""

    def __init__(self, url: str, model: str | None = None, timeout: float | None = None):
        self.url = normalize_url(url)
        self.model = model
        self.timeout = timeout
        self.last: dict[str, Any] = {}

    def _open(self, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise _error_from(e) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ServerError(
                f"cannot reach the qwen38 server at {self.url} ({reason}); is `qwen38 serve` "
                "running there?"
            ) from None

    def models(self) -> list[str]:
        """The model ids the server serves."""
        with self._open("/v1/models") as resp:
            try:
                return [m["id"] for m in json.load(resp)["data"]]
            except (ValueError, KeyError, TypeError) as e:
                raise ServerError(f"{self.url}/v1/models: not a model list ({e})") from None

    def generate(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        cancel: threading.Event | None = None,
        **options: Any,
    ) -> Iterator[Event]:
        """Stream one answer as events (text, reasoning, tool_call, then done). Options go to
        the server by name (sampling, KV, reasoning, tool_choice, response_format, ...);
        closing the iterator, or setting `cancel`, drops the connection, which cancels the
        generation on the server."""
        body: dict[str, Any] = {
            "messages": [_wire_message(m) for m in messages],
            "stream": True,
            "stream_options": {"include_usage": True},
            **{k: v for k, v in options.items() if v is not None},
        }
        if self.model is not None:
            body["model"] = self.model
        if tools:
            body["tools"] = tools
        self.last = {}
        resp = self._open("/v1/chat/completions", body)
        calls: dict[int, dict[str, str]] = {}
        finish = None
        extra: dict[str, Any] = {}
        usage: dict[str, Any] = {}
        try:
            for line in resp:
                if cancel is not None and cancel.is_set():
                    return
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise _typed(chunk["error"])
                usage = chunk.get("usage") or usage
                extra = chunk.get("qwen38") or extra
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("reasoning_content"):
                        yield Event("reasoning", text=delta["reasoning_content"])
                    if delta.get("content"):
                        yield Event("text", text=delta["content"])
                    for call in delta.get("tool_calls") or []:
                        part = calls.setdefault(call.get("index", len(calls)), {})
                        part["id"] = call.get("id") or part.get("id") or new_call_id()
                        fn = call.get("function") or {}
                        part["name"] = part.get("name", "") + (fn.get("name") or "")
                        part["arguments"] = part.get("arguments", "") + (fn.get("arguments") or "")
                    finish = choice.get("finish_reason") or finish
        finally:
            resp.close()
        for _, part in sorted(calls.items()):
            args = json.loads(part["arguments"]) if part["arguments"].strip() else {}
            yield Event("tool_call", tool_call=ToolCall(part["name"], args, part["id"]))
        details = usage.get("prompt_tokens_details") or {}
        self.last = {**extra, "usage": usage, "finish_reason": finish}
        yield Event(
            "done",
            # the engine says "stop" when an answer ends in calls; OpenAI says "tool_calls"
            finish_reason="stop" if finish == "tool_calls" else finish,
            usage={
                "prompt": usage.get("prompt_tokens", 0),
                "cached": details.get("cached_tokens", 0),
                "generated": usage.get("completion_tokens", 0),
            },
            incomplete=extra.get("incomplete"),
        )


def _wire_message(m: dict) -> dict:
    """OpenAI's form: tool-call arguments as a JSON string."""
    if not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        fn = dict(c.get("function") or {})
        if not isinstance(fn.get("arguments"), str):
            fn["arguments"] = json.dumps(fn.get("arguments") or {})
        calls.append({**c, "type": "function", "function": fn})
    return {**m, "tool_calls": calls}


def _typed(error: Any) -> errors.Qwen38Error:
    if not isinstance(error, dict):
        return ServerError(str(error))
    cls = ERROR_CODES.get(error.get("code") or "", ServerError)
    return cls(str(error.get("message")))


def _error_from(e: urllib.error.HTTPError) -> errors.Qwen38Error:
    try:
        body = json.loads(e.read())
    except ValueError:
        return ServerError(f"HTTP {e.code} from {e.url}")
    return _typed(body.get("error") if isinstance(body, dict) else body)
