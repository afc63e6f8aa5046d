"""The llm plugin end to end: the real `llm` CLI in subprocesses, a temp LLM_USER_PATH, the engine.

Tiny random weights (with the tiny tokenizer) cover the mechanics; the demo model
(SmolLM2-135M GGUF, marker `demo`) covers a real answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
from helpers import dense_fixture

WEATHER_TOOL = '''import typing
def weather(city: typing.Literal["Paris", "Berlin"]) -> str:
    """Current weather for a city."""
    return f"sunny in {city}"
'''


BATCH = """
import json, traceback
from click.testing import CliRunner
from llm.cli import cli

def run(commands):
    results = []
    for args in json.loads(commands):
        r = CliRunner().invoke(cli, args, prog_name="llm")
        err = r.stderr
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            err += "".join(traceback.format_exception(r.exception))  # as a process prints it
        results.append([r.exit_code, r.stdout, err])
    print(json.dumps(results))
"""


def llm_batch(env: dict[str, str], *commands: list[str]) -> list[subprocess.CompletedProcess]:
    """`llm` command lines (LLM.batch) in one fresh process with environment `env`."""
    code = BATCH + f"\nrun({json.dumps(list(commands))!r})"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return [
        subprocess.CompletedProcess(["llm", *args], code, out, err)
        for args, (code, out, err) in zip(commands, results, strict=True)
    ]


class LLM:
    """Runs `python -m llm` with an isolated user dir and an isolated engine home (registry
    and weights cache, shared with the `qwen38` command; see test_one_home.py)."""

    def __init__(self, user_dir: Path):
        self.user_dir = user_dir
        self.home = user_dir.parent / "qwen38-home"
        self.env = {**os.environ, "QWEN38_HOME": str(self.home)}
        self.env["LLM_USER_PATH"] = str(user_dir)
        self.env.pop("LLM_RAISE_ERRORS", None)

    def __call__(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", "llm", *args],
            env=self.env,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"llm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def batch(self, *commands: list[str]) -> list[subprocess.CompletedProcess]:
        """`llm` command lines run one after another in ONE fresh process, each through
        click's CliRunner on llm's own CLI (plugins loaded as `llm` loads them): one start-up
        (~2.5 s of imports) for the lot. For commands that only read or change files (the
        registry, the prefix store), refusals before any answer, and answers that read no
        other's state (-o cache false). Answers whose process boundary is part of what is
        tested (-c, the prefix store across calls, chat, interrupts) run in `llm` processes
        of their own (__call__)."""
        return llm_batch(self.env, *commands)

    def python(self, code: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=600
        )

    def register(self, path: Path, name: str) -> str:
        """Register weights under `name` in this home as `llm qwen38 add PATH --name NAME`
        does (registry.add_weights is all it runs), in this process: a fixture's set-up
        needs no fresh `llm` (~2.5 s of imports). test_missing_weights_directory and
        test_weights_of_another_model run the command itself."""
        from qwen38_backend.loading.registry import add_weights

        previous = os.environ.get("QWEN38_HOME")
        os.environ["QWEN38_HOME"] = str(self.home)
        try:
            add_weights(path, name)
        finally:
            if previous is None:
                os.environ.pop("QWEN38_HOME")
            else:
                os.environ["QWEN38_HOME"] = previous
        return name

    def responses(self) -> list[dict]:
        """Logged responses, oldest first (`llm logs --json`: storage-layout independent).

        Read in this process through llm's own CLI (click's runner): only the answers under
        test need a fresh `llm` process, and each costs ~2.5 s of imports."""
        if not (self.user_dir / "logs.db").exists():
            return []
        from click.testing import CliRunner
        from llm.cli import cli as llm_cli

        env = {"LLM_USER_PATH": str(self.user_dir), "QWEN38_HOME": str(self.home)}
        result = CliRunner().invoke(llm_cli, ["logs", "-n", "0", "--json"], env=env)
        assert result.exit_code == 0, (result.output, result.exception)
        rows = json.loads(result.stdout)
        for r in rows:
            for key in ("token_details", "response_json"):
                if isinstance(r.get(key), str):
                    r[key] = json.loads(r[key])
        return rows


@pytest.fixture
def cli(tmp_path, monkeypatch) -> LLM:
    monkeypatch.delenv("QWEN38_HOME", raising=False)
    return LLM(tmp_path / "llm-user")


@pytest.fixture
def tiny(cli, tmp_path) -> str:
    """Tiny qwen3 weights registered as `tiny`."""
    return cli.register(dense_fixture("qwen3", tmp_path / "models"), "tiny")


@pytest.fixture
def demo(cli, demo_gguf) -> str:
    """The demo model, placed in the engine's weights cache (no re-download)."""
    target = cli.home / "cache" / "demo" / demo_gguf.name
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(demo_gguf)
    return "qwen38-demo"


# ----- start-up cost -----------------------------------------------------------------------


def test_plugin_import_is_light(cli):
    code = (
        "import sys, llm; before = set(sys.modules); import llm_qwen38; "
        "heavy = {'mlx', 'mlx.core', 'tokenizers', 'llguidance', 'qwen38_backend', 'numpy'}; "
        "new = heavy & (set(sys.modules) - before); assert not new, new; "
        "from llm.cli import cli; from click.testing import CliRunner; "
        "r = CliRunner().invoke(cli, ['--help']); assert r.exit_code == 0, r.output; "
        "assert 'mlx' not in sys.modules and 'qwen38_backend' not in sys.modules; print('ok')"
    )
    proc = cli.python(code)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


def test_llm_help_is_fast(cli):
    cli("--help")  # warm the page cache
    start = time.perf_counter()
    out = cli("--help")
    assert time.perf_counter() - start < 10
    assert "qwen38" in out.stdout


# ----- models and commands ------------------------------------------------------------------


def test_models_list_shows_demo_alias_and_registered(cli, tiny):
    models, listed = cli.batch(["models", "list"], ["qwen38", "list"])
    out = models.stdout
    assert models.returncode == 0 and listed.returncode == 0, models.stderr + listed.stderr
    assert "qwen38-demo" in out
    assert "Qwen3.8 (local): qwen38\n" in out
    assert "Qwen3.8 (local): tiny" in out
    listed = listed.stdout
    assert "tiny" in listed and "qwen38-demo" in listed
    # the registry is the engine's (shared with `qwen38`), not a copy under the llm user dir
    assert (cli.home / "registry.json").is_file()
    assert not (cli.user_dir / "qwen38" / "registry.json").exists()


def test_default_alias(cli, tiny):
    proc, made, shown = cli.batch(
        ["-m", "qwen38", "hi", "-o", "max_tokens", "2"],
        ["qwen38", "default", "tiny"],
        ["qwen38", "default"],
    )
    assert proc.returncode != 0
    assert "llm qwen38 add" in proc.stderr and "qwen38-demo" in proc.stderr
    assert made.returncode == 0, made.stderr
    assert shown.returncode == 0 and shown.stdout.strip() == "tiny", shown.stderr
    cli("-m", "qwen38", "hi", "-o", "max_tokens", "3", "-o", "seed", "1")
    assert cli.responses()[-1]["response_json"]["weights"].endswith("qwen3")


def test_commands_remove_info_and_errors(cli, tiny):
    info, nope, missing, removed, listed = cli.batch(
        ["qwen38", "info", "tiny"],
        ["qwen38", "remove", "nope"],
        ["qwen38", "add", str(cli.user_dir / "missing")],
        ["qwen38", "remove", "tiny"],
        ["models", "list"],
    )
    assert info.returncode == 0, info.stderr
    assert "qwen3" in info.stdout and "state files" in info.stdout
    assert nope.returncode != 0 and "unknown model 'nope'" in nope.stderr
    assert missing.returncode != 0 and "no such file or directory" in missing.stderr
    assert removed.returncode == 0, removed.stderr
    assert listed.returncode == 0 and "tiny" not in listed.stdout, listed.stderr


def test_cache_commands(cli, tiny):
    cli("-m", "tiny", "hello", "-o", "max_tokens", "4", "-o", "seed", "1")
    store_dir = cli.user_dir / "qwen38" / "checkpoints"
    assert any(store_dir.rglob("*.safetensors"))
    listed, bad, pruned = cli.batch(
        ["qwen38", "cache", "list"],
        ["qwen38", "cache", "prune", "--max-bytes", "lots"],
        ["qwen38", "cache", "prune", "--max-bytes", "0"],
    )
    assert listed.returncode == 0, listed.stderr
    assert "state files" in listed.stdout and not listed.stdout.startswith("0 state files")
    assert bad.returncode != 0 and "invalid size" in bad.stderr
    assert pruned.returncode == 0, pruned.stderr
    assert not any(store_dir.rglob("*.safetensors"))
    cli("-m", "tiny", "hello", "-o", "max_tokens", "4", "-o", "seed", "1")
    cli("qwen38", "cache", "clear", "--yes")
    assert not any(store_dir.rglob("*.safetensors"))


# ----- bad input ---------------------------------------------------------------------------


def test_unknown_model(cli):
    proc = cli("-m", "qwen38-nope", "hi", check=False)
    assert proc.returncode != 0 and "Unknown model" in proc.stderr


INVALID_OPTIONS = [
    ("temperature", "-1", "temperature"),
    ("top_p", "0", "top_p"),
    ("max_tokens", "zero", "max_tokens"),
    ("kv_paged", "sometimes", "kv_paged"),
    ("think", "perhaps", "think"),
    ("bogus", "1", "bogus"),
]


@pytest.fixture(scope="module")
def refused_options(tmp_path_factory) -> tuple[dict, list[dict]]:
    """`llm -m tiny hi -o OPTION VALUE` for each of INVALID_OPTIONS (one `llm` process for
    all: each is refused before an answer starts), and what llm logged after them."""
    root = tmp_path_factory.mktemp("invalid")
    cli = LLM(root / "llm-user")
    cli.register(dense_fixture("qwen3", root / "models"), "tiny")
    commands = [["-m", "tiny", "hi", "-o", option, value] for option, value, _ in INVALID_OPTIONS]
    procs = cli.batch(*commands)
    logged = cli.responses() if (cli.user_dir / "logs.db").exists() else []
    return {case[0]: proc for case, proc in zip(INVALID_OPTIONS, procs, strict=True)}, logged


@pytest.mark.parametrize(("option", "value", "message"), INVALID_OPTIONS)
def test_invalid_options(refused_options, option, value, message):
    procs, logged = refused_options
    proc = procs[option]
    assert proc.args[-2:] == [option, value]
    assert proc.returncode != 0
    assert message in proc.stderr
    assert not logged


def test_missing_weights_directory(cli, tmp_path):
    path = dense_fixture("qwen3", tmp_path / "gone")
    cli("qwen38", "add", str(path), "--name", "gone")
    for f in path.iterdir():
        f.unlink()
    path.rmdir()
    proc, listed = cli.batch(["-m", "gone", "hi"], ["qwen38", "list"])
    assert proc.returncode != 0 and "no longer exists" in proc.stderr
    assert "[missing]" in listed.stdout  # the registry is intact


def test_weights_of_another_model(cli, tmp_path):
    """qwen3's config with llama's tensors: refused with the tensor names, nothing logged."""
    path = dense_fixture("qwen3", tmp_path / "mixed")
    llama = dense_fixture("llama", tmp_path / "llama")
    (path / "model.safetensors").write_bytes((llama / "model.safetensors").read_bytes())
    added, proc = cli.batch(["qwen38", "add", str(path), "--name", "mixed"], ["-m", "mixed", "hi"])
    assert added.returncode == 0, added.stderr
    assert proc.returncode != 0
    assert "Error:" in proc.stderr and "q_norm" in proc.stderr
    assert not (cli.user_dir / "logs.db").exists() or not cli.responses()


def test_corrupt_state_file_is_recomputed(cli, tiny):
    cli("-m", "tiny", "hello", "-o", "max_tokens", "4", "-o", "seed", "1")
    files = list((cli.user_dir / "qwen38" / "checkpoints").rglob("*.safetensors"))
    assert files
    for f in files:
        f.write_bytes(f.read_bytes()[:100])
    out = cli("-c", "again", "-o", "max_tokens", "4", "-o", "seed", "1")
    assert out.returncode == 0
    last = cli.responses()[-1]
    assert last["response_json"]["cached_tokens"] == 0  # refused, so recomputed
    assert last["output_tokens"] == 4
    # reported once, as one readable line of its own (no Python warning with a source line)
    problem = last["response_json"]["state_file_error"]
    assert problem and "recomputing instead" in problem
    lines = [line for line in out.stderr.splitlines() if "recomputing instead" in line]
    assert lines == [f"qwen38: {problem}"], out.stderr
    assert "Warning" not in out.stderr and "warnings.warn" not in out.stderr


# ----- generation, usage, conversations ----------------------------------------------------


def test_usage_and_response_json(cli, tiny):
    cli("-m", "tiny", "hello", "-o", "max_tokens", "6", "-o", "seed", "3", "-o", "temperature", "1")
    r = cli.responses()[-1]
    assert r["output_tokens"] == 6 and r["input_tokens"] > 0
    assert r["token_details"] == {"cached_tokens": 0}
    rj = r["response_json"]
    assert rj["finish_reason"] == "length"
    for key in ("decode_tokens_per_second", "prefill_tokens_per_second", "cached_tokens", "kv"):
        assert key in rj


def test_draft_options_and_response_json(cli, tiny):
    """-o draft ngram -o draft_tokens 3: the same answer as -o draft off, and the draft
    figures in response_json; a model without an MTP head refuses draft mtp by name."""
    prompt = "one two three one two three one two three one two three"
    # think off: the answer is stdout (the tiny model's reasoning would go to stderr)
    common = ["-m", tiny, prompt, "-o", "max_tokens", "24", "-o", "cache", "false"]
    common += ["-o", "think", "false"]
    # one `llm` process for the three (LLM.batch): without the cache no answer reads another's
    plain, drafted, refused = cli.batch(
        [*common, "-o", "draft", "off"],
        [*common, "-o", "draft", "ngram", "-o", "draft_tokens", "3"],
        [*common, "-o", "draft", "mtp"],
    )
    assert plain.returncode == 0 and drafted.returncode == 0, plain.stderr + drafted.stderr
    assert len(plain.stdout) > 1 and drafted.stdout == plain.stdout  # the answer itself
    rows = cli.responses()
    assert rows[-2]["response_json"]["draft"]["mode"] is None
    draft = rows[-1]["response_json"]["draft"]
    assert draft["mode"] == "ngram" and draft["drafted"] >= draft["accepted"]
    assert {"acceptance_rate", "tokens_per_forward"} <= draft.keys()
    assert refused.returncode != 0 and "no MTP head" in refused.stderr


def test_continue_in_a_new_process_restores_the_prefix(cli, tiny):
    cli("-m", "tiny", "hello there", "-o", "max_tokens", "5", "-o", "seed", "1")
    cli("-c", "and again", "-o", "max_tokens", "5", "-o", "seed", "1")
    first, second = cli.responses()[-2:]
    assert second["conversation_id"] == first["conversation_id"]
    # the prior turns are in the prompt, and their prefix came from the prefix store
    assert second["input_tokens"] > first["input_tokens"]
    assert second["token_details"]["cached_tokens"] >= first["input_tokens"] - 4
    assert second["token_details"]["cached_tokens"] > 0


def test_continue_keeps_the_conversations_kv_layout(cli, tiny, tmp_path):
    """`llm -c` without the first call's KV options continues in its paged, spilling
    layout from the state file (not a full prefill in the default layout); a new
    conversation does not inherit it."""
    kv = ["-o", "kv_paged", "on", "-o", "kv_page_tokens", "16", "-o", "kv_pool_tokens", "32"]
    kv += ["-o", "kv_spill_dir", str(tmp_path / "spill")]
    prompt = " ".join(["one two three four five six seven eight"] * 8)
    cli("-m", "tiny", prompt, "-o", "max_tokens", "5", *kv)
    cli("-c", "and again", "-o", "max_tokens", "5")
    first, second = cli.responses()[-2:]
    assert first["response_json"]["kv"]["pages_spilled"] > 0
    assert second["token_details"]["cached_tokens"] >= first["input_tokens"] - 4
    assert second["response_json"]["kv"]["pages_spilled"] > 0
    # a new conversation with the same opening keeps the default layout
    cli("-m", "tiny", prompt + " and more", "-o", "max_tokens", "5")
    assert "pages_spilled" not in cli.responses()[-1]["response_json"]["kv"]


def test_continue_with_cache_off_reprefills(cli, tiny):
    cli("-m", "tiny", "hello there", "-o", "max_tokens", "5", "-o", "seed", "1")
    cli("-c", "and again", "-o", "max_tokens", "5", "-o", "cache", "0")
    assert cli.responses()[-1]["token_details"]["cached_tokens"] == 0


def test_chat_reuses_the_live_session(cli, tiny):
    # no state files on disk (cap 0): any reuse must come from this process's memory
    cli.env["QWEN38_PREFIX_STORE_MAX_BYTES"] = "0"
    out = cli(
        "chat", "-m", "tiny", "-o", "max_tokens", "4", "-o", "seed", "2",
        input="one\ntwo\nthree\nquit\n",
    )  # fmt: skip
    assert out.returncode == 0
    rows = cli.responses()
    assert len(rows) == 3
    assert len({r["conversation_id"] for r in rows}) == 1
    assert rows[0]["token_details"]["cached_tokens"] == 0
    for prev, row in zip(rows, rows[1:], strict=False):
        assert row["input_tokens"] > prev["input_tokens"]
        assert row["token_details"]["cached_tokens"] >= prev["input_tokens"] - 4
    assert not any((cli.user_dir / "qwen38" / "checkpoints").rglob("*.safetensors"))


@pytest.mark.parametrize("style", ["qwen_xml", "json"])
def test_tool_chain_forced_by_the_constrained_sampler(cli, tiny, style):
    out = cli(
        "-m", "tiny", "--functions", WEATHER_TOOL, "What is the weather in Paris?",
        "-o", "tool_choice", "any", "-o", "tool_style", style,
        "-o", "max_tokens", "40", "-o", "seed", "5", "--td",
    )  # fmt: skip
    rows = cli.responses()
    assert len(rows) == 2, out.stdout  # the call, then the answer after the tool result
    calls = rows[0]["tool_calls"]
    assert len(calls) == 1 and calls[0]["name"] == "weather"
    assert calls[0]["arguments"]["city"] in ("Paris", "Berlin")
    assert rows[0]["response_json"]["constrained"] == "tool_call"
    results = rows[1]["tool_results"]
    assert results and results[0]["output"] == f"sunny in {calls[0]['arguments']['city']}"
    assert rows[1]["response_json"]["constrained"] is None  # answered freely
    assert rows[1]["token_details"]["cached_tokens"] > 0  # the chain reused the live state
    assert "Tool call: weather" in out.stdout + out.stderr


BOUNDED = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["a", "b"]},
    },
    "required": ["ok", "n", "tag"],
}


@pytest.mark.parametrize("seed", range(3))
def test_schema_output_is_valid_json(cli, tiny, seed):
    out = cli(
        "-m", "tiny", "--schema", json.dumps(BOUNDED), "give me data",
        "-o", "temperature", "1", "-o", "seed", str(seed), "-o", "max_tokens", "60",
    )  # fmt: skip
    data = json.loads(out.stdout)
    jsonschema.validate(data, {**BOUNDED, "additionalProperties": False})
    assert cli.responses()[-1]["response_json"]["constrained"] == "schema"


def test_async_model_matches_sync(cli, tiny):
    code = """
import asyncio, json, llm
async def main():
    model = llm.get_async_model("tiny")
    response = model.prompt("hello", max_tokens=6, seed=1)
    text = await response.text()
    usage = await response.usage()
    return text, usage.output
text, output = asyncio.run(main())
sync = llm.get_model("tiny").prompt("hello", max_tokens=6, seed=1)
print(json.dumps({"async": text, "sync": sync.text(), "out": output}))
"""
    proc = cli.python(code)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["out"] == 6
    assert result["async"] == result["sync"]


# ----- the demo model -----------------------------------------------------------------------


@pytest.mark.demo
def test_demo_answers_paris_and_continues(cli, demo):
    out = cli("-m", demo, "What is the capital of France?", "-o", "max_tokens", "16")
    assert "Paris" in out.stdout
    out = cli("-c", "And of Germany?", "-o", "max_tokens", "16")
    assert "Berlin" in out.stdout
    first, second = cli.responses()[-2:]
    assert second["token_details"]["cached_tokens"] > 0
    assert second["input_tokens"] > first["input_tokens"] + first["output_tokens"]


@pytest.mark.demo
def test_demo_schema(cli, demo):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "is_capital": {"type": "boolean"},
        },
        "required": ["city", "is_capital"],
    }
    out = cli(
        "-m", demo, "--schema", json.dumps(schema), "Paris as JSON", "-o", "max_tokens", "30",
    )  # fmt: skip
    jsonschema.validate(json.loads(out.stdout), schema)


def tiny_tokenizer(cli):
    from qwen38_backend.loading.registry import Registry
    from qwen38_backend.tokenizer import Tokenizer

    return Tokenizer.from_dir(Registry(cli.home / "registry.json").get("tiny"))


def prompt_of(tokenizer, n: int) -> str:
    """'fig fig ...' of about n tokens in this tokenizer (the issue's 330 demo tokens)."""
    words = 1
    while len(tokenizer.encode("fig " * words)) < n:
        words += 1
    return "fig " * words


def test_cached_short_prompt_then_longer_one(cli, tiny):
    """Issue 19: `llm -m M hi`, then a prompt longer than the KV buffer's first growth step,
    failed with a broadcast error on every retry (only -o cache false avoided it). With the
    GPU's 512-token prefill chunk: on the CPU's 128 the first chunk never outgrew the buffer."""
    cli.env["QWEN38_PREFILL_CHUNK"] = "512"
    cli("-m", tiny, "hi", "-o", "max_tokens", "3")
    long_prompt = prompt_of(tiny_tokenizer(cli), 330)  # past the first 256-row buffer
    first = cli("-m", tiny, long_prompt, "-o", "max_tokens", "4")
    cold = cli("-m", tiny, long_prompt, "-o", "max_tokens", "4", "-o", "cache", "false")
    assert first.stdout == cold.stdout


def test_schema_cut_by_max_tokens_is_an_error(cli, tiny):
    """Issue 19: a schema answer cut by max_tokens printed invalid JSON with exit 0."""
    out = cli(
        "-m", "tiny", "--schema-multi", "name, bio", "people please", "-o", "max_tokens", "3",
        check=False,
    )  # fmt: skip
    assert out.returncode != 0
    assert "cut at max_tokens" in out.stderr and "finish_reason: length" in out.stderr
    with pytest.raises(ValueError):
        json.loads(out.stdout)  # what was printed is indeed not JSON: the error was right


def test_bounded_pool_options_reach_the_engine(cli, tiny, tmp_path):
    """-o kv_pool_tokens / kv_spill_dir: a pool smaller than the context spills to disk and
    answers as the all-resident store does."""
    prompt = prompt_of(tiny_tokenizer(cli), 300)
    common = ["-m", tiny, prompt, "-o", "max_tokens", "6", "-o", "cache", "false"]
    common += ["-o", "think", "false"]  # the answer on stdout (reasoning goes to stderr)
    common += ["-o", "kv_paged", "on", "-o", "kv_page_tokens", "16"]
    spill = tmp_path / "spill"
    # one `llm` process for both (LLM.batch): without the cache neither reads the other's
    resident, bounded = cli.batch(
        common, [*common, "-o", "kv_pool_tokens", "64", "-o", "kv_spill_dir", str(spill)]
    )
    assert resident.returncode == 0 and bounded.returncode == 0, resident.stderr + bounded.stderr
    assert len(resident.stdout) > 1 and bounded.stdout == resident.stdout  # the answer
    kv = cli.responses()[-1]["response_json"]["kv"]
    assert kv.get("pages_spilled", kv.get("spill_writes", 0)) > 0, kv
    assert not any(spill.rglob("*")) or all(p.is_dir() for p in spill.rglob("*"))  # removed
