"""`qwen38 serve`: the real server in a subprocess on a free port, tiny dense weights.

Answers are compared with the in-process engine (same weights, greedy), so a wrong
translation either way (request -> build_request, events -> chunks -> events) shows up as a
different text. The 2-rank run goes through `mlx.launch --backend ring` on this CPU.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Literal

import pytest
from helpers import dense_fixture

import qwen38_backend

URL_RE = re.compile(r"on (http://127\.0\.0\.1:\d+)/v1")
GREEDY = {"temperature": 0, "max_tokens": 12}


class Server:
    """`qwen38 serve` (optionally under mlx.launch) in its own process group."""

    def __init__(self, weights: Path, home: Path, ranks: int = 1, flags: tuple[str, ...] = ()):
        cmd = [sys.executable, "-m", "qwen38_backend.cli", "serve", str(weights), "--port", "0"]
        cmd += list(flags)
        if ranks > 1:
            launch = Path(sys.executable).parent / "mlx.launch"
            cmd = [str(launch), "-n", str(ranks), "--backend", "ring", "--", *cmd]
        env = {**os.environ, "QWEN38_HOME": str(home), "PYTHONUNBUFFERED": "1"}
        self.ranks = ranks
        self.proc = subprocess.Popen(
            cmd, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self.log: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                break
            self.log.append(line)
            m = URL_RE.search(line)
            if m:
                self.url = m.group(1)
                return
        self.stop()
        raise AssertionError("server did not start:\n" + "".join(self.log))

    def post(self, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(
            self.url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)

    def stream(self, body: dict) -> list[dict]:
        req = urllib.request.Request(
            self.url + "/v1/chat/completions",
            data=json.dumps(
                {**body, "stream": True, "stream_options": {"include_usage": True}}
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        chunks = []
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert resp.headers["Content-Type"] == "text/event-stream"
            for line in resp:
                line = line.strip()
                if not line:
                    continue
                assert line.startswith(b"data: ")
                if line == b"data: [DONE]":
                    return chunks
                chunks.append(json.loads(line[6:]))
        raise AssertionError("stream ended without [DONE]")

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=30) as resp:
            return json.load(resp)

    def stop(self) -> int | None:
        """SIGTERM to the whole group (launcher and ranks); the ranks must all leave by
        themselves (rank 0 tells the others). The server's exit code (None: launched, the
        launcher dies of the signal itself)."""
        group = self.proc.pid
        if self.proc.poll() is None:
            os.killpg(group, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(group, 0)
            except ProcessLookupError:
                break
            self.proc.poll()
            time.sleep(0.1)
        else:
            os.killpg(group, signal.SIGKILL)
            raise AssertionError("the server's processes did not stop:\n" + "".join(self.log))
        self.proc.wait()
        return self.proc.returncode if self.ranks == 1 else None


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    return dense_fixture("qwen3", tmp_path_factory.mktemp("serve-models"))


@pytest.fixture(scope="module")
def server(weights, tmp_path_factory):
    s = Server(weights, tmp_path_factory.mktemp("serve-home"))
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def local(weights):
    return qwen38_backend.load(str(weights))


def local_answer(model, messages, **options) -> tuple[str, str, dict]:
    """(text, reasoning, usage) from the in-process engine, no cache."""
    events = list(model.session(cache=False).generate(messages, **options))
    text = "".join(e.text for e in events if e.type == "text")
    reasoning = "".join(e.text for e in events if e.type == "reasoning")
    return text, reasoning, events[-1].usage


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_whole_and_streamed_answers_equal_the_engine(server, local):
    messages = user("Tell me about the sea.")
    text, reasoning, usage = local_answer(local, messages, **GREEDY)
    assert text or reasoning

    status, body = server.post({"model": local.name, "messages": messages, **GREEDY})
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert (message["content"], message.get("reasoning_content", "")) == (text, reasoning)
    assert body["usage"]["prompt_tokens"] == usage["prompt"]
    assert body["usage"]["completion_tokens"] == usage["generated"]

    chunks = server.stream({"messages": messages, **GREEDY})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == text
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == reasoning
    assert (
        chunks[-1]["choices"] == []
        and chunks[-1]["usage"]["completion_tokens"] == usage["generated"]
    )
    # the same prompt again: all but the last prompt token come from the live state
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == usage["prompt"] - 1


def test_server_wide_kv_and_draft_defaults(weights, local, tmp_path):
    """`qwen38 serve --kv-... --draft ...` applies to every call (a bounded pool that spills,
    n-gram drafts); the answer is the engine's with the same options, and a call's own
    option overrides the server's."""
    spill = tmp_path / "spill"
    flags = ("--kv-paged", "on", "--kv-page-tokens", "16", "--kv-pool-tokens", "160")
    flags += ("--kv-topk", "64", "--kv-spill-dir", str(spill), "--draft", "ngram")
    s = Server(weights, tmp_path / "home", flags=flags)
    try:
        messages = user("Repeat after me: " + " ".join(["red green blue"] * 40))
        options = {"kv_paged": "on", "kv_page_tokens": 16, "kv_pool_tokens": 160, "kv_topk": 64}
        options.update(kv_spill_dir=str(tmp_path / "local-spill"), draft="ngram", **GREEDY)
        text, _, _ = local_answer(local, messages, **options)
        status, body = s.post({"messages": messages, **GREEDY})
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == text
        figures = body["qwen38"]
        assert figures["kv"]["pages_spilled"] > 0 and figures["draft"]["mode"] == "ngram"
        status, body = s.post({"messages": user("Say hi."), "draft": "off", **GREEDY})
        assert status == 200 and body["qwen38"]["draft"]["mode"] != "ngram"
    finally:
        assert s.stop() == 0, "".join(s.log)


def test_follow_up_shows_cached_tokens(server):
    first = user("A first question about rivers.")
    status, body = server.post({"messages": first, **GREEDY})
    assert status == 200
    answer = body["choices"][0]["message"]
    follow = first + [
        {"role": "assistant", "content": answer["content"] or ""},
        {"role": "user", "content": "And lakes?"},
    ]
    status, body2 = server.post({"messages": follow, **GREEDY})
    assert status == 200
    cached = body2["usage"]["prompt_tokens_details"]["cached_tokens"]
    # at least the first question's messages were not computed again
    assert body["usage"]["prompt_tokens"] // 2 < cached < body2["usage"]["prompt_tokens"]


def test_models_and_health(server, local):
    with urllib.request.urlopen(server.url + "/v1/models") as resp:
        assert [m["id"] for m in json.load(resp)["data"]] == [local.name]
    assert server.health()["status"] == "ok"


def test_unknown_option_is_a_400_naming_it(server):
    status, body = server.post({"messages": user("hi"), "bogus_option": 1, "kv_topk": 64})
    assert status == 400
    assert "bogus_option" in body["error"]["message"]
    assert "kv_topk" not in body["error"]["message"].split(";")[0]
    status, body = server.post({"messages": user("hi"), "n": 3})
    assert status == 400 and "n=3" in body["error"]["message"]
    status, body = server.post({"model": "someone-else", "messages": user("hi")})
    assert status == 404


def test_over_window_is_a_400_with_the_numbers(server, local):
    window = local.config.max_position_embeddings
    prompt_tokens = len(local.session(cache=False).request(user("hi")).ids)
    status, body = server.post({"messages": user("hi"), "max_tokens": window})
    assert status == 400, body
    error = body["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"{window:,}" in error["message"] and f"{prompt_tokens:,} tokens" in error["message"]
    # over the window by the prompt alone, with `context`
    status, body = server.post({"messages": user("hi"), "context": 4})
    assert status == 400 and f"the prompt is {prompt_tokens:,} tokens" in body["error"]["message"]


def drop_a_stream(server: Server) -> None:
    """Start a long streamed answer, leave after the headers; the server must count it
    cancelled and answer the next call at once."""
    before = server.health()["cancelled"]
    # no stop token: it would run 3,000 tokens (seconds) unless cancelled
    body = {"messages": user("Count for a long time."), "max_tokens": 3000, "temperature": 0}
    body.update(stream=True, stop_token_ids=[])
    host, port = server.url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        assert b"200 OK" in sock.recv(4096)  # streaming has begun
    deadline = time.monotonic() + 30
    while server.health()["cancelled"] == before and time.monotonic() < deadline:
        time.sleep(0.1)
    health = server.health()
    assert health["cancelled"] == before + 1, health
    start = time.monotonic()
    status, _ = server.post({"messages": user("hi"), "max_tokens": 2, "temperature": 0})
    assert status == 200 and time.monotonic() - start < 10


def test_disconnect_cancels_the_generation(server):
    drop_a_stream(server)


def test_llm_plugin_against_the_server(server, local, tmp_path, monkeypatch):
    from test_llm_plugin import LLM

    monkeypatch.delenv("QWEN38_HOME", raising=False)
    cli = LLM(tmp_path / "llm-user")
    # one fresh `llm` process for the three commands (LLM.batch); a server that is not
    # there is refused when added
    added, listed, down = cli.batch(
        ["qwen38", "add", "--url", server.url, "--name", "served"],
        ["qwen38", "list"],
        ["qwen38", "add", "--url", "http://127.0.0.1:9", "--name", "down"],
    )
    assert added.returncode == 0 and f"served at {server.url}" in added.stdout, added.stderr
    assert "served" in listed.stdout
    assert down.returncode != 0 and "cannot reach" in down.stderr
    prompt = "Say something about clouds."
    streamed = cli("-m", "served", prompt, "-o", "temperature", "0", "-o", "max_tokens", "12")
    text, _, _ = local_answer(local, user(prompt), **GREEDY)
    assert streamed.stdout.strip() == text.strip()
    cli("-c", "And rain?", "-o", "temperature", "0", "-o", "max_tokens", "12")
    first, second = cli.responses()[-2:]
    assert first["response_json"]["url"] == server.url
    assert 0 < second["response_json"]["cached_tokens"] < second["response_json"]["prompt_tokens"]
    assert second["token_details"]["cached_tokens"] == second["response_json"]["cached_tokens"]
    # ChatQwen38 finds the same registry entry
    from langchain_qwen38 import ChatQwen38

    monkeypatch.setenv("QWEN38_HOME", str(cli.home))
    chat = ChatQwen38(model="served", temperature=0, max_tokens=12)
    assert chat.invoke(prompt).content == text
    # the engine's command shares the registry and can add servers too
    added = subprocess.run(
        [sys.executable, "-m", "qwen38_backend.cli", "add", "--url", server.url + "/v1/"],
        env=cli.env,
        capture_output=True,
        text=True,
    )
    assert added.returncode == 0 and f"served at {server.url}" in added.stdout, added.stderr
    # the name is a server, not weights: loading it here is refused with the reason
    proc = subprocess.run(
        [sys.executable, "-m", "qwen38_backend.cli", "run", "served", "hi"],
        env=cli.env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "served at" in proc.stderr


def test_chat_qwen38_against_the_server(server, weights):
    from langchain_core.tools import tool
    from langchain_qwen38 import ChatQwen38

    @tool
    def weather(city: Literal["Paris", "Berlin"]) -> str:
        """Current weather for a city."""
        return "sunny"

    options = {"temperature": 0, "max_tokens": 24}
    served = ChatQwen38(base_url=server.url + "/v1", **options)
    here = ChatQwen38(model=str(weights), **options)
    assert served.invoke("Hello there").content == here.invoke("Hello there").content

    question = [("user", "What is the weather in Paris?")]
    call_options = {"tool_choice": "any", "max_tokens": 64}
    remote_call = served.bind_tools([weather], **call_options).invoke(question)
    local_call = here.bind_tools([weather], **call_options).invoke(question)
    assert remote_call.tool_calls and remote_call.tool_calls[0]["name"] == "weather"
    assert remote_call.tool_calls[0]["args"] == local_call.tool_calls[0]["args"]
    assert remote_call.response_metadata["finish_reason"] == "tool_calls"

    # a follow-up: the server reuses the conversation's prefix
    history = [("user", "Hi"), ("assistant", "Hello."), ("user", "How are you?")]
    served.invoke(history[:1])
    reply = served.invoke(history)
    assert reply.usage_metadata["input_token_details"]["cache_read"] > 0
    chunks = list(served.stream("Hello there"))
    assert "".join(c.content for c in chunks) == here.invoke("Hello there").content


def test_two_ranks_answer_as_one(weights, server, tmp_path):
    pair = Server(weights, tmp_path / "home2", ranks=2)
    try:
        assert pair.health()["ranks"] == 2
        messages = user("Tell me about mountains.")
        status, one = server.post({"messages": messages, **GREEDY})
        status2, two = pair.post({"messages": messages, **GREEDY})
        assert status == status2 == 200
        assert two["choices"][0]["message"] == one["choices"][0]["message"]
        assert two["usage"]["completion_tokens"] == one["usage"]["completion_tokens"]
        # sampling with a seed: every rank draws the same tokens as one process does
        sampled = {"messages": messages, "temperature": 0.9, "seed": 7, "max_tokens": 12}
        assert pair.post(sampled)[1]["choices"] == server.post(sampled)[1]["choices"]
        # a follow-up is cached on both ranks alike; admission / refusals answer as on one
        follow = messages + [
            {"role": "assistant", "content": one["choices"][0]["message"]["content"] or ""},
            {"role": "user", "content": "And hills?"},
        ]
        status, again = pair.post({"messages": follow, **GREEDY})
        assert status == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert pair.post({"messages": messages, "bogus": 1})[0] == 400
        chunks = pair.stream({"messages": messages, **GREEDY})
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        assert text == one["choices"][0]["message"]["content"]
        drop_a_stream(pair)  # every rank stops at the same token, and goes on serving
    finally:
        pair.stop()
