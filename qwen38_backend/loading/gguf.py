"""GGUF files of the dense family (llama / qwen2 / qwen3), read natively by `mx.load`.

Q4_0 / Q4_1 / Q8_0 tensors arrive as MLX affine triplets (uint32 weight, scales, biases;
group size 32) and stay quantized. Names are mapped to Hugging Face names, the HF config is
synthesized from the metadata, and llama's Q/K rows are un-permuted back to HF (NeoX) order.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import ConfigError, UnsupportedArchitectureError, WeightsError
from .gguf_header import validate_gguf
from .quant import check_shapes, infer_bits

GGUF_GROUP_SIZE = 32

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_SUFFIXES = ("weight", "scales", "biases", "bias")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.([a-z]+)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.([a-z]+)$")


def hf_name(name: str) -> str | None:
    """Hugging Face name for a GGUF tensor name, or None if it is not a known tensor."""
    m = _BLOCK_RE.match(name)
    if m:
        layer, base, suffix = m.groups()
        if base in _BLOCK and suffix in _SUFFIXES:
            return f"model.layers.{layer}.{_BLOCK[base]}.{suffix}"
        return None
    m = _TOP_RE.match(name)
    if m and m.group(1) in _TOP_LEVEL and m.group(2) in _SUFFIXES:
        return f"{_TOP_LEVEL[m.group(1)]}.{m.group(2)}"
    return None


def unpermute_rows(a: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE order -> HF rotate-half order).

    Per head the converter maps HF rows [2, head_dim/2] to [head_dim/2, 2]; rows are
    reshaped to [n_head, head_dim/2, 2, ...] and the two middle axes swapped back. Works on
    weights, per-row scales/biases (groups run along the input axis) and 1-D biases. Lazy.
    """
    rows = a.shape[0]
    if n_head <= 0 or rows % (2 * n_head):
        raise WeightsError(f"cannot un-permute {rows} rows into {n_head} heads of even size")
    half = rows // n_head // 2
    return a.reshape(n_head, half, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _value(v: Any) -> Any:
    """Plain Python value of a metadata entry (MLX scalars -> int/float/bool)."""
    if isinstance(v, mx.array):
        if v.size != 1:
            return v.tolist()
        x = v.item()
        # float32 metadata (eps, theta): keep the shortest decimal, e.g. 1e-05 not 9.99e-06
        return float(str(np.float32(x))) if v.dtype == mx.float32 else x
    return v


class _Meta:
    """Typed access to `{arch}.*` metadata keys with errors naming the file and key."""

    def __init__(self, path: Path, metadata: dict[str, Any], arch: str):
        self.path, self.metadata, self.arch = path, metadata, arch

    def get(self, key: str, default: Any = None, *, prefixed: bool = True) -> Any:
        full = f"{self.arch}.{key}" if prefixed else key
        return _value(self.metadata[full]) if full in self.metadata else default

    def int(self, key: str, default: int | None = None) -> int:
        v = self.get(key, default)
        if v is None:
            raise ConfigError(f"{self.path}: GGUF metadata key {self.arch}.{key} is missing")
        if isinstance(v, list):
            raise ConfigError(
                f"{self.path}: {self.arch}.{key} varies per layer ({v[:4]}...); not supported"
            )
        return int(v)


def synthesize_config(
    path: Path, metadata: dict[str, Any], tensors: dict[str, mx.array]
) -> dict[str, Any]:
    """HF-style config.json dict from GGUF metadata."""
    arch = _value(metadata.get("general.architecture"))
    if arch not in ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    m = _Meta(path, metadata, arch)
    hidden, heads = m.int("embedding_length"), m.int("attention.head_count")
    head_dim = m.int("attention.key_length", hidden // heads)
    config: dict[str, Any] = {
        "model_type": arch,
        "architectures": [ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": m.int("feed_forward_length"),
        "num_hidden_layers": m.int("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": m.int("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(m.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(m.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": m.int("context_length", 2048),
        "vocab_size": _vocab_size(m, tensors),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
    }
    rope_dims = m.get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        config["partial_rotary_factor"] = int(rope_dims) / head_dim
    config.update(_rope_scaling(m))
    config.update(_special_ids(m))
    return config


def _vocab_size(m: _Meta, tensors: dict[str, mx.array]) -> int:
    v = m.get("vocab_size")
    if v is not None:
        return int(v)
    tokens = m.get("tokenizer.ggml.tokens", prefixed=False)
    if tokens is not None:
        return len(tokens)
    return int(tensors["token_embd.weight"].shape[0])


def _rope_scaling(m: _Meta) -> dict[str, Any]:
    kind = m.get("rope.scaling.type")
    if kind in (None, "none"):
        return {}
    if kind == "linear":
        return {
            "rope_scaling": {"rope_type": "linear", "factor": float(m.get("rope.scaling.factor"))}
        }
    raise UnsupportedArchitectureError(f"{m.path}: GGUF rope scaling {kind!r} is not supported")


def _special_ids(m: _Meta) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("bos", "eos", "pad"):
        v = m.get(f"tokenizer.ggml.{key}_token_id", prefixed=False)
        if v is not None:
            out[f"{key}_token_id"] = int(v)
    return out


def _map_tensors(
    path: Path, tensors: dict[str, mx.array], config: dict[str, Any]
) -> dict[str, mx.array]:
    """Rename to HF names; un-permute llama Q/K rows."""
    unknown = sorted(n for n in tensors if hf_name(n) is None and n != "rope_freqs.weight")
    if unknown:
        raise WeightsError(
            f"{path}: GGUF tensors with no known Hugging Face name: {', '.join(unknown[:10])}"
        )
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights: dict[str, mx.array] = {}
    for name, arr in tensors.items():
        target = hf_name(name)
        if target is None:
            continue
        base = name.split(".")[2] if name.startswith("blk.") else ""
        if config["model_type"] == "llama" and base in heads:
            arr = unpermute_rows(arr, heads[base])
        weights[target] = arr
    return weights


def quantization_of(weights: dict[str, mx.array]) -> dict[str, tuple[int, int]]:
    """(32, bits) for every module with `.scales`, bits inferred from shapes and checked."""
    result: dict[str, tuple[int, int]] = {}
    for key in weights:
        if not key.endswith(".scales"):
            continue
        module = key[: -len(".scales")]
        w, s = weights[module + ".weight"], weights[key]
        bits = infer_bits(w, s, GGUF_GROUP_SIZE)
        check_shapes(module, w, s, GGUF_GROUP_SIZE, bits)
        result[module] = (GGUF_GROUP_SIZE, bits)
    return result


def load_gguf(path: Path) -> tuple[dict[str, Any], dict[str, mx.array], dict[str, Any], dict]:
    """Read a GGUF file: (config, HF-named weights, generation_config, raw metadata)."""
    validate_gguf(path)
    try:
        tensors, metadata = mx.load(str(path), return_metadata=True)
    except Exception as e:  # MLX raises RuntimeError / ValueError on bad files
        raise WeightsError(f"{path}: cannot read GGUF file: {e}") from e
    tensors = dict(tensors)
    config = synthesize_config(path, metadata, tensors)
    if "rope_freqs.weight" in tensors:
        config["rope_freqs"] = [float(x) for x in tensors["rope_freqs.weight"].tolist()]
    weights = _map_tensors(path, tensors, config)
    generation_config = {
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config
    }
    return config, weights, generation_config, metadata
