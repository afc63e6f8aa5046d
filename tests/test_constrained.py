"""Constrained decoding: sampled output always matches the grammar (JSON schema, tool calls)."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import mlx.core as mx
import numpy as np
import pytest
from helpers import dense_fixture

from qwen38_backend.constrained import (
    ConstraintViolation,
    GrammarProcessor,
    close_objects,
    json_mode_processor,
    json_schema_processor,
    lark_processor,
    make_tokenizer_adapter,
    tool_call_processor,
)
from qwen38_backend.errors import InvalidOptionError
from qwen38_backend.events import parse_completion

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 10},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
]
TOOL_SCHEMAS = {
    "get_weather": TOOLS[0]["function"]["parameters"],
    "add": TOOLS[1]["parameters"],
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny random qwen3 weights (vocab 512) with the tiny tokenizer (500 ids)."""
    import qwen38_backend

    path = dense_fixture("qwen3", tmp_path_factory.mktemp("constrained"))
    return qwen38_backend.load(str(path))


def _generate(model, processor, seed: int, max_tokens: int = 400, prompt: str = "hi"):
    ids = model.tokenizer.encode(prompt)
    stream = model.generate_tokens(
        ids, max_tokens=max_tokens, temperature=1.0, seed=seed, logits_processors=[processor]
    )
    tokens = list(stream)
    return tokens, stream.stats


def _text(model, tokens: list[int]) -> str:
    return model.tokenizer.decode([t for t in tokens if t not in model.eos_token_ids])


def test_adapter_is_cached_and_knows_eos(tiny):
    a = make_tokenizer_adapter(tiny)
    assert make_tokenizer_adapter(tiny) is a
    assert list(a.eos_tokens) == tiny.eos_token_ids
    assert a.vocab_size == tiny.tokenizer.vocab_size < tiny.config.vocab_size
    assert make_tokenizer_adapter(tiny.tokenizer, eos_token_ids=[7]) is not a


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_sampled_output_is_valid(tiny, seed):
    proc = json_schema_processor(tiny, PERSON)
    tokens, stats = _generate(tiny, proc, seed)
    assert stats.finish_reason == "stop", _text(tiny, tokens)
    assert tokens[-1] in tiny.eos_token_ids
    jsonschema.validate(json.loads(_text(tiny, tokens)), PERSON)


def test_json_without_processor_is_not_json(tiny):
    """The control: the random model alone does not produce the schema (the test can fail)."""
    tokens = list(tiny.generate_tokens(tiny.tokenizer.encode("hi"), 40, temperature=1.0, seed=0))
    with pytest.raises(ValueError):
        jsonschema.validate(json.loads(_text(tiny, tokens)), PERSON)


def test_masks_never_allow_an_invalid_token(tiny):
    """Every token the processor leaves finite is accepted by an independent matcher."""
    proc = json_schema_processor(tiny, PERSON)
    adapter = make_tokenizer_adapter(tiny)
    reference = llguidance.LLMatcher(adapter, proc.grammar, log_level=0)
    tokens, _ = _generate(tiny, proc, seed=11)
    vocab = tiny.config.vocab_size
    history: list[int] = []
    for token in tokens:
        masked = np.array(proc(history, mx.zeros((vocab,))))
        allowed = np.nonzero(np.isfinite(masked))[0]
        assert allowed.size > 0
        assert np.all(allowed < tiny.tokenizer.vocab_size)  # padded rows stay masked
        for t in allowed:
            probe = reference.deep_copy()
            assert probe.consume_token(int(t)) or (
                probe.is_accepting() and int(t) in tiny.eos_token_ids
            ), f"mask allowed token {t} the grammar rejects after {history}"
        # the mask constrains (llguidance may hide some valid non-canonical spellings of
        # forced text, so masked-out tokens are not all invalid: only the subset is checked)
        assert allowed.size < tiny.tokenizer.vocab_size
        assert token in allowed
        history.append(token)
        if token not in tiny.eos_token_ids:
            assert reference.consume_token(token)
    assert reference.is_accepting()


def test_completed_grammar_forces_eos(tiny):
    proc = json_schema_processor(tiny, {"enum": ["yes"]})
    ids = tiny.tokenizer.encode('"yes"')
    logits = mx.zeros((tiny.config.vocab_size,))
    proc(ids, logits)
    assert proc.is_stopped
    allowed = np.nonzero(np.isfinite(np.array(proc(ids, logits))))[0]
    assert set(allowed.tolist()) == set(tiny.eos_token_ids)


def test_processor_rewinds_for_a_new_history(tiny):
    proc = json_schema_processor(tiny, PERSON)
    first, _ = _generate(tiny, proc, seed=1)
    second, _ = _generate(tiny, proc, seed=2)  # same processor, fresh generation
    for tokens in (first, second):
        jsonschema.validate(json.loads(_text(tiny, tokens)), PERSON)


def test_foreign_token_is_a_clear_error(tiny):
    proc = json_schema_processor(tiny, PERSON)
    bad = tiny.tokenizer.encode("x")  # JSON cannot start with "x"
    with pytest.raises(ConstraintViolation, match="violates the grammar"):
        proc(bad, mx.zeros((tiny.config.vocab_size,)))
    # still usable afterwards
    proc([], mx.zeros((tiny.config.vocab_size,)))


@pytest.mark.parametrize("seed", range(3))
def test_json_mode_gives_an_object(tiny, seed):
    proc = json_mode_processor(tiny)
    tokens, stats = _generate(tiny, proc, seed, max_tokens=60)
    text = _text(tiny, tokens)
    assert text.startswith("{")
    if stats.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a valid prefix for the grammar
        assert not proc.is_stopped


@pytest.mark.parametrize("seed", range(3))
def test_thinking_prefix_then_json(tiny, seed):
    proc = json_schema_processor(tiny, PERSON, thinking=True)
    # force the reasoning to end early: a long random ramble is valid but slow to test
    close = tiny.tokenizer.encode("</think>")[0]

    def short_reasoning(history: list[int], logits: mx.array) -> mx.array:
        if len(history) >= 5 and close not in history:
            return mx.where(mx.arange(logits.shape[-1]) == close, 0.0, -float("inf"))
        return logits

    ids = tiny.tokenizer.encode("hi")
    tokens = list(
        tiny.generate_tokens(
            ids, 300, temperature=1.0, seed=seed, logits_processors=[short_reasoning, proc]
        )
    )
    text = _text(tiny, tokens)
    reasoning, _, answer = text.partition("</think>")
    assert len(tiny.tokenizer.encode(reasoning)) >= 1
    jsonschema.validate(json.loads(answer), PERSON)


def test_lark_grammar(tiny):
    proc = lark_processor(tiny, 'start: "yes" | "no" | "maybe"')
    for seed in range(4):
        tokens, stats = _generate(tiny, proc, seed)
        assert _text(tiny, tokens) in {"yes", "no", "maybe"}
        assert stats.finish_reason == "stop"


def test_invalid_grammar_and_schema_are_clear_errors(tiny):
    with pytest.raises(InvalidOptionError, match="invalid grammar"):
        lark_processor(tiny, "start: undefined_rule")
    with pytest.raises(InvalidOptionError, match="JSON schema"):
        json_schema_processor(tiny, ["not", "a", "schema"])  # type: ignore[arg-type]
    with pytest.raises(InvalidOptionError, match="no such tool"):
        tool_call_processor(tiny, TOOLS, choice="nope")


@pytest.mark.parametrize("style", ["json", "qwen_xml"])
@pytest.mark.parametrize("seed", range(3))
def test_tool_call_grammar_parses_into_a_valid_call(tiny, style, seed):
    proc = tool_call_processor(tiny, TOOLS, style=style)
    tokens, stats = _generate(tiny, proc, seed)
    assert stats.finish_reason == "stop"
    text = _text(tiny, tokens)
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    _, _, calls = parse_completion(text)
    assert len(calls) == 1, text
    call = calls[0]
    assert call.name in TOOL_SCHEMAS
    jsonschema.validate(call.arguments, TOOL_SCHEMAS[call.name])


@pytest.mark.parametrize("style", ["json", "qwen_xml"])
def test_tool_arguments_take_no_undeclared_keys(tiny, style):
    """A schema without additionalProperties, and a tool without parameters: a forced call
    takes exactly the declared arguments (extra keys could run on forever)."""
    tools = [
        {
            "name": "square",
            "parameters": {
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
            },
        },
        {"name": "ping"},
    ]

    def accepts(call: str) -> bool:
        proc = tool_call_processor(tiny, tools, style=style)
        text = f"<tool_call>\n{call}\n</tool_call>"
        try:
            proc.sync(tiny.tokenizer.encode(text))
        except ConstraintViolation:
            return False
        return proc.is_accepting

    if style == "json":
        good = ['{"name": "square", "arguments": {"n": 3}}', '{"name": "ping", "arguments": {}}']
        bad = [
            '{"name": "square", "arguments": {"n": 3, "type": "integer"}}',
            '{"name": "ping", "arguments": {"x": 1}}',
        ]
    else:
        good = ["<function=square>\n<parameter=n>\n3\n</parameter>\n</function>"]
        good.append("<function=ping>\n</function>")
        bad = ["<function=ping>\n<parameter=x>\n1\n</parameter>\n</function>"]
    assert all(accepts(c) for c in good)
    assert not any(accepts(c) for c in bad)


def test_tool_call_uses_the_single_tag_tokens(tiny):
    proc = tool_call_processor(tiny, TOOLS, choice="add")
    tokens, _ = _generate(tiny, proc, seed=0)
    open_id = tiny.tokenizer.encode("<tool_call>")
    assert len(open_id) == 1 and tokens[0] == open_id[0]
    _, _, calls = parse_completion(_text(tiny, tokens))
    assert [c.name for c in calls] == ["add"]


def test_processor_is_a_grammar_processor(tiny):
    assert isinstance(tool_call_processor(tiny, TOOLS), GrammarProcessor)


@pytest.mark.demo
@pytest.mark.parametrize("seed", range(3))
def test_demo_model_json_schema(demo_model, seed):
    """A real model (SmolLM2 GGUF tokenizer, 49k vocab) under a schema, temperature 1."""
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
            "population_millions": {"type": "number", "minimum": 0, "maximum": 100},
        },
        "required": ["city", "country", "population_millions"],
        "additionalProperties": False,
    }
    proc = json_schema_processor(demo_model, schema)
    prompt = demo_model.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe Paris as JSON."}]
    )
    tokens, stats = _generate(demo_model, proc, seed, max_tokens=120, prompt=prompt)
    assert stats.finish_reason == "stop"
    jsonschema.validate(json.loads(_text(demo_model, tokens)), schema)


def test_close_objects_only_touches_schemas():
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "string"},  # a property *named* properties
            "inner": {"type": "object", "properties": {"x": {}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
        },
        "anyOf": [{"properties": {"y": {}}}],
    }
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"] == {"type": "string"}
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is not modified
