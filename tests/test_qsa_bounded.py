"""Bounded QSA attention and QSA on the paged store (issue 14).

- Gathered attention (each query over its selected blocks plus the causal tail) equals the
  [T, context] masked attention it replaces, to fp32 rounding: prefill in one group and in
  many, decode, ties (zero indexer keys), partial tail blocks.
- The paged store (resident, and a small bounded pool spilling to disk) gives the contiguous
  store's logits and greedy tokens, token for token.
- Snapshots and state files keep only the open block's raw indexer keys; restoring one and
  replaying gives the same logits; reserve() makes room for verify rows without regrowth.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qwen38_backend.errors import InvalidOptionError
from qwen38_backend.kv.contiguous import ContiguousKV
from qwen38_backend.kv.paged import PagedKV
from qwen38_backend.loader import load_model
from qwen38_backend.models import qsa
from qwen38_backend.state import RewindError
from qwen38_backend.state_files import restore_state_file, save_state_file
from qwen38_backend.testing.tiny_qwen4_exp import write_tiny_qwen4_exp

TOL = 2e-5  # fp32: only the order of the softmax sums differs


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(write_tiny_qwen4_exp(tmp_path_factory.mktemp("qsa") / "tiny", seed=5))


def _ids(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(8, 500, n).tolist()


def _masked(self, q, qi, positions, st, offset):
    """The attention this replaces: every stored key, masked to the query's token set."""
    if positions is None:  # a one-row step's (attend makes them only where read)
        positions = mx.arange(offset, offset + q.shape[2], dtype=mx.int32)
    blocks = self.select(qi, positions, st)
    L = st.kv.length
    mask = qsa.token_mask(blocks, positions, self.ratio, L)
    keys, values = st.kv.keys[..., :L, :], st.kv.values[..., :L, :]
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)


def _run(model, ids, chunks, **kv):
    """Logits [n, vocab] fed in `chunks` (then one token at a time), and the state."""
    state = model.new_state(**kv)
    rows, i = [], 0
    for c in chunks:
        rows.append(np.array(model.forward(ids[i : i + c], state).astype(mx.float32)))
        i += c
    while i < len(ids):
        rows.append(np.array(model.forward(ids[i : i + 1], state).astype(mx.float32)))
        i += 1
    return np.concatenate(rows), state


@pytest.mark.parametrize("gather_bytes", [qsa.GATHER_BYTES, 1])  # one group; one query each
@pytest.mark.parametrize("tied", [False, True])
def test_gathered_attention_equals_masked(model, monkeypatch, gather_bytes, tied):
    saved = {}
    if tied:  # zero indexer keys: every block scores 0, ties everywhere
        for b in model.net.model.layers:
            if not b.is_linear:
                proj = b.self_attn.indexer.index_qk_proj
                saved[id(proj)] = (proj, proj.weight)
                w = np.array(proj.weight)
                w[b.self_attn.indexer.n_heads * b.self_attn.indexer.head_dim :] = 0.0
                proj.weight = mx.array(w)
    monkeypatch.setattr(qsa, "GATHER_BYTES", gather_bytes)
    # 61 tokens: chunks of 13 and 22 end inside blocks (partial tails), then decode
    ids = _ids(61, seed=1)
    try:
        got, _ = _run(model, ids, [13, 22])
        monkeypatch.setattr(qsa.QSAAttention, "_attend_selected", _masked)
        want, _ = _run(model, ids, [13, 22])
    finally:
        for proj, w in saved.values():
            proj.weight = w
    assert np.abs(got - want).max() <= TOL * max(1.0, np.abs(want).max())
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_rope_rounds_a_norms_rows_as_the_norm_would(dtype):
    """rope_at on a zero-centred norm's fp32 rows with their dtype (the rounding done in its
    own elementwise kernel, the partners gathered in fp32) gives the bits of rope_at on the
    norm's rounded rows, compiled as a step runs it, at small and deep positions."""
    from qwen38_backend.models.layers import RMSNorm

    norm = RMSNorm(128, 1e-6, zero_centered=True)
    norm.weight = 0.1 * mx.random.normal((128,), key=mx.random.key(1))
    x = (3 * mx.random.normal((3, 4, 128), key=mx.random.key(2))).astype(dtype)
    pos = mx.array([7, 4093, 262_143], dtype=mx.int32)

    def rounded_first(x, pos):
        return qsa.rope_at(norm(x), pos, 64, 1e7)

    def rounded_inside(x, pos):
        return qsa.rope_at(norm.for_product(x), pos, 64, 1e7, x.dtype)

    want = mx.compile(rounded_first)(x, pos)
    got = mx.compile(rounded_inside)(x, pos)
    assert got.dtype == dtype
    assert mx.array_equal(got, want).item()
    wrong = qsa.rope_at(norm.for_product(x), pos, 64, 1e7)  # never rounded: other bits
    assert not mx.array_equal(wrong.astype(dtype), want).item()


def test_token_ids_cover_the_mask_exactly():
    rng = np.random.default_rng(0)
    scores = mx.array(rng.integers(0, 3, (9, 12)).astype(np.float32))  # many ties
    pos = mx.array([3, 8, 10, 11, 22, 33, 45, 46, 47])
    blocks = qsa.select_blocks(scores, pos, 4, 3)
    mask = np.array(qsa.token_mask(blocks, pos, 4, 48))
    ids, valid = qsa.token_ids(blocks, pos, 4, 3)
    assert ids.shape == (9, 3 * 4 + 3)
    for r in range(9):
        chosen = sorted(np.array(ids[r])[np.array(valid[r])].tolist())
        assert chosen == np.nonzero(mask[r])[0].tolist(), r
        # padding reads the query's own row: no page beyond the ones it attends and its own
        assert set(np.array(ids[r])[~np.array(valid[r])].tolist()) <= {int(pos[r])}, r


def test_decode_attends_a_bounded_number_of_rows(model, monkeypatch):
    """Past the threshold a decode step gathers n_blocks * ratio + tail rows, whatever the
    depth (the store is asked for exactly those)."""
    sizes = []
    real = ContiguousKV.gather

    def spy(self, positions):
        sizes.append(positions.size)
        return real(self, positions)

    monkeypatch.setattr(ContiguousKV, "gather", spy)
    _run(model, _ids(90, seed=2), [60])
    att = next(b.self_attn for b in model.net.model.layers if not b.is_linear)
    per_layer = sizes[-30 * 2 :]  # 2 QSA layers, 30 decode steps
    assert max(per_layer) <= att.width and min(per_layer) >= att.n_blocks * att.ratio


@pytest.mark.parametrize(
    "kv",
    [
        {"kv_paged": "on", "kv_page_tokens": 8},
        {"kv_paged": "on", "kv_page_tokens": 4, "kv_pool_tokens": 24},  # spills
    ],
)
def test_paged_qsa_equals_contiguous(model, tmp_path, kv):
    if "kv_pool_tokens" in kv:
        kv = {**kv, "kv_spill_dir": str(tmp_path / "spill")}
    ids = _ids(70, seed=3)
    want, _ = _run(model, ids, [23, 9])
    got, state = _run(model, ids, [23, 9], **kv)
    np.testing.assert_allclose(got, want, atol=TOL * max(1.0, np.abs(want).max()))
    assert (got.argmax(-1) == want.argmax(-1)).all()
    stores = [st.kv for st in state.layers if isinstance(st, qsa.QSAState)]
    assert stores and all(isinstance(s, PagedKV) and not s.quest for s in stores)
    if "kv_pool_tokens" in kv:
        assert all(s.table.n_spilled for s in stores)  # the SSD tier was really used
    # greedy streams, through the engine
    a = list(model.generate_tokens(ids[:40], max_tokens=12, stop_token_ids=[]))
    b = list(model.generate_tokens(ids[:40], max_tokens=12, stop_token_ids=[], **kv))
    assert a == b


def test_a_pool_at_admissions_minimum_prefills_and_decodes(model, tmp_path):
    """A bounded pool of exactly the pages admission says a step needs (its selection's
    blocks, the query's own page, the open page) admits a prompt and answers it as all
    resident, prefill chunks past STEP_MAX_ROWS included: each query of a chunk gathers only
    its own pages (before, its padding read page 0, one page more than the pool held, and
    17- to 69-token prompts failed mid-prefill with "KV page pool full")."""
    from qwen38_backend.admission import memory_plan
    from qwen38_backend.rows import STEP_MAX_ROWS

    P = 4
    att = next(b.self_attn for b in model.net.model.layers if not b.is_linear)
    plan = memory_plan(model, 200, kv_paged="on", kv_page_tokens=P, kv_pool_tokens=64)
    assert plan.selection_pages == att.n_blocks + 2
    kv = {
        "kv_paged": "on",
        "kv_page_tokens": P,
        "kv_pool_tokens": plan.selection_pages * P,
        "kv_spill_dir": str(tmp_path / "spill"),
    }
    assert model.prefill_chunk > STEP_MAX_ROWS
    for n in (17, 21, 30, 45):
        ids = _ids(n, seed=n)
        want = list(model.generate_tokens(ids, max_tokens=6, stop_token_ids=[]))
        session = model.session(cache=False)  # admission on
        events = list(session.generate(ids, max_tokens=6, stop_token_ids=[], **kv))
        assert events[-1].type == "done", (n, events[-1])
        got = session.state.tokens[n:]  # what was fed back: all but the last token
        assert len(got) >= len(want) - 1 and got == want[: len(got)], (n, got, want)
        stores = [st.kv for st in session.state.layers if isinstance(st, qsa.QSAState)]
        assert all(s.table.n_spilled for s in stores), n  # the pool really was exceeded
        session.close()


def test_page_size_must_hold_whole_blocks(model):
    with pytest.raises(InvalidOptionError, match="multiple of indexer_compress_ratio"):
        model.new_state(kv_paged="on", kv_page_tokens=6)


def test_quest_options_are_refused_by_name(model):
    """kv_topk / kv_sinks / kv_recent would be ignored (QSA selects): refused before any work,
    naming them; the paged store's own options are accepted."""
    session = model.session(cache=False)
    for bad in ({"kv_topk": 256}, {"kv_sinks": 8, "kv_recent": 16}):
        with pytest.raises(InvalidOptionError, match=f"{next(iter(bad))}.*own QSA indexer"):
            session.request("hi", kv_paged="on", **bad)
    request = session.request("hi", kv_paged="on", kv_page_tokens=16, kv_pool_tokens=4096)
    assert request.kv == {"kv_paged": "on", "kv_page_tokens": 16, "kv_pool_tokens": 4096}


@pytest.mark.parametrize("kv", [{}, {"kv_paged": "on", "kv_page_tokens": 8}])
def test_state_file_keeps_open_block_raw_rows_and_replays(model, tmp_path, kv):
    ids = _ids(60, seed=4)
    n = 43  # 10 complete blocks and 3 raw rows of the open one
    full, _ = _run(model, ids, [n])
    _, state = _run(model, ids[:n], [n], **kv)
    snap = state.snapshot()
    for i, st in enumerate(state.layers):
        if isinstance(st, qsa.QSAState):
            assert snap.layers[i]["index_raw"].shape[0] == n % 4
            assert snap.layers[i]["index_pooled"].shape[0] == n // 4
            assert "kv.quest_min" not in snap.layers[i]
    path = tmp_path / "s.ckpt.safetensors"
    save_state_file(path, state, model)
    fresh = model.new_state(**kv)
    restore_state_file(path, model, fresh)
    rows = [np.array(model.forward(ids[j : j + 1], fresh).astype(mx.float32)) for j in range(n, 60)]
    np.testing.assert_allclose(np.concatenate(rows), full[n:], atol=TOL * np.abs(full).max())
    # a rewind into a block whose raw keys the restore did not bring back is refused
    st = next(s for s in fresh.layers if isinstance(s, qsa.QSAState))
    with pytest.raises(RewindError, match="raw indexer keys"):
        st.truncate(n - 5)


@pytest.mark.parametrize("kv", [{}, {"kv_paged": "on", "kv_page_tokens": 8}])
def test_rewind_and_replay_is_identical(model, kv):
    ids = _ids(64, seed=6)
    state = model.new_state(**kv)
    model.forward(ids[:37], state)
    state.save_point()
    first = [np.array(model.forward(ids[j : j + 1], state)) for j in range(37, 50)]
    state.truncate(37)
    again = [np.array(model.forward(ids[j : j + 1], state)) for j in range(37, 50)]
    np.testing.assert_array_equal(np.concatenate(first), np.concatenate(again))


@pytest.mark.parametrize("kv", [{}, {"kv_paged": "on", "kv_page_tokens": 8}])
def test_reserve_makes_room_for_verify_rows(model, kv):
    ids = _ids(80, seed=7)
    state = model.new_state(**kv)
    model.forward(ids[:61], state)
    st = next(s for s in state.layers if isinstance(s, qsa.QSAState))

    def sizes():
        store = st.kv
        kv_cap = store.pool.capacity if isinstance(store, PagedKV) else store.keys.shape[2]
        return kv_cap, st.raw.shape[0], st.pooled.shape[0]

    state.reserve(300)  # more than every buffer's free room, so the reserve must grow them
    before = sizes()
    assert before[0] >= (61 + 300 if not kv else -(-(61 + 300) // 8))
    model.forward(ids[61:80], state)  # a 19-row verify
    assert sizes() == before


# ----- admission -------------------------------------------------------------------------------
def _flash_next_config() -> dict:
    from qwen38_backend.testing.tiny_qwen4_exp import full_config, text_config

    c = text_config("flash", 48)
    c.update(num_experts=512, ngram_vocab_size_base=20_000_000)
    return full_config(c)


def test_flash_next_plan_at_262144_tokens():
    from qwen38_backend.admission import admit, format_plan, memory_plan
    from qwen38_backend.errors import AdmissionError

    n = 262_144
    plan = memory_plan(_flash_next_config(), n, dtype="bfloat16", mtp=False, prefill_chunk=512)
    # QWEN38.md: main KV 24 KiB/token (12 layers x 2 heads x 256 x K,V x bf16)
    assert plan["kv"] == 24 * 1024 * n
    # raw indexer keys 3 KiB/token (12 x 128 x bf16) plus a pooled key per 4 tokens
    assert plan["indexer"] == 12 * 128 * 2 * (n + n // 4)
    # the raw buffer grew once, from the first 512-token chunk to the whole context
    # (Model.prefill reserves it after the first chunk)
    assert plan["indexer_growth"] == 512 * 128 * 2
    # one prefill group: K/V of 2,048 + 3 gathered rows, 4 head scores + 4 selection rows of
    # 65,536 blocks fp32, for as many queries as fit 64 MiB, plus their output rows
    per_query = 2 * 2 * 2051 * 256 * 2 + (4 + 4) * (n // 4) * 4
    group = (64 << 20) // per_query
    assert plan["qsa_scratch"] == group * per_query + group * 24 * 256 * 2
    assert plan["quest_meta"] == 0
    text = format_plan(plan)
    assert f"{plan['qsa_scratch']:,} bytes" in text and "indexer_growth" in text
    # paged: the indexer selects whole pages; a pool below one step's pages is refused
    paged = memory_plan(
        _flash_next_config(), n, dtype="bfloat16", mtp=False, kv_paged="on", kv_pool_tokens=4096
    )
    assert paged.selection_pages == 512 + 2 and paged["quest_meta"] == 0
    with pytest.raises(AdmissionError, match="514 pages"):
        admit(paged, available=10**13, disk_available=10**13)


def test_indexer_plan_matches_the_run(model):
    from qwen38_backend.admission import memory_plan

    n = 600
    plan = memory_plan(model, n, prefill_chunk=128, dtype="float32", mtp=False)
    state = model.new_state()
    model.prefill(_ids(n, seed=8), state, chunk=128)
    qsa_layers = [s for s in state.layers if isinstance(s, qsa.QSAState)]
    held = sum(s.raw.nbytes + s.pooled.nbytes for s in qsa_layers)
    assert plan["indexer"] == held
    assert plan["kv"] == sum(s.kv.keys.nbytes + s.kv.values.nbytes for s in qsa_layers)


def test_info_shows_the_qsa_components(tmp_path):
    from qwen38_backend.info import describe

    d = write_tiny_qwen4_exp(tmp_path / "m", seed=1)
    text = describe(str(d), context=4096)
    for name in ("indexer", "indexer_growth", "qsa_scratch"):
        assert f"  {name} " in text
