"""Random Flash-Next (qwen4_exp) weights in the real layout, written with numpy only.

`dims="tiny"`: the QWEN38.md test config (vocab 512, hidden 64, 8 layers, ...), seconds on CPU.
`dims="flash"`: the real Flash-Next shapes (hidden 2560, 24/2 heads x 256, GDN 16/48 x 128,
indexer 4 x 128 budget 2048, hc 4 x 320, real vocab) with 4 layers, and two things scaled
down to fit a 24 GB machine: 16 experts (real: 512; top-10 and width 640 kept) and an n-gram
table with ngram_vocab_size_base 20,000 (real: 20,000,000; 160-wide rows and 128 shards kept).

Every parameter is randomized (norms, conv, gates, A_log, dt_bias too): HF's init leaves many
at trivial values that would hide mistakes. Each tensor's values depend only on (seed, name).
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np

from ..errors import InvalidOptionError
from ..models.ple import head_vocab_sizes, ngram_multipliers

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    hc_count=4,
    hc_lowrank=8,
    ple_layer_ids=[2],
    ple_embed_dim=64,
    ngram_vocab_size_base=1000,
    split_ngram_parts=4,
    indexer_n_heads=4,
    indexer_kv_heads=1,
    indexer_head_dim=16,
    indexer_budget=8,
    indexer_compress_ratio=4,
    eos_token_id=7,
    bos_token_id=7,
    max_position_embeddings=4096,
    mrope_section=[2, 1, 1],
)

FLASH = dict(
    vocab_size=248320,
    hidden_size=2560,
    num_hidden_layers=48,
    num_attention_heads=24,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=48,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    num_experts=16,  # real: 512 (scaled down to fit 24 GB RAM)
    num_experts_per_tok=10,
    moe_intermediate_size=640,
    shared_expert_intermediate_size=640,
    hc_count=4,
    hc_lowrank=320,
    ple_layer_ids=[2],
    ple_embed_dim=2560,
    ngram_vocab_size_base=20_000,  # real: 20,000,000 (a 102 GB table)
    split_ngram_parts=128,
    indexer_n_heads=4,
    indexer_kv_heads=1,
    indexer_head_dim=128,
    indexer_budget=2048,
    indexer_compress_ratio=4,
    eos_token_id=248044,
    bos_token_id=248044,
    max_position_embeddings=262144,
    mrope_section=[11, 11, 10],
)


def text_config(dims: str = "tiny", num_layers: int | None = None) -> dict:
    """The text_config dict of tiny or real-shape weights."""
    if dims not in ("tiny", "flash"):
        from ..errors import InvalidOptionError

        raise InvalidOptionError(f"dims={dims!r}: choose 'tiny' or 'flash'")
    base = dict(TINY if dims == "tiny" else FLASH)
    n = num_layers or (8 if dims == "tiny" else 4)
    mrope = base.pop("mrope_section")
    base["num_hidden_layers"] = n
    base.update(
        model_type="qwen4_exp_text",
        hidden_act="silu",
        output_gate_type="sigmoid",
        rms_norm_eps=1e-6,
        linear_conv_kernel_dim=4,
        norm_topk_prob=True,
        ple_conv_kernel_size=4,
        ngram_size=3,
        heads_per_ngram=8,
        make_ngram_vocab_size_divisible_by=128,
        seed=1234,
        tie_word_embeddings=False,
        attention_bias=False,
        mtp_num_hidden_layers=1,
        layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(n)],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": mrope,
            "mrope_interleaved": True,
        },
    )
    return base


def tensor_shapes(c: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every weights tensor: name -> (shape, kind); kind picks the random distribution."""
    H, hc, V = c["hidden_size"], c["hc_count"], c["vocab_size"]
    W = H * hc
    out: dict[str, tuple[tuple[int, ...], str]] = {}

    def lin(name: str, o: int, i: int) -> None:
        out[name + ".weight"] = ((o, i), "linear")

    def zc(name: str, n: int) -> None:
        out[name + ".weight"] = ((n,), "zc_norm")

    def hyper(p: str, inject: bool = True) -> None:
        zc(p + ".hc_norm", W)
        lin(p + ".input_mix_weight_down", c["hc_lowrank"], W)
        lin(p + ".input_mix_weight_up", W, c["hc_lowrank"])
        if inject:
            lin(p + ".block_inject_weight", hc, W)

    def attention(p: str) -> None:
        nh, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        lin(p + ".q_proj", 2 * nh * d, H)
        lin(p + ".k_proj", nkv * d, H)
        lin(p + ".v_proj", nkv * d, H)
        lin(p + ".o_proj", H, nh * d)
        zc(p + ".q_norm", d)
        zc(p + ".k_norm", d)
        ih, idim = c["indexer_n_heads"], c["indexer_head_dim"]
        lin(p + ".indexer.index_qk_proj", (ih + 1) * idim, H)
        zc(p + ".indexer.q_layernorm", idim)
        zc(p + ".indexer.k_layernorm", idim)

    def moe(p: str) -> None:
        E, inter, sh = (
            c["num_experts"],
            c["moe_intermediate_size"],
            c["shared_expert_intermediate_size"],
        )
        out[p + ".gate.weight"] = ((E, H), "router")
        out[p + ".experts.gate_up_proj"] = ((E, 2 * inter, H), "linear")
        out[p + ".experts.down_proj"] = ((E, H, inter), "linear")
        lin(p + ".shared_expert.gate_proj", sh, H)
        lin(p + ".shared_expert.up_proj", sh, H)
        lin(p + ".shared_expert.down_proj", H, sh)
        lin(p + ".shared_expert_gate", 1, H)

    def gdn(p: str) -> None:
        hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        conv = 2 * hk * dk + hv * dv
        lin(p + ".in_proj_qkv", conv, H)
        lin(p + ".in_proj_z", hv * dv, H)
        lin(p + ".in_proj_b", hv, H)
        lin(p + ".in_proj_a", hv, H)
        out[p + ".conv1d.weight"] = ((conv, 1, c["linear_conv_kernel_dim"]), "conv")
        out[p + ".dt_bias"] = ((hv,), "dt_bias")
        out[p + ".A_log"] = ((hv,), "A_log")
        out[p + ".norm.weight"] = ((dv,), "plain_norm")
        lin(p + ".out_proj", H, hv * dv)

    def ple(p: str, index: int) -> None:
        E = c["ple_embed_dim"]
        heads = (c["ngram_size"] - 1) * c["heads_per_ngram"]
        sizes = head_vocab_sizes(c["ngram_vocab_size_base"], heads, index)
        div = c["make_ngram_vocab_size_divisible_by"]
        rows = -(-sum(sizes) // div) * div
        parts = c["split_ngram_parts"]
        if rows % parts:
            raise InvalidOptionError(
                f"{rows} n-gram rows do not split into {parts} equal shards (split_ngram_parts)"
            )
        for s in range(parts):
            out[f"{p}.ple_embedding.ngram_embedding.shard_{s}.weight"] = (
                (rows // parts, E // heads),
                "table",
            )
        for b in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
            out[f"{p}.ple_embedding.{b}"] = ((), f"buffer:{b}:{index}")
        lin(p + ".key_proj", W, E)
        lin(p + ".value_proj", H, E)
        zc(p + ".norm_key", W)
        zc(p + ".norm_query", W)
        zc(p + ".norm_conv", W)
        out[p + ".conv1d.weight"] = ((W, 1, c["ple_conv_kernel_size"]), "conv")

    def layer(p: str, kind: str, ple_index: int | None) -> None:
        if kind == "linear_attention":
            gdn(p + ".linear_attn")
        else:
            attention(p + ".self_attn")
        moe(p + ".mlp")
        hyper(p + ".attn_hyper_connection")
        hyper(p + ".mlp_hyper_connection")
        if ple_index is not None:
            ple(p + ".ple", ple_index)

    root = "model.language_model"
    out[root + ".embed_tokens.weight"] = ((V, H), "embed")
    ple_ids = c["ple_layer_ids"]
    for i, kind in enumerate(c["layer_types"]):
        idx = ple_ids.index(i + 1) if (i + 1) in ple_ids else None
        layer(f"{root}.layers.{i}", kind, idx)
    hyper(root + ".hyper_connection_mixer", inject=False)
    lin("lm_head", V, H)
    for m in range(c.get("mtp_num_hidden_layers", 0)):
        layer(f"mtp.layers.{m}", "full_attention", None)
    if c.get("mtp_num_hidden_layers", 0):
        hyper("mtp.hyper_connection_mixer", inject=False)
        lin("mtp.fc_embedding", H, H)
        lin("mtp.fc_hidden", H, H)
        zc("mtp.pre_fc_norm_embedding", H)
        zc("mtp.pre_fc_norm_hidden", W)
    return out


_CHUNK = 1 << 24  # elements per generated piece: multi-GB tensors never sit in memory whole


def _values(name: str, shape: tuple[int, ...], kind: str, seed: int, c: dict):
    """Yield the tensor's values in row chunks (a single chunk for small tensors)."""
    if kind.startswith("buffer:"):
        _, which, index = kind.split(":")
        heads = (c["ngram_size"] - 1) * c["heads_per_ngram"]
        sizes = head_vocab_sizes(c["ngram_vocab_size_base"], heads, int(index))
        if which == "layer_multipliers":
            vals = ngram_multipliers(c["vocab_size"], c["ngram_size"], int(index), c["seed"])
        elif which == "ngram_heads_vocab_sizes":
            vals = sizes
        else:
            vals = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        yield np.asarray(vals, dtype=np.int64)
        return
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if kind == "A_log":
        rng.standard_normal(shape, dtype=np.float32)  # drawn and unused: keeps the stream
        yield np.log(rng.uniform(0.5, 4.0, shape)).astype(np.float32)
        return
    # the exact float32 operations matter: the committed fixtures fingerprint the bytes
    ops = {
        "linear": lambda n: n / np.float32(np.sqrt(shape[-1])),
        "router": lambda n: n * np.float32(2.0 / np.sqrt(shape[-1])),
        "embed": lambda n: n,
        "table": lambda n: n,
        "zc_norm": lambda n: n * np.float32(0.2),
        "plain_norm": lambda n: 1.0 + n * np.float32(0.2),
        "conv": lambda n: n * np.float32(0.5),
        "dt_bias": lambda n: n * np.float32(0.5),
    }[kind]
    row = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    step = max(1, _CHUNK // row) if len(shape) > 1 else shape[0]
    for start in range(0, shape[0], step):
        n = rng.standard_normal((min(step, shape[0] - start), *shape[1:]), dtype=np.float32)
        yield ops(n)


_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    u = a.astype(np.float32).view(np.uint32)
    # round to nearest even on the dropped 16 bits
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def write_safetensors(
    path: Path, specs: dict[str, tuple[tuple[int, ...], str]], make, dtype: str
) -> None:
    """Minimal streaming safetensors writer (numpy has no bfloat16): `make(name)` yields each
    tensor in turn, so multi-GB weights never sit in memory at once. Floats are written
    in `dtype`, buffers (kind "buffer:*") as I64."""
    itemsize = {"F32": 4, "BF16": 2, "F16": 2}
    header, offset, order = {}, 0, sorted(specs)
    for name in order:
        shape, kind = specs[name]
        if kind.startswith("buffer:"):
            shape = (len(next(make(name))),)
            st = "I64"
            nbytes = 8 * shape[0]
        else:
            st = _ST_DTYPES[dtype]
            nbytes = int(np.prod(shape)) * itemsize[st]
        header[name] = {
            "dtype": st,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((-len(h)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for name in order:
            written = 0
            for a in make(name):
                if a.dtype == np.int64:
                    raw = a.tobytes()
                elif dtype == "bfloat16":
                    raw = _to_bf16_bits(a).tobytes()
                else:
                    raw = a.astype(np.dtype(dtype)).tobytes()
                f.write(raw)
                written += len(raw)
            start, end = header[name]["data_offsets"]
            if written != end - start:
                raise AssertionError(f"{name}: {written} bytes, header says {end - start}")


def full_config(c: dict) -> dict:
    return {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "tie_word_embeddings": False,
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "text_config": c,
    }


def write_tiny_qwen4_exp(
    directory: str | Path,
    seed: int = 0,
    dims: str = "tiny",
    num_layers: int | None = None,
    dtype: str = "float32",
) -> Path:
    """Write config.json, model.safetensors, generation_config.json and a tokenizer.

    Deterministic in (seed, dims, num_layers, dtype). Returns the directory.
    """
    if dtype not in _ST_DTYPES:
        from ..errors import InvalidOptionError

        raise InvalidOptionError(f"dtype={dtype!r}: choose one of {', '.join(_ST_DTYPES)}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    c = text_config(dims, num_layers)
    cfg = full_config(c)
    if dims == "flash":
        cfg["_qwen38_note"] = (
            "real Flash-Next shapes with 4 layers; scaled down to fit 24 GB RAM: 16 experts "
            "(real 512) and ngram_vocab_size_base 20000 (real 20000000)"
        )
    specs = tensor_shapes(c)
    write_safetensors(
        out / "model.safetensors",
        specs,
        lambda name: _values(name, *specs[name], seed, c),
        dtype,
    )
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    eos = c["eos_token_id"]
    gen = {"bos_token_id": eos, "eos_token_id": [1 if dims == "tiny" else 248046, eos]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    from ..templates import write_tiny_tokenizer

    write_tiny_tokenizer(out)
    return out
