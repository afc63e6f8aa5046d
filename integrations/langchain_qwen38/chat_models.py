"""ChatQwen38: a LangChain chat model running the Qwen3.8 models locally on qwen38_backend."""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.base import LangSmithParams
from langchain_core.language_models.chat_models import (
    BaseChatModel,
    agenerate_from_stream,
    generate_from_stream,
)
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.output_parsers import (
    JsonOutputKeyToolsParser,
    JsonOutputParser,
    PydanticOutputParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from qwen38_backend.errors import OutputCutError

from .messages import to_template_messages
from .shared_models import DEFAULT_MODEL, SharedModel, shared_model

# speculative.MAX_TOKENS (a verify is a step of at most 16 rows), not imported: this module
# stays light; tests/test_speculative.py keeps the two equal
MAX_DRAFT_TOKENS = 15

__all__ = ["ChatQwen38"]

PROVIDER = "qwen38"
_SAMPLING_FIELDS = ("temperature", "max_tokens", "top_p", "top_k", "min_p", "seed")
_OPTION_FIELDS = (*_SAMPLING_FIELDS, "draft", "draft_tokens")


def _draft_metadata(session: Any) -> dict[str, Any]:
    """Speculative decoding's figures (drafted, accepted, acceptance_rate,
    tokens_per_forward, ...) of an in-process generation, under "draft"."""
    stats = getattr(session, "last_stats", None)
    return {"draft": stats.draft_stats()} if stats is not None else {}


class _Cancelled(Exception):
    """The caller went away (async task cancelled or stream closed)."""


class ChatQwen38(BaseChatModel):
    """Qwen3.8 models (and other local weights qwen38_backend loads) as a chat model.

    Construction is cheap: the weights load on the first call and are shared by every
    instance that names the same model and dtype, for the life of the process.

    ```python
    from langchain_qwen38 import ChatQwen38

    chat = ChatQwen38(model="qwen38-demo", temperature=0)
    chat.invoke("Hello!")
    chat.bind_tools([search], tool_choice="any").invoke(messages)
    chat.with_structured_output(Answer).invoke("...")  # decoding constrained to the schema
    ```

    Successive calls whose prompt extends an earlier one (chat histories, agent loops) reuse
    the already-computed prefix; `usage_metadata["input_token_details"]["cache_read"]` says
    how many prompt tokens were restored rather than recomputed.
    """

    model_config = ConfigDict(populate_by_name=True, protected_namespaces=())

    model: str = DEFAULT_MODEL
    """Registry name (`qwen38-demo`, a name added with `llm qwen38 add`), model directory or
    `.gguf` path. `qwen38` means the registry's default model, else the demo model."""
    dtype: str | None = None
    """Compute dtype ('float32', 'bfloat16', 'float16'); None: the backend's choice."""
    temperature: float | None = Field(default=None, ge=0)
    """Sampling temperature; 0 or None is greedy."""
    max_tokens: int | None = Field(default=None, ge=0)
    """Most tokens to generate (reasoning included); None: the model's default (4096, the demo
    512), cut to what the window leaves. Prompt + max_tokens over the window is refused."""
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, lt=1)
    seed: int | None = Field(default=None, ge=0)
    """Seed for sampling; the same seed and prompt give the same output."""
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    """Stop strings (not included in the output)."""
    draft: Literal["auto", "mtp", "ngram", "off"] | None = None
    """Speculative decoding drafts (the same tokens, fewer forwards): None / `auto` = the MTP
    head when the model has one; `ngram` = copy from earlier text; `off`. The figures are in
    the last chunk's `response_metadata["draft"]`."""
    draft_tokens: int | None = Field(default=None, ge=1, le=MAX_DRAFT_TOKENS)
    """Draft tokens per round (k); None: the mode's default."""
    timeout: float | None = Field(default=None, gt=0)
    """Seconds a generation may run (waiting for a busy model included) before it is stopped
    with TimeoutError."""
    max_retries: int = Field(default=0, ge=0)
    """Accepted for compatibility with API-backed chat models; local generation is not
    retried."""
    api_key: SecretStr | None = None
    """Accepted for compatibility with API-backed chat models (LangChain's standard tests pass
    one); neither local generation nor `qwen38 serve` uses a key."""
    streaming: bool = False
    """Whether invoke() streams internally (callbacks see tokens as they come)."""
    reasoning: bool | None = None
    """Thinking mode for templates that support it (`enable_thinking`): None leaves the
    template's default, except for constrained outputs (forced tool calls, structured output),
    which skip reasoning unless this is True."""
    base_url: str | None = None
    """URL of a `qwen38 serve` server (e.g. http://127.0.0.1:8080) to answer instead of
    loading weights in this process; `model` then names the served model (the default
    `qwen38`: whatever it serves). A registry name added with `llm qwen38 add --url` does the
    same without base_url."""
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra options for every call: KV store options (`kv_paged`, `kv_topk`, ...) or extra
    chat-template variables."""

    @model_validator(mode="before")
    @classmethod
    def _engine_options_as_keywords(cls, values: Any) -> Any:
        """Engine options given as keywords (`kv_pool_tokens=...`) join model_kwargs; any other
        unknown keyword is refused by name (pydantic would drop it without a word)."""
        if not isinstance(values, dict):
            return values
        fields = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        extra = [key for key in values if key not in fields]
        if not extra:
            return values
        from qwen38_backend.request import KNOWN_OPTIONS

        unknown = sorted(key for key in extra if key not in KNOWN_OPTIONS)
        if unknown:
            known = ", ".join(sorted(KNOWN_OPTIONS - fields))
            raise ValueError(
                f"unknown option(s) {', '.join(unknown)}; ChatQwen38 takes its fields and "
                f"the engine's options: {known}"
            )
        values = dict(values)
        kwargs = dict(values.get("model_kwargs") or {})
        for key in extra:
            value = values.pop(key)
            if key in kwargs and kwargs[key] != value:
                raise ValueError(f"{key} is given twice, as a keyword and in model_kwargs")
            kwargs[key] = value
        values["model_kwargs"] = kwargs
        return values

    @field_validator("base_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        from qwen38_backend.client import normalize_url

        return None if value is None else normalize_url(value)

    @field_validator("model_kwargs")
    @classmethod
    def _known_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        # refused by name at construction, not at the first call
        from qwen38_backend.request import KNOWN_OPTIONS

        unknown = sorted(set(value) - KNOWN_OPTIONS - {"tools", "tool_choice", "response_format"})
        if unknown:
            known = ", ".join(sorted(KNOWN_OPTIONS))
            raise ValueError(f"unknown model_kwargs {', '.join(unknown)}; known: {known}")
        return value

    # ----- identity ----------------------------------------------------------------------

    @property
    def _llm_type(self) -> str:
        return "qwen38-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "base_url": self.base_url,
            "dtype": self.dtype,
            "reasoning": self.reasoning,
            **{k: getattr(self, k) for k in _OPTION_FIELDS},
            "stop": self.stop,
            **self.model_kwargs,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider=PROVIDER,
            ls_model_name=kwargs.get("model") or self.model,
            ls_model_type="chat",
        )
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is not None:
            params["ls_temperature"] = temperature
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        if stop := stop or self.stop:
            params["ls_stop"] = stop
        return params

    def _resolve_model_profile(self) -> ModelProfile | None:
        # Static: building it must not load weights (construction stays cheap).
        return ModelProfile(
            open_weights=True,
            text_inputs=True,
            image_inputs=False,
            audio_inputs=False,
            video_inputs=False,
            pdf_inputs=False,
            text_outputs=True,
            reasoning_output=True,
            tool_calling=True,
            tool_choice=True,
            tool_call_streaming=True,
            structured_output=True,
            temperature=True,
        )

    # ----- the shared model---------------------------------------------------------------

    def _shared(self, model: str | None = None) -> SharedModel:
        return shared_model(model or self.model, self.dtype)

    def _served(self, model: str | None = None) -> tuple[str, str | None] | None:
        """(url, served model id or None) when a server answers this call, else None."""
        name = model or self.model
        if self.base_url is not None:
            return self.base_url, None if name == DEFAULT_MODEL else name
        from qwen38_backend.loading.registry import Registry

        served = Registry().served(name)
        return (served[0], served[1] or None) if served is not None else None

    def _remote_job(
        self,
        served: tuple[str, str | None],
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: dict[str, Any],
        emit: Callable[[tuple[str, Any]], None],
        cancelled: threading.Event,
        deadline: float | None,
    ) -> None:
        """`_job` for a served model, on its own thread: the server decides the call, its
        events come back through qwen38_backend.client."""
        from qwen38_backend.client import ServedModel

        def open_events(check: Callable[[], None]) -> tuple[Any, None]:
            options = self._options(stop, kwargs)
            tools = options.pop("tools", None) or None
            client = ServedModel(served[0], served[1], timeout=self.timeout)
            dicts = to_template_messages(messages)
            return client.generate(dicts, tools, cancel=cancelled, **options), None

        model_name = kwargs.get("model") or self.model
        self._emit_events(open_events, model_name, emit, cancelled, deadline)

    def _start(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: dict[str, Any],
        emit: Callable[[tuple[str, Any]], None],
        cancelled: threading.Event,
        deadline: float | None,
    ) -> str:
        """Start one generation (on the engine thread, or a thread reading the server);
        returns the name its errors carry. Local weights may load here (minutes)."""
        served = self._served(kwargs.get("model"))
        if served is not None:
            args = (served, messages, stop, kwargs, emit, cancelled, deadline)
            threading.Thread(target=self._remote_job, args=args, daemon=True).start()
            return served[0]
        shared = self._shared(kwargs.get("model"))
        shared.submit(self._job, shared, messages, stop, kwargs, emit, cancelled, deadline)
        return shared.name

    def _options(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Session.generate options from the fields and the call's kwargs (LangChain's names
        translated: `reasoning`, `response_format`, `tool_choice` pass through; the engine
        decides what they mean and refuses options it does not know, by name)."""
        kwargs = dict(kwargs)
        kwargs.pop("model", None)
        kwargs.pop("stream", None)
        kwargs.pop("ls_structured_output_format", None)
        opts: dict[str, Any] = {}
        for key in _OPTION_FIELDS:
            value = kwargs.pop(key, getattr(self, key))
            if value is not None:
                opts[key] = value
        stops = stop if stop is not None else self.stop
        if stops:
            opts["stop"] = list(stops)
        reasoning = kwargs.pop("reasoning", self.reasoning)
        if reasoning is not None:
            opts["reasoning"] = reasoning
        return {**self.model_kwargs, **opts, **kwargs}

    def _prepare(
        self, shared: SharedModel, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict
    ) -> Any:
        """The engine's Request for this call (rendered and tokenized once, here)."""
        options = self._options(stop, kwargs)
        tools = options.pop("tools", None) or None
        dicts = to_template_messages(messages)
        return shared.model_request(dicts, tools, **options)

    def _job(
        self,
        shared: SharedModel,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: dict[str, Any],
        emit: Callable[[tuple[str, Any]], None],
        cancelled: threading.Event,
        deadline: float | None,
    ) -> None:
        """One generation, on the engine thread (see `_emit_events`)."""

        def open_events(check: Callable[[], None]) -> tuple[Any, Any]:
            check()
            request = self._prepare(shared, messages, stop, kwargs)
            session = shared.acquire_session(request.ids)
            if request.params.seed is not None and session.state is not None:
                # the live state carries the previous call's RNG key, which would override
                # the seed: drop it so a seed reproduces its output
                session.state.extras.pop("rng_key", None)
            return session.generate(request, cancel=cancelled), session

        model_name = kwargs.get("model") or self.model
        self._emit_events(open_events, model_name, emit, cancelled, deadline)

    def _emit_events(
        self,
        open_events: Callable[[Callable[[], None]], tuple[Any, Any]],
        model_name: str,
        emit: Callable[[tuple[str, Any]], None],
        cancelled: threading.Event,
        deadline: float | None,
    ) -> None:
        """Emit ("chunk", AIMessageChunk) items from the events `open_events(check)` starts
        (local engine or server), then ("error", exc) if it failed, then ("end", None);
        `check` stops it on a cancel or past the deadline."""

        def check() -> None:
            if cancelled.is_set():
                raise _Cancelled()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{model_name}: generation exceeded timeout={self.timeout}s")

        try:
            events, session = open_events(check)
            try:
                for chunk in self._chunks_from_events(events, model_name, check, session):
                    emit(("chunk", chunk))
            finally:
                events.close()
        except _Cancelled:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            emit(("error", e))
        finally:
            emit(("end", None))

    def _deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout

    def _iter_chunks(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> Iterator[AIMessageChunk]:
        """Generate on the engine thread, yielding its chunks here as they come."""
        deadline = self._deadline()
        items: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        cancelled = threading.Event()
        name = self._start(messages, stop, kwargs, items.put, cancelled, deadline)
        try:
            while True:
                wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                try:
                    kind, item = items.get(timeout=wait)
                except queue.Empty:
                    raise TimeoutError(
                        f"{name}: no result within timeout={self.timeout}s"
                    ) from None
                if kind == "end":
                    return
                if kind == "error":
                    raise item
                yield item
        finally:
            cancelled.set()  # a consumer that stops early stops the generation too

    @staticmethod
    def _chunks_from_events(
        events: Iterator[Any], model_name: str, check: Callable[[], None], session: Any = None
    ) -> Iterator[AIMessageChunk]:
        n_calls = 0
        for event in events:
            check()
            if event.type == "text":
                yield AIMessageChunk(content=event.text)
            elif event.type == "reasoning":
                yield AIMessageChunk(
                    content="", additional_kwargs={"reasoning_content": event.text}
                )
            elif event.type == "tool_call":
                call = event.tool_call
                yield AIMessageChunk(
                    content="",
                    tool_call_chunks=[
                        tool_call_chunk(
                            name=call.name,
                            args=json.dumps(call.arguments, ensure_ascii=False),
                            id=call.id,
                            index=n_calls,
                        )
                    ],
                )
                n_calls += 1
            elif event.type == "done":
                usage = event.usage or {}
                prompt, generated = usage.get("prompt", 0), usage.get("generated", 0)
                finish = event.finish_reason
                if n_calls and finish == "stop":
                    finish = "tool_calls"
                yield AIMessageChunk(
                    content="",
                    usage_metadata=UsageMetadata(
                        input_tokens=prompt,
                        output_tokens=generated,
                        total_tokens=prompt + generated,
                        input_token_details={"cache_read": usage.get("cached", 0)},
                    ),
                    response_metadata={
                        "model_name": model_name,
                        "model_provider": PROVIDER,
                        "finish_reason": finish,
                        **_draft_metadata(session),
                    },
                    chunk_position="last",
                )
                if event.incomplete:
                    raise OutputCutError(
                        f"{model_name}: the answer was cut at max_tokens ({generated} tokens) "
                        f"before the {event.incomplete.replace('_', ' ')} was complete "
                        "(finish_reason: length); raise max_tokens"
                    )

    # ----- LangChain entry points --------------------------------------------------------

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for message in self._iter_chunks(messages, stop, dict(kwargs)):
            chunk = ChatGenerationChunk(message=message)
            if run_manager:
                run_manager.on_llm_new_token(message.text, chunk=chunk)
            yield chunk

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        # The engine thread generates; chunks come back through an asyncio queue, so the
        # event loop never blocks. Leaving early (task cancelled, aclose) sets `cancelled` and
        # the engine stops at its next event.
        loop = asyncio.get_running_loop()
        deadline = self._deadline()
        items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        cancelled = threading.Event()

        def emit(item: tuple[str, Any]) -> None:
            try:
                loop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                cancelled.set()

        name = await loop.run_in_executor(
            None, self._start, messages, stop, kwargs, emit, cancelled, deadline
        )
        try:
            while True:
                wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                try:
                    kind, item = await asyncio.wait_for(items.get(), wait)
                except asyncio.TimeoutError:
                    raise TimeoutError(
                        f"{name}: no result within timeout={self.timeout}s"
                    ) from None
                if kind == "end":
                    break
                if kind == "error":
                    raise item
                chunk = ChatGenerationChunk(message=item)
                if run_manager:
                    await run_manager.on_llm_new_token(item.text, chunk=chunk)
                yield chunk
        finally:
            cancelled.set()

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))

    # ----- tools and structured output ---------------------------------------------------

    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool],
        *,
        tool_choice: dict | str | bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (any form convert_to_openai_tool accepts).

        tool_choice: "auto" / None (the model decides), "none" (tools hidden), "any" or
        "required" (must call one of them), or a tool name (must call that one). A forced
        call is decoded under a grammar: the output is always a well-formed call whose
        arguments match the tool's schema. `strict` is accepted for compatibility: forced
        calls are always schema-exact.
        """
        from qwen38_backend.request import normalize_tool_choice

        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        normalize_tool_choice(tool_choice, formatted)  # fail now, not at the first call
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["function_calling", "json_schema", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """Output parsed into `schema` (pydantic class, TypedDict, JSON schema or tool dict;
        None with json_mode: any JSON object, as a dict).

        method "json_schema" (default): decoding is constrained to JSON valid against the
        schema. "function_calling": a forced, schema-constrained call of a tool named after
        the schema. "json_mode": decoding is constrained to a JSON object (say which keys in
        the prompt). `strict` is accepted for compatibility; the first two are always strict.
        """
        if kwargs:
            raise ValueError(f"unsupported arguments: {', '.join(sorted(kwargs))}")
        if schema is None and method != "json_mode":
            raise ValueError(f"method {method!r} needs a schema")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        ls_format = (
            {"kwargs": {"method": method, "strict": strict}, "schema": schema}
            if schema is not None
            else None
        )
        if method == "function_calling":
            tool = convert_to_openai_tool(schema)
            name = tool["function"]["name"]
            llm = self.bind_tools([tool], tool_choice=name, ls_structured_output_format=ls_format)
            parser: Runnable = (
                PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
                if is_pydantic
                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
            )
        elif method in ("json_schema", "json_mode"):
            response_format: Any = (
                convert_to_json_schema(schema) if method == "json_schema" else "json"
            )
            llm = self.bind(response_format=response_format, ls_structured_output_format=ls_format)
            parser = (
                PydanticOutputParser(pydantic_object=schema)  # type: ignore[arg-type]
                if is_pydantic
                else JsonOutputParser()
            )
        else:
            raise ValueError(
                f"unknown method {method!r}: use 'json_schema', 'function_calling' or 'json_mode'"
            )
        if not include_raw:
            return llm | parser
        parse = RunnablePassthrough.assign(
            parsed=itemgetter("raw") | parser, parsing_error=lambda _: None
        )
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parse.with_fallbacks(
            [fallback], exception_key="parsing_error"
        )
