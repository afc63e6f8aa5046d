"""MTP draft heads (no HF reference; layout and formulas follow vLLM, see QWEN38.md "MTP").

Qwen35MTP (27B, 15 tensors under `mtp.`):
    x = fc(cat[rms_zc(embed[t_{i+1}], pre_fc_norm_embedding), rms_zc(h_i, pre_fc_norm_hidden)])
    x = decoder layer (gated full attention + dense MLP, own KV cache, position i)
    draft logits = lm_head(rms_zc(x, norm))            # predicts t_{i+2}
Embedding and lm_head are the trunk's. Later draft steps feed the returned post-norm hidden
state as the next h.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from ..kv.contiguous import ContiguousKV
from .layers import RMSNorm, SwiGLU


class MTPState:
    """The MTP head's own per-sequence state: a KV store and its position.

    Implements the LayerState protocol (KV is truncatable).
    """

    can_truncate = True

    def __init__(self, kv_factory=ContiguousKV) -> None:
        self.kv = kv_factory()
        self.offset = 0

    def nbytes(self) -> int:
        return self.kv.nbytes()

    def snapshot(self) -> dict[str, mx.array]:
        snap = {f"kv.{k}": v for k, v in self.kv.snapshot().items()}
        snap["offset"] = mx.array(self.offset, dtype=mx.int64)
        return snap

    def restore(self, tensors: dict[str, mx.array]) -> None:
        self.kv.restore({k[3:]: v for k, v in tensors.items() if k.startswith("kv.")})
        self.offset = int(tensors["offset"].item()) if "offset" in tensors else 0

    def truncate(self, length: int) -> None:
        self.kv.truncate(length)
        self.offset = min(self.offset, length)


class Qwen35MTPLayer(nn.Module):
    """One decoder layer: gated full attention + SwiGLU, zero-centred norms."""

    def __init__(self, cfg):
        super().__init__()
        from .qwen3_5 import gated_attention

        self.self_attn = gated_attention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True
        )

    def __call__(self, h: mx.array, kv, offset: int) -> mx.array:
        h = h + self.self_attn(self.input_layernorm(h), kv, offset)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen35MTP(nn.Module):
    """The 27B MTP head; parameter names match the checkpoint's `mtp.*` tensors."""

    def __init__(self, cfg):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(H, eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(H, eps, zero_centered=True)
        self.layers = [Qwen35MTPLayer(cfg) for _ in range(max(cfg.mtp_num_hidden_layers, 1))]
        self.norm = RMSNorm(H, eps, zero_centered=True)

    def make_state(self, kv_factory=ContiguousKV) -> MTPState:
        return MTPState(kv_factory)

    def hidden(self, hidden: mx.array, next_embeds: mx.array, state: MTPState) -> mx.array:
        """hidden [T, H] (trunk's final-normed h_i), next_embeds [T, H] (embed of t_{i+1})
        -> post-norm MTP hidden [T, H]; advances state by T positions."""
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        x = self.layers[0](x, state.kv, state.offset)
        state.offset += x.shape[0]
        return self.norm(x)

    def draft_logits(
        self,
        hidden: mx.array,
        next_tokens: mx.array,
        state: MTPState,
        embed: nn.Embedding,
        lm_head: Callable[[mx.array], mx.array],
    ) -> mx.array:
        """Draft logits [T, vocab] predicting t_{i+2} for positions i = state.offset..+T-1.

        The post-norm hidden of the last call is kept in `state.last_hidden` for chaining.
        """
        h = self.hidden(hidden, embed(next_tokens.reshape(-1)), state)
        state.last_hidden = h
        return lm_head(h)
