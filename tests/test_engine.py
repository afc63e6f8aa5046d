"""The decode loop and sessions on a tiny dense model, checked against full forwards."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import dense_fixture

import qwen38_backend
from qwen38_backend.errors import InvalidOptionError


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return qwen38_backend.load(dense_fixture("qwen3", tmp_path_factory.mktemp("m")))


def test_greedy_stream_equals_argmax_of_full_forwards(model):
    prompt = [11, 12, 13, 200, 201]
    ours = list(model.generate_tokens(prompt, max_tokens=24, stop_token_ids=[]))
    ids = list(prompt)
    for _ in range(24):
        ids.append(int(np.argmax(model.logits(ids)[-1])))
    assert ours == ids[len(prompt) :]


def test_max_tokens_and_finish_reasons(model):
    prompt = [11, 12, 13]
    stream = model.generate_tokens(prompt, max_tokens=7, stop_token_ids=[])
    out = list(stream)
    assert len(out) == 7 and stream.stats.finish_reason == "length"
    assert stream.stats.usage() == {"prompt": 3, "cached": 0, "generated": 7}
    # stopping on a token the greedy stream produces at step 4
    stop = out[3]
    stream = model.generate_tokens(prompt, max_tokens=7, stop_token_ids=[stop])
    stopped = list(stream)
    assert stopped == out[: out.index(stop) + 1] and stream.stats.finish_reason == "stop"


def test_rewind_then_regenerate_is_identical(model):
    prompt = [3, 4, 5, 6]
    state = model.new_state()
    from qwen38_backend.sampling import SamplingParams

    first = list(model.run(prompt, state, SamplingParams(max_tokens=30, stop_token_ids=[])))
    # the state holds prompt + first[:-1]; rewind 10 tokens and continue from there
    state.rewind(10)
    kept = state.tokens[len(prompt) :]
    assert kept == first[: len(kept)]
    last = kept[-1]
    state.truncate(state.offset - 1)
    again = list(
        model.run([last], state, SamplingParams(max_tokens=30 - len(kept), stop_token_ids=[]))
    )
    assert kept + again == first


def test_session_text_events_usage_and_prefix_reuse(model):
    session = model.session()
    msgs = [{"role": "user", "content": "hello there"}]
    events = list(session.generate(msgs, max_tokens=12, enable_thinking=False))
    done = events[-1]
    assert done.type == "done" and done.usage["generated"] == 12
    assert done.usage["cached"] == 0
    text = "".join(e.text for e in events if e.type in ("text", "reasoning"))
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]
    done2 = list(session.generate(msgs, max_tokens=5, enable_thinking=False))[-1]
    assert done2.usage["cached"] > 0
    # cached equals the longest common token prefix of the two rendered prompts
    first_ids, _ = session.render(msgs[:1], enable_thinking=False)
    second_ids, _ = session.render(msgs, enable_thinking=False)
    common = 0
    while first_ids[common] == second_ids[common]:
        common += 1
    assert done2.usage["cached"] == common


def test_stop_string_cuts_text(model):
    session = model.session(cache=False)
    msgs = [{"role": "user", "content": "hello"}]
    full = "".join(
        e.text
        for e in session.generate(msgs, max_tokens=30, enable_thinking=False)
        if e.type in ("text", "reasoning")
    )
    assert len(full) > 6
    stop = full[4:6]
    events = list(session.generate(msgs, max_tokens=30, stop=[stop], enable_thinking=False))
    cut = "".join(e.text for e in events if e.type in ("text", "reasoning"))
    assert cut == full[: full.index(stop)]
    assert events[-1].finish_reason == "stop"


@pytest.mark.parametrize("bad", ["past", "negative"])
def test_a_token_id_outside_the_vocabulary_is_refused_before_work(model, bad):
    """MLX does not bounds-check an embedding lookup: an id past the vocabulary read other
    memory (NaN logits, or a crash once freed buffers were reused). It is refused with the id,
    its position and the vocabulary size, and the state is left as it was."""
    vocab = model.net.config.vocab_size
    wrong = vocab if bad == "past" else -1
    state = model.new_state()
    model.prefill([5, 6, 7], state)
    with pytest.raises(InvalidOptionError, match=rf"token id {wrong} \(position 2\)"):
        model.prefill([8, 9, wrong, 10], state)
    assert state.offset == 3
    with pytest.raises(InvalidOptionError, match=f"vocabulary of {vocab} ids"):
        list(model.generate_tokens([1, wrong], max_tokens=2))
    with pytest.raises(InvalidOptionError):
        model.logits([wrong])
    # the state still continues exactly like a fresh one
    model.prefill([8, 9], state)
    assert state.offset == 5
