"""n-gram speculative decoding (issue 13, greedy slice): the token stream equals plain greedy
decoding, token for token, on the dense fixtures and tiny qwen3_5 (Gated DeltaNet layers that
cannot be truncated). Oracle drafts (the plain stream's own continuation, partly corrupted)
force long accepted runs and rejections at every offset, so rollback is really exercised."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from helpers import dense_fixture

import qwen38_backend
from qwen38_backend import speculative
from qwen38_backend.errors import InvalidOptionError
from qwen38_backend.generation import GenerationStats
from qwen38_backend.request import split_options
from qwen38_backend.sampling import SamplingParams
from qwen38_backend.speculative import ngram_draft, parse_options
from qwen38_backend.testing import make_tiny_weights


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return qwen38_backend.load(str(dense_fixture("qwen3", tmp_path_factory.mktemp("spec"))))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return qwen38_backend.load(str(make_tiny_weights("qwen3_5", tmp_path_factory.mktemp("q35"))))


def run(model, prompt, n, **options):
    stream = model.generate_tokens(prompt, max_tokens=n, **options)
    return list(stream), stream.stats


def test_ngram_draft_takes_the_longest_most_recent_match():
    assert ngram_draft([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 2) == [7, 5]  # "2 3" latest first
    assert ngram_draft([1, 2, 3, 4, 8, 3, 4, 6, 2, 3, 4], 3) == [8, 3, 4]  # n=3 beats n=2
    assert ngram_draft([5, 6, 7], 4) == []
    assert ngram_draft([5, 6, 5], 4) == [6]  # a one-token match proposes one token
    assert ngram_draft([5, 6, 7, 5, 6], 4) == [7, 5, 6]
    assert ngram_draft([5, 6, 5], 0) == []


def test_options_are_checked_and_unknown_names_still_refused():
    assert parse_options({}) is None
    assert parse_options({"speculative": "off"}) is None
    assert parse_options({"speculative": "ngram", "speculative_tokens": 2}).tokens == 2
    for bad in ({"speculative": "mtp?"}, {"speculative": "ngram", "speculative_tokens": 0}):
        with pytest.raises(InvalidOptionError):
            parse_options(bad)
    _, _, _, request = split_options({"speculative": "ngram", "speculative_tokens": 3})
    assert request == {"speculative": "ngram", "speculative_tokens": 3}
    with pytest.raises(InvalidOptionError, match="speculativ"):
        split_options({"speculativ": "ngram"})


def repetitive(seed, period=5, repeats=5):
    rng = np.random.default_rng(seed)
    return rng.integers(3, 200, size=period).tolist() * repeats


@pytest.mark.parametrize("k", [1, 4, 7])
def test_dense_ngram_equals_plain_and_accepts(dense, k):
    accepted = 0
    for seed in range(3):
        for prompt in (repetitive(seed), np.random.default_rng(seed).integers(3, 200, 17).tolist()):
            plain, _ = run(dense, prompt, 48, stop_token_ids=[])
            spec, stats = run(
                dense, prompt, 48, stop_token_ids=[], speculative="ngram", speculative_tokens=k
            )
            assert spec == plain
            assert stats.generated_tokens == 48 and stats.finish_reason == "length"
            accepted += stats.speculative["accepted"]
            assert stats.speculative["drafted"] >= stats.speculative["accepted"]
    assert accepted > 0  # the verify path really ran and kept drafts


def test_paged_kv_across_page_boundaries(dense):
    prompt = repetitive(7, period=3, repeats=4)
    opts = {"kv_paged": "on", "kv_page_tokens": 4, "stop_token_ids": []}
    plain, _ = run(dense, prompt, 40, **opts)
    spec, stats = run(dense, prompt, 40, speculative="ngram", **opts)
    assert spec == plain and stats.speculative["rounds"] > 0


@pytest.fixture
def oracle(monkeypatch):
    """Drafts from the plain stream itself, each draft position corrupted with p=0.35."""

    def install(prompt, plain, seed=0):
        rng = np.random.default_rng(seed)

        def draft(tokens, k, max_n=3):
            done = len(tokens) - len(prompt)  # generated tokens already in `tokens`
            out = list(plain[done : done + k])
            for i in range(len(out)):
                if rng.random() < 0.35:
                    out[i] = (out[i] + 1 + int(rng.integers(50))) % 200
            return out

        monkeypatch.setattr(speculative, "ngram_draft", draft)

    return install


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_oracle_drafts_roll_back_exactly(request, oracle, which):
    model = request.getfixturevalue(which)
    for seed in range(2):
        prompt = np.random.default_rng(seed).integers(3, 200, 9).tolist()
        plain, _ = run(model, prompt, 32, stop_token_ids=[])
        oracle(prompt, plain, seed)
        spec, stats = run(model, prompt, 32, stop_token_ids=[], speculative="ngram")
        assert spec == plain
        sp = stats.speculative
        assert sp["accepted"] > 0 and sp["accepted"] < sp["drafted"]  # both kinds of rounds


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 9])
def test_max_tokens_is_never_exceeded(dense, oracle, n):
    prompt = [11, 12, 13, 14]
    plain, _ = run(dense, prompt, n, stop_token_ids=[])
    oracle(prompt, run(dense, prompt, n + 8, stop_token_ids=[])[0])
    spec, stats = run(dense, prompt, n, stop_token_ids=[], speculative="ngram")
    assert spec == plain and len(spec) == n and stats.finish_reason == "length"


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_eos_inside_an_accepted_draft_ends_the_stream(request, monkeypatch, which):
    model = request.getfixturevalue(which)
    prompt = [21, 22, 23, 24, 25]
    full, _ = run(model, prompt, 24, stop_token_ids=[])
    stop = full[6]
    plain, pstats = run(model, prompt, 24, stop_token_ids=[stop])
    assert plain[-1] == stop and stop not in plain[:-1] and pstats.finish_reason == "stop"

    def draft(tokens, k, max_n=3):  # always the true continuation, running past the stop
        done = len(tokens) - len(prompt)
        return list(full[done : done + 4])

    monkeypatch.setattr(speculative, "ngram_draft", draft)
    spec, stats = run(model, prompt, 24, stop_token_ids=[stop], speculative="ngram")
    assert spec == plain and stats.finish_reason == "stop"
    assert stats.speculative["accepted"] >= 4


def test_hybrid_drops_only_its_own_save_points(hybrid, oracle):
    session = hybrid.session(cache=False)
    prompt = np.random.default_rng(3).integers(3, 200, 9).tolist()
    plain, _ = run(hybrid, prompt, 16, stop_token_ids=[])
    oracle(prompt, plain)
    list(session.generate(prompt, max_tokens=16, stop_token_ids=[], speculative="ngram"))
    assert session.last_stats.speculative["rounds"] > 0
    assert session.state.save_points == [len(prompt)]  # the session's own prompt boundary


def test_session_text_and_fallbacks(dense):
    session = dense.session(cache=False)
    prompt = "one two three one two three one two three one two"

    def text(**options):
        events = list(session.generate(prompt, max_tokens=24, **options))
        return "".join(e.text or "" for e in events if e.type == "text")

    plain = text()
    assert text(speculative="ngram", speculative_tokens=3) == plain
    assert session.last_stats.speculative["mode"] == "ngram"
    # sampling, constraints and sparse selection decode plainly (no rounds, no counters)
    text(speculative="ngram", temperature=0.7, seed=1)
    assert session.last_stats.speculative == {}
    text(speculative="ngram", kv_paged="on", kv_topk=64)
    assert session.last_stats.speculative == {}


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    return qwen38_backend.load(str(make_tiny_weights("qwen4_exp", tmp_path_factory.mktemp("q4"))))


@pytest.mark.parametrize(
    ("which", "kv"),
    [
        ("dense", {}),
        ("dense", {"kv_paged": "on", "kv_page_tokens": 4}),
        ("hybrid", {}),
        ("flash", {}),
    ],
)
def test_verify_rows_equal_single_steps_on_cpu(request, which, kv):
    """The premise: a verify forward of T tokens gives, row for row, the logits of T single
    steps, bit for bit, on the CPU (the paged store and Gated DeltaNet layers included)."""
    model = request.getfixturevalue(which)
    prefix, tail = list(range(3, 40)), [7, 8, 9, 10, 11]
    one = model.new_state(**kv)
    many = model.new_state(**kv)
    model.prefill(prefix, one)
    model.prefill(prefix, many)
    steps = [np.array(model.forward([t], one)[-1].astype(mx.float32)) for t in tail]
    rows = np.array(model.forward(tail, many, last_only=False).astype(mx.float32))
    for i, step in enumerate(steps):
        assert np.array_equal(rows[i], step), f"row {i} differs"


def test_flash_next_past_the_qsa_dense_threshold(flash, oracle):
    # the tiny config selects 2 blocks of 4 tokens: a 120-token prompt is deep in the sparse
    # regime, where each verify row selects its own blocks as a single step would
    prompt = np.random.default_rng(5).integers(3, 200, 120).tolist()
    plain, _ = run(flash, prompt, 24, stop_token_ids=[])
    oracle(prompt, plain)
    spec, stats = run(flash, prompt, 24, stop_token_ids=[], speculative="ngram")
    assert spec == plain
    assert 0 < stats.speculative["accepted"] < stats.speculative["drafted"]


def test_cancel_ends_after_the_current_token(dense, oracle):
    prompt = [31, 32, 33, 34]
    full, _ = run(dense, prompt, 30, stop_token_ids=[])
    oracle(prompt, full)
    cancel = threading.Event()
    stats = GenerationStats()
    state = dense.new_state()
    logits = dense.prefill(prompt, state)
    got = []
    for token in dense.decode(
        logits,
        state,
        stream_params(30),
        stats,
        cancel=cancel,
        speculative=parse_options({"speculative": "ngram"}),
    ):
        got.append(token)
        if len(got) == 3:
            cancel.set()
    assert got == full[:3] and stats.finish_reason == "cancelled"


def stream_params(n):
    return SamplingParams(max_tokens=n, stop_token_ids=[])
