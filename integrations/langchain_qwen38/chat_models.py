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
from pydantic import BaseModel, ConfigDict, Field

from .engine_cache import DEFAULT_MODEL, Engine, get_engine
from .messages import TemplateFeatures, template_features, to_template_messages

__all__ = ["ChatQwen38"]

PROVIDER = "qwen38"
DEFAULT_MAX_TOKENS = 1024
_SAMPLING_FIELDS = ("temperature", "max_tokens", "top_p", "top_k", "min_p", "seed")
# call kwargs that are ours (or LangChain's) and never reach the engine
_CALL_KEYS = {"tools", "tool_choice", "response_format", "model", "reasoning", "stream"}


def _opens_reasoning(prompt: str) -> bool:
    """True when the rendered prompt leaves a <think> block open (the model starts reasoning)."""
    i = prompt.rfind("<think>")
    return i >= 0 and "</think>" not in prompt[i:]


def _tool_name(tool: dict[str, Any]) -> str:
    return tool["function"]["name"] if "function" in tool else tool["name"]


def _normalize_tool_choice(tool_choice: Any, tools: Sequence[dict[str, Any]] | None) -> str | None:
    """None / "auto" / "none" / "any" / a tool name, from every form LangChain passes."""
    if tool_choice is None or tool_choice == "auto":
        return None if tool_choice is None else "auto"
    if tool_choice is True:
        return "any"
    if tool_choice is False:
        return "none"
    if isinstance(tool_choice, dict):  # {"type": "function", "function": {"name": ...}}
        fn = tool_choice.get("function") or {}
        tool_choice = fn.get("name") or tool_choice.get("name")
    if tool_choice == "required":
        return "any"
    if not isinstance(tool_choice, str):
        raise ValueError(f"unsupported tool_choice {tool_choice!r}")
    if tool_choice not in ("any", "none"):
        names = [_tool_name(t) for t in tools or []]
        if tool_choice not in names:
            raise ValueError(
                f"tool_choice {tool_choice!r} is not a bound tool (tools: {', '.join(names)})"
            )
    return tool_choice


class _Cancelled(Exception):
    """The caller went away (async task cancelled or stream closed)."""


class ChatQwen38(BaseChatModel):
    """Qwen3.8 models (and other local checkpoints qwen38_backend loads) as a chat model.

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
    temperature: float | None = None
    """Sampling temperature; 0 or None is greedy."""
    max_tokens: int | None = None
    """Most tokens to generate (reasoning included); None: 1024."""
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    """Seed for sampling; the same seed and prompt give the same output."""
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    """Stop strings (not included in the output)."""
    timeout: float | None = None
    """Seconds a generation may run (waiting for a busy model included) before it is stopped
    with TimeoutError."""
    max_retries: int = 0
    """Accepted for compatibility with API-backed chat models; local generation is not
    retried."""
    streaming: bool = False
    """Whether invoke() streams internally (callbacks see tokens as they come)."""
    reasoning: bool | None = None
    """Thinking mode for templates that support it (`enable_thinking`): None leaves the
    template's default, except for constrained outputs (forced tool calls, structured output),
    which skip reasoning unless this is True."""
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra options for every call: KV store options (`kv_paged`, `kv_topk`, ...) or extra
    chat-template variables."""

    # ----- identity ----------------------------------------------------------------------

    @property
    def _llm_type(self) -> str:
        return "qwen38-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "reasoning": self.reasoning,
            **{k: getattr(self, k) for k in _SAMPLING_FIELDS},
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

    # ----- the engine --------------------------------------------------------------------

    def _engine(self, model: str | None = None) -> Engine:
        return get_engine(model or self.model, self.dtype)

    def _sampling(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        opts: dict[str, Any] = {}
        for key in _SAMPLING_FIELDS:
            value = kwargs.pop(key, getattr(self, key))
            if value is not None:
                opts[key] = value
        opts.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
        if "stop_token_ids" in kwargs:  # advanced: [] generates up to max_tokens
            opts["stop_token_ids"] = kwargs.pop("stop_token_ids")
        stops = stop if stop is not None else self.stop
        if stops:
            opts["stop"] = list(stops)
        return opts

    def _prepare(
        self, engine: Engine, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict
    ) -> tuple[list[int], list[dict[str, Any]], dict[str, Any]]:
        """(prompt token ids, template messages, Session.generate options).

        The session renders the messages itself again (it snapshots at the message boundary,
        which recurrent models need to reuse a conversation); rendering here too tells which
        session holds the longest prefix and whether the prompt opens a <think> block.
        """
        kwargs = dict(kwargs)
        model = engine.model
        tok = model.tokenizer
        features: TemplateFeatures = template_features(tok.chat_template)

        tools = kwargs.pop("tools", None) or None
        choice = _normalize_tool_choice(kwargs.pop("tool_choice", None), tools)
        if choice == "none":
            tools = None
        forced = choice not in (None, "auto", "none") and bool(tools)
        response_format = kwargs.pop("response_format", None)
        if forced and response_format is not None:
            raise ValueError("a forced tool_choice and a response_format cannot be combined")
        reasoning = kwargs.pop("reasoning", self.reasoning)
        kwargs.pop("model", None)
        kwargs.pop("stream", None)

        sampling = self._sampling(stop, kwargs)
        extra = {**self.model_kwargs, **kwargs}
        from qwen38_backend.kv import KV_OPTION_KEYS

        engine_opts = {k: v for k, v in extra.items() if k in KV_OPTION_KEYS}
        template_kwargs = {k: v for k, v in extra.items() if k not in KV_OPTION_KEYS}
        constrained = forced or response_format is not None
        if reasoning is not None:
            template_kwargs.setdefault("enable_thinking", bool(reasoning))
        elif constrained:
            # a constrained answer should not wait behind free-running reasoning
            template_kwargs.setdefault("enable_thinking", False)

        dicts, template_tools = to_template_messages(messages, tools, features)
        prompt = tok.apply_chat_template(
            dicts, tools=template_tools, add_generation_prompt=True, **template_kwargs
        )
        ids = tok.encode(prompt)
        thinking = _opens_reasoning(prompt)  # the grammar must then allow reasoning first

        processors = []
        if forced:
            from qwen38_backend import constrained as qc

            style = features.call_style if features.native_tools else "json"
            processors.append(
                qc.tool_call_processor(model, tools, choice, style=style, thinking=thinking)
            )
        elif response_format is not None:
            from qwen38_backend import constrained as qc

            if response_format in ("json", {"type": "json_object"}):
                processors.append(qc.json_mode_processor(model, thinking=thinking))
            else:
                schema = response_format
                if isinstance(schema, dict) and schema.get("type") == "json_schema":
                    schema = schema["json_schema"]["schema"]  # OpenAI response_format form
                # the listed properties are the whole object (as OpenAI's strict mode)
                schema = qc.close_objects(schema)
                processors.append(qc.json_schema_processor(model, schema, thinking=thinking))
        if processors:
            sampling["logits_processors"] = processors
        options = {**template_kwargs, **sampling, **engine_opts, "tools": template_tools}
        return ids, dicts, options

    def _job(
        self,
        engine: Engine,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: dict[str, Any],
        emit: Callable[[tuple[str, Any]], None],
        cancelled: threading.Event,
        deadline: float | None,
    ) -> None:
        """One generation, on the engine thread: emits ("chunk", AIMessageChunk) items, then
        ("error", exc) if it failed, then ("end", None)."""
        model_name = kwargs.get("model") or self.model

        def check() -> None:
            if cancelled.is_set():
                raise _Cancelled()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{model_name}: generation exceeded timeout={self.timeout}s")

        try:
            check()
            ids, dicts, options = self._prepare(engine, messages, stop, kwargs)
            session = engine.acquire_session(ids)
            if options.get("seed") is not None and session.state is not None:
                # the live state carries the previous call's RNG key, which would override
                # the seed: drop it so a seed reproduces its output
                session.state.extras.pop("rng_key", None)
            events = session.generate(dicts, **options)
            try:
                for chunk in self._chunks_from_events(events, model_name, check):
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
        engine = self._engine(kwargs.get("model"))
        items: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        cancelled = threading.Event()
        engine.submit(self._job, engine, messages, stop, kwargs, items.put, cancelled, deadline)
        try:
            while True:
                wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                try:
                    kind, item = items.get(timeout=wait)
                except queue.Empty:
                    raise TimeoutError(
                        f"{engine.name}: no result within timeout={self.timeout}s"
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
        events: Iterator[Any], model_name: str, check: Callable[[], None]
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
                    },
                    chunk_position="last",
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
        engine = await loop.run_in_executor(None, self._engine, kwargs.get("model"))
        items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        cancelled = threading.Event()

        def emit(item: tuple[str, Any]) -> None:
            try:
                loop.call_soon_threadsafe(items.put_nowait, item)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                cancelled.set()

        engine.submit(self._job, engine, messages, stop, kwargs, emit, cancelled, deadline)
        try:
            while True:
                wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                try:
                    kind, item = await asyncio.wait_for(items.get(), wait)
                except asyncio.TimeoutError:
                    raise TimeoutError(
                        f"{engine.name}: no result within timeout={self.timeout}s"
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
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        _normalize_tool_choice(tool_choice, formatted)  # fail now, not at the first call
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
