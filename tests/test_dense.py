"""Dense family (llama / qwen2 / qwen3) against transformers' logits, and its decode paths."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import DENSE_ARCHS, dense_fixture, dense_reference

import qwen38_backend
from qwen38_backend.config import DenseConfig
from qwen38_backend.errors import ConfigError, UnsupportedArchitectureError, WeightsError


@pytest.fixture(params=DENSE_ARCHS)
def arch_model(request, tmp_path):
    arch = request.param
    return arch, qwen38_backend.load(dense_fixture(arch, tmp_path))


def test_full_forward_matches_transformers(arch_model):
    arch, model = arch_model
    tokens, ref = dense_reference(arch)
    ours = model.logits(tokens)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-4


def test_prefill_then_decode_equals_full_forward(arch_model):
    arch, model = arch_model
    tokens, ref = dense_reference(arch)
    state = model.new_state()
    rows = [np.array(model.forward(tokens[:5], state))]
    for t in tokens[5:]:
        rows.append(np.array(model.forward([t], state)))
    assert np.abs(np.concatenate(rows) - ref).max() <= 1e-4
    assert state.offset == len(tokens)


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_prefill_equals_one_shot(arch_model, chunk):
    _, model = arch_model
    tokens, _ = dense_reference(_)
    one = np.array(model.prefill(tokens, model.new_state(), chunk=len(tokens)))
    chunked = np.array(model.prefill(tokens, model.new_state(), chunk=chunk))
    assert np.abs(one - chunked).max() <= 1e-5


def _quantized_copy(src, dst, bits: int, group_size: int = 32):
    """Write src's weights with every linear quantized as MLX affine (weight/scales/biases)."""
    weights = mx.load(str(src / "model.safetensors"))
    out, dequantized = {}, {}
    for name, w in weights.items():
        module = name[: -len(".weight")]
        if name.endswith(".weight") and w.ndim == 2 and "norm" not in name:
            q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
            out[name], out[module + ".scales"], out[module + ".biases"] = q, s, b
            dequantized[name] = mx.dequantize(q, s, b, group_size=group_size, bits=bits)
        else:
            out[name] = dequantized[name] = w
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config["quantization"] = {"group_size": group_size, "bits": bits}
    (dst / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(dst / "model.safetensors"), out)
    return dequantized


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_loading_matches_dequantized_weights(tmp_path, arch, bits, keep):
    src = dense_fixture(arch, tmp_path)
    dequantized = _quantized_copy(src, tmp_path / "q", bits)
    qmodel = qwen38_backend.load(tmp_path / "q", keep_quantized=keep)
    packed = "QuantizedLinear" in type(qmodel.net.model.layers[0].mlp.down_proj).__name__
    assert packed == keep
    # reference: the same architecture with the dequantized weights as plain floats
    deq_dir = tmp_path / "deq"
    deq_dir.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (deq_dir / f.name).write_bytes(f.read_bytes())
    mx.save_safetensors(str(deq_dir / "model.safetensors"), dequantized)
    ref_model = qwen38_backend.load(deq_dir)
    tokens, fp_ref = dense_reference(arch)
    q, ref = qmodel.logits(tokens), ref_model.logits(tokens)
    assert np.abs(q - ref).max() <= 1e-3
    # and the quantized model still tracks the full-precision one (8-bit much closer)
    corr = np.corrcoef(q.ravel(), fp_ref.ravel())[0, 1]
    assert corr > (0.8 if bits == 4 else 0.999)


def test_missing_tensor_is_named(tmp_path):
    src = dense_fixture("qwen2", tmp_path)
    weights = mx.load(str(src / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    mx.save_safetensors(str(src / "model.safetensors"), weights)
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        qwen38_backend.load(src)


def test_misshaped_tensor_is_named_with_shapes(tmp_path):
    src = dense_fixture("llama", tmp_path)
    weights = mx.load(str(src / "model.safetensors"))
    weights["model.layers.0.self_attn.k_proj.weight"] = mx.zeros((8, 64))
    mx.save_safetensors(str(src / "model.safetensors"), weights)
    with pytest.raises(WeightsError, match=r"k_proj\.weight: expected \(32, 64\), found \(8, 64\)"):
        qwen38_backend.load(src)


def test_unknown_architecture_is_refused(tmp_path):
    src = dense_fixture("llama", tmp_path)
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="gpt_neox"):
        qwen38_backend.load(src)


def test_dense_rope_read_once():
    base = {
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    assert DenseConfig.from_dict(base).rope_theta == 10000.0
    assert DenseConfig.from_dict({**base, "rope_theta": 5e5}).rope_theta == 5e5
    nested = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    cfg = DenseConfig.from_dict({**base, **nested})  # transformers 5 layout
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    cfg = DenseConfig.from_dict({**base, "rope_theta": 5e5, "rope_scaling": llama3})
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == llama3
    with pytest.raises(ConfigError, match="rope_parameters should be a dict"):
        DenseConfig.from_dict({**base, "rope_scaling": [1, 2]})
    with pytest.raises(ConfigError, match="multiple of num_key_value_heads"):
        DenseConfig.from_dict({**base, "num_key_value_heads": 3})
