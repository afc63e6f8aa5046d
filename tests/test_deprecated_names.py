"""Names a user could have typed before the one-word-per-concept renames still work, with a
note naming the new one: CheckpointError, CheckpointWarning, Model.checkpoint, the env var
QWEN38_CHECKPOINT_MAX_BYTES, the settings key checkpoint_max_bytes and the options
speculative / speculative_tokens (now draft / draft_tokens)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from qwen38_backend import errors, prefix_store
from qwen38_backend.engine import Model


def test_checkpoint_error_is_state_file_error():
    with pytest.warns(DeprecationWarning, match="use StateFileError"):
        old = errors.CheckpointError
    assert old is errors.StateFileError


def test_checkpoint_warning_is_state_file_warning():
    with pytest.warns(DeprecationWarning, match="use StateFileWarning"):
        old = prefix_store.CheckpointWarning
    assert old is prefix_store.StateFileWarning


def test_model_checkpoint_is_model_weights():
    weights = SimpleNamespace(tokenizer=None, generation_config={}, source="/x/tiny")
    model = Model(SimpleNamespace(config=None), weights, dtype=None)
    with pytest.warns(DeprecationWarning, match="use Model.weights"):
        assert model.checkpoint is weights


def test_old_cap_env_var_and_settings_key(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLM_USER_PATH", str(tmp_path))
    from llm_qwen38 import _home

    monkeypatch.delenv(_home.CAP_ENV, raising=False)
    monkeypatch.setenv("QWEN38_CHECKPOINT_MAX_BYTES", "3MB")
    assert _home.prefix_store_cap() == 3 * 1024**2
    assert "QWEN38_PREFIX_STORE_MAX_BYTES" in capsys.readouterr().err
    monkeypatch.setenv(_home.CAP_ENV, "5MB")  # the new name wins
    assert _home.prefix_store_cap() == 5 * 1024**2

    monkeypatch.delenv(_home.CAP_ENV)
    monkeypatch.delenv("QWEN38_CHECKPOINT_MAX_BYTES")
    settings = _home.plugin_dir() / _home.SETTINGS_FILE
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({"checkpoint_max_bytes": 7}))
    assert _home.prefix_store_cap() == 7
    settings.write_text(json.dumps({"checkpoint_max_bytes": 7, "prefix_store_max_bytes": 9}))
    assert _home.prefix_store_cap() == 9


def test_speculative_options_are_draft_options(tmp_path):
    import qwen38_backend
    from qwen38_backend.testing import make_tiny_weights

    model = qwen38_backend.load(str(make_tiny_weights("qwen3_5", tmp_path)))
    session = model.session(cache=False)
    with pytest.warns(DeprecationWarning, match="use 'draft") as caught:
        req = session.request("hi", speculative="ngram", speculative_tokens=3)
    assert {str(w.message).split("use ")[1] for w in caught} == {"'draft'", "'draft_tokens'"}
    assert (req.draft.mode, req.draft.tokens) == ("ngram", 3)
    with pytest.warns(DeprecationWarning, match="use 'draft'"):
        assert session.request("hi", speculative=False).draft is None  # the old off switch
