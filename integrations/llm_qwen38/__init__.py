"""llm plugin for the Qwen3.8 models: `llm -m qwen38 ...`, `llm chat`, `llm qwen38 ...`.

This module is imported on every `llm` start-up, so it imports nothing heavy (no MLX, numpy,
tokenizers or engine modules): the engine is imported inside `execute` (`_runtime`) and
inside the `llm qwen38` subcommands (`_commands`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

import llm
from pydantic import Field, field_validator

from . import _home

# speculative.MAX_TOKENS (a verify is a step of at most 16 rows), not imported: this module
# stays light; tests/test_speculative.py keeps the two equal
MAX_DRAFT_TOKENS = 15

__all__ = ["Qwen38", "AsyncQwen38", "Qwen38Options"]


class Qwen38Options(llm.Options):
    """Generation options (`-o NAME VALUE`); unset values use the model's defaults."""

    temperature: float | None = Field(
        default=None, ge=0, le=10, description="Sampling temperature; 0 is greedy (default)"
    )
    top_p: float | None = Field(default=None, gt=0, le=1, description="Nucleus sampling mass")
    top_k: int | None = Field(default=None, ge=0, description="Sample from the k best (0: off)")
    min_p: float | None = Field(
        default=None, ge=0, lt=1, description="Drop tokens below min_p x the best probability"
    )
    max_tokens: int | None = Field(
        default=None, ge=1, description="Most tokens to generate (default 4096)"
    )
    seed: int | None = Field(default=None, ge=0, description="Random seed for sampling")
    stop: list[str] | None = Field(
        default=None, description="Stop string, or a JSON list of stop strings"
    )
    think: bool | None = Field(
        default=None, description="Enable the model's thinking (Qwen templates); default on"
    )
    context: int | None = Field(
        default=None, ge=16, description="Max context in tokens (prompt + output)"
    )
    kv_paged: Literal["on", "off", "auto"] | None = Field(
        default=None, description="Paged KV store: on, off or auto"
    )
    kv_topk: int | None = Field(
        default=None, ge=1, description="Sparse decode budget: tokens of KV read per step"
    )
    kv_page_tokens: int | None = Field(default=None, ge=1, description="Tokens per KV page")
    kv_pool_tokens: int | None = Field(
        default=None,
        ge=1,
        description="KV tokens kept in RAM per attention layer (bounded pool; default: from "
        "free memory); older pages spill to disk",
    )
    kv_spill_dir: str | None = Field(
        default=None, description="Directory for the KV spill files (default: the cache dir)"
    )
    draft: Literal["auto", "mtp", "ngram", "off"] | None = Field(
        default=None,
        description="Speculative decoding drafts (same tokens, fewer forwards): auto (default) "
        "= the MTP head when the model has one; ngram = copy from earlier text; off",
    )
    draft_tokens: int | None = Field(
        default=None, ge=1, le=MAX_DRAFT_TOKENS, description="Draft tokens per round (k)"
    )
    cache: bool | None = Field(
        default=None,
        description="Reuse computed prefixes (live session, state files on disk); default on",
    )
    tool_choice: str | None = Field(
        default=None,
        description="auto (default), none, any (force a call) or a tool name",
    )
    tool_style: Literal["json", "qwen_xml"] | None = Field(
        default=None, description="Forced tool-call format (default: the template's)"
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> Any:
        # `-o stop X` arrives as one string; a JSON list gives several
        if isinstance(value, str):
            if value.startswith("["):
                try:
                    parsed = json.loads(value)
                except ValueError as e:
                    raise ValueError(f"stop: invalid JSON list: {e}") from e
                return parsed
            return [value]
        return value

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("tool_choice must be auto, none, any or a tool name")
        return value


class _Base:
    """Shared by the sync and async models: which weights, and what they support."""

    can_stream = True
    supports_schema = True
    supports_tools = True
    Options = Qwen38Options

    def __init__(self, model_id: str, target: str | None, description: str = ""):
        self.model_id = model_id
        # registry name / path, or None: the user's default (resolved at call time)
        self.target = target
        self.description = description

    def __str__(self) -> str:
        return f"Qwen3.8 (local): {self.model_id}"


class Qwen38(_Base, llm.Model):
    def execute(
        self,
        prompt: llm.Prompt,
        stream: bool,
        response: llm.Response,
        conversation: llm.Conversation | None = None,
    ) -> Iterator[Any]:
        from . import _remote, _runtime

        _home.ensure_home()
        served = _runtime.served_target(self.target)
        if served is not None:  # `llm qwen38 add --url`: a `qwen38 serve` server answers
            yield from _remote.execute(self, served, prompt, response)
        else:
            yield from _runtime.execute(self, prompt, response, conversation)


class AsyncQwen38(_Base, llm.AsyncModel):
    async def execute(
        self,
        prompt: llm.Prompt,
        stream: bool,
        response: llm.AsyncResponse,
        conversation: llm.AsyncConversation | None = None,
    ) -> AsyncIterator[Any]:
        from . import _remote, _runtime

        _home.ensure_home()
        served = _runtime.served_target(self.target)
        events = (
            _remote.execute_async(self, served, prompt, response)
            if served is not None
            else _runtime.execute_async(self, prompt, response, conversation)
        )
        async for event in events:
            yield event


def _pair(model_id: str, target: str | None) -> tuple[Qwen38, AsyncQwen38]:
    return Qwen38(model_id, target), AsyncQwen38(model_id, target)


@llm.hookimpl
def register_models(register: Any) -> None:
    _home.ensure_home()
    register(*_pair(_home.DEMO_NAME, _home.DEMO_NAME))
    # `qwen38` follows the user's default (`llm qwen38 default NAME`), read at call time
    register(*_pair(_home.DEFAULT_ALIAS, None))
    for name in _home.registered_names():
        if name in (_home.DEMO_NAME, _home.DEFAULT_ALIAS):
            continue
        register(*_pair(name, name), aliases=[f"qwen38/{name}"])


@llm.hookimpl
def register_commands(cli: Any) -> None:
    from ._commands import qwen38_group

    cli.add_command(qwen38_group, name="qwen38")
