"""StreamParser: text / reasoning splitting, tool calls (XML and JSON), malformed input."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qwen38_backend.events import Event, StreamParser, ToolCall, parse_completion, parse_tool_call


def _collect(chunks: list[str], start_in_reasoning: bool = False) -> list[Event]:
    p = StreamParser(start_in_reasoning=start_in_reasoning)
    events: list[Event] = []
    for c in chunks:
        events += p.feed(c)
    events += p.finish()
    return events


def _summary(events: list[Event]) -> tuple[str, str, list[tuple[str, dict]], list[str]]:
    """(text, reasoning, calls, order of kinds with adjacent text/reasoning merged)."""
    text = "".join(e.text for e in events if e.type == "text")
    reasoning = "".join(e.text for e in events if e.type == "reasoning")
    calls = [(e.tool_call.name, e.tool_call.arguments) for e in events if e.type == "tool_call"]
    order: list[str] = []
    for e in events:
        if not order or order[-1] != e.type or e.type == "tool_call":
            order.append(e.type)
    return text, reasoning, calls, order


XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=opts>\n"
    '{"unit": "C", "hourly": true}\n</parameter>\n'
    "<parameter=note>\nline one\nline two\n</parameter>\n</function>\n</tool_call>"
)
XML_ARGS = {
    "city": "San Francisco",
    "days": 3,
    "opts": {"unit": "C", "hourly": True},
    "note": "line one\nline two",
}
FULL = (
    "The user wants weather.\nTwo <b>cities</b> maybe.\n</think>\n\n"
    "Let me check < that > for you.\n\n" + XML_CALL + "\n"
    '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"é 😀\\"}"}\n</tool_call>'
)
FULL_EXPECTED = (
    "Let me check < that > for you.\n\n",
    "The user wants weather.\nTwo <b>cities</b> maybe.",
    [("get_weather", XML_ARGS), ("search", {"q": "é 😀"})],
    ["reasoning", "text", "tool_call", "tool_call"],
)


def test_full_completion_one_shot() -> None:
    assert _summary(_collect([FULL], start_in_reasoning=True)) == FULL_EXPECTED


def test_split_at_every_position() -> None:
    for i in range(len(FULL) + 1):
        got = _summary(_collect([FULL[:i], FULL[i:]], start_in_reasoning=True))
        assert got == FULL_EXPECTED, f"split at {i}: {FULL[:i]!r} | {FULL[i:]!r}"


def test_char_by_char_and_three_way_splits() -> None:
    assert _summary(_collect(list(FULL), start_in_reasoning=True)) == FULL_EXPECTED
    for i in range(0, len(FULL), 7):
        for j in range(i, len(FULL), 11):
            chunks = [FULL[:i], FULL[i:j], FULL[j:]]
            assert _summary(_collect(chunks, start_in_reasoning=True)) == FULL_EXPECTED


def test_think_block_in_output() -> None:
    text = "<think>\nreason here\n</think>\n\nThe answer is 4."
    for i in range(len(text) + 1):
        ev = _collect([text[:i], text[i:]])
        assert _summary(ev) == ("The answer is 4.", "reason here", [], ["reasoning", "text"])


def test_only_partial_tags_are_held_back() -> None:
    p = StreamParser()
    assert [(e.type, e.text) for e in p.feed("Hello <th")] == [("text", "Hello ")]
    assert p.feed("ink>") == []
    assert [(e.type, e.text) for e in p.feed("deep")] == [("reasoning", "deep")]
    assert p.feed(" thought </thi") == [Event("reasoning", text=" thought")]
    assert p.feed("nk>") == []
    assert p.feed("\n\nok") == [Event("text", text="ok")]
    assert p.feed(" a < b and <tool") == [Event("text", text=" a < b and ")]
    assert p.feed("s>") == [Event("text", text="<tools>")]  # not a tag after all
    assert p.finish() == []


def test_text_without_tags_streams_immediately() -> None:
    p = StreamParser()
    assert p.feed("plain text, no tags.\n") == [Event("text", text="plain text, no tags.\n")]
    assert p.finish() == []


def test_start_in_reasoning_without_close() -> None:
    content, reasoning, calls = parse_completion("\nstill thinking... ", start_in_reasoning=True)
    assert (content, reasoning, calls) == ("", "still thinking...", [])


def test_empty_think_block() -> None:
    assert parse_completion("<think>\n\n</think>\n\nHi!") == ("Hi!", "", [])
    assert parse_completion("\n</think>\n\nHi!", start_in_reasoning=True) == ("Hi!", "", [])


def test_stray_close_tag_in_text_is_dropped() -> None:
    assert parse_completion("oops</think>\n\nanswer") == ("oopsanswer", "", [])


def test_xml_tool_call_values() -> None:
    body = (
        "\n<function=f>\n<parameter=s>\nhello world\n</parameter>\n"
        "<parameter=n>\n-2.5\n</parameter>\n<parameter=b>\nfalse\n</parameter>\n"
        '<parameter=nul>\nnull\n</parameter>\n<parameter=lst>\n[1, "a"]\n</parameter>\n'
        '<parameter=quoted>\n"42"\n</parameter>\n<parameter=code>\n  x = 1\n</parameter>\n'
        "<parameter=ml>\n\nblank first\n\n</parameter>\n</function>\n"
    )
    call = parse_tool_call(body)
    assert call is not None and call.name == "f"
    assert call.arguments == {
        "s": "hello world",
        "n": -2.5,
        "b": False,
        "nul": None,
        "lst": [1, "a"],
        "quoted": '"42"',  # a JSON string stays the text the model wrote
        "code": "x = 1",
        "ml": "blank first",
    }


def test_json_tool_calls() -> None:
    a = parse_tool_call('{"name": "f", "arguments": {"x": [1, 2], "y": "z"}}')
    assert (a.name, a.arguments) == ("f", {"x": [1, 2], "y": "z"})
    b = parse_tool_call(' {"name": "g", "arguments": "{\\"k\\": 1}"} ')
    assert (b.name, b.arguments) == ("g", {"k": 1})
    c = parse_tool_call('{"name": "h"}')
    assert (c.name, c.arguments) == ("h", {})
    d = parse_tool_call('{"type": "function", "function": {"name": "i", "arguments": {}}}')
    assert (d.name, d.arguments) == ("i", {})


@pytest.mark.parametrize(
    "body",
    [
        "",
        "not json at all",
        '{"arguments": {}}',
        '{"name": 3, "arguments": {}}',
        '{"name": "f", "arguments": "{broken"}',
        '{"name": "f", "arguments": [1, 2]}',
        "[1, 2]",
        "<function=f>\n<parameter=x>\n1\n</parameter>\n",  # no </function>
        "<function=f>\ngarbage outside parameters\n</function>",
        "<function=>\n</function>",
    ],
)
def test_malformed_tool_calls_become_text(body: str) -> None:
    assert parse_tool_call(body) is None
    raw = "before <tool_call>" + body + "</tool_call> after"
    for i in range(len(raw) + 1):
        events = _collect([raw[:i], raw[i:]])
        assert all(e.type == "text" for e in events)
        assert "".join(e.text for e in events) == raw


def test_unterminated_tool_call_at_finish() -> None:
    ok = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n"
    content, _, calls = parse_completion(ok)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", {"a": 1})]
    bad = "text <tool_call>\n<function=f>\n<parameter=a>\n1\n"
    content, _, calls = parse_completion(bad)
    assert content == bad and calls == []


def test_tool_call_ids_unique_and_shaped() -> None:
    _, _, calls = parse_completion((XML_CALL + "\n") * 20)
    ids = [c.id for c in calls]
    assert len(calls) == 20 and len(set(ids)) == 20
    assert all(re.fullmatch(r"call_[0-9a-f]{8,32}", i) for i in ids)
    assert all(isinstance(c, ToolCall) for c in calls)


def test_has_tool_calls_and_no_feed_after_finish() -> None:
    p = StreamParser()
    p.feed("x")
    assert not p.has_tool_calls
    p.feed(XML_CALL)
    assert p.has_tool_calls
    p.finish()
    with pytest.raises(RuntimeError):
        p.feed("more")


def test_custom_tags() -> None:
    p = StreamParser(think_open="[T]", think_close="[/T]", tool_open="[C]", tool_close="[/C]")
    events = p.feed('[T]r[/T]t[C]{"name": "f", "arguments": {}}[/C]') + p.finish()
    assert _summary(events) == ("t", "r", [("f", {})], ["reasoning", "text", "tool_call"])


def test_event_type_is_checked() -> None:
    Event("done", finish_reason="stop", usage={"prompt_tokens": 1})
    with pytest.raises(ValueError):
        Event("bogus")


_PIECES = st.sampled_from(
    ["<think>", "</think>", "<tool_call>", "</tool_call>", XML_CALL, "<", "</", "<t", "\n", " "]
) | st.text(alphabet="ab<>/\n {}", max_size=6)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(_PIECES, max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
    start=st.booleans(),
)
def test_chunking_never_changes_the_result(pieces: list[str], cuts: list[int], start) -> None:
    text = "".join(pieces)
    events = _collect([text], start_in_reasoning=start)
    one = _summary(events)
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks, last = [], 0
    for b in bounds:
        chunks.append(text[last:b])
        last = b
    chunks.append(text[last:])
    assert _summary(_collect(chunks, start_in_reasoning=start)) == one
    # nothing is lost: in order, every character is text, reasoning, a think tag or whitespace
    if "<tool_call>" not in text:
        kept = "".join(e.text for e in events)
        assert re.sub(r"\s|</?think>", "", kept) == re.sub(r"\s|</?think>", "", text)


def test_xml_values_follow_the_declared_parameter_types():
    from qwen38_backend.events import StreamParser

    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {"code": {"type": "string"}, "n": {"type": "integer"}},
                },
            },
        }
    ]
    body = (
        "<tool_call>\n<function=f>\n<parameter=code>\n123\n</parameter>\n"
        "<parameter=n>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    typed = [e for e in StreamParser(tools=tools).feed(body) if e.type == "tool_call"]
    untyped = [e for e in StreamParser().feed(body) if e.type == "tool_call"]
    assert typed[0].tool_call.arguments == {"code": "123", "n": 7}
    assert untyped[0].tool_call.arguments == {"code": 123, "n": 7}
