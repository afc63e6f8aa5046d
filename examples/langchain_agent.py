"""A hand-written LangChain tool loop on a local model.

    python examples/langchain_agent.py                     # the demo model (fetched once)
    python examples/langchain_agent.py --model ~/models/Qwen3.8-27B-4bit "Weather in Oslo?"

The first call must use the tool (tool_choice="any": decoding is constrained to a well-formed
call); later calls may answer. Every call after the first restores the conversation's prefix
instead of recomputing it: watch `cache_read`.
"""

from __future__ import annotations

import argparse

from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_qwen38 import ChatQwen38


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is 23 degrees Celsius and sunny in {city}."


def run(model: str, question: str, max_steps: int = 4) -> AIMessage:
    chat = ChatQwen38(model=model, temperature=0, max_tokens=128)
    tools = {"get_weather": get_weather}
    messages: list[BaseMessage] = [HumanMessage(question)]
    reply = AIMessage("")
    for step in range(max_steps):
        llm = chat.bind_tools(list(tools.values()), tool_choice="any" if step == 0 else "auto")
        reply = llm.invoke(messages)
        usage = reply.usage_metadata or {}
        cached = usage.get("input_token_details", {}).get("cache_read", 0)
        print(f"step {step}: {usage.get('input_tokens')} prompt tokens, {cached} restored")
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            result = tools[call["name"]].invoke(call)  # a ToolMessage carrying the call id
            assert isinstance(result, ToolMessage)
            print(f"  {call['name']}({call['args']}) -> {result.content}")
            messages.append(result)
    return reply


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("question", nargs="?", default="What is the weather in Paris?")
    parser.add_argument("--model", default="qwen38-demo")
    args = parser.parse_args()
    print(run(args.model, args.question).text)


if __name__ == "__main__":
    main()
