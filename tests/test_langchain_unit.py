"""ChatQwen38 unit tests: langchain-tests' standard unit suite plus message conversion.

Nothing here loads weights: construction must stay cheap, and these run on every CI pass.
"""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import (
    AIMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_qwen38 import ChatQwen38
from langchain_qwen38.messages import to_template_messages
from langchain_qwen38.shared_models import loaded_shared_models
from langchain_tests.unit_tests import ChatModelUnitTests
from pydantic import BaseModel, Field

from qwen38_backend.chat_format import template_features, template_messages
from qwen38_backend.events import parse_completion
from qwen38_backend.request import normalize_tool_choice
from qwen38_backend.templates import QWEN3_CHAT_TEMPLATE
from qwen38_backend.tokenizer import render_chat_template

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TestChatQwen38Unit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatQwen38]:
        return ChatQwen38

    @property
    def chat_model_params(self) -> dict:
        return {"model": "qwen38-demo"}

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True


class Weather(BaseModel):
    """Get the weather in a city."""

    city: str = Field(description="city name")


def _history() -> list:
    return [
        SystemMessage("You are terse."),
        SystemMessage("Use tools."),
        HumanMessage("Weather in Paris?"),
        AIMessage(
            "",
            tool_calls=[{"name": "Weather", "args": {"city": "Paris"}, "id": "c1"}],
            additional_kwargs={"reasoning_content": "I should look it up."},
        ),
        ToolMessage("sunny, 21C", tool_call_id="c1", name="Weather"),
    ]


def test_construction_loads_nothing() -> None:
    before = dict(loaded_shared_models())
    chat = ChatQwen38(model="/nonexistent/model/dir", temperature=0.5)
    assert chat.model == "/nonexistent/model/dir"
    assert loaded_shared_models() == before
    assert chat.profile and chat.profile["tool_calling"] and chat.profile["structured_output"]


def test_ls_params_and_identity() -> None:
    chat = ChatQwen38(model="qwen38-demo", temperature=0.2, max_tokens=7, stop=["x"])
    ls = chat._get_ls_params()
    assert ls["ls_provider"] == "qwen38" and ls["ls_model_name"] == "qwen38-demo"
    assert ls["ls_temperature"] == 0.2 and ls["ls_max_tokens"] == 7 and ls["ls_stop"] == ["x"]
    assert chat._get_ls_params(model="other")["ls_model_name"] == "other"
    assert chat._identifying_params["model"] == "qwen38-demo"
    assert chat._llm_type == "qwen38-chat"


def test_qwen_template_native_tool_rendering() -> None:
    features = template_features(QWEN3_CHAT_TEMPLATE)
    assert features.native_tools and features.call_style == "qwen_xml"
    tools = [convert_to_openai_tool(Weather)]
    msgs, template_tools = template_messages(to_template_messages(_history()), tools, features)
    assert template_tools == tools
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[0]["content"] == "You are terse.\n\nUse tools."
    call = msgs[2]["tool_calls"][0]
    assert call["function"] == {"name": "Weather", "arguments": {"city": "Paris"}}
    assert msgs[2]["reasoning_content"] == "I should look it up."
    assert msgs[3]["tool_call_id"] == "c1"
    text = render_chat_template(
        QWEN3_CHAT_TEMPLATE, msgs, tools=template_tools, add_generation_prompt=True
    )
    assert "<function=Weather>\n<parameter=city>\nParis\n</parameter>" in text
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in text
    assert "I should look it up." in text and '"name": "Weather"' in text


def test_plain_template_gets_tools_as_text() -> None:
    features = template_features(CHATML)
    assert not features.native_tools and features.call_style == "json"
    tools = [convert_to_openai_tool(Weather)]
    msgs, template_tools = template_messages(to_template_messages(_history()), tools, features)
    assert template_tools is None
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert "<tools>" in msgs[0]["content"] and msgs[0]["content"].startswith("You are terse.")
    assert msgs[3]["content"] == "<tool_response>\nsunny, 21C\n</tool_response>"
    # the inlined call is in the format the backend's stream parser reads back
    _, _, calls = parse_completion(msgs[2]["content"])
    assert [(c.name, c.arguments) for c in calls] == [("Weather", {"city": "Paris"})]
    assert "tool_calls" not in msgs[2]


def test_list_content_and_refused_blocks() -> None:
    msg = AIMessage(
        [
            {"type": "text", "text": "some text"},
            {"type": "tool_use", "id": "a", "name": "Weather", "input": {"city": "Rome"}},
        ],
        tool_calls=[{"name": "Weather", "args": {"city": "Rome"}, "id": "a"}],
    )
    msgs = to_template_messages([HumanMessage("hi"), msg])
    assert msgs[1]["content"] == "some text" and len(msgs[1]["tool_calls"]) == 1
    image = HumanMessage([{"type": "image", "url": "https://example.com/x.png"}])
    with pytest.raises(ValueError, match="text only"):
        to_template_messages([image])
    structured = ToolMessage([{"type": "json", "json": {"a": 1}}], tool_call_id="a")
    msgs = to_template_messages([HumanMessage("x"), structured])
    assert json.loads(msgs[1]["content"]) == [{"type": "json", "json": {"a": 1}}]


def test_tool_choice_forms() -> None:
    tools = [convert_to_openai_tool(Weather)]
    assert normalize_tool_choice(None, tools) == "auto"
    assert normalize_tool_choice("auto", tools) == "auto"
    assert normalize_tool_choice("required", tools) == "any"
    assert normalize_tool_choice(True, tools) == "any"
    assert normalize_tool_choice("Weather", tools) == "Weather"
    fn = {"type": "function", "function": {"name": "Weather"}}
    assert normalize_tool_choice(fn, tools) == "Weather"
    with pytest.raises(ValueError, match="is not one of the tools"):
        normalize_tool_choice("nope", tools)
    with pytest.raises(ValueError, match="is not one of the tools"):
        ChatQwen38().bind_tools([Weather], tool_choice="nope")


def test_structured_output_rejects_unknown_method() -> None:
    with pytest.raises(ValueError, match="unknown method"):
        ChatQwen38().with_structured_output(Weather, method="xml")  # type: ignore[arg-type]


def test_engine_options_as_keywords_join_model_kwargs_and_unknown_ones_are_refused() -> None:
    """`ChatQwen38(kv_pool_tokens=...)` used to be dropped without a word (pydantic ignores
    unknown keywords): engine options now join model_kwargs, anything else is refused by
    name, and an option given both ways must agree; LangChain's own fields still pass."""
    chat = ChatQwen38(model="qwen38-demo", kv_pool_tokens=64, kv_paged="on")
    assert chat.model_kwargs == {"kv_pool_tokens": 64, "kv_paged": "on"}
    with pytest.raises(ValueError, match="unknown option\\(s\\) bogus_option"):
        ChatQwen38(model="qwen38-demo", bogus_option=3)
    with pytest.raises(ValueError, match="kv_topk is given twice"):
        ChatQwen38(model="qwen38-demo", kv_topk=64, model_kwargs={"kv_topk": 128})
    same = ChatQwen38(model="qwen38-demo", kv_topk=64, model_kwargs={"kv_topk": 64})
    assert same.model_kwargs == {"kv_topk": 64}
    chat = ChatQwen38(model="qwen38-demo", tags=["t"], metadata={"a": 1}, stop_sequences=["x"])
    assert chat.tags == ["t"] and chat.stop == ["x"] and chat.model_kwargs == {}
