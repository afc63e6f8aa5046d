"""Constrained decoding with llguidance: JSON schema, JSON mode, Lark grammars, tool calls.

A `GrammarProcessor` is a logits processor for `SamplingParams.logits_processors`:
`(generated_ids, logits[vocab]) -> logits`. Each call feeds the tokens generated since the
last call into an `llguidance.LLMatcher` and sets every token the grammar does not allow to
-inf, so any sampler (greedy or random, any top-k/p) only ever picks allowed tokens. Once the
grammar is complete the matcher allows only EOS, so generation ends there.

    proc = json_schema_processor(model, {"type": "object", ...})
    session.generate(messages, logits_processors=[proc], max_tokens=512)

The first argument of every constructor is a `Model` (its eos ids are used) or a
`qwen38_backend.tokenizer.Tokenizer` (its own eos ids, or `eos_token_ids=`).

Tags such as `<tool_call>` / `</think>` are matched as the tokenizer's single added token when
it has one (what real models emit), else as literal text.
"""

from __future__ import annotations

import copy
import json
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import mlx.core as mx
import numpy as np

from .errors import InvalidOptionError, Qwen38Error

__all__ = [
    "ConstraintViolation",
    "close_objects",
    "GrammarProcessor",
    "make_tokenizer_adapter",
    "json_schema_grammar",
    "json_schema_processor",
    "json_mode_processor",
    "lark_processor",
    "tool_call_grammar",
    "tool_call_processor",
    "JSON_COMPACT",
]

# Compact, deterministic JSON layout: no free whitespace, so a sampler cannot loop on blanks
# and the output is stable across seeds; separators match json.dumps' defaults.
JSON_COMPACT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class ConstraintViolation(Qwen38Error):
    """A token the grammar does not allow reached the matcher (e.g. a foreign history)."""


# ----- tokenizer adapter ----------------------------------------------------------------------

_ADAPTERS: weakref.WeakKeyDictionary[Any, dict[tuple[int, ...], llguidance.LLTokenizer]] = (
    weakref.WeakKeyDictionary()
)
_ADAPTERS_LOCK = threading.Lock()


def _unwrap(tokenizer: Any, eos_token_ids: Iterable[int] | None) -> tuple[Any, list[int]]:
    """(our Tokenizer, eos ids) from a Model or a Tokenizer."""
    if hasattr(tokenizer, "tokenizer") and hasattr(tokenizer, "eos_token_ids"):  # a Model
        model = tokenizer
        tokenizer = model.tokenizer
        eos = list(eos_token_ids) if eos_token_ids is not None else list(model.eos_token_ids)
    else:
        eos = (
            list(eos_token_ids)
            if eos_token_ids is not None
            else list(getattr(tokenizer, "eos_token_ids", []))
        )
    if not eos:
        raise InvalidOptionError(
            "constrained decoding needs at least one EOS token id (the grammar ends with it)"
        )
    return tokenizer, [int(i) for i in eos]


def _backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind our Tokenizer (or the object itself)."""
    return getattr(tokenizer, "backend", tokenizer)


def make_tokenizer_adapter(
    tokenizer: Any, eos_token_ids: Iterable[int] | None = None
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for ours, with the model's eos ids; cached per tokenizer.

    Building it walks the whole vocabulary (~1 s for 150k tokens), hence the cache.
    """
    tok, eos = _unwrap(tokenizer, eos_token_ids)
    key = tuple(eos)
    with _ADAPTERS_LOCK:
        per_tok = _ADAPTERS.setdefault(tok, {})
        hit = per_tok.get(key)
        if hit is not None:
            return hit
        backend = copy.copy(_backend(tok))
        # padding / truncation settings would leak into llguidance's own tokenization
        backend.no_padding()
        backend.no_truncation()
        adapter = llguidance.LLTokenizer(backend.to_str(), eos_token=eos)
        per_tok[key] = adapter
        return adapter


# ----- the logits processor -------------------------------------------------------------------


class GrammarProcessor:
    """Masks logits to the tokens an llguidance grammar allows next.

    Reusable across generations: each call re-syncs the matcher with `history` (the ids
    generated so far), rolling back when the history is not an extension of what it saw.
    """

    def __init__(self, adapter: llguidance.LLTokenizer, grammar: str, *, description: str = ""):
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, adapter)
        if is_error:
            what = f" for {description}" if description else ""
            raise InvalidOptionError(f"invalid grammar{what}: {messages[0] if messages else '?'}")
        self.adapter = adapter
        self.grammar = grammar
        self.description = description
        self.matcher = llguidance.LLMatcher(adapter, grammar, log_level=0)
        self._check(self.matcher)
        self.consumed: list[int] = []
        self.eos_token_ids = list(adapter.eos_tokens)

    def _check(self, matcher: llguidance.LLMatcher) -> None:
        if matcher.is_error():
            raise ConstraintViolation(f"grammar matcher failed: {matcher.get_error()}")

    def reset(self) -> None:
        self.matcher.reset()
        self.consumed = []

    def sync(self, history: Sequence[int]) -> None:
        """Make the matcher's consumed tokens equal `history`."""
        common = 0
        limit = min(len(self.consumed), len(history))
        while common < limit and self.consumed[common] == history[common]:
            common += 1
        if common < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - common)
            del self.consumed[common:]
        for token in history[common:]:
            token = int(token)
            if self.matcher.is_stopped() and token in self.eos_token_ids:
                self.consumed.append(token)  # EOS after completion: nothing left to match
                continue
            if not self.matcher.consume_token(token):
                error = self.matcher.get_error()
                # leave the processor usable for a fresh history
                self.matcher = llguidance.LLMatcher(self.adapter, self.grammar, log_level=0)
                self.consumed = []
                raise ConstraintViolation(
                    f"token {token} ({self.adapter.dbg_tokens([token])}) violates the grammar"
                    f" after {common + 1} generated tokens: {error}"
                )
            self.consumed.append(token)

    def allowed(self, size: int | None = None) -> np.ndarray:
        """Boolean mask [size] (default: tokenizer vocab) of the tokens allowed next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little").astype(bool)[: self.adapter.vocab_size]
        size = self.adapter.vocab_size if size is None else size
        if size > mask.shape[0]:
            # rows past the tokenizer's vocabulary (padded embedding) are never valid
            mask = np.concatenate([mask, np.zeros(size - mask.shape[0], dtype=bool)])
        return mask[:size]

    @property
    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    @property
    def is_stopped(self) -> bool:
        return self.matcher.is_stopped()

    def __call__(self, history: list[int], logits: mx.array) -> mx.array:
        self.sync(history)
        allowed = self.allowed(logits.shape[-1])
        if not allowed.any():
            raise ConstraintViolation(
                f"no token is allowed next ({self.matcher.get_error() or 'grammar dead end'})"
            )
        neg = mx.array(-float("inf"), dtype=logits.dtype)
        return mx.where(mx.array(allowed), logits, neg)


# ----- grammars ------------------------------------------------------------------------------


def json_schema_grammar(schema: dict | bool, compact: bool = True) -> str:
    """llguidance grammar for JSON matching `schema` (compact layout unless compact=False)."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    if not isinstance(schema, (dict, bool)):
        raise InvalidOptionError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides=JSON_COMPACT if compact else None
        )
    except ValueError as e:
        raise InvalidOptionError(f"invalid JSON schema: {e}") from e


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def close_objects(schema: Any) -> Any:
    """Copy of `schema` where objects with `properties` and no `additionalProperties` get
    `additionalProperties: false` (OpenAI-style strict outputs).

    JSON Schema allows extra keys by default; a sampler that may add keys can ramble on
    forever, so for generation the listed properties are taken as the whole object.
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(sub) for sub in out[key]]
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = close_objects(out[key])
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _with_guidance(schema: dict, compact: bool) -> dict:
    """Schema with compile options embedded (for `%json {...}` inside Lark)."""
    if not compact:
        return schema
    return {**schema, "x-guidance": {**JSON_COMPACT, **schema.get("x-guidance", {})}}


def _tag(tokenizer: Any, text: str) -> str:
    """Lark for a tag: its single token `<[id]>` when the tokenizer has one, else the literal."""
    ids = tokenizer.encode(text) if hasattr(tokenizer, "encode") else []
    if len(ids) == 1 and _decode(tokenizer, ids) == text:
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    try:
        return tokenizer.decode(ids)
    except Exception:  # noqa: BLE001 - any decoding failure means "not a single token"
        return ""


def _think_prefix(tokenizer: Any) -> str:
    """Lark rules for free reasoning text ending with </think> (the prompt opened <think>)."""
    close = _tag(tokenizer, "</think>")
    if close.startswith("<["):
        tid = close[2:-2]
        # any tokens but </think>, then </think>, then the blank lines Qwen puts after it
        return f"think: <[^{tid}]>* {close} /\\n*/\n"
    return "think[lazy]: /(?s:.*)<\\/think>/ /\\n*/\n"


def _lark_start(body: str, rules: str, tokenizer: Any, thinking: bool) -> str:
    if thinking:
        return f"start: think {body}\n{_think_prefix(tokenizer)}{rules}"
    return f"start: {body}\n{rules}"


def _processor(tokenizer: Any, eos: Iterable[int] | None, grammar: str, what: str):
    tok, eos_ids = _unwrap(tokenizer, eos)
    return GrammarProcessor(make_tokenizer_adapter(tok, eos_ids), grammar, description=what)


def json_schema_processor(
    tokenizer: Any,
    schema: dict,
    *,
    thinking: bool = False,
    compact: bool = True,
    eos_token_ids: Iterable[int] | None = None,
) -> GrammarProcessor:
    """Output is one JSON value valid against `schema` (after free reasoning if thinking)."""
    if isinstance(schema, str):
        schema = json.loads(schema)
    if not isinstance(schema, dict):
        raise InvalidOptionError(f"a JSON schema must be an object, got {type(schema).__name__}")
    if thinking:
        tok, _ = _unwrap(tokenizer, eos_token_ids)
        body = json.dumps(_with_guidance(schema, compact))
        grammar = llguidance.LLMatcher.grammar_from_lark(
            _lark_start("answer", f"answer: %json {body}\n", tok, thinking=True)
        )
    else:
        grammar = json_schema_grammar(schema, compact)
    return _processor(tokenizer, eos_token_ids, grammar, "JSON schema")


def json_mode_processor(
    tokenizer: Any, *, thinking: bool = False, eos_token_ids: Iterable[int] | None = None
) -> GrammarProcessor:
    """Output is any JSON object."""
    return json_schema_processor(
        tokenizer, {"type": "object"}, thinking=thinking, eos_token_ids=eos_token_ids
    )


def lark_processor(
    tokenizer: Any, lark: str, *, eos_token_ids: Iterable[int] | None = None
) -> GrammarProcessor:
    """Output matches a Lark grammar (llguidance's dialect; `start` is the entry rule)."""
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    return _processor(tokenizer, eos_token_ids, grammar, "Lark grammar")


def _tool_spec(tool: Any) -> tuple[str, dict]:
    """(name, parameters schema) of an OpenAI-style tool dict or {name, parameters} dict."""
    if isinstance(tool, dict) and tool.get("type") == "function" and "function" in tool:
        tool = tool["function"]
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise InvalidOptionError(f"a tool needs a 'name': {tool!r}")
    params = tool.get("parameters") or tool.get("input_schema") or {"type": "object"}
    if not isinstance(params, dict):
        raise InvalidOptionError(f"tool {tool['name']!r}: parameters must be a JSON schema object")
    # A call's arguments are the declared parameters and nothing else: with extra keys
    # allowed, a forced call may never close (a no-argument tool would take any object).
    if not any(k in params for k in ("properties", "additionalProperties", "patternProperties")):
        params = {**params, "properties": {}}
    return tool["name"], close_objects(params)


def _pick_tools(tools: Sequence[Any], choice: str) -> list[tuple[str, dict]]:
    specs = [_tool_spec(t) for t in tools]
    if not specs:
        raise InvalidOptionError("a tool-call grammar needs at least one tool")
    if choice in ("any", "required"):
        return specs
    chosen = [s for s in specs if s[0] == choice]
    if not chosen:
        names = ", ".join(n for n, _ in specs)
        raise InvalidOptionError(
            f"tool_choice {choice!r}: no such tool (tools: {names}); or use 'any'"
        )
    return chosen


def _string_choices(schema: Any) -> list[str] | None:
    """The allowed values of a string enum / const schema, else None."""
    if not isinstance(schema, dict):
        return None
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values and all(isinstance(v, str) and "\n</parameter>" not in v for v in values):
        return list(values)
    return None


def _xml_call(idx: int, name: str, params: dict, compact: bool) -> tuple[str, str]:
    """Lark for one Qwen XML call body: <function=NAME> then <parameter=...> blocks."""
    props: dict = params.get("properties") or {}
    required = set(params.get("required") or [])
    rules: list[str] = []
    parts = [json.dumps(f"<function={name}>\n")]
    for j, (pname, pschema) in enumerate(props.items()):
        rule = f"p{idx}_{j}"
        value = f"v{idx}_{j}"
        choices = _string_choices(pschema)
        open_param = json.dumps(f"<parameter={pname}>\n")
        close = json.dumps("\n</parameter>\n")
        if choices is not None:
            # Qwen writes string values raw (unquoted), enums included
            alts = " | ".join(json.dumps(c) for c in choices)
            rules.append(f"{value}: {alts}")
            rules.append(f"{rule}: {open_param} {value} {close}")
        elif (
            isinstance(pschema, dict)
            and pschema.get("type") == "string"
            and not ("enum" in pschema or "pattern" in pschema or "format" in pschema)
        ):
            # raw text up to the first "\n</parameter>" (lazy: ends at the first one)
            rules.append(f"{value}[lazy]: /(?s:.*)\\n<\\/parameter>\\n/")
            rules.append(f"{rule}: {open_param} {value}")
        else:
            sch = pschema if isinstance(pschema, dict) else {}
            rules.append(f"{value}: %json {json.dumps(_with_guidance(sch, compact))}")
            rules.append(f"{rule}: {open_param} {value} {close}")
        parts.append(rule if pname in required else f"{rule}?")
    parts.append(json.dumps("</function>"))
    return f"call{idx}", f"call{idx}: {' '.join(parts)}\n" + "\n".join(rules) + "\n"


def tool_call_grammar(
    tokenizer: Any,
    tools: Sequence[Any],
    choice: str = "any",
    style: str = "json",
    *,
    parallel: bool = False,
    thinking: bool = False,
    compact: bool = True,
) -> str:
    """Grammar for `<tool_call>...</tool_call>` block(s) calling one of `tools`.

    style "json": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` with the
    arguments valid against the tool's schema. style "qwen_xml": Qwen3.5's
    `<function=NAME>` / `<parameter=ARG>` body (properties in schema order; strings raw, other
    values JSON). choice: "any" (one of the tools) or a tool name. parallel: one or more calls.
    """
    if style not in ("json", "qwen_xml"):
        raise InvalidOptionError(f"tool-call style {style!r}: use 'json' or 'qwen_xml'")
    specs = _pick_tools(tools, choice)
    open_tag, close_tag = _tag(tokenizer, "<tool_call>"), _tag(tokenizer, "</tool_call>")
    rules = f'call: {open_tag} "\\n" body "\\n" {close_tag}\n'
    if style == "json":
        variants = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, params in specs
        ]
        schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
        rules += f"body: %json {json.dumps(_with_guidance(schema, compact))}\n"
    else:
        names = []
        for i, (name, params) in enumerate(specs):
            rule_name, text = _xml_call(i, name, params, compact)
            names.append(rule_name)
            rules += text
        rules += f"body: {' | '.join(names)}\n"
    body = 'call ("\\n" call)*' if parallel else "call"
    return llguidance.LLMatcher.grammar_from_lark(_lark_start(body, rules, tokenizer, thinking))


def tool_call_processor(
    tokenizer: Any,
    tools: Sequence[Any],
    choice: str = "any",
    style: str = "json",
    *,
    parallel: bool = False,
    thinking: bool = False,
    eos_token_ids: Iterable[int] | None = None,
) -> GrammarProcessor:
    """Output is a well-formed tool call (see `tool_call_grammar`)."""
    tok, _ = _unwrap(tokenizer, eos_token_ids)
    grammar = tool_call_grammar(tok, tools, choice, style, parallel=parallel, thinking=thinking)
    return _processor(tokenizer, eos_token_ids, grammar, "tool call")
