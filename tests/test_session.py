"""Sessions: multi-turn prefix reuse (live state and prefix store), refusals, disk full."""

from __future__ import annotations

import errno
import json
import os
import warnings
from pathlib import Path

import pytest
from helpers import dense_fixture

import qwen38_backend
from qwen38_backend.prefix_store import PrefixStore, StateFileWarning, common_prefix
from qwen38_backend.state_files import SUFFIX

GREEDY = dict(max_tokens=12, enable_thinking=False)
TURNS = ["hello there, how are you today?", "tell me about the weather", "and in Paris?"]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return qwen38_backend.load(str(dense_fixture("qwen3", tmp_path_factory.mktemp("d"))))


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    from qwen38_backend.testing import make_tiny_weights

    return qwen38_backend.load(
        str(make_tiny_weights("qwen3_5", tmp_path_factory.mktemp("q"), seed=0))
    )


@pytest.fixture(scope="module")
def qwen4_exp(tmp_path_factory):
    from qwen38_backend.testing import make_tiny_weights

    return qwen38_backend.load(
        str(make_tiny_weights("qwen4_exp", tmp_path_factory.mktemp("x"), seed=0))
    )


def _turn(session, msgs, **options):
    events = list(session.generate(msgs, **{**GREEDY, **options}))
    text = "".join(e.text for e in events if e.type in ("text", "reasoning"))
    return text, events[-1]


def _chat(model, store, turns=TURNS, **options):
    """Three turns; per turn: (text, usage, prompt ids, live tokens before the turn)."""
    session = model.session(cache=store)
    msgs, out = [], []
    for content in turns:
        msgs.append({"role": "user", "content": content})
        before = session.state.tokens if session.state is not None else []
        ids, _ = session.render(msgs, enable_thinking=False)
        text, done = _turn(session, msgs, **options)
        out.append((text, done.usage, ids, before))
        msgs.append({"role": "assistant", "content": text})
    return out


def _recomputed(model, turns=TURNS, **options):
    session = model.session(cache=False)
    msgs, texts = [], []
    for content in turns:
        msgs.append({"role": "user", "content": content})
        text, done = _turn(session, msgs, **options)
        assert done.usage["cached"] == 0
        texts.append(text)
        msgs.append({"role": "assistant", "content": text})
    return texts


def test_multi_turn_dense_reuses_the_common_prefix(dense, tmp_path):
    turns = _chat(dense, PrefixStore(tmp_path / "store"))
    assert turns[0][1]["cached"] == 0
    for _text, usage, ids, before in turns[1:]:
        shared = common_prefix_len(before, ids)
        assert usage["cached"] > 0
        assert usage["cached"] == min(shared, len(ids) - 1)  # attention state: cut anywhere
        assert usage["prompt"] == len(ids)
    assert [t[0] for t in turns] == _recomputed(dense)


@pytest.mark.parametrize("name", ["qwen3_5", "qwen4_exp"])
def test_multi_turn_recurrent_reuses_the_message_boundary(name, request, tmp_path):
    model = request.getfixturevalue(name)
    store = PrefixStore(tmp_path / "store")
    turns = _chat(model, store)
    session = model.session(cache=False)
    msgs = []
    for i, (text, usage, ids, before) in enumerate(turns):
        msgs.append({"role": "user", "content": TURNS[i]})
        if i:
            # recurrent layers cannot be cut: reuse ends at the last message boundary of the
            # previous turn (the end of its last user message), which prefixes this prompt
            prev_msgs = msgs[: 2 * i - 1]
            boundary = _messages_end(model, prev_msgs, turns[i - 1][2])
            assert 0 < boundary <= common_prefix_len(before, ids)
            assert session.request(prev_msgs, enable_thinking=False).boundary == boundary
            assert usage["cached"] == boundary
        msgs.append({"role": "assistant", "content": text})
    assert [t[0] for t in turns] == _recomputed(model)


def _messages_end(model, messages, ids) -> int:
    """Tokens of the messages rendered without the generation prompt, when they prefix ids
    (computed separately: a second tokenization, as the session did before)."""
    tok = model.tokenizer
    head = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=False, enable_thinking=False)
    )
    return len(head) if ids[: len(head)] == head and len(head) < len(ids) else 0


def test_fresh_session_resumes_from_disk(dense, qwen3_5, tmp_path):
    for model in (dense, qwen3_5):
        directory = tmp_path / type(model.net).__name__
        first = _chat(model, PrefixStore(directory), TURNS[:2])
        msgs = [
            {"role": "user", "content": TURNS[0]},
            {"role": "assistant", "content": first[0][0]},
            {"role": "user", "content": TURNS[1]},
        ]
        # a new store object (empty memory tier), as a new process would have
        again = model.session(cache=PrefixStore(directory))
        text, done = _turn(again, msgs)
        assert done.usage["cached"] > 0
        assert text == first[1][0]


@pytest.mark.parametrize("name", ["dense", "qwen3_5"])
def test_continued_kv_names_the_layout_a_conversation_was_computed_in(name, request, tmp_path):
    """`llm -c` passes none of the earlier call's options: Session.continued_kv names the KV
    options of the stored state holding the longest prefix (here a bounded pool that
    spilled), and a follow-up given them reuses that prefix, with the tokens of a call that
    repeats the options. A call that sets no options keeps the default layout (another
    conversation sharing a prefix must not inherit a Quest budget or a pool)."""
    model = request.getfixturevalue(name)
    P = 16
    kv = {
        "kv_paged": "on",
        "kv_page_tokens": P,
        "kv_pool_tokens": 4 * P,
        "kv_spill_dir": str(tmp_path / "spill"),
    }
    directory = tmp_path / "store"
    msgs = [{"role": "user", "content": " ".join(TURNS * 4)}]  # more than the pool's 4 pages
    first, _ = _turn(model.session(cache=PrefixStore(directory)), msgs, **kv)
    msgs += [{"role": "assistant", "content": first}, {"role": "user", "content": TURNS[1]}]
    again = model.session(cache=PrefixStore(directory))  # a new process's
    ids, _ = again.render(msgs, enable_thinking=False)
    assert again.continued_kv(ids) == kv
    text, done = _turn(again, msgs, **again.continued_kv(ids))
    assert done.usage["cached"] > 0
    assert again.state.extras["kv_options"] == kv
    assert again.last_stats.kv["pages_spilled"] > 0
    assert text == _turn(model.session(cache=False), msgs, **kv)[0]
    plain = model.session(cache=PrefixStore(directory))
    _, done = _turn(plain, msgs)
    assert plain.state.extras["kv_options"] == {}
    assert model.session(cache=False).continued_kv(ids) == {}


def test_a_restored_prefix_keeps_the_options_of_the_call_that_restored_it(dense, tmp_path):
    """A call given other KV options of the same layout (another Quest budget) reuses a
    stored conversation's prefix, but its state, the state file it leaves and a follow-up's
    continued_kv name its own options (they named the stored conversation's, so `llm -c`
    went on with the other budget)."""
    P = 16
    first_kv = {"kv_paged": "on", "kv_page_tokens": P, "kv_topk": 2 * P}
    second_kv = {"kv_paged": "on", "kv_page_tokens": P, "kv_topk": 4 * P}
    directory = tmp_path / "store"
    shared = " ".join(TURNS * 2)
    _turn(dense.session(cache=PrefixStore(directory)), [_user(shared + " one")], **first_kv)
    second = dense.session(cache=PrefixStore(directory))
    msgs = [_user(shared + " two")]
    text, done = _turn(second, msgs, **second_kv)
    assert done.usage["cached"] > 0  # the first conversation's prefix was restored
    assert second.state.extras["kv_options"] == second_kv
    msgs += [{"role": "assistant", "content": text}, _user(TURNS[1])]
    later = dense.session(cache=PrefixStore(directory))  # a new process's `llm -c`
    ids, _ = later.render(msgs, enable_thinking=False)
    assert later.continued_kv(ids) == second_kv


def test_continued_kv_drops_quest_options_stored_beside_kv_paged_off(dense, tmp_path):
    """A conversation stored before kv_topk & co. were refused beside kv_paged='off' (they
    did nothing there) continues with kv_paged='off' alone, not with an error."""
    session = dense.session(cache=PrefixStore(tmp_path / "store"))
    msgs = [_user(TURNS[0])]
    text, _ = _turn(session, msgs, kv_paged="off")
    session.state.extras["kv_options"] = {"kv_paged": "off", "kv_topk": 16}  # as then
    msgs += [{"role": "assistant", "content": text}, _user(TURNS[1])]
    ids, _ = session.render(msgs, enable_thinking=False)
    kv = session.continued_kv(ids)
    assert kv == {"kv_paged": "off"}
    _, done = _turn(session, msgs, **kv)
    assert done.usage["cached"] > 0


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_cache_false_stores_nothing(dense, isolated_home):
    session = dense.session(cache=False)
    _turn(session, [{"role": "user", "content": TURNS[0]}])
    _, done = _turn(session, [{"role": "user", "content": TURNS[0]}])
    assert done.usage["cached"] == 0
    assert not list(Path(isolated_home).rglob(f"*{SUFFIX}"))


def test_default_store_lives_under_the_data_dir(dense, isolated_home):
    session = dense.session()
    _turn(session, [{"role": "user", "content": TURNS[0]}])
    files = list((Path(isolated_home) / "checkpoints").rglob(f"*{SUFFIX}"))
    assert len(files) == 1


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_damaged_state_file_is_refused_and_recomputed(dense, tmp_path, damage):
    directory = tmp_path / "store"
    msgs = [{"role": "user", "content": TURNS[0]}]
    expected, _ = _turn(dense.session(cache=False), msgs)
    _turn(dense.session(cache=PrefixStore(directory)), msgs)
    (path,) = directory.rglob(f"*{SUFFIX}")
    if damage == "corrupt":
        _corrupt(path)
    else:
        path.write_bytes(path.read_bytes()[:-50])
    store = PrefixStore(directory)
    with pytest.warns(StateFileWarning, match="checksum|truncated"):
        text, done = _turn(dense.session(cache=store), msgs)
    assert done.usage["cached"] == 0 and text == expected
    assert "recomputing" not in (store.last_error or "")
    assert store.last_error and ("checksum" in store.last_error or "truncated" in store.last_error)


def test_a_large_state_file_with_a_corrupt_layer_is_refused_when_restored(
    dense, tmp_path, monkeypatch
):
    """A large state file is read layer by layer during the restore: a corrupt layer found
    there is refused as one found up front would be (warned about, deleted, recomputed)."""
    from qwen38_backend import state_files

    monkeypatch.setattr(state_files, "STREAM_BYTES", 0)  # every file counts as large
    directory = tmp_path / "store"
    msgs = [{"role": "user", "content": TURNS[0]}]
    expected, _ = _turn(dense.session(cache=False), msgs)
    _turn(dense.session(cache=PrefixStore(directory)), msgs)
    (path,) = directory.rglob(f"*{SUFFIX}")
    data = path.read_bytes()
    hlen = int.from_bytes(data[:8], "little")
    table = json.loads(data[8 : 8 + hlen])
    begin = 8 + hlen + table["layers.1.keys"]["data_offsets"][0]
    damaged = bytearray(data)
    damaged[begin] ^= 0x40
    path.write_bytes(bytes(damaged))
    store = PrefixStore(directory)
    with pytest.warns(StateFileWarning, match="layers.1.keys fails its checksum"):
        text, done = _turn(dense.session(cache=store), msgs)
    assert done.usage["cached"] == 0 and text == expected
    # the refused file was deleted, and the recomputed state saved anew in its place
    state_files.restore_state_file(path, dense, dense.new_state())
    with warnings.catch_warnings():
        warnings.simplefilter("error", StateFileWarning)
        _, again = _turn(dense.session(cache=PrefixStore(directory)), msgs)
    assert again.usage["cached"] > 0


def test_foreign_state_file_is_refused_and_recomputed(dense, tmp_path):
    other = qwen38_backend.load(str(dense_fixture("qwen2", tmp_path / "m")))
    msgs = [{"role": "user", "content": TURNS[0]}]
    foreign_store = PrefixStore(tmp_path / "foreign")
    _turn(other.session(cache=foreign_store), msgs)
    (foreign,) = foreign_store.directory.rglob(f"*{SUFFIX}")
    # plant it where this model's state files live, under a name that matches the prompt
    store = PrefixStore(tmp_path / "store")
    _turn(dense.session(cache=store), msgs)
    (own,) = store.directory.rglob(f"*{SUFFIX}")
    own.write_bytes(foreign.read_bytes())
    expected, _ = _turn(dense.session(cache=False), msgs)
    store2 = PrefixStore(store.directory)
    with pytest.warns(StateFileWarning, match="different model"):
        text, done = _turn(dense.session(cache=store2), msgs)
    assert done.usage["cached"] == 0 and text == expected


def test_disk_full_keeps_the_session_working(dense, tmp_path, monkeypatch):
    msgs = [{"role": "user", "content": TURNS[0]}]
    expected = _recomputed(dense, TURNS[:2])
    real_write = os.write

    def full_disk(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    store = PrefixStore(tmp_path / "store")
    session = dense.session(cache=store)
    monkeypatch.setattr(os, "write", full_disk)
    with pytest.warns(StateFileWarning, match="No space left on device"):
        text, _ = _turn(session, msgs)
    assert not [p for p in store.directory.rglob("*") if p.is_file()]  # nothing partial
    monkeypatch.setattr(os, "write", real_write)
    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": TURNS[1]}]
    with warnings.catch_warnings():
        warnings.simplefilter("error", StateFileWarning)
        text2, done = _turn(session, msgs)
    assert [text, text2] == expected and done.usage["cached"] > 0
    assert len(list(store.directory.rglob(f"*{SUFFIX}"))) == 1  # writes work again


def test_session_rewind(dense):
    session = dense.session(cache=False)
    _turn(session, [{"role": "user", "content": TURNS[0]}])
    n = session.state.offset
    session.rewind(5)
    assert session.state.offset == n - 5


@pytest.mark.demo
def test_multi_turn_demo(demo_model, tmp_path):
    short = {"max_tokens": 6}  # answers of 6 tokens, not 12: a demo token costs ~0.1 s here
    turns = _chat(demo_model, PrefixStore(tmp_path / "store"), **short)
    for _text, usage, ids, before in turns[1:]:
        assert usage["cached"] == min(common_prefix_len(before, ids), len(ids) - 1) > 0
    assert [t[0] for t in turns] == _recomputed(demo_model, **short)


def common_prefix_len(a, b) -> int:
    import numpy as np

    return common_prefix(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))
