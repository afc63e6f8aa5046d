"""The dense family: llama, qwen2 (qkv bias) and qwen3 (q/k norm), tied or untied embeddings.
The config (`DenseConfig`) is config.py."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .. import rows
from ..config import DenseConfig
from ..kv.contiguous import ContiguousKV
from ..state import SequenceState
from .base import CausalLM
from .layers import Attention, PreNormBlock, RMSNorm, SwiGLU, rope_from_config


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
        rows.prepare(h.dtype, self, ids.shape[0])
        h = state.run_layers(self.model.layers, h, offset, ids.shape[0])
        return self.model.norm(h)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return self.canonical_names(weights)
