"""Safetensors weights: single vs sharded, corruption, MLX affine 4/8-bit quantization."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import save_file

from qwen38_backend.errors import ConfigError, ModelNotFoundError, WeightsError
from qwen38_backend.loading import Weights, read_weights

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}


def tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {"model.embed_tokens.weight": rng.normal(size=(96, 64)).astype(np.float32)}
    for i in range(2):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = rng.normal(size=(64, 64)).astype(np.float16)
        out[p + "mlp.down_proj.weight"] = rng.normal(size=(64, 128)).astype(np.float32)
        out[p + "input_layernorm.weight"] = rng.normal(size=(64,)).astype(np.float32)
    return out


def write_dir(path: Path, config: dict | None = None, **files: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or CONFIG))
    for name, arrays in files.items():
        save_file(arrays, str(path / name.replace("__", ".")))
    return path


def write_sharded(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    names = sorted(arrays)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}  # fmt: skip
    write_dir(path)
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: arrays[k] for k in keys}, str(path / shard))
        weight_map.update(dict.fromkeys(keys, shard))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def test_single_file_as_stored(tmp_path: Path) -> None:
    ref = tensors()
    d = write_dir(tmp_path / "m", model__safetensors=ref)
    (d / "generation_config.json").write_text('{"eos_token_id": [2, 3]}')
    ck = read_weights(d, tokenizer=False)
    assert isinstance(ck, Weights)
    assert ck.config == CONFIG and ck.generation_config == {"eos_token_id": [2, 3]}
    assert ck.format == "safetensors" and ck.source == d and ck.quantization == {}
    assert set(ck.tensors) == set(ref)
    for k, v in ref.items():
        assert ck.tensors[k].dtype == {np.float16: mx.float16, np.float32: mx.float32}[v.dtype.type]
        np.testing.assert_array_equal(np.array(ck.tensors[k]), v)


def test_bf16_kept(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as save_torch

    t = torch.randn(8, 32).to(torch.bfloat16)
    (tmp_path / "config.json").write_text("{}")
    save_torch({"w": t}, str(tmp_path / "model.safetensors"))
    w = read_weights(tmp_path, tokenizer=False).tensors["w"]
    assert w.dtype == mx.bfloat16
    np.testing.assert_array_equal(np.array(w.astype(mx.float32)), t.float().numpy())


def test_sharded_equals_single(tmp_path: Path) -> None:
    ref = tensors(1)
    single = read_weights(write_dir(tmp_path / "a", model__safetensors=ref), tokenizer=False)
    sharded = read_weights(write_sharded(tmp_path / "b", ref), tokenizer=False)
    assert set(single.tensors) == set(sharded.tensors) == set(ref)
    for k in ref:
        np.testing.assert_array_equal(np.array(single.tensors[k]), np.array(sharded.tensors[k]))


def test_missing_shard(tmp_path: Path) -> None:
    d = write_sharded(tmp_path / "m", tensors())
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightsError, match="model-00002-of-00002.safetensors"):
        read_weights(d, tokenizer=False)


def test_tensor_missing_from_its_shard(tmp_path: Path) -> None:
    d = write_sharded(tmp_path / "m", tensors())
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.9.ghost.weight"] = "model-00001-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match="model.layers.9.ghost.weight"):
        read_weights(d, tokenizer=False)


def test_corrupt_header(tmp_path: Path) -> None:
    d = write_dir(tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"\xff" * 64)
    with pytest.raises(WeightsError, match=r"model\.safetensors.*corrupt"):
        read_weights(d, tokenizer=False)
    (d / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(WeightsError, match=r"model\.safetensors"):
        read_weights(d, tokenizer=False)


def test_truncated_file(tmp_path: Path) -> None:
    d = write_dir(tmp_path / "m", model__safetensors=tensors())
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(WeightsError, match="truncated"):
        read_weights(d, tokenizer=False)


def test_missing_and_invalid_config(tmp_path: Path) -> None:
    d = write_dir(tmp_path / "m", model__safetensors=tensors())
    (d / "config.json").unlink()
    with pytest.raises(ConfigError, match="config.json"):
        read_weights(d, tokenizer=False)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="invalid JSON"):
        read_weights(d, tokenizer=False)


def test_missing_path_and_no_weights(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        read_weights(tmp_path / "nope", tokenizer=False)
    d = write_dir(tmp_path / "empty")
    with pytest.raises(WeightsError, match="model.safetensors.index.json"):
        read_weights(d, tokenizer=False)


def quantized_dir(path: Path, bits: int, group_size: int, quant_key: str = "quantization"):
    """An mlx-lm style quantized directory; returns (dir, float reference, quantized triplets)."""
    rng = np.random.default_rng(bits)
    ref = {
        "model.layers.0.mlp.up_proj": rng.normal(size=(128, 256)).astype(np.float32),
        "model.layers.0.mlp.down_proj": rng.normal(size=(256, 128)).astype(np.float32),
    }
    arrays = {"model.norm.weight": np.ones(128, np.float32)}
    triplets = {}
    for module, w in ref.items():
        q, s, b = mx.quantize(mx.array(w), group_size=group_size, bits=bits)
        triplets[module] = (q, s, b)
        arrays |= {module + ".weight": np.array(q), module + ".scales": np.array(s),
                   module + ".biases": np.array(b)}  # fmt: skip
    config = {**CONFIG, quant_key: {"group_size": group_size, "bits": bits}}
    return write_dir(path, config, model__safetensors=arrays), ref, triplets


@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 32), (4, 32), (8, 128)])
def test_quantized_dirs(tmp_path: Path, bits: int, group_size: int) -> None:
    d, ref, triplets = quantized_dir(tmp_path / "q", bits, group_size)
    ck = read_weights(d, tokenizer=False)
    assert ck.quantization == dict.fromkeys(ref, (group_size, bits))
    for module, w in ref.items():
        q, s, b = (ck.tensors[module + x] for x in (".weight", ".scales", ".biases"))
        assert q.dtype == mx.uint32
        got = np.array(mx.dequantize(q, s, b, group_size=group_size, bits=bits))
        want = np.array(mx.dequantize(*triplets[module], group_size=group_size, bits=bits))
        np.testing.assert_array_equal(got, want)
        # MLX affine error: under one step, step = (max - min) / (2^bits - 1) (the grid is
        # shifted so that zero is exact, which can cost up to half a step at the edges)
        g = w.reshape(w.shape[0], -1, group_size)
        step = (g.max(-1, keepdims=True) - g.min(-1, keepdims=True)) / (2**bits - 1)
        err = np.abs(got - w).reshape(g.shape)
        assert (err <= step + 1e-5).all()
        assert err.max() > 0


def test_quantization_config_key_and_overrides(tmp_path: Path) -> None:
    d, ref, _ = quantized_dir(tmp_path / "q", 4, 64, quant_key="quantization_config")
    assert read_weights(d, tokenizer=False).quantization == dict.fromkeys(ref, (64, 4))
    # per-module override: rewrite down_proj at 8 bits, group 64
    cfg = json.loads((d / "config.json").read_text())
    w = mx.array(ref["model.layers.0.mlp.down_proj"])
    q, s, b = mx.quantize(w, group_size=64, bits=8)
    loaded = {k: np.array(v) for k, v in mx.load(str(d / "model.safetensors")).items()}
    m = "model.layers.0.mlp.down_proj"
    loaded |= {m + ".weight": np.array(q), m + ".scales": np.array(s), m + ".biases": np.array(b)}
    save_file(loaded, str(d / "model.safetensors"))
    with pytest.raises(WeightsError, match="down_proj"):
        read_weights(d, tokenizer=False)  # global (64, 4) does not fit the 8-bit shapes
    cfg["quantization_config"][m] = {"bits": 8}  # group_size from the global
    (d / "config.json").write_text(json.dumps(cfg))
    ck = read_weights(d, tokenizer=False)
    assert ck.quantization[m] == (64, 8)
    assert ck.quantization["model.layers.0.mlp.up_proj"] == (64, 4)
    cfg["quantization_config"][m] = False
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="unquantized"):
        read_weights(d, tokenizer=False)


def test_scales_without_quant_config(tmp_path: Path) -> None:
    d, _, _ = quantized_dir(tmp_path / "q", 4, 64)
    (d / "config.json").write_text(json.dumps(CONFIG))
    with pytest.raises(WeightsError, match="quantization"):
        read_weights(d, tokenizer=False)


def test_weights_are_lazy(tmp_path: Path) -> None:
    """Loading must not read tensor data: a file whose data bytes are zeroed after loading
    still yields zeros on first eval (memory-mapped / lazy read)."""
    d = write_dir(tmp_path / "m", model__safetensors={"w": np.ones((256, 256), np.float32)})
    ck = read_weights(d, tokenizer=False)
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-4:] = np.zeros(1, np.float32).tobytes()
    f.write_bytes(bytes(raw))
    assert float(np.array(ck.tensors["w"])[-1, -1]) == 0.0
