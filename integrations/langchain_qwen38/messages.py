"""LangChain messages -> the OpenAI-style message dicts the engine takes.

Assistant tool calls become `tool_calls` (function name + arguments mapping), reasoning
becomes `reasoning_content`, tool results `tool` messages with `tool_call_id`. What a template
cannot render natively the engine folds into text (qwen38_backend.chat_format).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

__all__ = ["to_template_messages", "content_text"]

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


def to_template_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """The conversation as OpenAI-style message dicts."""
    return [_convert(m) for m in messages]
