"""Stream events and the parser that turns generated text into text / reasoning / tool calls.

`StreamParser.feed(delta)` splits streamed text: text inside `<think>...</think>` is reasoning,
each `<tool_call>...</tool_call>` block becomes one ToolCall, everything else is text. Only a
possible partial tag at the end of a delta is held back. Tool-call bodies may be Qwen XML

    <function=NAME>
    <parameter=ARG>
    value
    </parameter>
    </function>

or JSON `{"name": ..., "arguments": {...}}`. A body that is neither comes back as text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ToolCall",
    "Event",
    "StreamParser",
    "parse_completion",
    "parse_tool_call",
    "parameter_types",
    "new_call_id",
]

EVENT_TYPES = ("text", "reasoning", "tool_call", "done")


@dataclass
class ToolCall:
    """One function call the model asked for."""

    name: str
    arguments: dict
    id: str


@dataclass
class Event:
    """A stream event: type is "text", "reasoning", "tool_call" or "done"."""

    type: str
    text: str = ""
    tool_call: ToolCall | None = None
    finish_reason: str | None = None
    usage: dict | None = None
    # On a done event cut by max_tokens under a constraint: what was cut ("schema", "json",
    # "tool_call"), i.e. the output is not a complete value. None otherwise.
    incomplete: str | None = None

    def __post_init__(self) -> None:
        if self.type not in EVENT_TYPES:
            raise ValueError(f"Event type must be one of {EVENT_TYPES}, got {self.type!r}")


def new_call_id() -> str:
    """A fresh tool-call id: "call_" + 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


_FUNCTION_RE = re.compile(r"\A\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.DOTALL)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


def _xml_value(raw: str, declared: str | None = None) -> Any:
    """An XML parameter's value: the tool schema's declared type decides when known
    (a string parameter stays text even if it looks like a number); else JSON if it parses."""
    # The newline after <parameter=...> and before </parameter> belongs to the format.
    if raw.startswith("\n"):
        raw = raw[1:]
    if raw.endswith("\n"):
        raw = raw[:-1]
    if declared == "string":
        return raw.strip()
    try:
        value = json.loads(raw)
    except ValueError:
        return raw.strip()
    return raw.strip() if isinstance(value, str) else value


def parameter_types(tools: list | None) -> dict[str, dict[str, str]]:
    """tool name -> {parameter: JSON-schema type} from OpenAI-style tool specs."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or "name" not in fn:
            continue
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn["name"]] = {
            p: spec.get("type")
            for p, spec in props.items()
            if isinstance(spec, dict) and isinstance(spec.get("type"), str)
        }
    return out


def parse_tool_call(body: str, types: dict[str, dict[str, str]] | None = None) -> ToolCall | None:
    """Parse the text between <tool_call> and </tool_call>; None when it is malformed.

    types: `parameter_types(tools)`, so XML values follow the declared parameter types."""
    m = _FUNCTION_RE.match(body)
    if m:
        name = m.group(1).strip()
        inner = m.group(2)
        declared = (types or {}).get(name, {})
        args: dict[str, Any] = {}
        for pm in _PARAM_RE.finditer(inner):
            key = pm.group(1).strip()
            args[key] = _xml_value(pm.group(2), declared.get(key))
        leftover = _PARAM_RE.sub("", inner)
        if not name or leftover.strip():
            return None
        return ToolCall(name=name, arguments=args, id=new_call_id())
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    args_raw = obj.get("arguments", obj.get("parameters", {}))
    if args_raw is None:
        args_raw = {}
    if isinstance(args_raw, str):
        if not args_raw.strip():
            args_raw = {}
        else:
            try:
                args_raw = json.loads(args_raw)
            except ValueError:
                return None
    if not isinstance(args_raw, dict):
        return None
    return ToolCall(name=name.strip(), arguments=args_raw, id=new_call_id())


def _partial_suffix(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of one of tags."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:k]):
                best = k
                break
    return best


class StreamParser:
    """Incremental splitter of generated text into text, reasoning and tool-call events.

    Whitespace right after `<think>`, `</think>` or `</tool_call>` and right before `</think>`
    is format, not content, and is dropped. A `</think>` seen outside reasoning is dropped.
    """

    def __init__(
        self,
        start_in_reasoning: bool = False,
        think_open: str = "<think>",
        think_close: str = "</think>",
        tool_open: str = "<tool_call>",
        tool_close: str = "</tool_call>",
        tools: list | None = None,
    ) -> None:
        self.types = parameter_types(tools)
        self.think_open, self.think_close = think_open, think_close
        self.tool_open, self.tool_close = tool_open, tool_close
        self._mode = "reasoning" if start_in_reasoning else "text"
        self._buf = ""
        self._strip_lead = start_in_reasoning
        self._tool_calls = 0
        self._finished = False

    @property
    def mode(self) -> str:
        """Current region: "text", "reasoning" or "tool"."""
        return self._mode

    @property
    def has_tool_calls(self) -> bool:
        """Whether any tool call has been emitted."""
        return self._tool_calls > 0

    def feed(self, delta: str) -> list[Event]:
        """Consume a text delta; return the events it completes."""
        if self._finished:
            raise RuntimeError("StreamParser.feed after finish()")
        self._buf += delta
        events: list[Event] = []
        while self._step(events):
            pass
        return _merge(events)

    def finish(self) -> list[Event]:
        """Flush everything held back (an unterminated tool call is parsed if it can be)."""
        events: list[Event] = []
        if not self._finished:
            self._finished = True
            while self._step(events):
                pass
            buf, self._buf = self._buf, ""
            if self._mode == "tool":
                call = parse_tool_call(buf, self.types)
                if call is not None:
                    self._tool_calls += 1
                    events.append(Event("tool_call", tool_call=call))
                else:
                    self._emit(events, "text", self.tool_open + buf, final=True)
            elif self._mode == "reasoning":
                self._emit(events, "reasoning", buf.rstrip(), final=True)
            else:
                self._emit(events, "text", buf, final=True)
        return _merge(events)

    # -- internals --

    def _emit(self, events: list[Event], kind: str, text: str, final: bool = False) -> None:
        if self._strip_lead:
            text = text.lstrip()
            if not text:
                return
            self._strip_lead = False
        if text:
            events.append(Event(kind, text=text))

    def _step(self, events: list[Event]) -> bool:
        """Process the buffer once; True when it changed mode (so call again)."""
        buf = self._buf
        if self._mode == "tool":
            i = buf.find(self.tool_close)
            if i < 0:
                return False
            body, self._buf = buf[:i], buf[i + len(self.tool_close) :]
            call = parse_tool_call(body, self.types)
            if call is not None:
                self._tool_calls += 1
                events.append(Event("tool_call", tool_call=call))
                self._strip_lead = True
            else:
                self._emit(events, "text", self.tool_open + body + self.tool_close)
            self._mode = "text"
            return True

        if self._mode == "reasoning":
            i = buf.find(self.think_close)
            if i >= 0:
                self._emit(events, "reasoning", buf[:i].rstrip())
                self._buf = buf[i + len(self.think_close) :]
                self._mode = "text"
                self._strip_lead = True
                return True
            keep = _partial_suffix(buf, (self.think_close,))
            head = buf[: len(buf) - keep]
            # Trailing whitespace may precede </think>: hold it back too.
            stripped = head.rstrip()
            self._emit(events, "reasoning", stripped)
            self._buf = buf[len(stripped) :]
            return False

        # text mode
        tags = (self.think_open, self.tool_open, self.think_close)
        hits = [(buf.find(t), t) for t in tags]
        hits = [(i, t) for i, t in hits if i >= 0]
        if hits:
            i, tag = min(hits, key=lambda h: (h[0], -len(h[1])))
            self._emit(events, "text", buf[:i])
            self._buf = buf[i + len(tag) :]
            if tag == self.think_open:
                self._mode = "reasoning"
                self._strip_lead = True
            elif tag == self.tool_open:
                self._mode = "tool"
                self._strip_lead = False
            else:  # a stray </think> in text is dropped; the text goes on
                self._strip_lead = True
            return True
        keep = _partial_suffix(buf, tags)
        self._emit(events, "text", buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        return False


def _merge(events: list[Event]) -> list[Event]:
    out: list[Event] = []
    for e in events:
        if out and e.type in ("text", "reasoning") and out[-1].type == e.type:
            out[-1] = Event(e.type, text=out[-1].text + e.text)
        else:
            out.append(e)
    return out


def parse_completion(
    text: str, start_in_reasoning: bool = False
) -> tuple[str, str, list[ToolCall]]:
    """Split a whole completion into (content, reasoning, tool calls)."""
    parser = StreamParser(start_in_reasoning=start_in_reasoning)
    events = parser.feed(text) + parser.finish()
    content = "".join(e.text for e in events if e.type == "text")
    reasoning = "".join(e.text for e in events if e.type == "reasoning")
    calls = [e.tool_call for e in events if e.type == "tool_call" and e.tool_call is not None]
    return content, reasoning, calls
