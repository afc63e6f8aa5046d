"""A hand-written agent loop on ChatQwen38: the model calls a tool, gets its result back, and
the follow-up call restores the conversation's prefix instead of recomputing it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from helpers import dense_fixture
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_qwen38 import ChatQwen38

TOOL_RESULT = "It is 23 degrees Celsius and sunny in {city}."


# An enum argument: even a random-weight model's forced call is short and complete.
@tool
def get_weather(city: Literal["London", "Paris", "Berlin", "Madrid"]) -> str:
    """Get the current weather in a city."""
    return TOOL_RESULT.format(city=city)


def agent_loop(chat: ChatQwen38, question: str, max_steps: int = 3) -> list[BaseMessage]:
    """Call -> run tools -> call again, until the model answers without calling."""
    messages: list[BaseMessage] = [HumanMessage(question)]
    for step in range(max_steps):
        # the first step must call the tool; afterwards the model decides
        llm = chat.bind_tools([get_weather], tool_choice="any" if step == 0 else "auto")
        reply = llm.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            result = get_weather.invoke(call)
            assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
            messages.append(result)
    return messages


def _cache_read(msg: AIMessage) -> int:
    return (msg.usage_metadata or {}).get("input_token_details", {}).get("cache_read", 0)


def test_agent_loop_tiny(tmp_path: Path) -> None:
    """Plumbing on a random-weight model: forced call, tool result fed back, prefix reused."""
    chat = ChatQwen38(model=str(dense_fixture("qwen3", tmp_path)), reasoning=False, max_tokens=64)
    messages = agent_loop(chat, "What is the weather in Paris?", max_steps=2)
    first, tool_msg, second = messages[1], messages[2], messages[3]
    assert isinstance(first, AIMessage) and len(first.tool_calls) == 1
    assert first.tool_calls[0]["name"] == "get_weather"
    assert isinstance(tool_msg, ToolMessage) and "23 degrees" in tool_msg.text
    assert isinstance(second, AIMessage)
    first_usage, second_usage = first.usage_metadata, second.usage_metadata
    assert first_usage and second_usage
    # the second prompt extends the first: everything up to the first answer is restored
    assert second_usage["input_tokens"] > first_usage["input_tokens"]
    assert _cache_read(second) >= first_usage["input_tokens"] - 8, second_usage


@pytest.mark.demo
@pytest.mark.slow
def test_agent_loop_demo(demo_gguf: Path) -> None:
    """A real model calls the tool with the city from the question and answers from its
    result; the second call restores the first call's prefix."""
    chat = ChatQwen38(model=str(demo_gguf), temperature=0, max_tokens=64)
    messages = agent_loop(chat, "What is the weather in Paris?")
    first, final = messages[1], messages[-1]
    assert isinstance(first, AIMessage) and first.tool_calls
    assert first.tool_calls[0]["name"] == "get_weather"
    assert "paris" in str(first.tool_calls[0]["args"].get("city", "")).lower()
    assert isinstance(messages[2], ToolMessage)
    second = messages[3]
    assert isinstance(second, AIMessage) and _cache_read(second) > 0, second.usage_metadata
    assert isinstance(final, AIMessage) and not final.tool_calls
    assert "23" in final.text, final.text
