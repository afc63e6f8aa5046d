"""qwen4_exp (Flash-Next): logits and QSA selections vs transformers' Qwen4ExpForCausalLM
(fixtures from scripts/make_qwen4_exp_fixtures.py), MoE / PLE / QSA pieces vs numpy, config
validation, state handling, the MTP formula, and real-shape 4-layer weights (slow)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from qwen38_backend.config import Qwen4ExpConfig
from qwen38_backend.errors import ConfigError, WeightsError
from qwen38_backend.kv.contiguous import ContiguousKV
from qwen38_backend.loader import load_model
from qwen38_backend.models import qsa
from qwen38_backend.models.hyper_connections import GatedResidual
from qwen38_backend.models.moe import SparseMoE
from qwen38_backend.models.ple import head_vocab_sizes, ngram_multipliers, ngram_rows
from qwen38_backend.models.qwen4_exp import close_streams
from qwen38_backend.testing.tiny_qwen4_exp import full_config, text_config, write_tiny_qwen4_exp

FIX = Path(__file__).parent / "fixtures" / "qwen4_exp"
META = json.loads((FIX / "reference.json").read_text())
REF = np.load(FIX / "reference.npz")
LENGTHS = (10, 40, 64)
TOL = 1e-4


def _fingerprint(d: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        h.update((d / name).read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    d = write_tiny_qwen4_exp(tmp_path_factory.mktemp("q4") / "tiny", seed=META["seed"])
    assert _fingerprint(d) == META["fingerprint_sha256"], "tiny weights writer changed"
    return d


@pytest.fixture(scope="module")
def model(weights_dir):
    return load_model(weights_dir)


def _tokens(n: int) -> list[int]:
    return META["tokens"][str(n)]


def _feed(net, ids: list[int], state) -> np.ndarray:
    out = net(mx.array(ids, dtype=mx.int32), state)
    state.advance(ids)
    return np.array(out.astype(mx.float32))


# ----- logits vs transformers ---------------------------------------------------------------
@pytest.mark.parametrize("n", LENGTHS)
def test_prefill_logits_match_reference(model, n):
    out = model.logits(_tokens(n))
    assert np.abs(out - REF[f"logits_{n}"]).max() <= TOL


@pytest.mark.parametrize("n", LENGTHS)
def test_chunked_prefill_matches_reference(model, n):
    ids, state, rows = _tokens(n), model.net.make_state(), []
    for s in range(0, n, 7):  # chunks cross block (4) and sparse-regime boundaries
        rows.append(_feed(model.net, ids[s : s + 7], state))
    assert np.abs(np.concatenate(rows) - REF[f"logits_{n}"]).max() <= TOL


@pytest.mark.parametrize("n", LENGTHS)
def test_token_by_token_decode_matches_reference(model, n):
    # sparse selection starts at position 11 (budget 8 = 2 blocks of 4)
    ids, state = _tokens(n), model.net.make_state()
    rows = [_feed(model.net, [t], state) for t in ids]
    assert np.abs(np.concatenate(rows) - REF[f"logits_{n}"]).max() <= TOL


def test_logits_last_only_and_engine_prefill(model):
    ids = _tokens(40)
    last = model.prefill(ids, model.new_state(), chunk=16)
    assert np.abs(np.array(last) - REF["logits_40"][-1]).max() <= TOL


# ----- QSA selections vs the reference indexer ------------------------------------------------
def _our_selections(model, ids, monkeypatch):
    """Run a prefill, capturing each QSA layer's (scores, token mask) over its query groups."""
    got: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    scores_seen: list[mx.array] = []
    real_scores = qsa.block_scores

    def spy(qi, kb):
        s = real_scores(qi, kb)
        scores_seen.append(s)
        return s

    monkeypatch.setattr(qsa, "block_scores", spy)
    layers = [i for i, b in enumerate(model.net.model.layers) if not b.is_linear]
    for i in layers:
        att = model.net.model.layers[i].self_attn

        def wrapped(qi, positions, st, _i=i, _orig=att.select, _att=att):
            blocks = _orig(qi, positions, st)
            mask = qsa.token_mask(blocks, positions, _att.ratio, st.length)
            got.setdefault(_i, []).append((np.array(scores_seen[-1]), np.array(mask)))
            return blocks

        monkeypatch.setattr(att, "select", wrapped)
    model.net(mx.array(ids, dtype=mx.int32), model.net.make_state())
    return {
        i: (np.concatenate([s for s, _ in parts]), np.concatenate([m for _, m in parts]))
        for i, parts in got.items()
    }


@pytest.mark.parametrize("n", (40, 64))
def test_qsa_selection_matches_reference_where_no_ties(model, n, monkeypatch):
    ids = _tokens(n)
    ours = _our_selections(model, ids, monkeypatch)
    k = 2  # indexer_budget 8 / compress_ratio 4
    compared = sparse = 0
    for layer, (scores, mask) in ours.items():
        ref = np.unpackbits(REF[f"selection_{n}_layer{layer}"], axis=-1)[:, :n].astype(bool)
        for p in range(n):
            nvis = (p + 1) // 4
            if nvis > k:
                s = np.sort(scores[p, :nvis])[::-1]
                if s[k - 1] - s[k] <= 1e-5 * max(1.0, abs(s[k - 1])):
                    continue  # a tie at the cut: the reference's choice is arbitrary
                sparse += 1
            compared += 1
            np.testing.assert_array_equal(mask[p], ref[p], err_msg=f"layer {layer} pos {p}")
    assert sparse >= 20 and compared >= 2 * n - 10  # the test must exercise real selections


def test_top_blocks_ties_take_lower_block_ids():
    scores = mx.array(
        [
            [1.0, 3.0, 3.0, 0.0, 3.0, 2.0],
            [0.0, 0.0, 0.0, 0.0, 5.0, 0.0],
            [2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
            [0.5, 0.1, 0.9, 0.9, 0.2, 0.3],
        ]
    )
    got = np.array(qsa.top_blocks(scores, 2))
    golden = [[1, 2], [0, 4], [0, 1], [2, 3]]
    assert [list(np.nonzero(r)[0]) for r in got] == golden
    got4 = np.array(qsa.top_blocks(scores, 4))
    assert [list(np.nonzero(r)[0]) for r in got4] == [
        [1, 2, 4, 5],
        [0, 1, 2, 4],
        [0, 1, 2, 3],
        [0, 2, 3, 5],
    ]


def test_select_blocks_dense_regime_and_tail():
    # 6 complete blocks, k = 2; positions 3 (1 block), 11 (3 blocks, sparse), 25 (6, sparse)
    scores = mx.array([[0.0, 9, 1, 7, 5, 3]] * 3)
    pos = mx.array([3, 11, 25])
    blocks = np.array(qsa.select_blocks(scores, pos, 4, 2))
    assert [list(np.nonzero(r)[0]) for r in blocks] == [[0], [1, 2], [1, 3]]
    mask = np.array(qsa.token_mask(mx.array(blocks), pos, 4, 26))
    assert list(np.nonzero(mask[0])[0]) == [0, 1, 2, 3]
    assert list(np.nonzero(mask[1])[0]) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert list(np.nonzero(mask[2])[0]) == [4, 5, 6, 7, 12, 13, 14, 15, 24, 25]
    # the decode path gathers the same token set, ascending; the index buffer's rows past the
    # visible blocks (capacity, stale rows after a rewind) are never chosen
    qi = mx.array([[[1.0]]])  # one head of one dim: the block scores are the pooled keys
    pooled = mx.array([[0.0], [9], [1], [7], [5], [3], [100], [100]])
    args = (qi, pooled, mx.array(25), mx.array([24, 25], dtype=mx.int32))
    want = [4, 5, 6, 7, 12, 13, 14, 15, 24, 25]
    assert qsa.decode_tokens(*args, ratio=4, n_blocks=2).tolist() == want
    assert qsa.decode_tokens_step(4, 2)(*args).tolist() == want


def test_decode_tokens_equal_the_mask_compiled_or_not():
    """Every sparse decode position, tied scores, 0-3 stale rows past the visible blocks: the
    gathered ids are the mask's tokens in ascending order, and the compiled selection (one
    trace per buffer capacity and tail length) gives the same ids."""
    rng = np.random.default_rng(0)
    ratio, k = 4, 3
    qi = mx.array([[[1.0]]])
    compiled = qsa.decode_tokens_step(ratio, k)
    for p in range(4 * (k + 1) - 1, 70):
        nvis = (p + 1) // ratio
        kb = rng.integers(0, 3, (nvis + int(rng.integers(0, 4)), 1)).astype(np.float32)
        tail = mx.array(list(range(nvis * ratio, p + 1)), dtype=mx.int32)
        args = (qi, mx.array(kb), mx.array(p), tail)
        got = qsa.decode_tokens(*args, ratio=ratio, n_blocks=k).tolist()
        assert compiled(*args).tolist() == got, p
        pos = mx.array([p])
        blocks = qsa.select_blocks(mx.array(kb[:nvis].T), pos, ratio, k)
        mask = np.array(qsa.token_mask(blocks, pos, ratio, p + 1))[0]
        assert got == np.nonzero(mask)[0].tolist(), p


def test_tied_indexer_selects_lowest_blocks_end_to_end(weights_dir, monkeypatch):
    """Zero indexer keys: every block scores 0, so the golden choice is blocks 0 and 1."""
    m = load_model(weights_dir)
    att = m.net.model.layers[3].self_attn
    w = np.array(att.indexer.index_qk_proj.weight)
    w[4 * 16 :] = 0.0  # the key rows of index_qk_proj
    att.indexer.index_qk_proj.weight = mx.array(w)
    gathered = {}
    real = ContiguousKV.gather

    def spy(self, positions):
        gathered[id(self)] = np.array(positions).tolist()
        return real(self, positions)

    monkeypatch.setattr(ContiguousKV, "gather", spy)
    state = m.net.make_state()
    ids = _tokens(40)[:21]
    _feed(m.net, ids[:20], state)
    _feed(m.net, ids[20:], state)  # decode at position 20: nvis 5 > k 2
    assert gathered[id(state.layers[3].kv)] == [0, 1, 2, 3, 4, 5, 6, 7, 20]


def test_fused_hyper_connection_projections_give_the_same_streams():
    """GatedResidual.fuse: the down and inject projections as one matmul, the same result."""
    gr = GatedResidual(16, 4, 8, 1e-6)
    gr.hc_norm.weight = mx.random.normal((64,), key=mx.random.key(1)) * 0.2
    R = mx.random.normal((3, 64), key=mx.random.key(2))

    def block(x):
        return 2.0 * x + 1.0

    want, want_x = gr(R, block), gr.open(R)[0]
    gr.fuse()
    assert "down_inject_proj" in gr and "block_inject_weight" not in gr
    np.testing.assert_allclose(np.array(gr(R, block)), np.array(want), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.array(gr.open(R)[0]), np.array(want_x), rtol=0, atol=1e-6)
    assert not np.allclose(np.array(want), np.array(R))  # the block's output reached R


# ----- MoE vs numpy --------------------------------------------------------------------------
def _np_silu(x):
    return x / (1.0 + np.exp(-x))


@pytest.mark.parametrize("fused", [False, True])  # the router and shared gate as one product
@pytest.mark.parametrize("T", (3, 50))  # 50 * top-2 >= 64 takes the expert-sorted path
def test_moe_matches_per_token_numpy(T, fused):
    E, H, inter, k = 8, 24, 12, 3
    moe = SparseMoE(H, E, k, inter, 10, norm_topk_prob=True)
    rng = np.random.default_rng(0)
    params = {
        "gate.weight": rng.standard_normal((E, H)) * 0.5,
        "experts.gate_up_proj": rng.standard_normal((E, 2 * inter, H)) * 0.3,
        "experts.down_proj": rng.standard_normal((E, H, inter)) * 0.3,
        "shared_expert.gate_proj.weight": rng.standard_normal((10, H)) * 0.3,
        "shared_expert.up_proj.weight": rng.standard_normal((10, H)) * 0.3,
        "shared_expert.down_proj.weight": rng.standard_normal((H, 10)) * 0.3,
        "shared_expert_gate.weight": rng.standard_normal((1, H)) * 0.3,
    }
    from mlx.utils import tree_unflatten

    moe.update(tree_unflatten([(n, mx.array(v.astype(np.float32))) for n, v in params.items()]))
    x = rng.standard_normal((T, H)).astype(np.float32)
    if fused:
        unfused = np.array(moe(mx.array(x)))
        moe.fuse()
        assert "router_gate_proj" in moe and "gate" not in moe
    out = np.array(moe(mx.array(x)))
    if fused:
        np.testing.assert_array_equal(out, unfused)
    inds, weights = moe.route(mx.array(x))
    P = {n: v.astype(np.float64) for n, v in params.items()}
    for t in range(T):
        logits = P["gate.weight"] @ x[t]
        prob = np.exp(logits - logits.max())
        prob /= prob.sum()
        top = np.argsort(-prob)[:k]
        assert set(np.array(inds[t]).tolist()) == set(top.tolist())
        w = prob[top] / prob[top].sum()
        y = np.zeros(H)
        for e, we in zip(top, w, strict=True):
            gu = P["experts.gate_up_proj"][e] @ x[t]
            y += we * (P["experts.down_proj"][e] @ (_np_silu(gu[:inter]) * gu[inter:]))
        sh = P["shared_expert.down_proj.weight"] @ (
            _np_silu(P["shared_expert.gate_proj.weight"] @ x[t])
            * (P["shared_expert.up_proj.weight"] @ x[t])
        )
        gate = 1.0 / (1.0 + np.exp(-(P["shared_expert_gate.weight"] @ x[t])[0]))
        y += gate * sh
        np.testing.assert_allclose(out[t], y, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(
            sorted(np.array(weights[t]).tolist()), sorted(w.tolist()), atol=1e-6
        )


# ----- PLE -------------------------------------------------------------------------------------
def test_ple_multipliers_and_primes_for_flash_next():
    assert ngram_multipliers(248320, 3, 0, 1234) == [
        23703573157769,
        20109073645365,
        8052911324071,
    ]
    assert ngram_multipliers(248320, 3, 0, 0) != ngram_multipliers(248320, 3, 0, 1234)
    sizes = head_vocab_sizes(20_000_000, 16)
    assert sizes[0] > 19_999_999 and len(set(sizes)) == 16 and sizes == sorted(sizes)
    for a, b in zip(sizes, sizes[1:], strict=False):
        assert all(any(n % d == 0 for d in range(2, math.isqrt(n) + 1)) for n in range(a + 1, b))
    for p in sizes:
        assert all(p % d for d in range(2, math.isqrt(p) + 1))
    assert -(-sum(sizes) // 128) * 128 == 320_001_536


def test_ple_eos_resets_ngram_context():
    m = [3, 5, 7]
    sizes = np.array(head_vocab_sizes(1000, 16), np.int64)
    offs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    eos = 7

    def rows(hist):
        return ngram_rows(np.array(hist, np.int64), len(hist) - 2, eos, m, sizes, offs, 8)

    a = rows([eos, eos, 50, 60, eos, 70, 80])
    fresh = rows([eos, eos, 70, 80])
    np.testing.assert_array_equal(a[3:], fresh)  # after an EOS: as if the sequence restarted
    # without the EOS the context differs
    b = rows([eos, eos, 50, 60, 61, 70, 80])
    assert not np.array_equal(b[3:], fresh)
    # bigram head of token 70 after EOS: (70*m0) ^ (eos*m1)
    assert a[3, 0] == ((70 * 3) ^ (eos * 5)) % sizes[0] + offs[0]
    assert a[4, 8] == ((80 * 3) ^ (70 * 5) ^ (eos * 7)) % sizes[8] + offs[8]


@pytest.mark.parametrize("join", [True, False])
def test_ngram_table_of_arrays_gathers_rows_in_order(join, monkeypatch):
    """An in-process table (MLX-array shards, joined into one or not): the rows come back in
    the order asked, across shards and repeats, as the concatenated table's rows in fp32."""
    from qwen38_backend.models import ple

    if not join:
        monkeypatch.setattr(ple, "JOIN_BYTES", 0)
    rng = np.random.default_rng(5)
    shards = [rng.standard_normal((n, 6)).astype(np.float16) for n in (7, 3, 11, 5)]
    table = ple.NgramTable.from_arrays([mx.array(s) for s in shards])
    assert len(table.shards) == (1 if join else 4)
    rows = np.array([[25, 0, 9], [8, 8, 24], [12, 3, 10]], np.int64)  # shards 3 0 1 / 1 1 3 ...
    got = np.array(table.gather(rows))
    assert got.dtype == np.float32 and got.shape == (3, 3, 6)
    np.testing.assert_array_equal(got, np.concatenate(shards).astype(np.float32)[rows])
    with pytest.raises(WeightsError, match="out of range"):
        table.gather(np.array([26], np.int64))


def test_ple_buffer_mismatch_is_a_clear_error(weights_dir, tmp_path):
    from qwen38_backend.loading import read_weights
    from qwen38_backend.models import build_model
    from qwen38_backend.models.assign import assign_weights

    c = read_weights(weights_dir, tokenizer=False)
    weights = dict(c.tensors)
    name = "model.language_model.layers.1.ple.ple_embedding.layer_multipliers"
    weights[name] = mx.array(np.array(ngram_multipliers(512, 3, 0, 0), np.int64))
    with pytest.raises(WeightsError, match="layer_multipliers"):
        assign_weights(build_model(c.config), weights, {}, mx.float32)


def test_memory_mapped_table_gives_the_same_logits(weights_dir):
    m = load_model(weights_dir)
    assert m.net.attach_ngram_tables(weights_dir)
    table = m.net.model.layers[1].ple.ple_embedding.table
    assert table.dtypes is not None and len(table.shards) == 4
    assert np.abs(m.logits(_tokens(40)) - REF["logits_40"]).max() <= TOL


def test_per_expert_weights_layout_loads(weights_dir, tmp_path):
    """transformers' save_pretrained writes per-expert tensors; sanitize fuses them."""
    from qwen38_backend.loading import read_weights
    from qwen38_backend.models import build_model
    from qwen38_backend.models.assign import assign_weights

    c = read_weights(weights_dir, tokenizer=False)
    weights = {}
    for n, w in c.tensors.items():
        if n.endswith("experts.gate_up_proj"):
            p, inter = n[: -len("gate_up_proj")], w.shape[1] // 2
            for e in range(w.shape[0]):
                weights[f"{p}{e}.gate_proj.weight"] = w[e, :inter]
                weights[f"{p}{e}.up_proj.weight"] = w[e, inter:]
        elif n.endswith("experts.down_proj"):
            p = n[: -len("down_proj")]
            for e in range(w.shape[0]):
                weights[f"{p}{e}.down_proj.weight"] = w[e]
        else:
            weights[n] = w
    net = build_model(c.config)
    assign_weights(net, weights, {}, mx.float32)
    out = np.array(net(mx.array(_tokens(10), dtype=mx.int32), net.make_state()))
    assert np.abs(out - REF["logits_10"]).max() <= TOL


# ----- state -----------------------------------------------------------------------------------
def test_snapshot_restore_replays_exactly(model):
    ids = _tokens(64)
    state = model.net.make_state()
    _feed(model.net, ids[:30], state)
    snap = state.snapshot()
    first = [_feed(model.net, [t], state) for t in ids[30:36]]
    assert not state.can_truncate  # recurrent layers: rewinds go through snapshots
    state.restore(snap)
    again = [_feed(model.net, [t], state) for t in ids[30:36]]
    np.testing.assert_array_equal(np.concatenate(first), np.concatenate(again))
    np.testing.assert_allclose(np.concatenate(again), REF["logits_64"][30:36], atol=TOL)


def test_qsa_state_truncate_drops_pooled_blocks_and_repools(model):
    att = model.net.model.layers[3].self_attn
    x = mx.array(np.random.default_rng(1).standard_normal((14, 64)).astype(np.float32))
    st = qsa.QSAState(ContiguousKV(), 4)
    y_full = att(x, st, 0)
    pooled = np.array(st.blocks())
    assert st.n_blocks == 3 and st.length == 14
    st.truncate(6)
    assert st.n_blocks == 1 and st.length == 6 and st.kv.length == 6
    y_tail = att(x[6:], st, 6)
    np.testing.assert_allclose(np.array(st.blocks()), pooled, atol=1e-6)
    np.testing.assert_allclose(np.array(y_tail), np.array(y_full[6:]), atol=1e-5)


# ----- config validation -------------------------------------------------------------------------
def _cfg(**change) -> dict:
    c = text_config("tiny")
    for k, v in change.items():
        if v is None:
            c.pop(k)
        else:
            c[k] = v
    return full_config(c)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"indexer_budget": None}, "indexer_budget"),
        ({"indexer_kv_heads": 2}, "indexer_kv_heads must be 1"),
        ({"indexer_budget": 10}, "multiple of indexer_compress_ratio"),
        ({"indexer_head_dim": 4}, "fit indexer_head_dim"),
        ({"hc_count": 1}, "hc_count must be > 1"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
        ({"ple_layer_ids": [4]}, "only supported on linear_attention"),
        ({"ple_layer_ids": [9]}, "1-based"),
        ({"ple_embed_dim": 60}, "split evenly"),
        ({"eos_token_id": None, "bos_token_id": None}, "eos_token_id"),
        ({"output_gate_type": "relu"}, "output_gate_type"),
        ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
        ({"hc_lowrank": "8"}, "hc_lowrank"),
    ],
)
def test_config_validation_errors(change, match):
    with pytest.raises(ConfigError, match=match):
        Qwen4ExpConfig.from_dict(_cfg(**change))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"eos_token_id": "2"}, "eos_token_id"),
        ({"ple_layer_ids": ["1"]}, "ple_layer_ids"),
        ({"rope_parameters": {"rope_type": "yarn"}}, "not supported"),
        ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
    ],
)
def test_more_config_errors_are_typed(change, match):
    with pytest.raises(ConfigError, match=match):
        Qwen4ExpConfig.from_dict(_cfg(**change))


def test_a_config_built_in_code_is_validated_too():
    cfg = Qwen4ExpConfig.from_dict(_cfg())
    assert dataclasses.replace(cfg) == cfg
    with pytest.raises(ConfigError, match="hc_count must be > 1"):
        dataclasses.replace(cfg, hc_count=1)
    with pytest.raises(ConfigError, match="indexer_kv_heads must be 1"):
        dataclasses.replace(cfg, indexer_kv_heads=2)


def test_layer_type_spellings_all_mean_qsa():
    for spelling in ("full_attention", "indexed_attention", "qwen_sparse_attention"):
        types = ["linear_attention", "linear_attention", "linear_attention", spelling] * 2
        cfg = Qwen4ExpConfig.from_dict(_cfg(layer_types=types))
        assert cfg.layer_types == ("linear_attention",) * 3 + ("qsa",) + (
            "linear_attention",
        ) * 3 + ("qsa",)
    flat = text_config("tiny")  # a flat (text-only) config works too
    assert Qwen4ExpConfig.from_dict(flat).num_hidden_layers == 8


# ----- MTP -------------------------------------------------------------------------------------
def test_mtp_has_31_tensors_and_is_dropped_when_absent(weights_dir, model):
    assert len(tree_flatten(model.net.mtp.parameters())) == 31
    from qwen38_backend.loading import read_weights
    from qwen38_backend.models import build_model
    from qwen38_backend.models.assign import assign_weights

    c = read_weights(weights_dir, tokenizer=False)
    net = build_model(c.config)
    assign_weights(
        net, {n: w for n, w in c.tensors.items() if not n.startswith("mtp.")}, {}, mx.float32
    )
    assert not net.has_mtp


def _rms_zc(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


def test_mtp_draft_equals_formula(model):
    net = model.net
    ids = _tokens(40)[:12]
    R = net.residual(mx.array(ids, dtype=mx.int32), net.make_state())  # H_i, [T, 256]
    nxt = mx.array(ids[1:] + [5], dtype=mx.int32)  # t_{i+1}
    st = net.make_mtp_state()
    draft = np.array(net.draft_logits(R, nxt, st))
    assert st.offset == 12 and st.last_residual is not None

    # fusion by hand, ONE norm statistic over all 4 x 64 features
    mtp = net.mtp
    p = {k: np.array(v, dtype=np.float64) for k, v in tree_flatten(mtp.parameters())}
    emb = np.array(net.model.embed_tokens.weight, dtype=np.float64)[np.array(nxt)]
    e = _rms_zc(emb, p["pre_fc_norm_embedding.weight"]) @ p["fc_embedding.weight"].T
    Hn = _rms_zc(np.array(R, dtype=np.float64), p["pre_fc_norm_hidden.weight"])
    S0 = (Hn.reshape(12, 4, 64) @ p["fc_hidden.weight"].T + e[:, None, :]).reshape(12, 256)
    np.testing.assert_allclose(
        np.array(mtp.fuse(R, mx.array(emb.astype(np.float32)))), S0, atol=2e-5
    )
    # grouped statistics would give something else: the test can tell them apart
    grouped = _rms_zc(
        np.array(R, dtype=np.float64).reshape(12, 4, 64),
        p["pre_fc_norm_hidden.weight"].reshape(4, 64),
    )
    assert np.abs(grouped.reshape(12, 256) - Hn).max() > 1e-2

    # then one Flash-Next layer (QSA + MoE, own state), the head's mixer, the shared lm_head
    layer_state = mtp.layers[0].make_state(net.config, ContiguousKV)
    S, unclosed = mtp.layers[0](mx.array(S0.astype(np.float32)), None, layer_state, 0)
    S = close_streams(mtp.hyper_connection_mixer, S, unclosed)  # (a step's, if any)
    x = mtp.hyper_connection_mixer.read(S)
    expect = np.array(x) @ np.array(net.lm_head.weight).T
    np.testing.assert_allclose(draft, expect, atol=1e-4)


# ----- real shapes -------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_shape_flash_next_4_layers_decodes(tmp_path):
    d = write_tiny_qwen4_exp(tmp_path / "flash", seed=0, dims="flash", dtype="bfloat16")
    m = load_model(d)
    assert m.net.attach_ngram_tables(d)
    cfg = m.net.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.hc_lowrank) == (
        2560,
        24,
        256,
        320,
    )
    out = list(m.generate_tokens([248045, 100, 200, 248044, 300, 400], max_tokens=4))
    assert len(out) == 4 and all(0 <= t < cfg.vocab_size for t in out)


@pytest.mark.parametrize("T", (3, 40))  # decode gather and prefill grouped paths
def test_quantized_experts_match_their_dequantized_weights(T):
    from qwen38_backend.models.moe import Experts

    rng = np.random.default_rng(3)
    e = Experts(8, 64, 32)
    e.update(
        {
            "gate_up_proj": mx.array(rng.standard_normal((8, 64, 64)).astype(np.float32)),
            "down_proj": mx.array(rng.standard_normal((8, 64, 32)).astype(np.float32)),
        }
    )
    q = e.to_quantized(group_size=32, bits=8)
    deq = Experts(8, 64, 32)
    deq.update(
        {
            n: mx.dequantize(q[n]["weight"], q[n]["scales"], q[n]["biases"], 32, 8)
            for n in ("gate_up_proj", "down_proj")
        }
    )
    x = mx.array(rng.standard_normal((T, 64)).astype(np.float32))
    inds = mx.array(rng.integers(0, 8, (T, 2)).astype(np.uint32))
    a, b = np.array(q(x, inds)), np.array(deq(x, inds))
    assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max() + 1e-3


def _experts_4bit_checkpoint(src: Path, tmp: Path) -> tuple[Path, Path]:
    """(a checkpoint whose fused expert stacks are MLX 4-bit under the HF `model.language_model.`
    names, the same model with those experts dequantized to floats)."""
    import shutil

    weights = mx.load(str(src / "model.safetensors"))
    rng = np.random.default_rng(5)
    quant, floats = {}, {}
    for name, w in weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # intermediate 32 (tiny has 16): a quantization group needs 32 columns
            E, rows, cols = w.shape
            shape = (E, 64, cols) if name.endswith("gate_up_proj") else (E, rows, 32)
            w = mx.array((rng.standard_normal(shape) * 0.2).astype(np.float32))
            q, s, b = mx.quantize(w, group_size=32, bits=4)
            quant.update({f"{name}.weight": q, f"{name}.scales": s, f"{name}.biases": b})
            floats[name] = mx.dequantize(q, s, b, group_size=32, bits=4)
        else:
            quant[name] = floats[name] = w
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = 32
    dirs = []
    for label, tensors, quantization in (
        ("q4", quant, {"group_size": 32, "bits": 4}),
        ("deq", floats, None),
    ):
        d = tmp / label
        shutil.copytree(src, d)
        mx.save_safetensors(str(d / "model.safetensors"), tensors)
        cfg = dict(config, quantization=quantization) if quantization else config
        (d / "config.json").write_text(json.dumps(cfg))
        dirs.append(d)
    return dirs[0], dirs[1]


@pytest.mark.parametrize("keep", (True, False))
def test_4bit_expert_checkpoint_loads_and_matches_dequantized(weights_dir, tmp_path, keep):
    """Fused expert stacks quantized under the multimodal names: kept packed (gather_qmm,
    prefill's grouped path and decode's compiled step) or dequantized at load, the logits are
    those of the float checkpoint holding the dequantized experts."""
    from qwen38_backend.models.moe import Experts, QuantizedExperts

    q_dir, ref_dir = _experts_4bit_checkpoint(weights_dir, tmp_path)
    q, ref = load_model(q_dir, keep_quantized=keep), load_model(ref_dir)
    kinds = {type(b.mlp.experts) for b in q.net.model.layers} | {
        type(q.net.mtp.layers[0].mlp.experts)
    }
    assert kinds == {QuantizedExperts if keep else Experts}
    ids = _tokens(40)  # 40 tokens x top-2 >= 64 pairs: the expert-sorted prefill path
    want = ref.logits(ids)
    np.testing.assert_allclose(q.logits(ids), want, atol=1e-4 * np.abs(want).max())
    state = q.new_state()
    q.forward(ids[:36], state)
    rows = [np.array(q.forward([t], state).astype(mx.float32))[0] for t in ids[36:]]
    np.testing.assert_allclose(np.stack(rows), want[36:], atol=1e-4 * np.abs(want).max())


def test_a_ple_step_hands_its_layers_to_the_device_as_they_are_built(model, monkeypatch):
    """PLE reads a step's token ids on the host, so building decode step t+1 waits there for
    step t: the step then hands each layer to the device (mx.async_eval) as it is built
    instead of all at once at the end. Tokens equal the whole-step hand-over
    (QWEN38_EAGER_LAYERS=0) and a stride of 3."""
    ids = _tokens(LENGTHS[-1])
    n_layers = len(model.net.model.layers)
    assert model.net.make_state().reads_back()
    queued = []
    real = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: queued.append(len(a)) or real(*a))
    runs = {}
    for stride in ("0", "1", "3"):
        monkeypatch.setenv("QWEN38_EAGER_LAYERS", stride)
        queued.clear()
        tokens = list(model.generate_tokens(ids, max_tokens=6, stop_token_ids=[]))
        runs[stride] = (tokens, len(queued))
    assert runs["0"][0] == runs["1"][0] == runs["3"][0]
    decode_steps = 5  # the first token comes from the prefill
    assert runs["1"][1] >= runs["0"][1] + decode_steps * n_layers
    assert runs["0"][1] < runs["3"][1] < runs["1"][1]
