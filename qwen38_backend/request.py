"""One generate call, decided once: options checked, prompt rendered and tokenized, limits set.

Every entry point (Python, `qwen38 run`, the llm plugin, ChatQwen38) hands its messages, tools,
tool_choice, response_format, reasoning and options to `build_request`, which decides the chat
policy the integrations used to repeat:
- reasoning: the template's default, except off for a constrained answer unless asked for;
- tools: folded into text for templates that do not render them; a forced tool_choice only
  while the user spoke last (after tool results the model answers freely);
- constrained decoding: the grammar processor for a JSON schema, JSON mode or a forced call;
- the window: a prompt that does not fit is refused before any work, naming the numbers; an
  unset max_tokens is the model's default, cut to what the window leaves.
The prompt is rendered and tokenized once; the message boundary (where a snapshot is reusable
by the next turn) comes from the same tokenization.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .chat_format import opens_reasoning, template_features, template_messages
from .errors import ContextWindowError, InvalidOptionError
from .kv import KV_OPTION_KEYS
from .sampling import SamplingParams
from .speculative import OPTION_KEYS as DRAFT_OPTION_KEYS
from .speculative import DraftOptions
from .speculative import parse_options as parse_draft
from .speculative import resolve as resolve_draft

SAMPLING_KEYS = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "stop_token_ids",
        "logits_processors",
    }
)
# Template variables a caller may set by name; any other goes in chat_template_kwargs.
TEMPLATE_KEYS = frozenset({"enable_thinking"})
REQUEST_KEYS = frozenset({"context", "chat_template_kwargs"})
KNOWN_OPTIONS = SAMPLING_KEYS | KV_OPTION_KEYS | TEMPLATE_KEYS | REQUEST_KEYS | DRAFT_OPTION_KEYS
DEFAULT_MAX_TOKENS = 4096


@dataclass
class Request:
    """A prompt ready to run: token ids, where the messages end, and how to sample."""

    ids: list[int]
    text: str
    boundary: int  # tokens of the rendered messages before the generation prompt (0: none)
    params: SamplingParams
    kv: dict[str, Any]
    window: int
    tools: list[dict] | None = None  # as the stream parser should read calls back
    thinking: bool = False  # the prompt leaves a <think> block open
    constrained: str | None = None  # "schema", "json" or "tool_call"
    grammar: Any = None  # the constraint's GrammarProcessor (says whether output is complete)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    draft: DraftOptions | None = None  # resolved draft options (None: plain decoding)


def split_options(options: dict[str, Any]) -> tuple[dict, dict, dict, dict]:
    """(sampling, kv, template, request) options; an unknown name is refused by name."""
    unknown = sorted(set(options) - KNOWN_OPTIONS)
    if unknown:
        raise InvalidOptionError(
            f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(KNOWN_OPTIONS))} "
            "(other chat-template variables go in chat_template_kwargs={...})"
        )
    sampling = {k: v for k, v in options.items() if k in SAMPLING_KEYS}
    kv = {k: v for k, v in options.items() if k in KV_OPTION_KEYS and v is not None}
    template = {k: v for k, v in options.items() if k in TEMPLATE_KEYS and v is not None}
    extra = options.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise InvalidOptionError("chat_template_kwargs must be a dict of template variables")
    template = {**extra, **template}
    thinking = template.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):  # "no" would be truthy
        raise InvalidOptionError(f"enable_thinking={thinking!r}: must be true or false")
    request = {k: options[k] for k in ("context",) if options.get(k) is not None}
    request.update({k: v for k, v in options.items() if k in DRAFT_OPTION_KEYS})
    return sampling, kv, template, request


def _check_tools(tools: Any) -> None:
    """tools: a list of tool specs, each naming its function (OpenAI's {"type": "function",
    "function": {"name": ...}} or {"name": ...})."""
    if tools is None:
        return
    if not isinstance(tools, (list, tuple)):
        raise InvalidOptionError(f"tools={tools!r}: must be a list of tool specs")
    for tool in tools:
        spec = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise InvalidOptionError(f"tool {tool!r}: must be a dict naming its function")


def tool_name(tool: dict[str, Any]) -> str:
    return tool["function"]["name"] if "function" in tool else tool["name"]


def normalize_tool_choice(choice: Any, tools: Sequence[dict[str, Any]] | None) -> str:
    """ "auto", "none", "any" or a tool name, from every form callers pass (None, True/False,
    "required", {"type": "function", "function": {"name": ...}})."""
    if choice is None or choice == "auto":
        return "auto"
    if choice is True or choice == "required":
        return "any"
    if choice is False:
        return "none"
    if isinstance(choice, dict):
        fn = choice.get("function") or {}
        choice = fn.get("name") or choice.get("name")
    if not isinstance(choice, str) or not choice.strip():
        raise InvalidOptionError(
            f"tool_choice={choice!r}: use auto, none, any (or required) or a tool name"
        )
    if choice not in ("any", "none"):
        names = [tool_name(t) for t in tools or []]
        if choice not in names:
            raise InvalidOptionError(
                f"tool_choice {choice!r} is not one of the tools ({', '.join(names) or 'none'})"
            )
    return choice


def response_schema(response_format: Any) -> tuple[str, dict | None]:
    """("json", None) for JSON mode, ("schema", schema) for a JSON schema (plain, or OpenAI's
    {"type": "json_schema", "json_schema": {"schema": ...}} form)."""
    if response_format in ("json", {"type": "json_object"}):
        return "json", None
    schema = response_format
    if isinstance(schema, dict) and schema.get("type") == "json_schema":
        schema = schema["json_schema"]["schema"]
    if not isinstance(schema, dict):
        raise InvalidOptionError(
            f"response_format must be 'json' or a JSON schema object, got {type(schema).__name__}"
        )
    return "schema", schema


# Quest's selection options: Flash-Next selects with its trained QSA indexer instead
QUEST_KEYS = ("kv_topk", "kv_sinks", "kv_recent")


def _check_selection_options(model: Any, kv: dict[str, Any]) -> None:
    """Refuse Quest options on a model whose selection is its own (they would be ignored)."""
    given = [k for k in QUEST_KEYS if k in kv]
    budget = getattr(getattr(model, "config", None), "indexer_budget", None)
    if given and budget is not None:
        raise InvalidOptionError(
            f"{', '.join(given)}: this model (Flash-Next, qwen4_exp) selects what decode reads "
            f"with its own QSA indexer ({budget} tokens, from its config); Quest options do "
            "not apply (kv_paged, kv_page_tokens, kv_pool_tokens and kv_spill_dir do)"
        )


def build_request(
    model: Any,
    prompt: Any,
    tools: list[dict] | None = None,
    *,
    tool_choice: Any = None,
    tool_style: str | None = None,
    response_format: Any = None,
    reasoning: bool | None = None,
    model_sampling: bool = False,
    **options: Any,
) -> Request:
    """Decide everything about one call (see the module docstring) before any model work.

    model_sampling=True takes temperature / top_p / top_k the call leaves unset from the
    model's generation_config when it asks to sample (do_sample); otherwise unset is greedy.
    """
    from . import constrained as grammar

    sampling, kv, template, limits = split_options(options)
    _check_selection_options(model, kv)
    _check_tools(tools)
    if model_sampling:
        sampling = {**model_sampling_defaults(model), **sampling}
    choice = normalize_tool_choice(tool_choice, tools)
    if choice == "none":
        tools = None
    messages = _messages(prompt)
    forced = bool(tools) and choice not in ("auto", "none")
    # forced only while the user spoke last: after tool results the model answers freely
    forced = forced and messages is not None and messages[-1].get("role") == "user"
    if forced and response_format is not None:
        raise InvalidOptionError("a forced tool_choice and a response_format cannot be combined")
    constrained = "tool_call" if forced else None
    if response_format is not None:
        constrained, schema = response_schema(response_format)
    if reasoning is not None:
        template["enable_thinking"] = bool(reasoning)
    elif constrained is not None:
        template.setdefault("enable_thinking", False)  # answer at once, not after reasoning

    tok = model.tokenizer
    if messages is None:  # token ids as given
        ids, text, boundary, features = list(prompt), tok.decode(list(prompt)), 0, None
    else:
        features = template_features(tok.chat_template)
        rendered, template_tools = template_messages(messages, tools, features)
        ids, text, boundary = _render(tok, rendered, template_tools, template)

    window = _window(model, limits.get("context"))
    sampling["max_tokens"] = _max_tokens(model, len(ids), sampling.get("max_tokens"), window)
    thinking = opens_reasoning(text)
    processors = list(sampling.get("logits_processors") or [])
    n_given = len(processors)
    if constrained == "tool_call":
        style = tool_style or (
            features.call_style if features and features.native_tools else "json"
        )
        closed = [
            {**t, "function": {**t["function"], "parameters": grammar.close_objects(_params(t))}}
            for t in tools or []
        ]
        processors.append(
            grammar.tool_call_processor(model, closed, choice, style=style, thinking=thinking)
        )
    elif constrained == "json":
        processors.append(grammar.json_mode_processor(model, thinking=thinking))
    elif constrained == "schema":
        # the listed properties are the whole object (as OpenAI's strict mode)
        processors.append(
            grammar.json_schema_processor(model, grammar.close_objects(schema), thinking=thinking)
        )
    if processors:
        sampling["logits_processors"] = processors
    return Request(
        ids=ids,
        text=text,
        boundary=boundary,
        params=SamplingParams.from_options(**sampling),
        kv=kv,
        window=window,
        tools=tools or None,
        thinking=thinking,
        constrained=constrained,
        grammar=processors[n_given] if len(processors) > n_given else None,
        template_kwargs=template,
        draft=resolve_draft(parse_draft(limits), model),
    )


def model_sampling_defaults(model: Any) -> dict[str, Any]:
    """temperature / top_p / top_k from generation_config.json when the model asks to sample."""
    gen = getattr(model, "generation_config", None) or {}
    if not gen.get("do_sample"):
        return {}
    return {k: gen[k] for k in ("temperature", "top_p", "top_k") if gen.get(k) is not None}


def _messages(prompt: Any) -> list[dict] | None:
    """The prompt as chat messages, or None for a list of token ids."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise InvalidOptionError("prompt must be a string, or a non-empty list of messages or ids")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return None
    if not all(isinstance(m, dict) and "role" in m for m in prompt):
        raise InvalidOptionError("every message must be a dict with a 'role'")
    return list(prompt)


def _params(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _render(tok: Any, messages: list[dict], tools: list | None, template: dict):
    """(ids, text, boundary): one tokenization of the prompt; the boundary is where the
    rendered messages end (before the generation prompt) if that is a token boundary."""
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **template)
    try:
        head = tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=False, **template
        )
    except Exception:  # noqa: BLE001 - a template may refuse to end without a generation prompt
        head = ""
    ids, ends = tok.encode_with_offsets(text)
    boundary = 0
    if head and len(head) < len(text) and text.startswith(head):
        n = sum(1 for end in ends if end <= len(head))
        if 0 < n < len(ids) and ends[n - 1] == len(head):
            boundary = n
    return ids, text, boundary


def _window(model: Any, context: int | None) -> int:
    window = int(model.config.max_position_embeddings)
    if context is None:
        return window
    if isinstance(context, bool) or not isinstance(context, int) or context < 2:
        raise InvalidOptionError(f"context={context!r}: must be an integer >= 2")
    return min(window, context)


def _max_tokens(model: Any, prompt_tokens: int, asked: int | None, window: int) -> int:
    """The explicit max_tokens if prompt + it fits the window (else refused), or the model's
    default cut to what the window leaves."""
    name = getattr(model, "name", "the model")
    if prompt_tokens >= window:
        raise ContextWindowError(
            f"the prompt is {prompt_tokens:,} tokens, over the {window:,}-token window of "
            f"{name} by {prompt_tokens - window + 1:,} (one token must be left to generate); "
            "shorten the prompt or the conversation"
        )
    room = window - prompt_tokens
    if asked is None:
        return min(getattr(model, "default_max_tokens", DEFAULT_MAX_TOKENS), room)
    if isinstance(asked, int) and not isinstance(asked, bool) and asked > room:
        raise ContextWindowError(
            f"the prompt is {prompt_tokens:,} tokens and max_tokens is {asked:,}: "
            f"{prompt_tokens + asked:,} is over the {window:,}-token window of {name} by "
            f"{prompt_tokens + asked - window:,}; lower max_tokens to at most {room:,} or "
            "shorten the prompt"
        )
    return asked
