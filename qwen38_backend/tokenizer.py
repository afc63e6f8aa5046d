"""Tokenizer: a `tokenizers.Tokenizer`, the model's Jinja chat template, and streaming decode.

Two sources: a Hugging Face model directory (`tokenizer.json` + `tokenizer_config.json`, and
`chat_template.jinja` when present) or the metadata of a GGUF file (byte-level BPE vocabularies,
`tokenizer.ggml.model == "gpt2"`).

Chat templates are rendered the way transformers renders them (sandboxed jinja2 with
trim_blocks / lstrip_blocks, loop controls, a non-escaping `tojson`, `raise_exception`,
`strftime_now`, and the named special tokens as variables), so prompts are token-identical.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import TokenizerError

__all__ = ["Tokenizer", "IncrementalDetokenizer", "render_chat_template"]

# Named special tokens transformers exposes to chat templates (its `special_tokens_map`).
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token")
_NAMED_SPECIALS += ("mask_token",)

# Names a message's reasoning may arrive under; templates read `reasoning_content`.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")

# --- pre-tokenizer splits for GGUF byte-level vocabularies, keyed by tokenizer.ggml.pre ------
# The regexes are the published pre-tokenization patterns of each model family.
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "falcon3": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "qwen35": _QWEN35,
}
# Families that isolate every digit before the GPT-2 split (llama.cpp's STARCODER group,
# matching their tokenizer.json: Sequence[Digits(individual_digits), ByteLevel]).
_DIGITS_FIRST_PRE = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}

_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4


@lru_cache(maxsize=1)
def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _scalar(value: Any) -> Any:
    """A Python scalar from a 0-d mx/np array (GGUF metadata), or the value itself."""
    if value is None:
        return None
    if hasattr(value, "item"):
        try:
            return value.item()
        except (ValueError, TypeError):
            pass
    return value


def _as_list(value: Any) -> list:
    if value is None:
        return []
    if hasattr(value, "tolist"):
        out = value.tolist()
        return out if isinstance(out, list) else [out]
    return list(value)


def _token_text(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or an AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value)


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON-like types (what the sandbox may see)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if hasattr(value, "item") and callable(value.item):  # numpy / mlx scalars
        try:
            return _plain(value.item())
        except (ValueError, TypeError):
            pass
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return _plain(dump())
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: Sequence[Any]) -> list[dict]:
    """Plain dicts, None-valued keys dropped, reasoning aliased under every common name."""
    out = []
    for message in messages:
        m = _plain(message)
        if not isinstance(m, dict):
            raise TokenizerError(f"chat messages must be dicts, got {type(message).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_KEYS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        if m.get("tool_calls"):
            m["tool_calls"] = [_dict_arguments(call) for call in m["tool_calls"]]
        out.append(m)
    return out


def _dict_arguments(call: Any) -> Any:
    """OpenAI-style history carries arguments as a JSON string; Qwen templates iterate a dict."""
    if not isinstance(call, dict):
        return call
    fn = call.get("function")
    target = fn if isinstance(fn, dict) else call
    args = target.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            return call
        if isinstance(parsed, dict):
            target = {**target, "arguments": parsed}
            return {**call, "function": target} if isinstance(fn, dict) else target
    return call


# --- Jinja environment ---------------------------------------------------------------------


def _template_error(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _SafeDict:
    """`dict` for templates without exposing the type object itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _make_namespace_class() -> type:
    import jinja2.exceptions
    import jinja2.utils

    def check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates may not set underscore attributes on a namespace ({name!r})"
            )

    class _Namespace(jinja2.utils.Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's signature trick)
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for key in attrs:
                check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return _Namespace


@lru_cache(maxsize=32)
def _compile(template: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _template_error
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _SafeDict()
    env.globals["namespace"] = _make_namespace_class()
    # transformers' `{% generation %}` marker (assistant masks): render its body unchanged.
    env.add_extension(_generation_extension())
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise TokenizerError(f"chat template does not compile: {e}") from e


@lru_cache(maxsize=1)
def _generation_extension() -> type:
    import jinja2.nodes
    from jinja2.ext import Extension

    class _Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    return _Generation


def render_chat_template(
    template: str,
    messages: Sequence[Any],
    tools: Sequence[Any] | None = None,
    add_generation_prompt: bool = True,
    documents: Sequence[Any] | None = None,
    **variables: Any,
) -> str:
    """Render `template` over `messages` as transformers' `apply_chat_template` does.

    Raises TokenizerError with the template's own message when rendering fails.
    """
    compiled = _compile(template)
    try:
        return compiled.render(
            messages=_prepare_messages(messages),
            tools=_plain(list(tools)) if tools is not None else None,
            documents=_plain(list(documents)) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
            **_plain(variables),
        )
    except TokenizerError:
        raise
    except Exception as e:  # template code can fail in many ways; all are template errors
        raise TokenizerError(f"chat template error: {e}") from e


# --- Tokenizer -----------------------------------------------------------------------------


class Tokenizer:
    """Byte-level BPE (or any `tokenizers` model) plus chat template and special-token facts."""

    def __init__(
        self,
        backend: Any,
        *,
        chat_template: str | dict[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        add_bos_token: bool = False,
        special_ids: Iterable[int] | None = None,
    ) -> None:
        self._tok = backend
        if isinstance(chat_template, dict):
            self._templates = dict(chat_template)
        elif chat_template:
            self._templates = {"default": chat_template}
        else:
            self._templates = {}
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._eos = list(dict.fromkeys(int(i) for i in eos_token_ids))
        self._bos = bos_token_id
        self._add_bos = add_bos_token
        if special_ids is None:
            decoder = backend.get_added_tokens_decoder()
            special_ids = [i for i, t in decoder.items() if t.special]
        self._special_ids = frozenset(int(i) for i in special_ids)

    # -- constructors --

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json)."""
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFTokenizer

        root = Path(path)
        tj = root / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(f"{tj} not found: need a tokenizer.json (HF fast tokenizer)")
        try:
            backend = HFTokenizer.from_file(str(tj))
        except Exception as e:
            raise TokenizerError(f"cannot read {tj}: {e}") from e
        cfg: dict[str, Any] = {}
        cfg_path = root / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise TokenizerError(f"cannot read {cfg_path}: {e}") from e

        # Added tokens declared only in the config (rare) must still encode whole.
        decoder = backend.get_added_tokens_decoder()
        for sid, entry in (cfg.get("added_tokens_decoder") or {}).items():
            if int(sid) in decoder or not isinstance(entry, Mapping) or "content" not in entry:
                continue
            if backend.token_to_id(entry["content"]) != int(sid):
                continue  # adding it would append a new id: leave the vocabulary alone
            special = bool(entry.get("special", False))
            token = AddedToken(
                entry["content"], special=special, normalized=bool(entry.get("normalized", False))
            )
            if special:
                backend.add_special_tokens([token])
            else:
                backend.add_tokens([token])

        specials = {k: _token_text(cfg.get(k)) for k in _NAMED_SPECIALS}
        template: Any = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template if "name" in t}
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if template is None and (root / "chat_template.json").is_file():
            try:
                template = json.loads((root / "chat_template.json").read_text()).get(
                    "chat_template"
                )
            except (OSError, ValueError, AttributeError):
                template = None

        eos = specials.get("eos_token")
        eos_ids = [backend.token_to_id(eos)] if eos else []
        bos = specials.get("bos_token")
        bos_id = backend.token_to_id(bos) if bos else None
        return cls(
            backend,
            chat_template=template,
            special_tokens=specials,
            eos_token_ids=[i for i in eos_ids if i is not None],
            bos_token_id=bos_id,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
        )

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer a GGUF file describes (byte-level BPE: tokenizer.ggml.model gpt2)."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
        from tokenizers import Tokenizer as HFTokenizer

        kind = _scalar(metadata.get("tokenizer.ggml.model"))
        if kind != "gpt2":
            raise TokenizerError(
                f"GGUF tokenizer.ggml.model = {kind!r} is not supported: "
                "only 'gpt2' (byte-level BPE)"
            )
        tokens = [str(t) for t in _as_list(metadata.get("tokenizer.ggml.tokens"))]
        if not tokens:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
        merges_raw = [str(m) for m in _as_list(metadata.get("tokenizer.ggml.merges"))]
        types = [int(t) for t in _as_list(metadata.get("tokenizer.ggml.token_type"))]
        types += [1] * (len(tokens) - len(types))

        byte_char = _byte_chars()
        alphabet = frozenset(byte_char.values())

        def spell(token: str) -> str:
            if set(token) <= alphabet:
                return token
            return "".join(byte_char[b] for b in token.encode("utf-8"))

        vocab: dict[str, int] = {}
        for i, token in enumerate(tokens):
            vocab.setdefault(spell(token), i)
        merges = []
        for m in merges_raw:
            left, sep, right = m.partition(" ")
            if not sep:
                raise TokenizerError(f"GGUF merge {m!r} is not 'left right'")
            merges.append((left, right))
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        except Exception as e:
            raise TokenizerError(f"GGUF byte-level BPE vocabulary is invalid: {e}") from e
        backend = HFTokenizer(bpe)

        pre = _scalar(metadata.get("tokenizer.ggml.pre"))
        if pre in _SPLIT_BY_PRE:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(_SPLIT_BY_PRE[pre]), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        elif pre in _DIGITS_FIRST_PRE:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        else:  # "gpt2", "default", unknown: the GPT-2 split inside ByteLevel
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        backend.decoder = decoders.ByteLevel()

        # Control tokens become special added tokens (they encode whole and can be skipped);
        # user-defined ones (e.g. <think> in Qwen GGUFs) become plain added tokens.
        control = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _GGUF_CONTROL and vocab.get(t) is not None and set(t) <= alphabet
        ]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _GGUF_USER_DEFINED and t in vocab
        ]
        if control:
            backend.add_special_tokens(control)
        if user:
            backend.add_tokens(user)

        def tid(key: str) -> int | None:
            v = _scalar(metadata.get(f"tokenizer.ggml.{key}"))
            return int(v) if v is not None and 0 <= int(v) < len(tokens) else None

        bos_id, eos_id = tid("bos_token_id"), tid("eos_token_id")
        unk_id, pad_id = tid("unknown_token_id"), tid("padding_token_id")
        add_bos = bool(_scalar(metadata.get("tokenizer.ggml.add_bos_token")) or False)
        if add_bos and bos_id is not None:
            bos_text = tokens[bos_id]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos_text}:0 $A:0",
                pair=f"{bos_text}:0 $A:0 $B:1",
                special_tokens=[(bos_text, bos_id)],
            )
        specials = {
            "bos_token": tokens[bos_id] if bos_id is not None else None,
            "eos_token": tokens[eos_id] if eos_id is not None else None,
            "unk_token": tokens[unk_id] if unk_id is not None else None,
            "pad_token": tokens[pad_id] if pad_id is not None else None,
        }
        eos_ids = [eos_id] if eos_id is not None else []
        eot = tid("eot_token_id")
        if eot is not None:
            eos_ids.append(eot)
        template = _scalar(metadata.get("tokenizer.chat_template"))
        return cls(
            backend,
            chat_template=str(template) if template else None,
            special_tokens=specials,
            eos_token_ids=eos_ids,
            bos_token_id=bos_id,
            add_bos_token=add_bos,
        )

    # -- token facts --

    @property
    def backend(self) -> Any:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end generation (tokenizer's eos; callers may extend from generation_config)."""
        return list(self._eos)

    def add_eos_token_ids(self, ids: Iterable[int]) -> None:
        """Add stop ids, e.g. generation_config.json's eos_token_id list."""
        self._eos = list(dict.fromkeys([*self._eos, *(int(i) for i in ids)]))

    @property
    def bos_token_id(self) -> int | None:
        """The BOS id, or None."""
        return self._bos

    @property
    def add_bos_token(self) -> bool:
        """Whether `encode(add_special_tokens=True)` prepends BOS."""
        return self._add_bos

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def special_ids(self) -> set[int]:
        """Ids of the special (control) tokens."""
        return set(self._special_ids)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special tokens (bos_token, eos_token, ...) as exposed to chat templates."""
        return dict(self._special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (vocabulary spelling), or None."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary spelling of an id, or None."""
        return self._tok.id_to_token(int(token_id))

    # -- encode / decode --

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it encode as their single ids."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids of `text` and the character offset where each token ends."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [end for _, end in enc.offsets]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; special tokens appear as their text unless skipped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def detokenizer(
        self, skip_special_tokens: bool = False, skip_ids: Iterable[int] | None = None
    ) -> IncrementalDetokenizer:
        """A fresh streaming decoder."""
        skip = set(skip_ids or ())
        if skip_special_tokens:
            skip |= self._special_ids
        return IncrementalDetokenizer(self, skip_ids=skip)

    # -- chat template --

    @property
    def chat_template(self) -> str | None:
        """The default chat template source, or None."""
        return self._templates.get("default") or next(iter(self._templates.values()), None)

    def _pick_template(self, tools: Any) -> str:
        if tools and "tool_use" in self._templates:
            return self._templates["tool_use"]
        template = self.chat_template
        if not template:
            raise TokenizerError(
                "this tokenizer has no chat template (tokenizer_config.json chat_template, "
                "chat_template.jinja or GGUF tokenizer.chat_template)"
            )
        return template

    def apply_chat_template(
        self,
        messages: Sequence[Any],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` (and OpenAI-style `tools`) with the model's own template.

        Extra keyword arguments (e.g. `enable_thinking=False`) become template variables and
        override the special-token variables of the same name.
        """
        if not messages:
            raise TokenizerError("cannot render an empty conversation")
        variables = {**self._special_tokens, **template_kwargs}
        text = render_chat_template(
            self._pick_template(tools),
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text


# --- streaming decode ----------------------------------------------------------------------

# Longest UTF-8 sequence is 4 bytes and every token carries at least one byte, so a decoded
# tail that still ends in U+FFFD after this many pending tokens is a genuine replacement char.
_MAX_PENDING = 8


class IncrementalDetokenizer:
    """Turns a stream of ids into text deltas that never end inside a UTF-8 sequence.

    Decodes only a small window (the last emitted token group plus the pending ones), so each
    step costs O(window), not O(sequence).
    """

    def __init__(self, tokenizer: Tokenizer, skip_ids: Iterable[int] = ()) -> None:
        self._tok = tokenizer
        self._skip = frozenset(int(i) for i in skip_ids)
        self._prefix: list[int] = []  # last emitted group: context for the next decode
        self._pending: list[int] = []  # ids not yet turned into text
        self._prefix_text = ""

    def add(self, token_id: int) -> str:
        """Feed one id; return the newly completed text (may be "")."""
        token_id = int(token_id)
        if token_id in self._skip:
            return ""
        self._pending.append(token_id)
        text = self._tok.decode(self._prefix + self._pending)
        if text.endswith("\ufffd") and len(self._pending) < _MAX_PENDING:
            return ""
        return self._emit(text)

    def _emit(self, text: str) -> str:
        if text.startswith(self._prefix_text):
            delta = text[len(self._prefix_text) :]
        else:  # decoder changed earlier text (rare cleanup rules): fall back to the new part
            delta = self._tok.decode(self._pending)
        self._prefix = self._pending
        self._pending = []
        self._prefix_text = self._tok.decode(self._prefix)
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete sequence decodes as U+FFFD)."""
        if not self._pending:
            return ""
        return self._emit(self._tok.decode(self._prefix + self._pending))
