"""What a chat template renders natively, and tools folded into text for templates that don't.

Qwen-family templates understand `tools`, assistant `tool_calls` (function name + arguments
mapping), `reasoning_content` and `tool` messages with `tool_call_id`. Templates that know
none of that (e.g. the demo model's plain ChatML template) get the same information as text:
tool definitions in the system prompt, calls as `<tool_call>` JSON blocks in the assistant turn
and results as `<tool_response>` blocks in a user turn. Both forms are what
`events.StreamParser` reads back, so tool calling works on either kind of template.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

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


def opens_reasoning(prompt_text: str, open_tag: str = "<think>", close_tag: str = "</think>"):
    """True when the rendered prompt leaves a <think> block open (the model starts reasoning)."""
    i = prompt_text.rfind(open_tag)
    return i >= 0 and close_tag not in prompt_text[i:]


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
    msg = dict(msg)
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


def template_messages(
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]] | None,
    features: TemplateFeatures,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to pass to the chat template, from OpenAI-style dicts.

    Leading system messages are merged into one (templates only treat the first message as
    the system prompt). Where the template lacks native tool support, tools, calls and results
    are folded into plain text; the returned tools are then None.
    """
    converted = [dict(m) for m in messages]
    leading: list[str] = []
    while converted and converted[0]["role"] == "system":
        leading.append(converted.pop(0).get("content") or "")
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
