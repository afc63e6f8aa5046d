"""qwen3_5 (Qwen3.8-27B layout): logits vs transformers' Qwen3_5ForCausalLM on a tiny random
weights, the two Gated DeltaNet forms, state, config validation, sanitize, MTP."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from qwen38_backend.config import Qwen35Config
from qwen38_backend.errors import ConfigError, UnsupportedArchitectureError
from qwen38_backend.loader import load_model
from qwen38_backend.loading import read_weights
from qwen38_backend.models import build_model
from qwen38_backend.models.assign import assign_weights
from qwen38_backend.models.gated_delta import chunked_gated_delta, prepare_qk, recurrent_gated_delta
from qwen38_backend.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetState
from qwen38_backend.state import RewindError
from qwen38_backend.testing import make_tiny_weights
from qwen38_backend.testing.tiny_qwen3_5 import fingerprint, text_config

FIXTURES = Path(__file__).parent / "fixtures" / "qwen3_5"
REF = json.loads((FIXTURES / "reference.json").read_text())
LENGTHS = (10, 40, 64)
TOL = 1e-4


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory) -> Path:
    return make_tiny_weights("qwen3_5", tmp_path_factory.mktemp("q35") / "tiny", seed=REF["seed"])


@pytest.fixture(scope="module")
def model(weights_dir):
    return load_model(weights_dir)


def reference(n: int) -> tuple[list[int], np.ndarray]:
    return REF["tokens"][str(n)], np.load(FIXTURES / f"logits_{n}.npy")


def run_in_chunks(model, ids: list[int], chunk: int) -> np.ndarray:
    """Every position's logits, feeding ids `chunk` at a time into one state."""
    state = model.new_state()
    outs = []
    for s in range(0, len(ids), chunk):
        out = model.forward(ids[s : s + chunk], state)
        mx.eval(out)
        outs.append(np.array(out.astype(mx.float32)))
    return np.concatenate(outs, axis=0)


def test_weights_generator_is_deterministic(weights_dir):
    # the fixtures were computed on weights with this fingerprint: drift breaks parity
    assert fingerprint(weights_dir) == REF["fingerprint"]


@pytest.mark.parametrize("n", LENGTHS)
def test_prefill_matches_transformers(model, n):
    ids, ref = reference(n)
    out = model.logits(ids)
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() <= TOL


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("chunk", [7, 16])
def test_chunked_prefill_matches_transformers(model, n, chunk):
    ids, ref = reference(n)
    assert np.abs(run_in_chunks(model, ids, chunk) - ref).max() <= TOL


@pytest.mark.parametrize("n", LENGTHS)
def test_token_by_token_decode_matches_transformers(model, n):
    ids, ref = reference(n)
    assert np.abs(run_in_chunks(model, ids, 1) - ref).max() <= TOL


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("limit", [0, 10_000])
def test_each_delta_rule_form_matches_transformers(model, n, limit, monkeypatch):
    """Force the chunked form (limit 0) or the recurrent form (limit 10000) for every T."""
    monkeypatch.setattr(GatedDeltaNet, "recurrent_max_tokens", limit)
    ids, ref = reference(n)
    assert np.abs(run_in_chunks(model, ids, 23) - ref).max() <= TOL


def test_prefill_then_generate(model):
    ids, ref = reference(40)
    state = model.new_state()
    last = model.prefill(ids[:30], state, chunk=16)
    assert np.abs(np.array(last) - ref[29]).max() <= TOL
    rest = run_in_chunks(model, ids, 1)[30:]
    assert np.abs(rest - ref[30:]).max() <= TOL
    toks = list(model.generate_tokens(ids[:12], max_tokens=5))
    greedy = []
    st = model.new_state()
    logits = model.forward(ids[:12], st, last_only=True)[-1]
    for _ in range(5):
        t = int(mx.argmax(logits).item())
        greedy.append(t)
        logits = model.forward([t], st)[-1]
    assert toks[: len(greedy)] == greedy[: len(toks)]


# ----- Gated DeltaNet ----------------------------------------------------------------------
def _random_gdn_inputs(T, Hk=2, Hv=6, Dk=16, Dv=16, seed=0, hard=False):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, Hk, Dk))
    k = rng.standard_normal((T, Hk, Dk))
    if hard:  # nearly parallel keys, beta ~ 1, little decay: ill-conditioned chunks
        k = 1.0 + 0.01 * k
    v = rng.standard_normal((T, Hv, Dv))
    g = -0.001 * np.ones((T, Hv)) if hard else -np.abs(rng.standard_normal((T, Hv)))
    beta = 0.99 * np.ones((T, Hv)) if hard else rng.random((T, Hv))
    S = rng.standard_normal((Hv, Dk, Dv))
    f = lambda x: mx.array(x.astype(np.float32))  # noqa: E731
    qp, kp = prepare_qk(f(q), f(k), Hv)
    return qp, kp, f(v), f(g), f(beta), f(S), (q, k, v, g, beta, S)


def _numpy_delta_rule(q, k, v, g, beta, S):
    """Float64 reference straight from QWEN38.md, one head at a time."""
    T, Hk, Dk = k.shape
    Hv = v.shape[1]
    S = S.astype(np.float64).copy()
    out = np.zeros_like(v, dtype=np.float64)
    for h in range(Hv):
        kh = h // (Hv // Hk)
        for t in range(T):
            qt = q[t, kh] / math.sqrt((q[t, kh] ** 2).sum() + 1e-6) / math.sqrt(Dk)
            kt = k[t, kh] / math.sqrt((k[t, kh] ** 2).sum() + 1e-6)
            S[h] *= math.exp(g[t, h])
            delta = (v[t, h] - S[h].T @ kt) * beta[t, h]
            S[h] += np.outer(kt, delta)
            out[t, h] = S[h].T @ qt
    return out, S


@pytest.mark.parametrize("T", [1, 5, 64, 65, 150])
@pytest.mark.parametrize("hard", [False, True])
def test_chunked_equals_recurrent_and_numpy(T, hard):
    qp, kp, v, g, beta, S, raw = _random_gdn_inputs(T, seed=T, hard=hard)
    o_r, S_r = recurrent_gated_delta(qp, kp, v, g, beta, S)
    o_c, S_c = chunked_gated_delta(qp, kp, v, g, beta, S)
    o_n, S_n = _numpy_delta_rule(*raw)
    scale = max(1.0, np.abs(o_n).max())
    assert np.abs(np.array(o_c) - np.array(o_r)).max() <= 2e-5 * scale
    assert np.abs(np.array(S_c) - np.array(S_r)).max() <= 2e-5 * max(1.0, np.abs(S_n).max())
    assert np.abs(np.array(o_r) - o_n).max() <= 2e-5 * scale
    assert np.abs(np.array(S_c) - S_n).max() <= 2e-5 * max(1.0, np.abs(S_n).max())


def test_chunk_size_does_not_matter():
    qp, kp, v, g, beta, S, _ = _random_gdn_inputs(100, seed=3)
    o64, S64 = chunked_gated_delta(qp, kp, v, g, beta, S, chunk=64)
    o16, S16 = chunked_gated_delta(qp, kp, v, g, beta, S, chunk=16)
    assert np.abs(np.array(o64 - o16)).max() <= 2e-5
    assert np.abs(np.array(S64 - S16)).max() <= 2e-5


def test_gdn_state_protocol(model):
    ids, _ = reference(40)
    state = model.new_state()
    model.forward(ids[:20], state)
    gdn = state.layers[0]
    assert isinstance(gdn, GatedDeltaNetState)
    assert gdn.recurrent.shape == (6, 16, 16) and gdn.recurrent.dtype == mx.float32
    assert gdn.conv.shape == (3, 2 * 32 + 96)
    assert gdn.nbytes() == gdn.recurrent.nbytes + gdn.conv.nbytes
    assert gdn.can_truncate is False
    gdn.truncate(20)  # no-op at the current length
    with pytest.raises(RewindError):
        gdn.truncate(19)
    with pytest.raises(RewindError):
        state.rewind(1)
    snap = state.snapshot()
    a = np.array(model.forward(ids[20:30], state))
    state.restore(snap)
    assert state.offset == 20
    b = np.array(model.forward(ids[20:30], state))
    assert np.array_equal(a, b)


# ----- config --------------------------------------------------------------------------------
def _config(**text_overrides) -> dict:
    tc = text_config("tiny")
    tc.update(text_overrides)
    return {"model_type": "qwen3_5", "text_config": tc}


def test_flat_and_nested_configs_agree():
    nested = build_model(_config()).config
    flat = build_model(dict(text_config("tiny"))).config
    assert nested == flat
    assert nested.rotary_dims == 8 and nested.layer_types.count("full_attention") == 2


def test_config_without_layer_types_uses_interval():
    tc = text_config("tiny")
    del tc["layer_types"]
    cfg = build_model({"model_type": "qwen3_5", "text_config": tc}).config
    assert cfg.layer_types == tuple(text_config("tiny")["layer_types"])


def test_rope_theta_from_top_level():
    tc = text_config("tiny")
    rope = tc.pop("rope_parameters")
    tc["rope_theta"] = 5000.0
    tc["partial_rotary_factor"] = rope["partial_rotary_factor"]
    cfg = build_model({"model_type": "qwen3_5", "text_config": tc}).config
    assert cfg.rope_theta == 5000.0 and cfg.partial_rotary_factor == 0.25


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"layer_types": ["linear_attention"] * 7}, "layer_types has 7 entries"),
        ({"layer_types": ["linear_attention"] * 7 + ["sliding"]}, "unknown entries"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"linear_num_value_heads": 5}, "multiple of linear_num_key_heads"),
        ({"linear_num_key_heads": None}, "linear_num_key_heads"),
        ({"hidden_size": "64"}, "hidden_size"),
        ({"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
    ],
)
def test_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_model(_config(**overrides))


@pytest.mark.parametrize(
    "rope, match",
    [
        ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
        ({"partial_rotary_factor": 0.1}, "must be even"),
        ({"mrope_section": [3, 3, 3]}, "mrope_section"),
        ({"rope_type": "yarn"}, "not supported"),
    ],
)
def test_rope_config_errors(rope, match):
    tc = text_config("tiny")
    tc["rope_parameters"] = {**tc["rope_parameters"], **rope}
    with pytest.raises(ConfigError, match=match):
        build_model({"model_type": "qwen3_5", "text_config": tc})


def test_unsupported_activation():
    with pytest.raises(UnsupportedArchitectureError, match="hidden_act"):
        build_model(_config(hidden_act="gelu"))


def test_more_config_errors_are_typed():
    tc = text_config("tiny")
    del tc["layer_types"]
    tc["full_attention_interval"] = 0
    with pytest.raises(ConfigError, match="full_attention_interval"):
        build_model({"model_type": "qwen3_5", "text_config": tc})
    tc = text_config("tiny")
    tc["rope_parameters"] = {**tc["rope_parameters"], "mrope_section": ["a", 2]}
    with pytest.raises(ConfigError, match="mrope_section"):
        build_model({"model_type": "qwen3_5", "text_config": tc})


def test_a_config_built_in_code_is_validated_too():
    cfg = Qwen35Config.from_dict(_config())
    assert dataclasses.replace(cfg).num_key_value_heads == cfg.num_key_value_heads
    with pytest.raises(ConfigError, match="multiple of num_key_value_heads"):
        dataclasses.replace(cfg, num_key_value_heads=3)
    with pytest.raises(UnsupportedArchitectureError, match="mtp_num_hidden_layers"):
        dataclasses.replace(cfg, mtp_num_hidden_layers=2)


def test_gated_deltanet_errors_are_typed():
    with pytest.raises(ConfigError, match="multiple of key heads"):
        GatedDeltaNet(16, n_k_heads=3, n_v_heads=4, k_head_dim=4, v_head_dim=4)
    with pytest.raises(ConfigError, match="silu or sigmoid"):
        GatedDeltaNet(16, 2, 4, 4, 4, gate_activation="relu")


# ----- sanitize ------------------------------------------------------------------------------
def _load_with(weights_dir, transform) -> object:
    read = read_weights(weights_dir)
    net = build_model(read.config)
    assign_weights(net, transform(dict(read.tensors)), {}, mx.float32)
    return net


def _logits(net, ids):
    out = net(mx.array(ids, dtype=mx.int32), net.make_state())
    return np.array(out)


def test_sanitize_prefix_variants(weights_dir):
    ids, ref = reference(10)

    def plain_model_prefix(w):  # `model.X` (text-only export) instead of model.language_model.X
        return {k.replace("model.language_model.", "model."): v for k, v in w.items()}

    def with_vision(w):
        return {**w, "model.visual.blocks.0.attn.qkv.weight": mx.zeros((3, 3))}

    for transform in (lambda w: w, plain_model_prefix, with_vision):
        net = _load_with(weights_dir, transform)
        assert np.abs(_logits(net, ids) - ref).max() <= TOL
        assert net.has_mtp


def test_sanitize_mlx_lm_layout(weights_dir):
    """mlx-lm conversions: conv1d as [C, K, 1], +1 folded into zero-centred norms, no MTP."""
    ids, ref = reference(10)
    suffixes = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight")
    suffixes += ("k_norm.weight", "model.language_model.norm.weight")

    def mlx_lm(w):
        out = {}
        for k, v in w.items():
            if k.startswith("mtp."):
                continue
            if k.endswith("conv1d.weight"):
                v = v.swapaxes(1, 2)
            elif k.endswith(suffixes):
                v = v + 1.0
            out[k] = v
        return out

    net = _load_with(weights_dir, mlx_lm)
    assert not net.has_mtp
    assert np.abs(_logits(net, ids) - ref).max() <= TOL


def test_missing_tensor_is_named(weights_dir):
    from qwen38_backend.errors import WeightsError

    def drop(w):
        w = dict(w)
        del w["model.language_model.layers.0.linear_attn.A_log"]
        return w

    with pytest.raises(WeightsError, match="layers.0.linear_attn.A_log"):
        _load_with(weights_dir, drop)


# ----- MTP -----------------------------------------------------------------------------------
def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


def _rms_zc(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + w)


def _rope(x, pos, dims, theta):
    half = dims // 2
    inv = theta ** (-np.arange(half) * 2.0 / dims)
    ang = pos[:, None] * inv[None, :]  # [T, half]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:dims]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., dims:]], axis=-1)


def _numpy_mtp(net, hidden, next_ids, positions):
    """QWEN38.md MTP formula by hand, float64, on the loaded tensors."""
    cfg = net.config
    P = {k: _np(v) for k, v in _flat(net.mtp.parameters()).items()}
    E = _np(net.model.embed_tokens.weight)
    eps = cfg.rms_norm_eps
    x = np.concatenate(
        [
            _rms_zc(E[next_ids], P["pre_fc_norm_embedding.weight"], eps),
            _rms_zc(hidden, P["pre_fc_norm_hidden.weight"], eps),
        ],
        axis=-1,
    )
    x = x @ P["fc.weight"].T
    L = "layers.0."
    T, H, Hkv, D = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    a = _rms_zc(x, P[L + "input_layernorm.weight"], eps)
    qg = (a @ P[L + "self_attn.q_proj.weight"].T).reshape(T, H, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
    k = (a @ P[L + "self_attn.k_proj.weight"].T).reshape(T, Hkv, D)
    v = (a @ P[L + "self_attn.v_proj.weight"].T).reshape(T, Hkv, D)
    q = _rope(
        _rms_zc(q, P[L + "self_attn.q_norm.weight"], eps),
        positions,
        cfg.rotary_dims,
        cfg.rope_theta,
    )
    k = _rope(
        _rms_zc(k, P[L + "self_attn.k_norm.weight"], eps),
        positions,
        cfg.rotary_dims,
        cfg.rope_theta,
    )
    rep = H // Hkv
    att = np.zeros((T, H, D))
    for h in range(H):
        s = q[:, h] @ k[:, h // rep].T / math.sqrt(D)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        att[:, h] = p @ v[:, h // rep]
    o = (att.reshape(T, H * D) / (1 + np.exp(-gate))) @ P[L + "self_attn.o_proj.weight"].T
    x = x + o
    m = _rms_zc(x, P[L + "post_attention_layernorm.weight"], eps)
    gp = m @ P[L + "mlp.gate_proj.weight"].T
    up = m @ P[L + "mlp.up_proj.weight"].T
    x = x + ((gp / (1 + np.exp(-gp))) * up) @ P[L + "mlp.down_proj.weight"].T
    return _rms_zc(x, P["norm.weight"], eps) @ _np(net.lm_head.weight).T


def _flat(params) -> dict:
    from mlx.utils import tree_flatten

    return dict(tree_flatten(params))


def test_mtp_tensor_names(model):
    names = sorted(_flat(model.net.mtp.parameters()))
    assert len(names) == 15
    assert "fc.weight" in names and "pre_fc_norm_embedding.weight" in names


def test_mtp_draft_matches_formula(model):
    net = model.net
    ids, _ = reference(40)
    T = 12
    h = net.hidden(mx.array(ids[:T], dtype=mx.int32), net.make_state())
    expected = _numpy_mtp(
        net, _np(h[: T - 1]), np.array(ids[1:T]), np.arange(T - 1, dtype=np.float64)
    )
    st = net.make_mtp_state()
    got = np.array(net.draft_logits(h[: T - 1], mx.array(ids[1:T], dtype=mx.int32), st))
    assert np.abs(got - expected).max() <= TOL
    assert st.offset == T - 1
    # the same positions drafted in two calls (own KV cache carried) give the same logits
    st2 = net.make_mtp_state()
    a = net.draft_logits(h[:5], mx.array(ids[1:6], dtype=mx.int32), st2)
    b = net.draft_logits(h[5 : T - 1], mx.array(ids[6:T], dtype=mx.int32), st2)
    both = np.concatenate([np.array(a), np.array(b)])
    assert np.abs(both - expected).max() <= TOL
    # snapshot / restore of the MTP state
    snap = st2.snapshot()
    c = np.array(net.draft_logits(h[:1], mx.array(ids[1:2], dtype=mx.int32), st2))
    st2.restore(snap)
    d = np.array(net.draft_logits(h[:1], mx.array(ids[1:2], dtype=mx.int32), st2))
    assert np.array_equal(c, d)


# ----- real 27B shapes ---------------------------------------------------------------------
@pytest.mark.slow
def test_real_27b_shapes_load_and_decode(tmp_path):
    """4 layers (3 DeltaNet + 1 attention) at the real 27B widths, bf16 on disk, real vocab."""
    d = make_tiny_weights(
        "qwen3_5",
        tmp_path / "q27",
        seed=0,
        dims="27b",
        num_layers=4,
        dtype="bfloat16",
        with_mtp=False,
    )
    m = load_model(d, dtype="bfloat16")
    cfg = m.net.config
    assert (cfg.hidden_size, cfg.vocab_size, cfg.linear_num_value_heads) == (5120, 248320, 48)
    toks = list(m.generate_tokens([7, 100, 200, 300, 400], max_tokens=3))
    assert len(toks) == 3 and all(0 <= t < 248320 for t in toks)
    st = m.new_state()
    m.prefill([7, 100, 200, 300, 400], st)
    assert st.layers[0].recurrent.shape == (48, 128, 128)
    assert st.layers[3].keys.shape[1] == 4
