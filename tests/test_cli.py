"""The `qwen38` command: real runs on tiny weights, and one-line errors on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import dense_fixture


def qwen38(*args: str, env_home, input: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "QWEN38_HOME": str(env_home)}
    return subprocess.run(
        [sys.executable, "-m", "qwen38_backend.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        input=input,
    )


def test_chat_answers_each_line_skips_empty_ones_and_quits_on_slash_exit(tmp_path, isolated_home):
    model = dense_fixture("qwen3", tmp_path)
    args = ["chat", str(model), "--max-tokens", "3", "--no-think", "--stats"]
    out = qwen38(*args, env_home=isolated_home, input="hello\n\n   \nagain\n/exit\nnever\n")
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("generated") == 2  # two turns: empty lines sent nothing
    for word in ("quit", "/quit", "/bye", "EXIT"):
        done = qwen38(*args, env_home=isolated_home, input=f"{word}\nhello\n")
        assert done.returncode == 0 and "generated" not in done.stderr


def test_run_streams_an_answer_and_reports_stats(tmp_path, isolated_home):
    model = dense_fixture("qwen3", tmp_path)
    out = qwen38(
        "run",
        str(model),
        "hello",
        "--max-tokens",
        "8",
        "--stats",
        "--no-think",
        env_home=isolated_home,
    )
    assert out.returncode == 0, out.stderr
    assert "generated 8" in out.stderr and "prefill" in out.stderr


def test_run_with_drafts_prints_the_same_answer_and_their_figures(tmp_path, isolated_home):
    model = dense_fixture("qwen3", tmp_path)
    prompt = "one two three one two three one two three one two three"
    args = ["run", str(model), prompt, "--max-tokens", "16", "--no-think", "--stats"]
    plain = qwen38(*args, "--draft", "off", env_home=isolated_home)
    drafted = qwen38(*args, "--draft", "ngram", "--draft-tokens", "3", env_home=isolated_home)
    assert drafted.returncode == 0, drafted.stderr
    assert drafted.stdout == plain.stdout
    assert "draft ngram: accepted" in drafted.stderr and "tokens per forward" in drafted.stderr
    refused = qwen38(*args, "--draft", "mtp", env_home=isolated_home)
    assert refused.returncode != 0 and "no MTP head" in refused.stderr


def test_info_prints_architecture_and_memory_plan(tmp_path, isolated_home):
    model = dense_fixture("qwen2", tmp_path)
    out = qwen38("info", str(model), "--context", "1000", env_home=isolated_home)
    assert out.returncode == 0, out.stderr
    config = json.loads((model / "config.json").read_text())
    assert "qwen2" in out.stdout and f"{config['num_hidden_layers']} layers" in out.stdout
    assert "memory plan" in out.stdout and "kv" in out.stdout


def test_info_plans_with_the_kv_options_of_a_run(tmp_path, isolated_home):
    """`qwen38 info --context N` takes the KV flags `run` takes, so "does 262K fit with this
    pool?" is asked of the same plan a run gets; without --context they are refused."""
    model = dense_fixture("qwen3", tmp_path)
    spill = tmp_path / "spill"
    args = ["info", str(model), "--context", "262144", "--kv-paged", "on"]
    args += ["--kv-pool-tokens", "4096", "--kv-spill-dir", str(spill)]
    out = qwen38(*args, env_home=isolated_home)
    assert out.returncode == 0, out.stderr
    assert "pool kv_pool_tokens=4,096" in out.stdout and f"({spill})" in out.stdout
    assert not spill.exists()  # a plan that only informs writes nothing
    bad = qwen38("info", str(model), "--kv-pool-tokens", "4096", env_home=isolated_home)
    assert bad.returncode != 0 and "give --context N too" in bad.stderr


def test_info_plans_one_rank_of_a_split_model(tmp_path, isolated_home):
    from qwen38_backend.admission import memory_plan

    model = dense_fixture("qwen3", tmp_path)
    out = qwen38("info", str(model), "--context", "1000", "--ranks", "2", env_home=isolated_home)
    assert out.returncode == 0, out.stderr
    assert "per rank of 2" in out.stdout
    config = json.loads((model / "config.json").read_text())
    half = memory_plan(config, 1000, ranks=2, dtype="float32").weights
    assert f"{half:,} bytes" in out.stdout  # the rank's share, not the whole model
    # 4 attention heads, 2 key/value heads: 3 ranks are refused by name, nothing planned
    bad = qwen38("info", str(model), "--context", "1000", "--ranks", "3", env_home=isolated_home)
    assert bad.returncode != 0 and "cannot be split evenly over 3 ranks" in bad.stderr


def test_add_then_run_by_name(tmp_path, isolated_home):
    model = dense_fixture("qwen3", tmp_path)
    out = qwen38("add", str(model), "--name", "tiny", "--default", env_home=isolated_home)
    assert out.returncode == 0, out.stderr
    assert f"added tiny -> {model.resolve()} (qwen3, safetensors)" in out.stdout
    listed = qwen38("models", env_home=isolated_home)
    assert f"tiny  {model.resolve()}  (default)" in listed.stdout
    assert f"registry: {isolated_home / 'registry.json'}" in listed.stderr
    run = qwen38("run", "tiny", "hi", "--max-tokens", "3", env_home=isolated_home)
    assert run.returncode == 0, run.stderr


def test_make_tiny_writes_loadable_weights(tmp_path, isolated_home):
    out = qwen38("make-tiny", "qwen3_5", str(tmp_path / "t"), "--seed", "3", env_home=isolated_home)
    assert out.returncode == 0, out.stderr
    run = qwen38("run", str(tmp_path / "t"), "hi", "--max-tokens", "3", env_home=isolated_home)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize(
    "args,expected",
    [
        (["run", "/no/such/model", "hi"], "neither an existing path nor a registered model"),
        (["info", "not-a-model-name"], "register one with `qwen38 add PATH --name NAME`"),
        (["add", "{model}", "--name", "qwen38-demo"], "'qwen38-demo' is reserved"),
        (["add", "{model}", "--name", "a/b"], "invalid model name"),
        (["add", "/no/such/model"], "no such file or directory"),
        (["run", "{model}", "hi", "--top-p", "2"], "top_p"),
        (["run", "{model}", "hi", "--kv-topk", "-5"], "kv_topk"),
    ],
)
def test_bad_input_is_one_clear_line(tmp_path, isolated_home, args, expected):
    model = dense_fixture("llama", tmp_path)
    out = qwen38(*[a.replace("{model}", str(model)) for a in args], env_home=isolated_home)
    assert out.returncode == 2
    assert expected in out.stderr
    assert "Traceback" not in out.stderr
