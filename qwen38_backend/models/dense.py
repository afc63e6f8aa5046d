"""The dense family: llama, qwen2 (qkv bias) and qwen3 (q/k norm), tied or untied embeddings."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..config import field, text_config
from ..kv.contiguous import ContiguousKV
from ..state import SequenceState
from .base import CausalLM
from .layers import Attention, PreNormBlock, RMSNorm, SwiGLU, rope_from_config


@dataclass
class DenseConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_interleaved: bool = False

    @classmethod
    def from_dict(cls, config: dict) -> DenseConfig:
        c = text_config(config)
        mtype = field(c, "model_type", str)
        where = f"config.json ({mtype})"
        hidden = field(c, "hidden_size", int, where=where)
        heads = field(c, "num_attention_heads", int, where=where)
        # transformers 5 writes rope_parameters; older configs rope_theta + rope_scaling.
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        theta = field(c, "rope_theta", float, rope.get("rope_theta", 10000.0), where)
        scaled = rope.get("rope_type", rope.get("type")) not in (None, "default")
        attn_bias = field(c, "attention_bias", bool, mtype == "qwen2", where)
        return cls(
            model_type=mtype,
            vocab_size=field(c, "vocab_size", int, where=where),
            hidden_size=hidden,
            intermediate_size=field(c, "intermediate_size", int, where=where),
            num_hidden_layers=field(c, "num_hidden_layers", int, where=where),
            num_attention_heads=heads,
            num_key_value_heads=field(c, "num_key_value_heads", int, heads, where),
            head_dim=field(c, "head_dim", int, hidden // max(heads, 1), where),
            rms_norm_eps=field(c, "rms_norm_eps", float, 1e-6, where),
            rope_theta=theta,
            rope_scaling=rope if scaled else None,
            max_position_embeddings=field(c, "max_position_embeddings", int, 4096, where),
            tie_word_embeddings=field(c, "tie_word_embeddings", bool, False, where),
            qkv_bias=attn_bias,
            o_bias=attn_bias and mtype == "llama",
            mlp_bias=field(c, "mlp_bias", bool, False, where),
            qk_norm=mtype == "qwen3",
            rope_interleaved=bool(c.get("rope_interleaved", False)),
        )


class DenseBlock(PreNormBlock):
    def __init__(self, cfg: DenseConfig):
        super().__init__()
        rope = rope_from_config(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, interleaved=cfg.rope_interleaved
        )
        self.self_attn = Attention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            rope,
            qkv_bias=cfg.qkv_bias,
            o_bias=cfg.o_bias,
            qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None,
        )
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def __call__(self, h: mx.array, kv: ContiguousKV, offset: int) -> mx.array:
        return self.attention_block(h, kv, offset)


class DenseBody(nn.Module):
    def __init__(self, cfg: DenseConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DenseBlock(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DenseModel(CausalLM):
    """Causal LM over token ids [T] of one sequence, writing K/V into `state`."""

    def __init__(self, cfg: DenseConfig):
        super().__init__(cfg)
        self.model = DenseBody(cfg)

    def make_state(self, kv_factory=ContiguousKV) -> SequenceState:
        return SequenceState([kv_factory() for _ in range(self.config.num_hidden_layers)])

    def hidden(self, ids: mx.array, state: SequenceState) -> mx.array:
        """Final-normed hidden states [T, hidden]."""
        offset = state.offset
        h = self.model.embed_tokens(ids)
        for layer, kv in zip(self.model.layers, state.layers, strict=True):
            h = layer(h, kv, offset)
        return self.model.norm(h)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return self.canonical_names(weights)
