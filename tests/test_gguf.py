"""GGUF loading: name map, config synthesis, llama Q/K un-permutation, native quant types.

Tiny GGUF files are written with the `gguf` package from random transformers models, with
Q/K permuted the way llama.cpp's convert_hf_to_gguf does; the reference is the HF state dict.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from qwen38_backend.errors import UnsupportedArchitectureError, WeightsError  # noqa: E402
from qwen38_backend.loading import read_weights  # noqa: E402
from qwen38_backend.loading.gguf import hf_name, unpermute_rows  # noqa: E402

QT = gguf.GGMLQuantizationType
DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)

BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute: HF rotate-half rows -> interleaved rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def gguf_name(hf: str) -> str:
    module, suffix = hf.rsplit(".", 1)
    if module in TOP:
        return f"{TOP[module]}.{suffix}"
    parts = module.split(".")
    return f"blk.{parts[2]}.{BLOCK['.'.join(parts[3:])]}.{suffix}"


def make_hf(arch: str, tie: bool):
    torch.manual_seed(0)
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    extra = {"head_dim": 16} if arch == "qwen3" else {}
    model = model_cls(cfg_cls(**DIMS, tie_word_embeddings=tie, **extra)).eval()
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    for k in list(sd):  # random norms so a wrong mapping cannot hide behind all-ones
        if k.endswith("norm.weight"):
            sd[k] = np.random.default_rng(len(k)).normal(1, 0.1, sd[k].shape).astype(np.float32)
    if tie:
        sd.pop("lm_head.weight", None)
    return sd


def write_gguf(path: Path, arch: str, sd: dict[str, np.ndarray], qtype=QT.F32) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(DIMS["num_hidden_layers"])
    w.add_context_length(DIMS["max_position_embeddings"])
    w.add_embedding_length(DIMS["hidden_size"])
    w.add_feed_forward_length(DIMS["intermediate_size"])
    w.add_head_count(DIMS["num_attention_heads"])
    w.add_head_count_kv(DIMS["num_key_value_heads"])
    w.add_layer_norm_rms_eps(DIMS["rms_norm_eps"])
    w.add_rope_freq_base(DIMS["rope_theta"])
    w.add_vocab_size(DIMS["vocab_size"])
    if arch == "qwen3":
        w.add_key_length(16)
        w.add_value_length(16)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, arr in sd.items():
        if arch == "llama" and name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, DIMS["num_attention_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, DIMS["num_key_value_heads"])
        if arr.ndim == 2 and qtype != QT.F32:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def dequant(ck, name: str) -> np.ndarray:
    module = name[: -len(".weight")]
    if module not in ck.quantization:
        return np.array(ck.tensors[name].astype(mx.float32))
    gs, bits = ck.quantization[module]
    w = ck.tensors
    scales, biases = (w[module + s].astype(mx.float32) for s in (".scales", ".biases"))
    out = mx.dequantize(w[name], scales, biases, group_size=gs, bits=bits)
    return np.array(out.astype(mx.float32))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_f32_names_and_unpermute_exact(tmp_path: Path, arch: str) -> None:
    sd = make_hf(arch, tie=False)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(path, arch, sd)
    ck = read_weights(path, tokenizer=False)
    assert ck.format == "gguf" and ck.rope_interleaved is False and ck.source == path
    assert set(ck.tensors) == set(sd)
    for name, ref in sd.items():
        got = np.array(ck.tensors[name])
        assert got.shape == ref.shape, name
        np.testing.assert_array_equal(got, ref, err_msg=name)
    assert ck.quantization == {}
    c = ck.config
    assert c["model_type"] == arch and c["tie_word_embeddings"] is False
    for key in DIMS:
        assert c[key] == pytest.approx(DIMS[key]), key
    assert c["head_dim"] == 16
    assert c["attention_bias"] is (arch == "qwen2")
    assert ck.generation_config == {"bos_token_id": 1, "eos_token_id": 2}


@pytest.mark.parametrize("qtype,bits", [(QT.Q8_0, 8), (QT.Q4_0, 4), (QT.Q4_1, 4)])
def test_quantized_llama_unpermuted_within_quant_error(tmp_path: Path, qtype, bits) -> None:
    sd = make_hf("llama", tie=True)
    path = tmp_path / "q.gguf"
    write_gguf(path, "llama", sd, qtype)
    ck = read_weights(path, tokenizer=False)
    assert ck.config["tie_word_embeddings"] is True and "lm_head.weight" not in ck.tensors
    linears = {n[: -len(".weight")] for n, a in sd.items() if a.ndim == 2}
    assert set(ck.quantization) == linears
    assert set(ck.quantization.values()) == {(32, bits)}
    assert ck.tensors["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    for name, ref in sd.items():
        got = dequant(ck, name)
        assert got.shape == ref.shape, name
        if ref.ndim == 1:
            np.testing.assert_array_equal(got, ref, err_msg=name)
            continue
        # Same math as gguf's own dequantizer applied to the (HF-order) quantized rows
        own = gguf.quants.dequantize(gguf.quants.quantize(ref, qtype), qtype)
        np.testing.assert_allclose(got, own, rtol=1e-5, atol=1e-7, err_msg=name)
        # ... and within the format's error bound of the original HF weight
        blocks = np.abs(ref).reshape(ref.shape[0], -1, 32).max(-1, keepdims=True)
        bound = blocks / (2 ** (bits - 1) - 1) + 1e-6
        err = np.abs(got - ref).reshape(bound.shape[0], -1, 32)
        assert (err <= bound).all(), name


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(24, 5)
    for heads in (1, 3, 6):
        permuted = llama_cpp_permute(w, heads)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(np.array(unpermute_rows(mx.array(permuted), heads)), w)
    with pytest.raises(WeightsError):
        unpermute_rows(mx.zeros((10, 2)), 3)


def test_name_map() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight"
    assert hf_name("blk.7.attn_q.bias") == "model.layers.7.self_attn.q_proj.bias"
    assert hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_name("blk.3.ffn_down.scales") == "model.layers.3.mlp.down_proj.scales"
    assert hf_name("blk.3.ffn_gate_exps.weight") is None


def test_unknown_architecture(tmp_path: Path) -> None:
    sd = make_hf("llama", tie=True)
    path = tmp_path / "x.gguf"
    write_gguf(path, "gemma", sd)
    with pytest.raises(UnsupportedArchitectureError, match="gemma"):
        read_weights(path, tokenizer=False)


def test_garbage_gguf(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\x00\xff" * 50)
    with pytest.raises(WeightsError, match="bad.gguf"):
        read_weights(path, tokenizer=False)


@pytest.mark.demo
def test_demo_gguf_layout(demo_gguf: Path) -> None:
    ck = read_weights(demo_gguf)
    assert ck.tokenizer.encode("Hello world") == [19556, 905]
    c = ck.config
    assert (c["model_type"], c["num_hidden_layers"], c["hidden_size"]) == ("llama", 30, 576)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["tie_word_embeddings"] and c["rms_norm_eps"] == 1e-5 and c["rope_theta"] == 1e5
    assert ck.quantization["model.embed_tokens"] == (32, 8)
    assert ck.quantization["model.layers.0.self_attn.q_proj"] == (32, 4)
    assert len(ck.quantization) == 1 + 30 * 7


@pytest.mark.demo
def test_demo_gguf_unpermute_matches_independent_dequant(demo_gguf: Path, demo_gguf_reader) -> None:
    """Layer-0 Q/K from gguf's own reader + dequantizer, un-permuted with transformers'
    reverse permutation, equal our lazily un-permuted MLX triplets."""
    DEMO = demo_gguf
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    proc = LlamaTensorProcessor(config={})
    reader = demo_gguf_reader
    raw = {t.name: t for t in reader.tensors if t.name.startswith("blk.0.attn_")}
    ck = read_weights(DEMO, tokenizer=False)
    for gname, heads in (("attn_q", 9), ("attn_k", 3), ("attn_v", 3)):
        t = raw[f"blk.0.{gname}.weight"]
        deq = gguf.quants.dequantize(t.data, t.tensor_type)
        if gname != "attn_v":
            deq = proc._reverse_permute_weights(deq, 9, heads)
        ours = dequant(ck, f"model.layers.0.self_attn.{gname[5]}_proj.weight")
        np.testing.assert_allclose(ours, deq, rtol=1e-5, atol=1e-7, err_msg=gname)


def test_truncated_gguf(tmp_path: Path) -> None:
    path = tmp_path / "t.gguf"
    write_gguf(path, "llama", make_hf("llama", tie=True), QT.Q8_0)
    data = path.read_bytes()
    for cut in (len(data) - 10, 200, 30):
        path.write_bytes(data[:cut])
        with pytest.raises(WeightsError, match="truncated"):
            read_weights(path, tokenizer=False)
