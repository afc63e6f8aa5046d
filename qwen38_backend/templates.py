# ruff: noqa: E501  (the chat template keeps its prompt lines whole)
"""A Qwen3-style chat template and a tiny byte-level BPE tokenizer for tests and tiny weights.

`QWEN3_CHAT_TEMPLATE` follows the conventions of Qwen's published Qwen3 / Qwen3.5 templates:
ChatML turns, tools listed as JSON inside `<tools>` in the system turn, tool calls as XML
(`<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`),
tool results as `<tool_response>` blocks in a user turn, reasoning in `<think>` blocks (kept
only for assistant turns after the last real user query), and `enable_thinking` (default
true: the generation prompt opens `<think>\\n`; false: an empty think block is pre-filled).

Real weights always come with their own template; this one exists so tiny test models behave
like the real family.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = [
    "QWEN3_CHAT_TEMPLATE",
    "TINY_SPECIAL_TOKENS",
    "TINY_ADDED_TOKENS",
    "TINY_VOCAB_SIZE",
    "write_tiny_tokenizer",
]

QWEN3_CHAT_TEMPLATE = r"""{%- macro text_of(content) -%}
{%- if content is string -%}
{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content -%}
{%- if part is mapping and part.type == 'text' -%}
{{- part.text -}}
{%- elif part is string -%}
{{- part -}}
{%- endif -%}
{%- endfor -%}
{%- elif content is not none -%}
{{- content | string -}}
{%- endif -%}
{%- endmacro -%}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- set has_system = messages[0].role == 'system' %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\n' }}
    {{- 'If you choose to call a function ONLY reply in the following format with NO suffix:\n\n' }}
    {{- '<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n' }}
    {{- '<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n' }}
    {{- '</function>\n</tool_call>\n\n' }}
    {{- '<IMPORTANT>\nReminder:\n' }}
    {{- '- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n' }}
    {{- '- Required parameters MUST be specified\n' }}
    {{- '- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n' }}
    {{- '- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n' }}
    {{- '</IMPORTANT>' }}
    {%- if has_system %}
        {%- set system_text = text_of(messages[0].content) | trim %}
        {%- if system_text %}
            {{- '\n\n' + system_text }}
        {%- endif %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- elif has_system %}
    {{- '<|im_start|>system\n' + (text_of(messages[0].content) | trim) + '<|im_end|>\n' }}
{%- endif %}
{%- set state = namespace(in_tool_results=true, last_query=messages | length - 1) %}
{%- for message in messages[::-1] %}
    {%- set idx = (messages | length - 1) - loop.index0 %}
    {%- if state.in_tool_results and message.role == 'user' %}
        {%- set user_text = text_of(message.content) | trim %}
        {%- if not (user_text.startswith('<tool_response>') and user_text.endswith('</tool_response>')) %}
            {%- set state.in_tool_results = false %}
            {%- set state.last_query = idx %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = text_of(message.content) %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- '<|im_start|>system\n' + (content | trim) + '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- set reasoning = reasoning | trim %}
        {%- set content = content | trim %}
        {%- if loop.index0 > state.last_query %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for call in message.tool_calls %}
                {%- if call.function is defined %}
                    {%- set call = call.function %}
                {%- endif %}
                {%- if not loop.first %}
                    {{- '\n' }}
                {%- elif content %}
                    {{- '\n\n' }}
                {%- endif %}
                {{- '<tool_call>\n<function=' + call.name + '>\n' }}
                {%- if call.arguments is mapping %}
                    {%- for arg_name, arg_value in call.arguments | items %}
                        {{- '<parameter=' + arg_name + '>\n' }}
                        {%- if arg_value is string %}
                            {{- arg_value }}
                        {%- else %}
                            {{- arg_value | tojson }}
                        {%- endif %}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- elif call.arguments is string and call.arguments %}
                    {{- raise_exception('tool_calls arguments must be a mapping, not a JSON string') }}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}
"""

# (content, special) in id order. "<|endoftext|>" sits at id 7: the tiny configs use eos 7.
TINY_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("<|endoftext|>", True),
    ("</tool_response>", False),
)
TINY_SPECIAL_TOKENS = tuple(t for t, special in TINY_ADDED_TOKENS if special)
TINY_VOCAB_SIZE = 500  # target ids in all (<= 512, the tiny models' vocab)

_TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog. Hello, world! How are you today?
I think the answer is 42. Let me check the weather in Paris and London.
You are a helpful assistant. The user asked a question; the assistant answered it.
def function(value):
    return value * 2 + 1
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
# Tools
You have access to the following functions:
<function=get_weather>
<parameter=city>
Berlin
</parameter>
</function>
system user assistant tool response reasoning content message messages
The number 1234567890 and the list [1, 2, 3] and the dict {"a": true, "b": null}.
Unicode: café naïve résumé — “quotes” ‘single’ … 中文 日本語 한국어 emoji 😀🎉
"""


def _tiny_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[t for t, _ in TINY_ADDED_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = _TINY_CORPUS.splitlines(keepends=True)
    tok.train_from_iterator([line for _ in range(4) for line in lines], trainer=trainer)
    spec = json.loads(tok.to_str())
    # Mark the non-control tokens (<think>, <tool_call>, ...) as plain added tokens, as Qwen does.
    special = dict(TINY_ADDED_TOKENS)
    for entry in spec["added_tokens"]:
        entry["special"] = special[entry["content"]]
    return json.dumps(spec, ensure_ascii=False, indent=1)


def write_tiny_tokenizer(directory: str | Path, chat_template: str = QWEN3_CHAT_TEMPLATE) -> Path:
    """Write a tiny HF-layout tokenizer (tokenizer.json + tokenizer_config.json) into directory.

    Byte-level BPE with < 512 ids in all; specials <|im_start|>, <|im_end|>, <|endoftext|>
    (id 7) and plain added tokens <think>, </think>, <tool_call>, </tool_call>,
    <tool_response>, </tool_response>. eos_token is <|im_end|>. Returns the directory.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(_tiny_tokenizer_json(), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(i): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for i, (content, special) in enumerate(TINY_ADDED_TOKENS)
        },
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8"
    )
    return out
