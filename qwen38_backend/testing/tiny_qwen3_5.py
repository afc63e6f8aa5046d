"""Random qwen3_5 (Qwen3.8-27B layout) weights: config.json, generation_config.json,
model.safetensors and a tiny tokenizer. numpy only; deterministic in the seed.

Two sizes: the tiny test config of QWEN38.md (default) and `dims="27b"`: the real 27B
shapes (vocab 248320, hidden 5120, ...) with fewer layers, for real-shape load tests and CPU
benchmarks. Every parameter is random (norms, conv, gates, A_log, dt_bias included), because
the usual init leaves norms and gates at trivial values that hide bugs.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..errors import InvalidOptionError

TINY_TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    rope_theta=10000.0,
    mrope_section=[2, 1, 1],
    max_position_embeddings=4096,
)

DIMS_27B = dict(
    vocab_size=248320,
    hidden_size=5120,
    intermediate_size=17408,
    num_hidden_layers=64,
    num_attention_heads=24,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    rope_theta=10000000.0,
    mrope_section=[11, 11, 10],
    max_position_embeddings=262144,
)

# tiny tokenizer ids (qwen38_backend.templates): <|im_end|> 1, <|endoftext|> 7
TINY_EOS = [1, 7]
TINY_BOS = 7

_ROW_BLOCK = 1 << 22  # elements generated at a time (bounds memory for real-size tensors)


def text_config(dims: str = "tiny", num_layers: int | None = None, **overrides) -> dict:
    """The `text_config` dict for the chosen dims (HF field names)."""
    if dims not in ("tiny", "27b"):
        raise InvalidOptionError(f"dims must be 'tiny' or '27b', got {dims!r}")
    d = dict(TINY_TEXT if dims == "tiny" else DIMS_27B)
    if num_layers is not None:
        d["num_hidden_layers"] = int(num_layers)
    unknown = set(overrides) - set(d) - {"rms_norm_eps", "mtp_num_hidden_layers"}
    if unknown:
        raise InvalidOptionError(f"unknown qwen3_5 tiny overrides: {sorted(unknown)}")
    d.update(overrides)
    n = d["num_hidden_layers"]
    section = d.pop("mrope_section")
    theta = d.pop("rope_theta")
    return {
        "model_type": "qwen3_5_text",
        **d,
        "hidden_act": "silu",
        "rms_norm_eps": d.get("rms_norm_eps", 1e-6),
        "attention_bias": False,
        "attn_output_gate": True,
        "full_attention_interval": 4,
        "layer_types": [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)
        ],
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": theta,
            "partial_rotary_factor": 0.25,
            "mrope_section": section,
            "mrope_interleaved": True,
        },
        "mtp_num_hidden_layers": d.get("mtp_num_hidden_layers", 1),
        "tie_word_embeddings": False,
        "bos_token_id": TINY_BOS,
        "eos_token_id": TINY_BOS,
    }


def tensor_shapes(tc: dict, with_mtp: bool = True) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the weights with its HF name and shape, in a fixed order."""
    H, inter, V = tc["hidden_size"], tc["intermediate_size"], tc["vocab_size"]
    nh, nkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    hk, hv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
    dk, dv, K = tc["linear_key_head_dim"], tc["linear_value_head_dim"], tc["linear_conv_kernel_dim"]
    conv_dim = 2 * hk * dk + hv * dv

    def attention(p: str) -> list[tuple[str, tuple[int, ...]]]:
        return [
            (f"{p}.self_attn.q_proj.weight", (2 * nh * hd, H)),
            (f"{p}.self_attn.k_proj.weight", (nkv * hd, H)),
            (f"{p}.self_attn.v_proj.weight", (nkv * hd, H)),
            (f"{p}.self_attn.o_proj.weight", (H, nh * hd)),
            (f"{p}.self_attn.q_norm.weight", (hd,)),
            (f"{p}.self_attn.k_norm.weight", (hd,)),
        ]

    def mlp_norms(p: str) -> list[tuple[str, tuple[int, ...]]]:
        return [
            (f"{p}.mlp.gate_proj.weight", (inter, H)),
            (f"{p}.mlp.up_proj.weight", (inter, H)),
            (f"{p}.mlp.down_proj.weight", (H, inter)),
            (f"{p}.input_layernorm.weight", (H,)),
            (f"{p}.post_attention_layernorm.weight", (H,)),
        ]

    out = [("model.language_model.embed_tokens.weight", (V, H))]
    for i, kind in enumerate(tc["layer_types"]):
        p = f"model.language_model.layers.{i}"
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            out += [
                (f"{a}.in_proj_qkv.weight", (conv_dim, H)),
                (f"{a}.in_proj_z.weight", (hv * dv, H)),
                (f"{a}.in_proj_b.weight", (hv, H)),
                (f"{a}.in_proj_a.weight", (hv, H)),
                (f"{a}.conv1d.weight", (conv_dim, 1, K)),
                (f"{a}.A_log", (hv,)),
                (f"{a}.dt_bias", (hv,)),
                (f"{a}.norm.weight", (dv,)),
                (f"{a}.out_proj.weight", (H, hv * dv)),
            ]
        else:
            out += attention(p)
        out += mlp_norms(p)
    out += [("model.language_model.norm.weight", (H,)), ("lm_head.weight", (V, H))]
    if with_mtp and tc.get("mtp_num_hidden_layers", 0):
        out += [
            ("mtp.fc.weight", (H, 2 * H)),
            ("mtp.pre_fc_norm_embedding.weight", (H,)),
            ("mtp.pre_fc_norm_hidden.weight", (H,)),
            ("mtp.norm.weight", (H,)),
        ]
        out += attention("mtp.layers.0") + mlp_norms("mtp.layers.0")
    return out


def _random(name: str, shape: tuple[int, ...], seed: int) -> Iterator[np.ndarray]:
    """fp32 values of one tensor, in row blocks; the stream depends only on (seed, name)."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    n = int(np.prod(shape))
    if name.endswith("A_log"):
        yield np.log(rng.uniform(0.05, 2.0, n)).astype(np.float32)
        return
    if name.endswith("dt_bias"):
        yield (0.5 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
        return
    if name.endswith("linear_attn.norm.weight"):  # plain RMSNormGated weight (not 1 + w)
        yield (1.0 + 0.2 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
        return
    if len(shape) == 1:  # zero-centred norms: the model uses 1 + w
        yield (0.2 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
        return
    if name.endswith("conv1d.weight"):
        yield (0.4 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)
        return
    if name.endswith("embed_tokens.weight"):
        scale = 1.0
    else:
        scale = 1.0 / np.sqrt(shape[-1])  # keeps activations O(1) through the stack
    for start in range(0, n, _ROW_BLOCK):
        m = min(_ROW_BLOCK, n - start)
        yield rng.standard_normal(m, dtype=np.float32) * np.float32(scale)


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns (round to nearest even)."""
    u = x.astype(np.float32).view(np.uint32)
    u = u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
    return (u >> np.uint32(16)).astype(np.uint16)


def write_safetensors(
    path: Path, tensors: list[tuple[str, tuple[int, ...]]], seed: int, dtype: str
) -> None:
    """Stream a safetensors file (header, then each tensor's random blocks)."""
    itemsize = {"float32": 4, "bfloat16": 2}[dtype]
    st_dtype = {"float32": "F32", "bfloat16": "BF16"}[dtype]
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        size = int(np.prod(shape)) * itemsize
        header[name] = {
            "dtype": st_dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    blob = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape in tensors:
            for block in _random(name, shape, seed):
                data = block if dtype == "float32" else _to_bf16_bits(block)
                f.write(np.ascontiguousarray(data).tobytes())


def write_tiny_qwen3_5(
    directory: str | Path,
    seed: int = 0,
    *,
    dims: str = "tiny",
    num_layers: int | None = None,
    dtype: str = "float32",
    with_mtp: bool = True,
    tokenizer: bool = True,
    **overrides,
) -> Path:
    """Write config.json, generation_config.json, model.safetensors (+ tokenizer) to directory."""
    if dtype in ("bf16",):
        dtype = "bfloat16"
    if dtype in ("fp32",):
        dtype = "float32"
    if dtype not in ("float32", "bfloat16"):
        raise InvalidOptionError(f"dtype must be float32 or bfloat16, got {dtype!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tc = text_config(dims, num_layers, **overrides)
    if not with_mtp:
        tc["mtp_num_hidden_layers"] = 0
    tc["dtype"] = dtype
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": tc,
        "tie_word_embeddings": False,
        "dtype": dtype,
        "transformers_version": "5.23.0",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    gen = {"bos_token_id": TINY_BOS, "eos_token_id": TINY_EOS, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_safetensors(out / "model.safetensors", tensor_shapes(tc, with_mtp), seed, dtype)
    if tokenizer:
        from ..templates import write_tiny_tokenizer  # lazily: tokenizers is only needed here

        write_tiny_tokenizer(out)
    return out


def fingerprint(directory: str | Path) -> str:
    """sha256 of config.json + model.safetensors: catches any drift in the generator."""
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        with open(Path(directory) / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()
