"""Speculative decoding (issue 13): with drafts the token stream is the plain stream, token for
token, greedy and seeded sampling alike: dense fixtures, the demo (n-gram drafts), tiny
qwen3_5 and qwen4_exp (MTP drafts). Oracle drafts (the plain stream's own continuation, partly
corrupted) force long accepted runs and rejections at every offset, so rollback is exercised;
the MTP head's history is checked against a head fed the trunk's own features, and against a
session that ran on after a state file restore or a rewind (it is part of the state)."""

from __future__ import annotations

import math
import threading

import mlx.core as mx
import numpy as np
import pytest
from helpers import dense_fixture

import qwen38_backend
from qwen38_backend import drafts, rows, speculative
from qwen38_backend.errors import InvalidOptionError
from qwen38_backend.generation import GenerationStats
from qwen38_backend.prefix_store import PrefixStore
from qwen38_backend.request import split_options
from qwen38_backend.sampling import SamplingParams, filter_logprobs
from qwen38_backend.speculative import (
    DraftLength,
    DraftOptions,
    Throttle,
    parse_options,
    resolve,
)
from qwen38_backend.testing import make_tiny_weights

NGRAM = {"draft": "ngram"}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return qwen38_backend.load(str(dense_fixture("qwen3", tmp_path_factory.mktemp("spec"))))


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return qwen38_backend.load(str(make_tiny_weights("qwen3_5", tmp_path_factory.mktemp("q35"))))


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    return qwen38_backend.load(str(make_tiny_weights("qwen4_exp", tmp_path_factory.mktemp("q4"))))


def run(model, prompt, n, **options):
    stream = model.generate_tokens(prompt, max_tokens=n, **options)
    return list(stream), stream.stats


def use_drafts(monkeypatch, draft):
    """n-gram rounds draft `draft(tokens, k)` instead (reported as 3-token matches); `tokens`
    is the whole context the index holds."""
    monkeypatch.setattr(drafts.NgramIndex, "match", lambda index, k: (draft(index.tokens, k), 3))


def quantized_hybrid(path):
    """Tiny qwen3_5 with its linears (those of a width of 32s) quantized to 4 bits, as a
    4-bit checkpoint kept packed."""
    import mlx.nn as nn

    model = qwen38_backend.load(str(make_tiny_weights("qwen3_5", path)))
    nn.quantize(
        model.net,
        group_size=32,
        bits=4,
        class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % 32 == 0,
    )
    return model


def repetitive(seed, period=5, repeats=5):
    rng = np.random.default_rng(seed)
    return rng.integers(3, 200, size=period).tolist() * repeats


# ----- options -------------------------------------------------------------------------------
def test_ngram_draft_takes_the_longest_most_recent_match():
    def ngram(tokens, k):
        return drafts.ngram_match(tokens, k)[0]

    assert ngram([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 2) == [7, 5]  # "2 3" latest first
    assert ngram([1, 2, 3, 4, 8, 3, 4, 6, 2, 3, 4], 3) == [8, 3, 4]  # n=3 beats n=2
    assert ngram([5, 6, 7], 4) == []
    assert ngram([5, 6, 5], 4) == [6]  # a one-token match proposes one token
    assert ngram([5, 6, 7, 5, 6], 4) == [7, 5, 6]
    assert ngram([5, 6, 5], 0) == []
    assert drafts.ngram_match([1, 2, 3, 4, 8, 3, 4, 6, 2, 3, 4], 3) == ([8, 3, 4], 3)
    assert drafts.ngram_match([5, 6, 5], 4) == ([6], 1)
    assert drafts.ngram_match([5, 6, 7], 4) == ([], 0)


def test_options_are_checked_and_resolved_against_the_model(dense, hybrid):
    assert parse_options({}) == DraftOptions("auto", None)
    assert parse_options({"draft": "ngram", "draft_tokens": 2}) == DraftOptions("ngram", 2)
    for bad in ({"draft": "mtp?"}, {"draft": "ngram", "draft_tokens": 0}, {"draft_tokens": 1.5}):
        with pytest.raises(InvalidOptionError, match="draft"):
            parse_options(bad)
    assert resolve(parse_options({}), dense) is None  # auto: no head, no drafts
    assert resolve(parse_options({}), hybrid) == DraftOptions("mtp", 2)
    assert resolve(parse_options({"draft": "ngram"}), hybrid) == DraftOptions("ngram", 4)
    assert resolve(parse_options({"draft": "off"}), hybrid) is None
    with pytest.raises(InvalidOptionError, match="no MTP head"):
        dense.session(cache=False).request("hi", draft="mtp")
    _, _, _, request = split_options({"draft": "ngram", "draft_tokens": 3})
    assert request == {"draft": "ngram", "draft_tokens": 3}
    with pytest.raises(InvalidOptionError, match="drafts"):
        split_options({"drafts": "ngram"})


def test_no_drafting_where_verify_rows_differ_from_plain_steps(hybrid, monkeypatch):
    """Where a verify forward's rows would not be the plain steps' bits (rows.exact_rows 1:
    a GPU whose few-row products are not padded, QWEN38_PAD_ROWS=1), auto decodes plainly
    and an explicit draft mode is refused before any work; k is bounded by what a row-exact
    verify takes there."""
    assert speculative.verify_rows(hybrid) == rows.STEP_MAX_ROWS  # this CPU
    monkeypatch.setattr(speculative, "verify_rows", lambda model: 1)
    assert resolve(parse_options({}), hybrid) is None
    for mode in ("mtp", "ngram"):
        with pytest.raises(InvalidOptionError, match="not bit-identical"):
            resolve(parse_options({"draft": mode}), hybrid)
    with pytest.raises(InvalidOptionError, match="not bit-identical"):
        hybrid.session(cache=False).request("hi", draft="ngram")
    # a GPU pads few-row products to 8 rows: 7 draft tokens at most, an unset k capped
    monkeypatch.setattr(speculative, "verify_rows", lambda model: 3)
    assert resolve(parse_options({"draft": "ngram"}), hybrid) == DraftOptions("ngram", 2)
    with pytest.raises(InvalidOptionError, match="use at most 2"):
        resolve(parse_options({"draft": "ngram", "draft_tokens": 3}), hybrid)


def test_old_option_names_warn_and_map_to_the_new_ones():
    with pytest.warns(DeprecationWarning, match="use 'draft'"):
        assert parse_options({"speculative": "ngram"}) == DraftOptions("ngram", None)
    with pytest.warns(DeprecationWarning, match="use 'draft_tokens'"):
        assert parse_options({"speculative_tokens": 3}).tokens == 3
    with pytest.warns(DeprecationWarning):
        assert parse_options({"speculative": False}).mode == "off"
    with pytest.warns(DeprecationWarning), pytest.raises(InvalidOptionError, match="disagree"):
        parse_options({"speculative": "ngram", "draft": "off"})


# ----- greedy: n-gram drafts -----------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 4, 7])
def test_dense_ngram_equals_plain_and_accepts(dense, k):
    accepted = 0
    for seed in range(3):
        for prompt in (repetitive(seed), np.random.default_rng(seed).integers(3, 200, 17).tolist()):
            plain, _ = run(dense, prompt, 48, stop_token_ids=[])
            spec, stats = run(dense, prompt, 48, stop_token_ids=[], draft="ngram", draft_tokens=k)
            assert spec == plain
            assert stats.generated_tokens == 48 and stats.finish_reason == "length"
            accepted += stats.accepted
            assert stats.drafted >= stats.accepted
    assert accepted > 0  # the verify path really ran and kept drafts


def test_ngram_lookups_see_the_whole_context_as_it_is_decided(dense, monkeypatch):
    """One index per generation, appended to as tokens are decided (rounds and plain runs
    alike): every lookup sees the sequence's tokens (an earlier turn's too) and the tokens
    decided so far, one more at each lookup at least, nothing else."""
    seen: list[list[int]] = []
    real = drafts.NgramIndex.match

    def match(index, k):
        seen.append(list(index.tokens))
        return real(index, k)

    monkeypatch.setattr(drafts.NgramIndex, "match", match)
    state = dense.new_state()
    params = SamplingParams(max_tokens=30, stop_token_ids=[])
    context: list[int] = []
    for turn in (repetitive(0), repetitive(1, period=3)):
        seen.clear()
        out = list(dense.run(turn, state, params, DraftOptions("ngram", 3)))
        context += turn + out
        lengths = [len(tokens) for tokens in seen]
        assert all(tokens == context[: len(tokens)] for tokens in seen)
        assert lengths[0] == len(context) - len(out) + 1 and lengths[-1] <= len(context) - 1
        assert all(a < b for a, b in zip(lengths, lengths[1:], strict=False))
        context = state.tokens  # the last token is not fed: the next turn starts without it


@pytest.mark.parametrize("reserved", [True, False])
def test_verify_rows_append_without_moving_live_buffers(dense, monkeypatch, reserved):
    """A round makes room for its k+1 rows before the verify forward, so the verify's append
    never reallocates a KV buffer (checked against the store's capacity at each append; with
    the reservation switched off the same stream does reallocate, so the check can fail)."""
    from qwen38_backend.kv.contiguous import ContiguousKV
    from qwen38_backend.state import SequenceState

    grew: list[int] = []
    append = ContiguousKV.append
    prompt = repetitive(3, period=7, repeats=60)  # 420 tokens: the buffer grows past 512

    def watched(self, k, v):
        verify = k.shape[2] > 1 and self.length >= len(prompt)  # not a prefill chunk
        if verify and self.keys is not None:
            if self.keys.shape[2] < self.length + k.shape[2]:
                grew.append(self.length)
        append(self, k, v)

    monkeypatch.setattr(ContiguousKV, "append", watched)
    if not reserved:
        monkeypatch.setattr(SequenceState, "reserve", lambda self, n: None)
    spec, stats = run(dense, prompt, 200, stop_token_ids=[], draft="ngram", draft_tokens=7)
    assert stats.accepted > 0
    assert (grew == []) is reserved


def test_one_token_prompts(dense, hybrid, flash):
    for model, opts in ((dense, NGRAM), (hybrid, {"draft": "mtp"}), (flash, {"draft": "mtp"})):
        for token in (5, 77):
            plain, _ = run(model, [token], 20, stop_token_ids=[], draft="off")
            spec, stats = run(model, [token], 20, stop_token_ids=[], **opts)
            assert spec == plain and stats.draft == opts["draft"]


def test_paged_kv_across_page_boundaries(dense):
    prompt = repetitive(7, period=3, repeats=4)
    opts = {"kv_paged": "on", "kv_page_tokens": 4, "stop_token_ids": []}
    plain, _ = run(dense, prompt, 40, **opts)
    spec, stats = run(dense, prompt, 40, **NGRAM, **opts)
    assert spec == plain and stats.accepted > 0


@pytest.fixture
def oracle(monkeypatch):
    """n-gram drafts from the plain stream itself, each position corrupted with p=`bad`."""

    def install(prompt, plain, seed=0, bad=0.35):
        rng = np.random.default_rng(seed)

        def draft(tokens, k):
            done = len(tokens) - len(prompt)  # generated tokens already in `tokens`
            out = list(plain[done : done + k])
            for i in range(len(out)):
                if rng.random() < bad:
                    out[i] = (out[i] + 1 + int(rng.integers(50))) % 200
            return out

        use_drafts(monkeypatch, draft)

    return install


@pytest.fixture(params=["1", "8"], ids=["unpadded", "padded"])
def pad(request, monkeypatch):
    """Few-row products as this CPU runs them, or padded to 8 rows as a GPU runs them."""
    monkeypatch.setenv("QWEN38_PAD_ROWS", request.param)
    return int(request.param)


@pytest.mark.parametrize("which", ["dense", "hybrid", "flash"])
def test_oracle_drafts_roll_back_exactly(request, oracle, which, pad):
    model = request.getfixturevalue(which)
    for seed in range(2):
        prompt = np.random.default_rng(seed).integers(3, 200, 9).tolist()
        plain, _ = run(model, prompt, 32, stop_token_ids=[], draft="off")
        oracle(prompt, plain, seed)
        spec, stats = run(model, prompt, 32, stop_token_ids=[], **NGRAM)
        assert spec == plain
        assert 0 < stats.accepted < stats.drafted  # both kinds of rounds


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 9])
def test_max_tokens_is_never_exceeded(dense, oracle, n):
    prompt = [11, 12, 13, 14]
    plain, _ = run(dense, prompt, n, stop_token_ids=[])
    oracle(prompt, run(dense, prompt, n + 8, stop_token_ids=[])[0])
    spec, stats = run(dense, prompt, n, stop_token_ids=[], **NGRAM)
    assert spec == plain and len(spec) == n and stats.finish_reason == "length"


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_eos_inside_an_accepted_draft_ends_the_stream(request, monkeypatch, which):
    model = request.getfixturevalue(which)
    prompt = [21, 22, 23, 24, 25]
    full, _ = run(model, prompt, 24, stop_token_ids=[], draft="off")
    stop = full[6]
    plain, pstats = run(model, prompt, 24, stop_token_ids=[stop], draft="off")
    assert plain[-1] == stop and stop not in plain[:-1] and pstats.finish_reason == "stop"

    def draft(tokens, k):  # always the true continuation, running past the stop
        done = len(tokens) - len(prompt)
        return list(full[done : done + 4])

    use_drafts(monkeypatch, draft)
    state = model.new_state()
    params = SamplingParams(max_tokens=24, stop_token_ids=[stop])
    stream = model.run(prompt, state, params, DraftOptions("ngram", 4))
    spec, stats = list(stream), stream.stats
    assert spec == plain and stats.finish_reason == "stop"
    assert stats.accepted >= 4
    # the drafts past the stop were not kept: a follow-up turn can reuse the whole state
    assert state.tokens == prompt + plain[:-1]


@pytest.mark.parametrize("which", ["hybrid", "flash"])
def test_rollback_replays_recurrent_layers_to_the_plain_state_bit_for_bit(
    request, oracle, monkeypatch, which
):
    """A rejected verify replays only the recurrent layers' own update over the kept rows
    (Gated DeltaNet; Flash-Next's PLE too): the state after decoding is the plain single-step
    state, every array bit for bit, with fewer forwards than feeding the kept tokens again."""
    hybrid = request.getfixturevalue(which)
    prompt = np.random.default_rng(8).integers(3, 200, 9).tolist()
    plain, _ = run(hybrid, prompt, 32, stop_token_ids=[], draft="off")
    params = SamplingParams(max_tokens=32, stop_token_ids=[])
    forwards = {}
    for replay in (True, False):
        monkeypatch.setattr(speculative, "_can_replay", lambda state, on=replay: on)
        oracle(prompt, plain)
        state = hybrid.new_state()
        stream = hybrid.run(prompt, state, params, DraftOptions("ngram", 4))
        assert list(stream) == plain and 0 < stream.stats.accepted < stream.stats.drafted
        forwards[replay] = stream.stats.forwards
        ref = hybrid.new_state()
        hybrid.prefill(prompt, ref)
        for token in plain[:-1]:
            hybrid.forward([token], ref, last_only=True)
        assert state.tokens == ref.tokens
        for got, want in zip(state.snapshot().layers, ref.snapshot().layers, strict=True):
            assert got.keys() == want.keys()
            for name in want:
                assert np.array_equal(np.array(got[name]), np.array(want[name])), name
    assert forwards[True] < forwards[False]


def test_hybrid_drops_only_its_own_save_points(hybrid, oracle):
    session = hybrid.session(cache=False)
    prompt = np.random.default_rng(3).integers(3, 200, 9).tolist()
    plain, _ = run(hybrid, prompt, 16, stop_token_ids=[], draft="off")
    oracle(prompt, plain)
    list(session.generate(prompt, max_tokens=16, stop_token_ids=[], **NGRAM))
    assert session.last_stats.drafted > 0
    assert session.state.save_points == [len(prompt)]  # the session's own prompt boundary


def test_demo_model_ngram_equals_plain(demo_model):
    session = demo_model.session(cache=False)
    prompt = "Repeat exactly: red, green, blue, red, green, blue, red, green, blue."
    ids = session.request(prompt, enable_thinking=False).ids
    plain, _ = run(demo_model, ids, 16, draft="off")
    spec, stats = run(demo_model, ids, 16, **NGRAM)
    assert spec == plain and stats.accepted > 0


# ----- greedy: MTP drafts --------------------------------------------------------------------
@pytest.fixture
def mtp_oracle(monkeypatch):
    """The MTP head runs (its KV grows and chains as usual), but its proposal is replaced by
    the plain stream's continuation, corrupted with p=0.35, so drafts are also accepted."""
    real = drafts.MTPTrack.draft

    def install(prompt, plain, seed=0):
        rng = np.random.default_rng(seed)

        def draft(self, net, next_token, k):
            out, keep = real(self, net, next_token, k)
            done = self.seen - len(prompt) + 1  # generated index of the first draft token
            out = list(plain[done : done + k])
            for i in range(len(out)):
                if rng.random() < 0.35:
                    out[i] = (out[i] + 1 + int(rng.integers(50))) % 200
            return out, keep

        monkeypatch.setattr(drafts.MTPTrack, "draft", draft)

    return install


def mtp_history_matches_the_trunk(model, state):
    """The head's KV after decoding == a head fed the trunk's features of every position:
    no entry computed from chained draft features survived the rollbacks. (Tolerance: the
    reference runs the whole sequence through chunked Gated DeltaNet, decode steps did not.)"""
    track = state.mtp
    track.flush(model.net)
    tokens = state.tokens
    ref_state = model.new_state()
    feats = model.forward_features(tokens, ref_state)
    ref = model.net.make_mtp_state()
    mx.eval(model.net.mtp_advance(feats[:-1], mx.array(tokens[1:]), ref))
    assert track.positions == list(range(len(tokens) - 1))
    got, want = track.state.snapshot(), ref.snapshot()
    assert got.keys() == want.keys()
    for name in want:
        a, b = np.array(got[name].astype(mx.float32)), np.array(want[name].astype(mx.float32))
        assert a.shape == b.shape and np.allclose(a, b, atol=1e-4, rtol=1e-4), name


@pytest.mark.parametrize("which", ["hybrid", "flash"])
def test_mtp_drafts_equal_plain_and_roll_back_the_head(request, mtp_oracle, which):
    model = request.getfixturevalue(which)
    for seed in range(2):
        prompt = np.random.default_rng(seed + 10).integers(3, 200, 11).tolist()
        plain, _ = run(model, prompt, 28, stop_token_ids=[], draft="off")
        mtp_oracle(prompt, plain, seed)
        state = model.new_state()
        params = SamplingParams(max_tokens=28, stop_token_ids=[])
        stream = model.run(prompt, state, params, DraftOptions("mtp", 3))
        assert list(stream) == plain
        assert 0 < stream.stats.accepted < stream.stats.drafted
        # the last token was decided, not fed: the state holds prompt + all but it
        assert state.tokens == prompt + plain[:-1]
        mtp_history_matches_the_trunk(model, state)


def test_mtp_is_the_default_for_a_model_with_a_head(hybrid):
    prompt = [9, 8, 7, 6]
    plain, _ = run(hybrid, prompt, 12, stop_token_ids=[], draft="off")
    spec, stats = run(hybrid, prompt, 12, stop_token_ids=[])
    assert spec == plain and stats.draft == "mtp" and stats.drafted > 0


# ----- the Quest gate ------------------------------------------------------------------------
QUEST = {"kv_paged": "on", "kv_page_tokens": 4, "kv_topk": 16, "kv_sinks": 4, "kv_recent": 4}


def test_quest_gate_keeps_the_sparse_stream(dense, oracle, monkeypatch):
    """Budget 4 pages of 4 tokens: decode reads every page up to 16 tokens, then selects.
    With the gate, rounds stop before the crossover and the stream is the plain sparse one;
    without it (rounds continuing in the sparse tail) the stream drifts."""
    prompt = np.random.default_rng(2).integers(3, 200, 6).tolist()
    opts = {**QUEST, "stop_token_ids": []}
    plain, pstats = run(dense, prompt, 48, **opts)
    assert pstats.kv["sparse_steps"] > 0  # the plain stream really went sparse
    oracle(prompt, plain, bad=0.2)
    spec, stats = run(dense, prompt, 48, **NGRAM, **opts)
    assert spec == plain
    assert stats.accepted > 0 and stats.gate_closed_at is not None
    assert stats.gate_closed_at <= 16

    monkeypatch.setattr(speculative, "gate_open", lambda state, through: True)
    oracle(prompt, plain, bad=0.2)
    ungated, _ = run(dense, prompt, 48, **NGRAM, **opts)
    assert ungated != plain


def test_mtp_rounds_under_quest_and_past_the_qsa_threshold(hybrid, flash, mtp_oracle):
    """MTP drafts: qwen3_5 with paged KV + Quest across the sparse crossover (the gate closes
    the rounds), Flash-Next with a prompt deep in QSA's sparse regime (rounds go on)."""
    cases = ((hybrid, 6, {**QUEST}), (flash, 120, {}))
    for model, n_prompt, kv in cases:
        prompt = np.random.default_rng(n_prompt).integers(3, 200, n_prompt).tolist()
        plain, _ = run(model, prompt, 32, stop_token_ids=[], draft="off", **kv)
        mtp_oracle(prompt, plain)
        spec, stats = run(model, prompt, 32, stop_token_ids=[], draft="mtp", **kv)
        assert spec == plain and stats.accepted > 0
        assert (stats.gate_closed_at is not None) == bool(kv)


def test_quest_auto_mode_and_dense_through():
    from qwen38_backend.kv.paged import PagedKV

    on = PagedKV(page_tokens=4, budget=16, sinks=4, recent=4)
    assert on.dense_through(16) and not on.dense_through(17)
    auto = PagedKV(page_tokens=4, budget=16, sinks=4, recent=4, mode="auto")
    assert auto.dense_through(4 * 16 - 1) and not auto.dense_through(4 * 16)
    assert not PagedKV(page_tokens=4, always_select=True).dense_through(1)


# ----- sampling ------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_seeded_sampling_is_the_plain_stream(request, oracle, which):
    model = request.getfixturevalue(which)
    prompt = np.random.default_rng(4).integers(3, 200, 8).tolist()
    for seed in range(3):
        opts = {"stop_token_ids": [], "temperature": 0.7, "top_k": 20, "seed": seed}
        plain, _ = run(model, prompt, 24, **opts, draft="off")
        oracle(prompt, plain, seed)
        spec, stats = run(model, prompt, 24, **opts, **NGRAM)
        assert spec == plain and 0 < stats.accepted < stats.drafted


def exact_probs(model, ids, params):
    """The plain sampler's distribution after `ids` (temperature, top_k), float64 [vocab]."""
    logits = mx.array(model.logits(ids)[-1])
    lp = logits / params.temperature
    lp = filter_logprobs(lp - mx.logsumexp(lp), params.top_k, params.top_p, params.min_p)
    p = np.exp(np.array(lp, dtype=np.float64))
    return p / p.sum()


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Wilson-Hilferty upper quantile of chi-square (z = 3.09: p = 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: np.ndarray, expected: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic with cells of expected count < 5 pooled."""
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def test_sampling_with_drafts_matches_the_model_distribution(dense, monkeypatch):
    """Joint frequencies of the first two sampled tokens over many seeds, drafting the most
    likely second token (accepted when the sampler agrees, else the round's own token), fit
    the model's exact joint distribution and the plain sampler's frequencies (chi-square,
    p = 0.001); the same test rejects a distribution at another temperature."""
    prompt = [17, 42, 99, 5]
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=6, stop_token_ids=[])
    p1 = exact_probs(dense, prompt, params)
    firsts = np.nonzero(p1)[0]
    cond = {int(t): exact_probs(dense, prompt + [int(t)], params) for t in firsts}
    best = {t: int(np.argmax(p)) for t, p in cond.items()}
    use_drafts(monkeypatch, lambda tokens, k: [best[tokens[-1]]])
    vocab = p1.shape[0]
    joint = np.zeros((vocab, vocab))
    for t, p in cond.items():
        joint[t] = p1[t] * p
    n = 800
    counts = {"ngram": np.zeros((vocab, vocab)), "off": np.zeros((vocab, vocab))}
    drafted = accepted = 0
    for mode, offset in (("ngram", 0), ("off", 10**6)):
        for seed in range(n):
            toks, stats = run(  # 3 tokens: room for a one-token draft after the first
                dense, prompt, 3, stop_token_ids=[], temperature=1.0, top_k=6,
                seed=seed + offset, draft=mode,
            )  # fmt: skip
            counts[mode][toks[0], toks[1]] += 1
            if mode == "ngram":
                drafted, accepted = drafted + stats.drafted, accepted + stats.accepted
    assert drafted >= n and 0.1 * n < accepted < 0.9 * n  # both branches taken often
    stat, df = chi2(counts["ngram"].ravel(), n * joint.ravel())
    assert stat < chi2_critical(df), (stat, df)
    # two samples (drafts vs plain, independent seeds): contingency chi-square
    both = counts["ngram"].ravel() + counts["off"].ravel()
    cells = both >= 10
    table = np.stack([counts["ngram"].ravel()[cells], counts["off"].ravel()[cells]])
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    stat2 = float(((table - expected) ** 2 / expected).sum())
    assert stat2 < chi2_critical(int(cells.sum()) - 1), stat2
    # power: the same counts against the distribution at temperature 0.7 fail
    hot = SamplingParams(max_tokens=2, temperature=0.7, top_k=6)
    q1 = exact_probs(dense, prompt, hot)
    wrong = np.zeros((vocab, vocab))
    for t in np.nonzero(q1)[0]:
        wrong[t] = q1[t] * exact_probs(dense, prompt + [int(t)], hot)
    stat3, df3 = chi2(counts["ngram"].ravel(), n * wrong.ravel())
    assert stat3 > chi2_critical(df3), (stat3, df3)


# ----- the throttle --------------------------------------------------------------------------
def test_throttle_pauses_losing_drafts_and_doubles():
    t = Throttle()
    for i in range(speculative.WINDOW):
        assert t.allows(i)
        t.record(i, -0.3)
    assert t.pauses == 1 and not t.allows(8) and t.allows(8 + speculative.FIRST_PAUSE)
    t.record(30, 3.0)  # winning rounds never pause
    for i in range(speculative.WINDOW - 1):
        t.record(31 + i, -0.3)
    assert t.pauses == 1  # the winning round outweighs the window's losing ones
    # windows do not overlap: a losing run right after a winning window pauses only once it
    # fills a window of its own
    for i in range(speculative.WINDOW - 1):
        t.record(40 + i, -0.3)
        assert t.pauses == 1
    t.record(50, -0.3)
    # the winning window reset the pause: a stream that pays again is re-checked soon
    assert t.pauses == 2 and t.resume_at == 50 + speculative.FIRST_PAUSE


def test_throttle_pause_doubles_up_to_a_cap_while_drafts_keep_losing():
    """Losing windows back to back double the pause up to MAX_PAUSE, so drafting is tried
    again at least that often (a copied span after prose is found; benchmarks/throttle_sim.py:
    streams alternating p 0.2 / 0.9 every 64 tokens 1.00x -> 1.06x, a stream that always
    loses at p 0.2 0.986x -> 0.975x, 512 tokens, H200 round costs)."""
    t, n, pauses = Throttle(), 0, []
    for _ in range(8):
        while not t.allows(n):
            n += 1
        start = n
        for _ in range(speculative.WINDOW):
            t.record(n, -0.3)
            n += 1
        pauses.append(t.resume_at - (n - 1))
        assert start < n
    first, cap = speculative.FIRST_PAUSE, speculative.MAX_PAUSE
    assert pauses[:3] == [first, 2 * first, 4 * first] and max(pauses) == cap
    assert pauses[-1] == cap and t.pauses == 8


def test_draft_length_follows_the_streams_agreement():
    """k starts at the most allowed, drops to 1 while first drafts keep failing, and comes
    back when they agree again."""
    length = DraftLength(4, lambda k: speculative.verify_cost(k + 1, gpu=True))
    assert length.next() == 4
    for _ in range(10):
        length.record(4, 0)
    assert length.next() == 1
    for _ in range(10):
        length.record(1, 1)
    assert length.next() == 4


@pytest.mark.parametrize(
    ("device", "p"), [("gpu", 0.65), ("gpu", 0.8), ("cpu", 0.2), ("cpu", 0.65)]
)
def test_draft_length_spends_fewer_steps_than_the_fixed_rule(device, p):
    """On simulated streams where each draft token agrees with probability p, drafting k by
    DraftLength decides more tokens per step spent than the rule it replaced (k, but one
    token after a round whose first draft failed), at each device's measured round costs."""
    import random

    def cost(k):
        return speculative.verify_cost(k + 1, gpu=device == "gpu")

    def tokens_per_step(choose, record) -> float:
        rng, tokens, spent, last = random.Random(7), 0, 0.0, None
        for _ in range(4000):
            k = choose(last)
            accepted = 0
            while accepted < k and rng.random() < p:
                accepted += 1
            record(k, accepted)
            tokens, spent, last = tokens + accepted + 1, spent + cost(k), accepted
        return tokens / spent

    fixed = tokens_per_step(lambda last: 1 if last == 0 else 4, lambda k, a: None)
    length = DraftLength(4, cost)
    adaptive = tokens_per_step(lambda last: length.next(), length.record)
    assert adaptive >= fixed * (1.03 if (device, p) == ("gpu", 0.65) else 0.99)


def test_round_costs_are_the_devices_own():
    """Rounds of 5 rows keeping 1.7 tokens each lose against plain steps on this CPU (a
    5-row verify ~1.8 steps) and win on the H200, where a 5-row round costs ~1.5 plain steps
    (measured end to end: speculative.verify_cost): the throttle pauses only the CPU."""
    cpu, gpu = Throttle(), Throttle()
    for i in range(speculative.WINDOW):
        cpu.record(i, 1.7 - speculative.verify_cost(5, gpu=False))
        gpu.record(i, 1.7 - speculative.verify_cost(5, gpu=True))
    assert cpu.pauses == 1 and gpu.pauses == 0
    assert speculative.verify_cost(1, gpu=True) == 1.0
    assert speculative.verify_cost(3) == speculative.verify_cost(3, gpu=False)  # this CPU
    # a quantized GPU verify reads its weights once per row: even k 1 at acceptance 0.7
    # (1.7 tokens a round) loses there, and pauses
    per_row = Throttle()
    for i in range(speculative.WINDOW):
        per_row.record(i, 1.7 - speculative.verify_cost(2, gpu=True, weights_per_row=True))
    assert per_row.pauses == 1
    assert speculative.verify_cost(2, gpu=False, weights_per_row=True) == speculative.verify_cost(
        2, gpu=False
    )


def test_always_wrong_drafts_stop_being_drafted(dense, monkeypatch):
    use_drafts(monkeypatch, lambda tokens, k: [1] * k)
    prompt = [3, 4, 5]
    plain, _ = run(dense, prompt, 120, stop_token_ids=[], draft="off")
    assert 1 not in plain
    spec, stats = run(dense, prompt, 120, stop_token_ids=[], **NGRAM)
    assert spec == plain and stats.accepted == 0 and stats.throttle_pauses >= 2
    # rounds: WINDOW before each pause; pauses of 16, 32, 64 tokens leave few in 120
    assert stats.drafted <= 4 * speculative.WINDOW + 4


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_paused_drafting_decodes_pipelined(request, monkeypatch, which):
    """While the throttle pauses drafting, plain steps run as Model.decode's: the step that
    feeds a token is queued before the token is handed out (the device never waits for the
    host between them). The stream is still the plain one, the last token unfed, and the
    MTP head was fed every position of the run."""
    model = request.getfixturevalue(which)
    prompt = [3, 4, 5]
    plain, _ = run(model, prompt, 80, stop_token_ids=[], draft="off")
    wrong = [(t + 1) % 200 for t in plain]
    if which == "dense":
        use_drafts(monkeypatch, lambda tokens, k: wrong[len(tokens) - 3 : len(tokens) - 3 + k])
        options = DraftOptions("ngram", 2)
    else:
        real = drafts.MTPTrack.draft

        def draft(self, net, next_token, k):
            _, keep = real(self, net, next_token, k)
            done = self.seen - len(prompt) + 1
            return wrong[done : done + k], keep

        monkeypatch.setattr(drafts.MTPTrack, "draft", draft)
        options = DraftOptions("mtp", 2)
    state = model.new_state()
    stream = model.run(prompt, state, SamplingParams(max_tokens=80, stop_token_ids=[]), options)
    ahead = []
    for n, _token in enumerate(stream, 1):
        ahead.append(state.offset - len(prompt) - n)  # 0: already fed, -1: not yet
    stats = stream.stats
    assert [t for t in state.tokens[len(prompt) :]] + [_token] == plain
    assert stats.accepted == 0 and stats.throttle_pauses >= 1
    # the first pause's run hands out its tokens fed already (all but its last)
    assert ahead.count(0) >= speculative.FIRST_PAUSE - 1, ahead
    if which == "hybrid":
        mtp_history_matches_the_trunk(model, state)


def test_tokens_keep_their_order_when_fed_ids_follow_unread_ones():
    """A plain run feeds tokens still on the device; a round or the next run then feeds host
    ids: the sequence's token record keeps the order they were fed in (an ordered record
    is what prefix reuse matches against)."""
    from qwen38_backend.state import SequenceState

    state = SequenceState([])
    state.advance([1, 2])
    state.advance(mx.array([3], dtype=mx.uint32))
    state.advance([4])
    state.advance(mx.array([5, 6]))
    state.advance([7])
    assert state.offset == 7 and state.tokens == [1, 2, 3, 4, 5, 6, 7]


def test_drafted_stream_records_what_it_fed(dense, monkeypatch):
    """Drafting that keeps failing runs plain steps with tokens still on the device (a
    paused throttle, a lookup ending a run), and near max_tokens (no room for a draft) feeds
    host ids after them: the state's tokens are the prompt and every token but the last, in
    order, at every length (a follow-up reused a scrambled record and answered differently
    from a cold run)."""
    use_drafts(monkeypatch, lambda tokens, k: [1] * k)  # never right: rounds, pauses, runs
    prompt = [124]
    plain, _ = run(dense, prompt, 40, stop_token_ids=[], draft="off")
    assert 1 not in plain
    for n in range(2, 41):
        state = dense.new_state()
        params = SamplingParams(max_tokens=n, stop_token_ids=[])
        tokens = list(dense.run(prompt, state, params, DraftOptions("ngram", 3)))
        assert tokens == plain[:n]
        assert state.tokens == prompt + tokens[:-1], n


# ----- sessions: text, rewind, state files ---------------------------------------------------
def test_session_text_and_fallbacks(dense):
    session = dense.session(cache=False)
    prompt = "one two three one two three one two three one two"

    def text(**options):
        events = list(session.generate(prompt, max_tokens=24, **options))
        return "".join(e.text or "" for e in events if e.type == "text")

    plain = text()
    assert text(draft="ngram", draft_tokens=3) == plain
    assert session.last_stats.draft == "ngram"
    # logits processors (constraints) decode plainly (no rounds)
    text(draft="ngram", logits_processors=[lambda history, logits: logits])
    assert session.last_stats.draft is None and session.last_stats.forwards == 0


@pytest.mark.parametrize(
    ("which", "mode"), [("dense", "ngram"), ("hybrid", "mtp"), ("flash", "mtp")]
)
def test_after_rewind_and_after_restoring_a_state_file(request, tmp_path, which, mode):
    model = request.getfixturevalue(which)
    first = repetitive(1, period=4, repeats=3)
    more = repetitive(2, period=4, repeats=2)

    def turns(draft, store_dir):
        session = model.session(cache=PrefixStore(store_dir))
        opts = {"max_tokens": 16, "stop_token_ids": [], "draft": draft}
        list(session.generate(first, **opts))
        after_first = session.state.tokens
        session.rewind(session.state.offset - len(first))  # to the prompt boundary
        params = SamplingParams(16, stop_token_ids=[])
        second = list(model.run(more, session.state, params, resolve(DraftOptions(draft), model)))
        # a fresh session restores the state file stored for the first prompt
        fresh = model.session(cache=PrefixStore(store_dir))
        list(fresh.generate(first + [7], **opts))
        return after_first, second, fresh.last_stats.cached_tokens, fresh.state.tokens

    plain = turns("off", tmp_path / "plain")
    spec = turns(mode, tmp_path / "spec")
    assert spec == plain
    assert spec[2] == len(first)  # the third turn started from a restored state file


# ----- the MTP head's history is part of the state --------------------------------------------
def record_drafts(monkeypatch) -> list[tuple[int, int, list[int]]]:
    """Every MTP proposal from now on: (trunk position, token drafted after, draft tokens)."""
    log: list[tuple[int, int, list[int]]] = []
    real = drafts.MTPTrack.draft

    def draft(self, net, next_token, k):
        out, keep = real(self, net, next_token, k)
        log.append((self.seen, next_token, list(out)))
        return out, keep

    monkeypatch.setattr(drafts.MTPTrack, "draft", draft)
    return log


def head_history(state) -> dict[str, np.ndarray]:
    """The MTP track's snapshot as numpy (head KV and offset, positions, seen, features)."""
    snap = state.mtp.snapshot() or {}
    return {
        k: np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v) for k, v in snap.items()
    }


def assert_same_history(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    assert "positions" in want and len(want["positions"]) > 0
    for name in want:
        assert got[name].shape == want[name].shape and np.array_equal(got[name], want[name]), name


@pytest.mark.parametrize("which", ["hybrid", "flash"])
def test_mtp_history_survives_a_state_file(request, tmp_path, monkeypatch, which):
    """A follow-up restored from a state file in a fresh session (an empty memory tier: the
    file is read) drafts what the session that ran on drafts: the same proposals at the same
    positions, and the same head KV, bit for bit; the tokens are the plain ones."""
    model = request.getfixturevalue(which)
    log = record_drafts(monkeypatch)
    rng = np.random.default_rng(21)
    first, more = rng.integers(3, 200, 13).tolist(), rng.integers(3, 200, 6).tolist()

    def follow_up(session, ids, opts):
        log.clear()
        events = list(session.generate(ids, **opts))
        text = "".join(e.text or "" for e in events if e.type == "text")
        return text, list(log), head_history(session.state)

    def turns(draft, store_dir):
        opts = {"max_tokens": 12, "stop_token_ids": [], "draft": draft}
        went_on = model.session(cache=PrefixStore(store_dir))
        list(went_on.generate(first, **opts))
        ids = went_on.state.tokens + more  # the stored final state is a prefix of it
        want = follow_up(went_on, ids, opts)  # the live state: nothing restored
        fresh = model.session(cache=PrefixStore(store_dir))
        got = follow_up(fresh, ids, opts)
        assert fresh.last_stats.cached_tokens == len(ids) - len(more)
        return want, got

    want, got = turns("mtp", tmp_path / "mtp")
    assert got[1] == want[1] and len(want[1]) > 1
    assert_same_history(got[2], want[2])
    plain_want, plain_got = turns("off", tmp_path / "off")
    assert got[0] == want[0] == plain_want[0] == plain_got[0]


@pytest.mark.parametrize("which", ["hybrid", "flash"])
def test_mtp_history_survives_a_rewind_to_a_stored_boundary(request, monkeypatch, which):
    """Rewound to the prompt boundary after decoding, the head drafts the next prompt's
    continuation as a session that stopped at that boundary does (the save point keeps the
    features of its last position); the tokens are the plain ones."""
    model = request.getfixturevalue(which)
    log = record_drafts(monkeypatch)
    rng = np.random.default_rng(22)
    first, more = rng.integers(3, 200, 13).tolist(), rng.integers(3, 200, 6).tolist()
    params = SamplingParams(max_tokens=12, stop_token_ids=[])

    def at_boundary(draft, n):
        session = model.session(cache=False)
        list(session.generate(first, max_tokens=n, stop_token_ids=[], draft=draft))
        session.rewind(session.state.offset - len(first))  # n=1: nothing was fed after it
        return session.state

    def run_more(state, draft):
        log.clear()
        out = list(model.run(more, state, params, resolve(DraftOptions(draft), model)))
        return out, list(log), head_history(state)

    got = run_more(at_boundary("mtp", 12), "mtp")
    want = run_more(at_boundary("mtp", 1), "mtp")
    assert got[1] == want[1] and len(want[1]) > 1
    assert_same_history(got[2], want[2])
    plain = run_more(at_boundary("off", 12), "off")
    assert got[0] == want[0] == plain[0]


# ----- the premise and cancel ----------------------------------------------------------------
def test_few_row_products_are_padded(monkeypatch):
    """rows.project pads a product of fewer than pad_rows() rows (a GPU's 8) and returns the
    caller's rows; on the CPU each row of a step is a product of its own (OpenBLAS picks its
    kernel by the row count), padded alone."""
    import mlx.nn as nn

    seen = []

    class Counted(nn.Linear):
        def __call__(self, x):
            seen.append(x.shape[0])
            return super().__call__(x)

    linear = Counted(6, 5)
    x = mx.random.normal((3, 6), key=mx.random.key(0))
    rows.prepare(mx.float32)  # a forward decides its padding once
    assert rows.pad_rows() == 1 and rows.forward_pad() == 1  # the CPU pads nothing
    assert rows.split_rows()  # but computes a step's rows one by one
    want = rows.project(linear, x)
    assert seen == [1, 1, 1]
    alone = mx.concatenate([nn.Linear.__call__(linear, x[i : i + 1]) for i in range(3)])
    assert mx.array_equal(want, alone).item()
    assert rows.project(linear, mx.zeros((17, 6))).shape == (17, 5) and seen[-1] == 17
    monkeypatch.setenv("QWEN38_PAD_ROWS", "8")
    assert rows.project(linear, x).shape == (3, 5) and seen[-1] == 1  # this forward's plan
    rows.prepare(mx.float32)
    got = rows.project(linear, x)
    assert seen[-3:] == [8, 8, 8] and got.shape == (3, 5)  # each row padded alone
    assert mx.allclose(got, want, atol=1e-6).item()
    monkeypatch.setattr(rows, "_splits", lambda: False)  # a GPU's plan: the rows together
    rows.prepare(mx.float32)
    assert rows.project(linear, x).shape == (3, 5) and seen[-1] == 8
    assert rows.project(linear, mx.zeros((9, 6))).shape == (9, 5) and seen[-1] == 9
    assert rows.exact_rows() == 8
    with rows.unpadded():  # a family that never verifies on a GPU keeps one-row products
        rows.project(linear, x)
    assert seen[-1] == 3 and rows.pad_rows() == 8
    monkeypatch.undo()
    rows.prepare(mx.float32)  # the next forward here plans for the CPU again


def test_cpu_steps_split_only_the_products_whose_rows_differ():
    """On the CPU `rows.prepare(dtype, net, rows)` probes each distinct linear of the net for
    that row count: a product whose rows differ from one-row products runs row by row (the
    plain step's call per row), one whose rows agree runs whole; prefill-sized forwards and
    one-row steps split nothing."""
    import mlx.nn as nn

    seen = []

    class RowInvariant(nn.Linear):  # each row reduced on its own: the same bits at any count
        def __call__(self, x):
            seen.append(("inv", x.shape[0]))
            return (x[:, None, :] * self.weight[None]).sum(-1)

    class RowDependent(nn.Linear):  # a kernel picked by the row count (as OpenBLAS does)
        def __call__(self, x):
            seen.append(("dep", x.shape[0]))
            return x @ self.weight.T + 1e-3 * x.shape[0]

    net = nn.Module()
    net.a, net.b = RowInvariant(6, 5), RowDependent(6, 4)
    x = mx.random.normal((3, 6), key=mx.random.key(1))
    rows.prepare(mx.float32, net, 3)
    try:
        split = rows.split_rows()
        assert split == frozenset({rows._linear_key(net.b)}), split
        seen.clear()
        whole, by_row = rows.project(net.a, x), rows.project(net.b, x)
        assert seen == [("inv", 3), ("dep", 1), ("dep", 1), ("dep", 1)]
        alone = mx.concatenate([net.b(x[i : i + 1]) for i in range(3)])
        assert mx.array_equal(by_row, alone).item()
        assert mx.array_equal(whole, mx.concatenate([net.a(x[i : i + 1]) for i in range(3)])).item()
        for n in (1, 17):  # a one-row step, a prefill chunk: nothing to split
            rows.prepare(mx.float32, net, n)
            assert rows.split_rows() is None
    finally:
        rows.prepare(mx.float32)


def test_step_products_go_to_the_rows_kernel_where_chosen(monkeypatch):
    """Where `rows.prepare` chose the row-invariant kernel (CUDA; here a stand-in computing
    each row alone), a step's unquantized products go through it with their weight (a
    Linear's, biased or not, or a tied embedding's), any leading shape; quantized products,
    other dtypes and prefill-sized products do not."""
    import mlx.nn as nn

    from qwen38_backend.kernel_import import kernel_module

    kernels = kernel_module("rows_matmul")
    calls = []

    def row_by_row(x, w):  # each row on its own: what the kernel promises
        calls.append((x.shape, w.shape))
        return mx.concatenate([x[i : i + 1] @ w.T for i in range(x.shape[0])])

    monkeypatch.setattr(kernels, "rows_matmul", row_by_row)
    monkeypatch.setattr(kernels, "available", lambda dtype: dtype == mx.float32)
    for epilogues in ("epilogues_available", "gates_available", "mix_available"):
        monkeypatch.setattr(kernels, epilogues, lambda dtype: False)  # plain products
    biased, plain = nn.Linear(8, 5), nn.Linear(8, 5, bias=False)
    embedding = nn.Embedding(7, 8)
    quantized = nn.QuantizedLinear.from_linear(nn.Linear(64, 32), group_size=32, bits=4)
    x = mx.random.normal((3, 8), key=mx.random.key(1))
    rows.prepare(mx.float32)
    assert rows.kernel_dtype() == mx.float32
    for linear in (biased, plain, embedding.as_linear):
        want = linear(x)
        assert mx.allclose(rows.project(linear, x), want, atol=1e-6).item()
    assert rows.project(plain, x.reshape(3, 1, 8)).shape == (3, 1, 5)
    assert [w for _, w in calls] == [(5, 8), (5, 8), (7, 8), (5, 8)]
    assert calls[-1][0] == (3, 8)
    before = len(calls)
    rows.project(quantized, mx.zeros((3, 64)))
    rows.project(plain, x.astype(mx.float16))
    rows.project(plain, mx.zeros((rows.STEP_MAX_ROWS + 1, 8)))
    assert len(calls) == before
    rows.prepare(mx.float16)  # the probe said no: nothing goes to the kernel
    assert rows.kernel_dtype() is None
    rows.project(plain, x)
    assert len(calls) == before


@pytest.mark.parametrize(
    ("which", "kv"),
    [
        ("dense", {}),
        ("dense", {"kv_paged": "on", "kv_page_tokens": 4}),
        ("hybrid", {}),
        ("flash", {}),
    ],
)
def test_verify_rows_equal_single_steps_on_cpu(request, which, kv, pad):
    """The premise: a verify forward of T tokens gives, row for row, the logits of T single
    steps, bit for bit, on the CPU (the paged store and Gated DeltaNet layers included),
    also with few-row products padded as on a GPU (rows.py)."""
    model = request.getfixturevalue(which)
    prefix, tail = list(range(3, 40)), [7, 8, 9, 10, 11]
    one = model.new_state(**kv)
    many = model.new_state(**kv)
    model.prefill(prefix, one)
    model.prefill(prefix, many)
    steps = [np.array(model.forward([t], one)[-1].astype(mx.float32)) for t in tail]
    feats = model.forward_features(tail, many)
    rows = np.array(model.net.logits_from_features(feats).astype(mx.float32))
    for i, step in enumerate(steps):
        assert np.array_equal(rows[i], step), f"row {i} differs"


def test_flash_next_past_the_qsa_dense_threshold(flash, oracle):
    # the tiny config selects 2 blocks of 4 tokens: a 120-token prompt is deep in the sparse
    # regime, where each verify row selects its own blocks as a single step would
    prompt = np.random.default_rng(5).integers(3, 200, 120).tolist()
    plain, _ = run(flash, prompt, 24, stop_token_ids=[], draft="off")
    oracle(prompt, plain)
    spec, stats = run(flash, prompt, 24, stop_token_ids=[], **NGRAM)
    assert spec == plain
    assert 0 < stats.accepted < stats.drafted


def test_cancel_ends_after_the_current_token(dense, oracle):
    prompt = [31, 32, 33, 34]
    full, _ = run(dense, prompt, 30, stop_token_ids=[])
    oracle(prompt, full)
    cancel = threading.Event()
    stats = GenerationStats()
    state = dense.new_state()
    logits = dense.prefill(prompt, state)
    got = []
    params = SamplingParams(max_tokens=30, stop_token_ids=[])
    for token in dense.decode(
        logits, state, params, stats, cancel=cancel, draft=DraftOptions("ngram", 4)
    ):
        got.append(token)
        if len(got) == 3:
            cancel.set()
    assert got == full[:3] and stats.finish_reason == "cancelled"


def test_quantized_products_run_unpadded_where_their_rows_are_exact(monkeypatch):
    """Where products are padded (a GPU's plan), a quantized linear runs unpadded when the
    probe finds each of its rows equal to the one-row product for 2..R rows: a plain step
    keeps the one-row kernel and a verify has at most R rows (`exact_rows`). A quantized
    product whose rows differ from 2 rows on keeps every quantized product padded."""
    import mlx.nn as nn

    seen = []

    def linear(differs_from: int):
        class Probed(nn.QuantizedLinear):  # a kernel chosen by the row count, as MLX's qmm
            def __call__(self, x):
                seen.append(x.shape[0])
                y = super().__call__(x)
                return y + 1e-3 if x.shape[0] >= differs_from else y

        layer = Probed(64, 32 + differs_from, group_size=32, bits=4)  # one key per layer
        return layer

    monkeypatch.setenv("QWEN38_PAD_ROWS", "8")
    monkeypatch.setattr(rows, "_splits", lambda: False)  # a GPU's plan: rows together
    x = mx.random.normal((1, 64), key=mx.random.key(2))

    net = nn.Module()
    net.a, net.b, net.dense = linear(99), linear(4), nn.Linear(64, 8)
    assert rows.quantized_plan(net, mx.float32)[::2] == ("unpadded", 3)
    assert rows.exact_rows(net, mx.float32) == 3 and rows.exact_rows() == 8
    rows.prepare(mx.float32, net, 1)
    seen.clear()
    rows.project(net.a, x)
    rows.project(net.b, mx.concatenate([x, x, x]))
    assert seen == [1, 3]  # not padded
    bad = nn.Module()
    bad.a, bad.b = linear(99), linear(2)
    assert rows.quantized_plan(bad, mx.float32) == ("", frozenset(), 0)
    assert rows.exact_rows(bad, mx.float32) == 8
    rows.prepare(mx.float32, bad, 1)
    seen.clear()
    rows.project(bad.a, x)
    assert seen == [8]  # padded, as before
    monkeypatch.undo()
    rows.prepare(mx.float32)


def test_quantized_model_drafts_equal_plain_with_a_gpus_padding(tmp_path, monkeypatch, oracle):
    """A 4-bit tiny qwen3_5 under a GPU's padding plan: its quantized products run unpadded
    (the probe finds their rows exact here), so plain steps use one-row products, and drafted
    greedy output still equals plain, token for token."""
    model = quantized_hybrid(tmp_path)
    monkeypatch.setenv("QWEN38_PAD_ROWS", "8")
    mode, keys, most = rows.quantized_plan(model.net, model.dtype)
    # MLX's CPU quantized product computes each row alone (no rows kernel on the CPU)
    assert mode == "unpadded" and keys and most == 8
    assert speculative.verify_rows(model) == 8
    prompt = [5, 9, 13, 17, 21, 25, 29]
    plain, _ = run(model, prompt, 24, stop_token_ids=[], draft="off")
    oracle(prompt, plain, 0)
    spec, stats = run(model, prompt, 24, stop_token_ids=[], **NGRAM)
    assert spec == plain and 0 < stats.accepted < stats.drafted


def test_auto_does_not_draft_where_verify_rows_read_the_weights_each(hybrid, monkeypatch):
    """Where a verify reads the weights once per row (a GPU's unpadded quantized products),
    no draft length pays (verify_cost): auto decodes plainly, an explicit choice still drafts
    with one token by default."""
    monkeypatch.setattr(speculative, "reads_weights_per_row", lambda model: True)
    assert resolve(parse_options({}), hybrid) is None
    assert resolve(parse_options({"draft": "mtp"}), hybrid) == DraftOptions("mtp", 1)
    assert resolve(parse_options({"draft": "ngram"}), hybrid) == DraftOptions("ngram", 1)
    monkeypatch.undo()
    assert resolve(parse_options({}), hybrid) == DraftOptions("mtp", 2)


def test_integrations_bound_draft_tokens_as_the_engine_does():
    """llm's and LangChain's option fields refuse what the engine refuses (a k over
    MAX_TOKENS), before any work."""
    import pydantic
    from langchain_qwen38 import chat_models
    from llm_qwen38 import MAX_DRAFT_TOKENS, Qwen38

    assert MAX_DRAFT_TOKENS == chat_models.MAX_DRAFT_TOKENS == speculative.MAX_TOKENS
    Qwen38.Options(draft_tokens=speculative.MAX_TOKENS)
    with pytest.raises(pydantic.ValidationError):
        Qwen38.Options(draft_tokens=speculative.MAX_TOKENS + 1)


def test_a_stream_with_nothing_to_draft_reports_one_token_per_forward(dense):
    """n-gram mode where no lookup ever matches decodes by plain steps: one token per forward,
    as plain decoding reports (the step in flight when the stream stops is not counted; it
    made `qwen38 run --draft ngram --stats` print 0.91 tokens per forward)."""
    prompt = [3, 4, 5]
    plain, _ = run(dense, prompt, 12, stop_token_ids=[])
    stop = plain[6]  # a stop token ends the run with the next step in flight
    assert stop not in plain[:6]
    tokens, stats = run(dense, prompt, 12, stop_token_ids=[stop], draft="ngram")
    assert stats.drafted == 0  # this fixture's stream never repeats a token pair
    assert tokens == plain[:7] and stats.forwards == len(tokens) - 1
    assert stats.tokens_per_forward == 1.0


def test_an_unpadded_step_splits_its_rows_where_rows_are_not_split(monkeypatch):
    """On a GPU (no split by default) a step of a few rows built unpadded (Flash-Next keeps
    its one-row kernels) runs every product the row-invariant kernel does not take one row at
    a time, as its plain steps run them; a one-row step, a prefill chunk and a padded step
    do not."""
    monkeypatch.setattr(rows, "_splits", lambda: False)
    with rows.unpadded():
        assert rows._split_plan(mx.float32, None, 5) == "all"
        assert rows._split_plan(mx.float32, None, 1) is None
        assert rows._split_plan(mx.float32, None, rows.STEP_MAX_ROWS + 1) is None
    assert rows._split_plan(mx.float32, None, 5) is None
