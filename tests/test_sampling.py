"""Sampling filters against a numpy reference, seeds, and option validation."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import dense_fixture

import qwen38_backend
from qwen38_backend.errors import InvalidOptionError
from qwen38_backend.sampling import Sampler, SamplingParams, filter_logprobs


def numpy_filter(logits: np.ndarray, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Straightforward reference: the set of tokens each filter keeps."""
    lp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    keep = np.ones_like(lp, dtype=bool)
    if top_k:
        kth = np.sort(lp)[-top_k]
        keep &= lp >= kth
    if min_p:
        keep &= np.exp(lp) >= min_p * np.exp(lp.max())
    if top_p < 1:
        order = np.argsort(-np.where(keep, lp, -np.inf), kind="stable")
        probs = np.exp(np.where(keep, lp, -np.inf))[order]
        mass_before = np.cumsum(probs) - probs
        nucleus = np.zeros_like(keep)
        nucleus[order[mass_before < top_p]] = True
        keep &= nucleus
    return keep


@pytest.mark.parametrize(
    "top_k,top_p,min_p", [(5, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.1), (20, 0.9, 0.05)]
)
def test_filters_keep_the_reference_set(top_k, top_p, min_p):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=200).astype(np.float32) * 3
    lp = mx.array(logits) - mx.logsumexp(mx.array(logits))
    ours = np.isfinite(np.array(filter_logprobs(lp, top_k, top_p, min_p)))
    assert (ours == numpy_filter(logits, top_k, top_p, min_p)).all()


def test_sampling_frequencies_follow_softmax():
    logits = mx.array([2.0, 1.0, 0.0, -1.0])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    draws = np.array([int(sampler(logits).item()) for _ in range(4000)])
    freq = np.bincount(draws, minlength=4) / len(draws)
    expected = np.exp([2.0, 1.0, 0.0, -1.0])
    expected /= expected.sum()
    assert np.abs(freq - expected).max() < 0.03


def test_same_seed_same_stream_different_seed_differs(tmp_path):
    model = qwen38_backend.load(dense_fixture("llama", tmp_path))
    prompt = [5, 9, 40, 41, 42]

    def run(seed):
        return list(
            model.generate_tokens(
                prompt, max_tokens=40, temperature=1.5, seed=seed, stop_token_ids=[]
            )
        )

    assert run(7) == run(7)
    assert run(7) != run(8)


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"min_p": 1.0},
        {"max_tokens": -1},
        {"seed": "x"},
        {"stop": [""]},
        {"stop": 5},  # was a TypeError
        {"stop_token_ids": "x"},  # was accepted over HTTP, and stopped on nothing
        {"stop_token_ids": [1, -2]},
        {"stop_token_ids": [1.5]},
        {"max_tokens": True},
        {"seed": True},
        {"nonsense": 1},
    ],
)
def test_invalid_options_are_refused(options):
    with pytest.raises(InvalidOptionError):
        SamplingParams.from_options(**options)


def test_seed_wins_over_a_reused_states_rng(tmp_path):
    """A seeded call on a state that already carries an RNG key gives the seeded stream."""
    from qwen38_backend.sampling import SamplingParams

    model = qwen38_backend.load(dense_fixture("qwen2", tmp_path))
    prompt = [5, 9, 40]
    fresh = list(
        model.generate_tokens(prompt, max_tokens=20, temperature=1.0, seed=11, stop_token_ids=[])
    )
    state = model.new_state()
    list(
        model.run(
            [1, 2], state, SamplingParams(max_tokens=3, temperature=1.0, seed=3, stop_token_ids=[])
        )
    )
    assert "rng_key" in state.extras
    state.truncate(0)
    reused = list(
        model.run(
            prompt,
            state,
            SamplingParams(max_tokens=20, temperature=1.0, seed=11, stop_token_ids=[]),
        )
    )
    assert reused == fresh
