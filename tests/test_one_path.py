"""One path from prompt to tokens: every entry point tokenizes a prompt once, refuses a prompt
over the window before any work (naming both numbers), and refuses unknown options by name.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from helpers import dense_fixture
from langchain_qwen38 import ChatQwen38

import qwen38_backend
from qwen38_backend.errors import ContextWindowError, InvalidOptionError
from qwen38_backend.tokenizer import Tokenizer

WINDOW = 4096  # the dense fixtures' max_position_embeddings


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return dense_fixture("qwen3", tmp_path_factory.mktemp("one-path"))


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return qwen38_backend.load(str(tiny_path))


@pytest.fixture
def count_tokenizations(monkeypatch):
    """Counts calls that tokenize text (encode, encode_with_offsets) on any Tokenizer."""
    calls: list[int] = []
    for name in ("encode", "encode_with_offsets"):
        original = getattr(Tokenizer, name)

        def counted(self, text, *args, _original=original, **kwargs):
            calls.append(len(text))
            return _original(self, text, *args, **kwargs)

        monkeypatch.setattr(Tokenizer, name, counted)
    return calls


def over_window_prompt(model) -> str:
    """A user message of just over the window in this tokenizer."""
    words = WINDOW // max(len(model.tokenizer.encode("fig ")), 1) + 8
    return "fig " * words


# ----- tokenized once ------------------------------------------------------------------------


def test_session_call_tokenizes_once(tiny, count_tokenizations):
    session = tiny.session(cache=False)
    messages = [{"role": "user", "content": "hello there"}]
    list(session.generate(messages, max_tokens=2))
    assert len(count_tokenizations) == 1


def test_chatqwen38_call_tokenizes_once(tiny_path, count_tokenizations):
    chat = ChatQwen38(model=str(tiny_path), max_tokens=2, reasoning=False)
    chat.invoke("warm up")  # loads the model (its own tokenizer checks are not the call's)
    count_tokenizations.clear()
    chat.invoke("hello there")
    assert len(count_tokenizations) == 1


def test_llm_prompt_tokenizes_once(tiny_path, count_tokenizations, tmp_path, monkeypatch):
    import llm

    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path / "llm"))
    from qwen38_backend.loading.registry import Registry

    Registry().add("onepath", tiny_path)
    model = llm.get_model("onepath")
    model.prompt("warm up", max_tokens=2).text()
    count_tokenizations.clear()
    model.prompt("hello there", max_tokens=2).text()
    assert len(count_tokenizations) == 1


# ----- refused before any work ---------------------------------------------------------------


def test_python_refuses_over_window_at_once(tiny):
    session = tiny.session(cache=False)
    t0 = time.perf_counter()
    with pytest.raises(ContextWindowError, match=rf"over the {WINDOW:,}-token window"):
        list(session.generate(over_window_prompt(tiny)))
    assert time.perf_counter() - t0 < 1.0
    assert session.state is None  # nothing was prefilled
    with pytest.raises(ContextWindowError, match="max_tokens is 5,000") as err:
        list(session.generate("hi", max_tokens=5000))
    assert "at most" in str(err.value)
    with pytest.raises(ContextWindowError, match="window"):
        list(session.generate("hi there", context=4, max_tokens=2))


def test_chatqwen38_refuses_over_window_at_once(tiny_path, tiny):
    chat = ChatQwen38(model=str(tiny_path), reasoning=False)
    chat.invoke("warm up", max_tokens=1)
    t0 = time.perf_counter()
    with pytest.raises(ContextWindowError, match="window"):
        chat.invoke(over_window_prompt(tiny))
    assert time.perf_counter() - t0 < 1.0


def _cli(args: list[str], env: dict, stdin: str | None = None) -> tuple[int, str, float]:
    t0 = time.monotonic()
    proc = subprocess.run(args, env=env, input=stdin, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr, time.monotonic() - t0


def test_cli_and_llm_refuse_over_window_before_prefill(tiny_path, tiny, tmp_path):
    """`qwen38 run M -` and `llm -m M` with a prompt over the window: refused with both
    numbers, before any prefill (which would take many seconds for 4K tokens on this CPU)."""
    import os

    env = {**os.environ, "LLM_USER_PATH": str(tmp_path / "llm"), "PYTHONUNBUFFERED": "1"}
    prompt = over_window_prompt(tiny)
    code, err, _ = _cli(
        [sys.executable, "-m", "qwen38_backend.cli", "run", str(tiny_path), "-"], env, prompt
    )
    assert code == 2 and f"{WINDOW:,}-token window" in err and "Traceback" not in err
    from qwen38_backend.loading.registry import Registry

    Registry().add("onepath", tiny_path)
    code, err, _ = _cli([sys.executable, "-m", "llm", "-m", "onepath"], env, prompt)
    assert code != 0 and f"{WINDOW:,}-token window" in err and "Traceback" not in err
    assert not (tmp_path / "llm" / "qwen38").exists() or not any(
        (tmp_path / "llm" / "qwen38").rglob("*.safetensors")
    )  # no state file: nothing ran


# ----- unknown options refused by name -------------------------------------------------------


def test_python_refuses_unknown_option_by_name(tiny):
    session = tiny.session(cache=False)
    with pytest.raises(InvalidOptionError, match="temprature"):
        list(session.generate("hi", temprature=0.5))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"enable_thinking": "no"}, "enable_thinking='no': must be true or false"),
        ({"tools": "search"}, "must be a list of tool specs"),
        ({"tools": [{"description": "no name"}]}, "must be a dict naming its function"),
        ({"stop": 5}, "stop=5: must be a string or a list of them"),
    ],
)
def test_python_refuses_badly_typed_options_by_name(tiny, options, message):
    """Found by trying them: a string for enable_thinking (truthy "no") and for tools were
    accepted, a number for stop was a TypeError."""
    session = tiny.session(cache=False)
    with pytest.raises(InvalidOptionError, match=message):
        session.request([{"role": "user", "content": "hi"}], **options)


def test_chatqwen38_refuses_unknown_option_by_name(tiny_path):
    with pytest.raises(ValueError, match="kv_top_k"):
        ChatQwen38(model=str(tiny_path), model_kwargs={"kv_top_k": 5})
    chat = ChatQwen38(model=str(tiny_path), max_tokens=2)
    with pytest.raises(InvalidOptionError, match="temprature"):
        chat.invoke("hi", temprature=0.5)


def test_llm_refuses_unknown_option_by_name(tiny_path, tmp_path):
    import os

    env = {**os.environ, "LLM_USER_PATH": str(tmp_path / "llm")}
    from qwen38_backend.loading.registry import Registry

    Registry().add("onepath", tiny_path)
    proc = subprocess.run(
        [sys.executable, "-m", "llm", "-m", "onepath", "hi", "-o", "temprature", "0.5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "temprature" in proc.stderr


def test_qwen38_run_max_tokens_zero_reads_the_prompt_into_the_prefix_store(tiny_path):
    """`--max-tokens 0` is meaningful: the prompt is prefilled and stored, nothing generated;
    the same prompt afterwards starts from the stored state."""
    import os

    run = [sys.executable, "-m", "qwen38_backend.cli", "run", str(tiny_path), "a long document"]
    env = dict(os.environ)
    first = subprocess.run(
        [*run, "--max-tokens", "0", "--stats", "--no-think"], env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert first.returncode == 0 and "generated 0" in first.stderr, first.stderr
    second = subprocess.run(
        [*run, "--max-tokens", "2", "--stats", "--no-think"], env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    prompt_tokens = int(second.stderr.split("prompt ")[1].split()[0])
    cached = int(second.stderr.split("(cached ")[1].split(")")[0])
    assert cached == prompt_tokens - 1, second.stderr  # all but the token that starts decoding
