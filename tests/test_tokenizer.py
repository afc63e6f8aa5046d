"""Tokenizer, chat template and streaming decode, checked against transformers.

References: transformers' own tokenizer / apply_chat_template on the same files, Python's
json.dumps for the tojson filter, and plain full-sequence decode for the detokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qwen38_backend.errors import TokenizerError
from qwen38_backend.templates import (
    QWEN3_CHAT_TEMPLATE,
    TINY_ADDED_TOKENS,
    write_tiny_tokenizer,
)
from qwen38_backend.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\nmixed\n\n\n",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "Café naïve résumé façade Ångström é (combining)",
    "你好，世界！这是一个测试。日本語のテキスト 한국어 텍스트",
    "Россия и Українa — مرحبا بالعالم",
    "Emoji: 😀👍🏽🇺🇸 and ❤️ 🧑‍🤝‍🧑",
    "def foo(x):\n    return x ** 2  # comment\n\n\tclass A: pass\n",
    "zero\u200bwidth and non\u00a0breaking",
    "<|im_start|>user\nhi<|im_end|>\n<think>\nhmm\n</think>\n<tool_call>{}</tool_call>",
    "<|im_start <|im_end| <thin </tool_",
    "\ufffd literal replacement char",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? Ünïcödé 😀"},
    ],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nanswer one"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "answer two", "reasoning_content": "new reasoning"},
    ],
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather für eine Stadt — today",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "days": {"type": "integer"},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    },
]

TOOL_CONVERSATION = [
    {"role": "system", "content": "Use tools when needed."},
    {"role": "user", "content": "Weather in Paris and Zürich?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "Two cities: two calls.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": {"city": "Zürich", "opts": {"unit": "C", "list": [1, 2]}},
                },
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny, 18 °C"},
    {"role": "assistant", "content": "Paris 21, Zürich 18.", "reasoning_content": "done"},
    {"role": "user", "content": "Thanks!"},
]


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tok"))


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(tiny_dir))


def _hf_render(hf, messages, **kwargs) -> str:
    kwargs.setdefault("add_generation_prompt", True)
    return hf.apply_chat_template(messages, tokenize=False, **kwargs)


def _hf_ids(hf, text: str) -> list[int]:
    return list(hf(text, add_special_tokens=False)["input_ids"])


# --- tiny tokenizer: encode / decode ------------------------------------------------------------


def test_tiny_tokenizer_shape(tiny: Tokenizer) -> None:
    assert tiny.vocab_size <= 512
    for i, (content, special) in enumerate(TINY_ADDED_TOKENS):
        assert tiny.token_to_id(content) == i
        assert tiny.encode(content) == [i]
        assert (i in tiny.special_ids) == special
    assert tiny.token_to_id("<|endoftext|>") == 7
    assert tiny.eos_token_ids == [tiny.token_to_id("<|im_end|>")]
    assert tiny.bos_token_id is None
    assert tiny.chat_template == QWEN3_CHAT_TEMPLATE
    assert tiny.id_to_token(tiny.token_to_id("<think>")) == "<think>"


def test_tiny_tokenizer_is_deterministic(tmp_path: Path, tiny_dir: Path) -> None:
    again = write_tiny_tokenizer(tmp_path / "again")
    assert (again / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("text", TEXTS)
def test_tiny_roundtrip_and_ids_match_transformers(tiny: Tokenizer, hf_tiny, text: str) -> None:
    ids = tiny.encode(text)
    assert tiny.decode(ids) == text
    assert ids == _hf_ids(hf_tiny, text)
    assert tiny.decode(ids, skip_special_tokens=True) == hf_tiny.decode(
        ids, skip_special_tokens=True
    )


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=80))
def test_tiny_roundtrip_property(tiny: Tokenizer, hf_tiny, text: str) -> None:
    ids = tiny.encode(text)
    assert tiny.decode(ids) == text
    assert ids == _hf_ids(hf_tiny, text)


def test_special_tokens_encode_whole_and_skip(tiny: Tokenizer) -> None:
    ids = tiny.encode("<|im_start|>user\nx<|im_end|><think>y</think>")
    assert ids[0] == 0 and 1 in ids
    assert tiny.token_to_id("<think>") in ids
    # special (control) tokens are dropped by skip_special_tokens, <think> is not special
    assert tiny.decode(ids, skip_special_tokens=True) == "user\nx<think>y</think>"


# --- chat template vs transformers --------------------------------------------------------------


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_tiny_template_matches_transformers(
    tiny: Tokenizer, hf_tiny, conv: int, add_generation_prompt: bool, enable_thinking
) -> None:
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    messages = CONVERSATIONS[conv]
    ours = tiny.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
    theirs = _hf_render(hf_tiny, messages, add_generation_prompt=add_generation_prompt, **kwargs)
    assert ours == theirs
    ids = tiny.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
    )
    assert ids == _hf_ids(hf_tiny, theirs)


@pytest.mark.parametrize("enable_thinking", [None, True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tiny_template_tools_matches_transformers(
    tiny: Tokenizer, hf_tiny, enable_thinking, add_generation_prompt: bool
) -> None:
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ours = tiny.apply_chat_template(
        TOOL_CONVERSATION, tools=TOOLS, add_generation_prompt=add_generation_prompt, **kwargs
    )
    theirs = _hf_render(
        hf_tiny,
        TOOL_CONVERSATION,
        tools=TOOLS,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )
    assert ours == theirs
    # the facts the template promises, read off the transformers render
    assert '"description": "Weather für eine Stadt — today"' in theirs  # tojson keeps non-ASCII
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" in ours
    assert '<parameter=opts>\n{"unit": "C", "list": [1, 2]}\n</parameter>' in ours
    assert '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n' in ours
    if add_generation_prompt:
        tail = "<think>\n\n</think>\n\n" if enable_thinking is False else "<think>\n"
        assert ours.endswith("<|im_start|>assistant\n" + tail)


def test_tool_call_then_results_keep_reasoning(tiny: Tokenizer, hf_tiny) -> None:
    # Conversation ending in tool results: the in-progress turn keeps its reasoning.
    messages = TOOL_CONVERSATION[:5]
    ours = tiny.apply_chat_template(messages, tools=TOOLS)
    assert ours == _hf_render(hf_tiny, messages, tools=TOOLS)
    assert "<think>\nTwo cities: two calls.\n</think>\n\nLet me check.\n\n<tool_call>" in ours


def test_reasoning_aliases_and_none_fields(tiny: Tokenizer, hf_tiny) -> None:
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "thinking": "via thinking", "tool_calls": None},
    ]
    ours = tiny.apply_chat_template(messages, add_generation_prompt=False)
    assert ours == _hf_render(hf_tiny, messages, add_generation_prompt=False)
    assert "via thinking" in ours


def test_template_error_is_tokenizer_error(tiny: Tokenizer) -> None:
    with pytest.raises(TokenizerError, match="Unexpected message role: robot"):
        tiny.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(TokenizerError):
        tiny.apply_chat_template([])


def _dir_with_template(tmp_path: Path, template: str, **config) -> Path:
    d = write_tiny_tokenizer(tmp_path / "tok", chat_template=template)
    if config:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg.update(config)
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_environment_features_match_transformers(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    template = (
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{{ m.content | tojson }}|{{ m | tojson(indent=2) }}\n"
        "{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
        "{{ eos_token }}/{{ pad_token }}/{{ custom | default('none') }}"
        "{% set ns = namespace(n=0) %}{% for k in dict(a=1, b=2) %}{% set ns.n = ns.n + 1 %}"
        "{% endfor %}{{ ns.n }}{{ strftime_now('%Y') | length }}"
    )
    d = _dir_with_template(tmp_path, template)
    ours = Tokenizer.from_dir(d)
    hf = PreTrainedTokenizerFast.from_pretrained(str(d))
    messages = [
        {"role": "user", "content": "héllo <b> & ü"},
        {"role": "skip", "content": "x"},
        {"role": "user", "content": "two"},
        {"role": "user", "content": "three"},
        {"role": "user", "content": "four"},
    ]
    for kwargs in ({}, {"custom": "yes"}):
        got = ours.apply_chat_template(messages, **kwargs)
        assert got == _hf_render(hf, messages, **kwargs)
    # independent check of the tojson filter: json.dumps without ASCII escaping
    assert json.dumps("héllo <b> & ü", ensure_ascii=False) in got
    assert json.dumps(messages[0], ensure_ascii=False, indent=2) in got
    assert "<|im_end|>/<|endoftext|>/yes" in got


def test_raise_exception_message(tmp_path: Path) -> None:
    d = _dir_with_template(tmp_path, "{{ raise_exception('no system role here') }}")
    with pytest.raises(TokenizerError, match="no system role here"):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])


def test_syntax_error_is_tokenizer_error(tmp_path: Path) -> None:
    d = _dir_with_template(tmp_path, "{% for m in messages %}{{ m }")
    with pytest.raises(TokenizerError):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])


def test_sandbox_blocks_attribute_escape(tmp_path: Path) -> None:
    d = _dir_with_template(tmp_path, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(TokenizerError):
        Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_jinja_file_wins(tmp_path: Path) -> None:
    d = write_tiny_tokenizer(tmp_path / "tok")
    (d / "chat_template.jinja").write_text("FILE:{{ messages[0].content }}")
    assert Tokenizer.from_dir(d).apply_chat_template([{"role": "user", "content": "x"}]) == "FILE:x"


def test_named_templates_pick_tool_use(tmp_path: Path) -> None:
    d = write_tiny_tokenizer(tmp_path / "tok")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(d)
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs) == "D1"
    assert tok.apply_chat_template(msgs, tools=TOOLS) == "T2"


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


# --- GGUF metadata path (synthetic, from the tiny tokenizer) -------------------------------------


def _gguf_metadata_from_tokenizer_json(path: Path, pre: str = "gpt2") -> dict:
    spec = json.loads(path.read_text())
    vocab = spec["model"]["vocab"]
    tokens = [None] * len(vocab)
    for tok, i in vocab.items():
        tokens[i] = tok
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    types = [1] * len(tokens)
    for entry in spec["added_tokens"]:
        types[entry["id"]] = 3 if entry["special"] else 4
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.eos_token_id": np.array(1, dtype=np.uint32),
        "tokenizer.ggml.padding_token_id": np.array(7, dtype=np.uint32),
        "tokenizer.ggml.add_bos_token": np.array(False),
        "tokenizer.chat_template": QWEN3_CHAT_TEMPLATE,
    }


def test_gguf_metadata_matches_hf_dir(tiny: Tokenizer, tiny_dir: Path) -> None:
    md = _gguf_metadata_from_tokenizer_json(tiny_dir / "tokenizer.json")
    g = Tokenizer.from_gguf_metadata(md)
    assert g.vocab_size == tiny.vocab_size
    assert g.special_ids == tiny.special_ids == {0, 1, 7}
    assert g.eos_token_ids == [1]
    for text in TEXTS:
        assert g.encode(text) == tiny.encode(text)
        assert g.decode(g.encode(text)) == text
    msgs = CONVERSATIONS[2]
    assert g.apply_chat_template(msgs, tools=TOOLS) == tiny.apply_chat_template(msgs, tools=TOOLS)


def test_gguf_add_bos_and_bad_model(tiny_dir: Path) -> None:
    md = _gguf_metadata_from_tokenizer_json(tiny_dir / "tokenizer.json")
    md["tokenizer.ggml.bos_token_id"] = np.array(0, dtype=np.uint32)
    md["tokenizer.ggml.add_bos_token"] = np.array(True)
    g = Tokenizer.from_gguf_metadata(md)
    assert g.encode("hi", add_special_tokens=True) == [0, *g.encode("hi")]
    md["tokenizer.ggml.model"] = "llama"
    with pytest.raises(TokenizerError, match="llama"):
        Tokenizer.from_gguf_metadata(md)


# --- incremental detokenizer --------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], **kw) -> list[str]:
    det = tok.detokenizer(**kw)
    parts = [det.add(i) for i in ids]
    parts.append(det.flush())
    return parts


MULTIBYTE = "naïve 😀👍🏽 中文字 🇺🇸 ❤️ Ω≈ç√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 e\u0301"


def test_detokenizer_multibyte_split_across_tokens(tiny: Tokenizer) -> None:
    ids = tiny.encode(MULTIBYTE)
    # the tiny vocabulary has no merges for these, so characters span several byte tokens
    assert len(ids) > len(MULTIBYTE)
    assert any("\ufffd" in tiny.decode([i]) for i in ids)
    parts = _stream(tiny, ids)
    assert "".join(parts) == tiny.decode(ids) == MULTIBYTE
    assert all("\ufffd" not in p for p in parts)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(max_size=60))
def test_detokenizer_property(tiny: Tokenizer, text: str) -> None:
    ids = tiny.encode(text)
    parts = _stream(tiny, ids)
    assert "".join(parts) == text
    if "\ufffd" not in text:
        assert all("\ufffd" not in p for p in parts)


def test_detokenizer_window_is_bounded(tiny: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tiny.encode(MULTIBYTE * 30)
    seen: list[int] = []
    real = Tokenizer.decode

    def spy(self, token_ids, skip_special_tokens=False):
        token_ids = list(token_ids)
        seen.append(len(token_ids))
        return real(self, token_ids, skip_special_tokens)

    monkeypatch.setattr(Tokenizer, "decode", spy)
    text = "".join(_stream(tiny, ids))
    monkeypatch.undo()
    assert text == MULTIBYTE * 30
    assert max(seen) <= 16  # a few tokens, never the whole sequence


def test_detokenizer_special_tokens_and_skips(tiny: Tokenizer) -> None:
    ids = tiny.encode("<think>\nhm\n</think>\n\nok<tool_call>{}</tool_call><|im_end|>")
    assert "".join(_stream(tiny, ids)) == tiny.decode(ids)
    skipped = "".join(_stream(tiny, ids, skip_special_tokens=True))
    assert skipped == "<think>\nhm\n</think>\n\nok<tool_call>{}</tool_call>"
    im_end = tiny.token_to_id("<|im_end|>")
    think = tiny.token_to_id("<think>")
    assert "".join(_stream(tiny, ids, skip_ids={think, im_end})).startswith("\nhm\n</think>")


# --- the demo model (GGUF) ----------------------------------------------------------------------

# Inputs where the GGUF "smollm" pre-tokenizer and transformers' GGUF loader agree (see
# test_demo_digits_follow_llama_cpp for where they differ).
DEMO_TEXTS = [t for t in TEXTS if "\ufffd" not in t] + [
    "The year 2024 had 365 days; pi=3.14159.",
    "Numbers: 1,000,000 and 42x and x42 and 7.",
    "SmolLM2 is a 135M model. <|endoftext|><|im_start|>assistant\n",
    "<repo_name>a/b<file_sep>main.py\nimport os\n",
]


@pytest.fixture(scope="module")
def demo_pair(demo_gguf, demo_gguf_reader):
    from unittest import mock

    import gguf
    import mlx.core as mx
    from transformers import AutoTokenizer

    path = Path(demo_gguf)
    _, metadata = mx.load(str(path), return_metadata=True)
    ours = Tokenizer.from_gguf_metadata(metadata)
    # transformers reads the file with gguf's reader: the session's (test_gguf parses the
    # same file with it), not a second ~6 s parse
    real = gguf.GGUFReader

    def reader(file, *args, **kwargs):
        same = Path(file).resolve() == path.resolve() and not args and not kwargs
        return demo_gguf_reader if same else real(file, *args, **kwargs)

    with mock.patch.object(gguf, "GGUFReader", reader):
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, hf


@pytest.mark.demo
def test_demo_facts(demo_pair) -> None:
    ours, hf = demo_pair
    assert ours.vocab_size == len(hf) == 49152
    assert ours.eos_token_ids == [hf.eos_token_id]
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.special_tokens_map == hf.special_tokens_map
    assert ours.special_ids == {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert ours.special_ids == set(range(17))  # the 17 control tokens of SmolLM2


@pytest.mark.demo
@pytest.mark.parametrize("text", DEMO_TEXTS)
def test_demo_ids_match_transformers(demo_pair, text: str) -> None:
    ours, hf = demo_pair
    ids = ours.encode(text)
    assert ids == _hf_ids(hf, text)
    assert ours.decode(ids) == text
    assert ours.encode(text, add_special_tokens=True) == list(
        hf(text, add_special_tokens=True)["input_ids"]
    )


def _llama_cpp_smollm_reference(hf, text: str) -> list[int]:
    """llama.cpp's "smollm" pre-tokenization (each digit alone, then the GPT-2 split), with
    transformers' tokenizer applying the BPE merges to each piece."""
    import regex

    gpt2 = regex.compile(
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    )
    ids: list[int] = []
    for chunk in regex.split(r"(\p{N})", text):
        for piece in gpt2.findall(chunk):
            ids += _hf_ids(hf, piece)
    return ids


@pytest.mark.demo
@pytest.mark.parametrize(
    "text", ["a  1", "list:\n\n1. one\n2. two", "x \t 12 \n 3", "3.14  15", "done\n\n\n2024"]
)
def test_demo_digits_follow_llama_cpp(demo_pair, text: str) -> None:
    # SmolLM2 was trained with every digit split off before the byte-level split; llama.cpp's
    # "smollm" pre-tokenizer does this, transformers' GGUF loader does not (it only differs when
    # whitespace runs up to a digit).
    ours, hf = demo_pair
    assert ours.encode(text) == _llama_cpp_smollm_reference(hf, text)
    assert ours.decode(ours.encode(text)) == text


@pytest.mark.demo
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS) - 1))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_demo_template_matches_transformers(demo_pair, conv: int, add_generation_prompt) -> None:
    ours, hf = demo_pair
    messages = CONVERSATIONS[conv]
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = _hf_render(hf, messages, add_generation_prompt=add_generation_prompt)
    assert text == theirs
    ids = ours.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    assert ids == _hf_ids(hf, theirs)


@pytest.mark.demo
def test_demo_detokenizer(demo_pair) -> None:
    ours, _ = demo_pair
    text = MULTIBYTE + " — and some plain English text, with code: x = [1, 2, 3]\n"
    ids = ours.encode(text)
    parts = _stream(ours, ids)
    assert "".join(parts) == text
    assert all("\ufffd" not in p for p in parts)


def test_json_string_tool_arguments_render_like_dict_arguments(tmp_path):
    """OpenAI-style history (arguments as a JSON string) renders as if given a dict."""
    from qwen38_backend.templates import write_tiny_tokenizer
    from qwen38_backend.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(write_tiny_tokenizer(tmp_path / "tok"))

    def history(arguments):
        call = {
            "type": "function",
            "id": "c1",
            "function": {"name": "lookup", "arguments": arguments},
        }
        return [
            {"role": "user", "content": "find it"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"},
        ]

    as_dict = tok.apply_chat_template(history({"query": "x", "n": 2}))
    as_text = tok.apply_chat_template(history('{"query": "x", "n": 2}'))
    assert as_text == as_dict and "<parameter=query>" in as_dict
