"""LangChain messages -> the OpenAI-style dicts a chat template renders.

Qwen-family templates understand `tools`, assistant `tool_calls` (function name + arguments
mapping), `reasoning_content` and `tool` messages with `tool_call_id`. Templates that know
none of that (e.g. the SmolLM2 demo model's plain ChatML template) get the same information
as text instead: tool definitions in the system prompt, calls as `<tool_call>` JSON blocks in
the assistant turn and results as `<tool_response>` blocks in a user turn. Both forms are what
`qwen38_backend.events.StreamParser` reads back, so tool calling works on either kind.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

__all__ = [
    "TemplateFeatures",
    "template_features",
    "to_template_messages",
    "content_text",
    "tools_system_text",
]

ToolCallStyle = Literal["json", "qwen_xml"]


@dataclass(frozen=True)
class TemplateFeatures:
    """What a chat template renders natively."""

    tools: bool  # renders the `tools` variable
    tool_calls: bool  # renders assistant `tool_calls`
    tool_role: bool  # renders `tool` messages
    call_style: ToolCallStyle  # how tool calls look in the model's output

    @property
    def native_tools(self) -> bool:
        return self.tools and self.tool_calls and self.tool_role


def template_features(template: str | None) -> TemplateFeatures:
    """Sniff a Jinja chat template's source for tool support (no rendering needed)."""
    src = template or ""
    tools = re.search(r"\btools\b", src) is not None
    tool_calls = "tool_calls" in src
    tool_role = re.search(r"""['"]tool['"]""", src) is not None
    # Qwen3.5-style XML calls vs Hermes / Qwen2.5-style JSON calls
    style: ToolCallStyle = "qwen_xml" if tools and "<function=" in src else "json"
    return TemplateFeatures(
        tools=tools, tool_calls=tool_calls, tool_role=tool_role, call_style=style
    )


_TEXT_TYPES = {"text", "text-plain"}
_REASONING_TYPES = {"reasoning", "thinking"}
_SKIPPED_TYPES = {"tool_use", "tool_call", "tool_call_chunk", "invalid_tool_call"}


def content_text(content: str | list[Any], *, role: str = "message") -> tuple[str, str]:
    """(text, reasoning) of a message's content, which may be a string or a list of blocks.

    Tool-call blocks are skipped (the message's `tool_calls` carry them); anything that is not
    text (images, audio, files) is refused: these models read text only.
    """
    if isinstance(content, str):
        return content, ""
    texts: list[str] = []
    reasoning: list[str] = []
    for block in content:
        if isinstance(block, str):
            texts.append(block)
            continue
        if not isinstance(block, dict):
            raise ValueError(f"unsupported content block in a {role}: {block!r}")
        kind = block.get("type")
        if kind in _TEXT_TYPES:
            texts.append(str(block.get("text", "")))
        elif kind in _REASONING_TYPES:
            reasoning.append(str(block.get("reasoning") or block.get("thinking") or ""))
        elif kind in _SKIPPED_TYPES:
            continue
        else:
            raise ValueError(f"ChatQwen38 accepts text only: a {role} has a {kind!r} content block")
    return "".join(texts), "".join(reasoning)


def _tool_result_text(message: ToolMessage | FunctionMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    try:
        return content_text(message.content, role="tool message")[0]
    except ValueError:
        # structured (non-text) tool output: show it to the model as JSON
        return json.dumps(message.content, ensure_ascii=False, default=str)


def _openai_tool_calls(message: AIMessage) -> list[dict[str, Any]]:
    return [
        {
            "id": call.get("id") or f"call_{i}",
            "type": "function",
            # a mapping, not a JSON string: templates iterate over the arguments
            "function": {"name": call["name"], "arguments": dict(call.get("args") or {})},
        }
        for i, call in enumerate(message.tool_calls)
    ]


def _role_of(message: BaseMessage) -> str:
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, (ToolMessage, FunctionMessage)):
        return "tool"
    if isinstance(message, ChatMessage):
        return {"human": "user", "ai": "assistant"}.get(message.role, message.role)
    raise ValueError(f"unsupported message type {type(message).__name__}")


def _convert(message: BaseMessage) -> dict[str, Any]:
    role = _role_of(message)
    if role == "tool":
        assert isinstance(message, (ToolMessage, FunctionMessage))
        out: dict[str, Any] = {"role": "tool", "content": _tool_result_text(message)}
        if isinstance(message, ToolMessage):
            out["tool_call_id"] = message.tool_call_id
        if message.name:
            out["name"] = message.name
        return out
    text, reasoning = content_text(message.content, role=f"{role} message")
    out = {"role": role, "content": text}
    if isinstance(message, AIMessage):
        kw_reasoning = message.additional_kwargs.get("reasoning_content")
        if isinstance(kw_reasoning, str) and kw_reasoning:
            reasoning = kw_reasoning
        if reasoning:
            out["reasoning_content"] = reasoning
        if message.tool_calls:
            out["tool_calls"] = _openai_tool_calls(message)
    elif isinstance(message, HumanMessage) and message.name:
        out["name"] = message.name
    return out


def tools_system_text(tools: Sequence[dict[str, Any]]) -> str:
    """Tool definitions and the JSON call format, for templates that do not render tools."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _inline_tool_calls(msg: dict[str, Any]) -> dict[str, Any]:
    """Assistant turn with its tool calls written into the text, in the JSON call format."""
    blocks = [
        "<tool_call>\n"
        + json.dumps(
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
            ensure_ascii=False,
        )
        + "\n</tool_call>"
        for c in msg.pop("tool_calls")
    ]
    text = msg.get("content") or ""
    msg["content"] = "\n".join(([text] if text else []) + blocks)
    return msg


def to_template_messages(
    messages: Sequence[BaseMessage],
    tools: Sequence[dict[str, Any]] | None,
    features: TemplateFeatures,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to pass to the chat template.

    Leading system messages are merged into one (templates only treat the first message as
    the system prompt). Where the template lacks native tool support, tools, calls and results
    are folded into plain text; the returned tools are then None.
    """
    converted = [_convert(m) for m in messages]
    leading: list[str] = []
    while converted and converted[0]["role"] == "system":
        leading.append(converted.pop(0)["content"])
    if leading:
        converted.insert(0, {"role": "system", "content": "\n\n".join(leading)})

    if features.native_tools:
        return converted, list(tools) if tools else None

    out: list[dict[str, Any]] = []
    for msg in converted:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            out.append(_inline_tool_calls(msg))
        elif msg["role"] == "tool":
            block = f"<tool_response>\n{msg['content']}\n</tool_response>"
            if out and out[-1].get("_tool_results"):  # consecutive results share one turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(msg)
    for msg in out:
        msg.pop("_tool_results", None)
    if tools:
        text = tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{text}" if out[0]["content"] else text
        else:
            out.insert(0, {"role": "system", "content": text})
    return out, None
