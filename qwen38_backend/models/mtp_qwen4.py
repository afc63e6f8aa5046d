"""The Flash-Next MTP draft head (no HF reference; layout and formulas follow vLLM / SGLang, see
QWEN38.md "MTP"). 31 tensors under `mtp.`:

    e  = fc_embedding(rms_zc(embed[t_{i+1}], pre_fc_norm_embedding))             [H]
    Hn = rms_zc(H_i, pre_fc_norm_hidden)     ONE statistic over all hc*H features (not grouped)
    S  = fc_hidden(Hn per stream) + e on every stream                            [hc*H]
    S  = one Flash-Next layer (QSA with its own indexer + MoE, hyper-connections, no PLE)
    draft logits = lm_head(read(S, mtp.hyper_connection_mixer))      predicts t_{i+2}

H_i is the trunk's residual after its last layer (before the mixer). Embedding and lm_head
are the trunk's. Later draft steps feed the returned residual S as the next H.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..kv.contiguous import ContiguousKV
from .hyper_connections import GatedResidual
from .layers import RMSNorm
from .qsa import QSAState


class Qwen4MTPState:
    """The head's own per-sequence state: one QSA layer state per MTP layer, and its position."""

    can_truncate = True

    def __init__(self, layers: list[QSAState]) -> None:
        self.layers = layers
        self.offset = 0
        self.last_residual: mx.array | None = None

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.layers)

    def snapshot(self) -> dict[str, mx.array]:
        snap = {
            f"layer{i}.{k}": v for i, s in enumerate(self.layers) for k, v in s.snapshot().items()
        }
        snap["offset"] = mx.array(self.offset, dtype=mx.int64)
        return snap

    def restore(self, tensors: dict[str, mx.array]) -> None:
        for i, s in enumerate(self.layers):
            p = f"layer{i}."
            s.restore({k[len(p) :]: v for k, v in tensors.items() if k.startswith(p)})
        self.offset = int(tensors["offset"].item()) if "offset" in tensors else 0
        self.last_residual = None

    def truncate(self, length: int) -> None:
        for s in self.layers:
            s.truncate(length)
        self.offset = min(self.offset, length)


class Qwen4ExpMTP(nn.Module):
    """Parameter names match the checkpoint's `mtp.*` tensors."""

    def __init__(self, cfg):
        super().__init__()
        from .qwen4_exp import QSA, Qwen4ExpBlock

        H, hc, eps = cfg.hidden_size, cfg.hc_count, cfg.rms_norm_eps
        self.hidden_size, self.hc_count = H, hc
        self.ratio = cfg.indexer_compress_ratio
        self.pre_fc_norm_embedding = RMSNorm(H, eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(H * hc, eps, zero_centered=True)
        self.fc_embedding = nn.Linear(H, H, bias=False)
        self.fc_hidden = nn.Linear(H, H, bias=False)
        self.layers = [Qwen4ExpBlock(cfg, QSA) for _ in range(max(cfg.mtp_num_hidden_layers, 1))]
        self.hyper_connection_mixer = GatedResidual(H, hc, cfg.hc_lowrank, eps, inject=False)

    def make_state(self, kv_factory=ContiguousKV) -> Qwen4MTPState:
        return Qwen4MTPState([QSAState(kv_factory(), self.ratio) for _ in self.layers])

    def fuse(self, residual: mx.array, next_embeds: mx.array) -> mx.array:
        """S0 [T, hc*H] from trunk residuals [T, hc*H] and embeddings of t_{i+1} [T, H]."""
        T = residual.shape[0]
        e = self.fc_embedding(self.pre_fc_norm_embedding(next_embeds))
        Hn = self.pre_fc_norm_hidden(residual).reshape(T, self.hc_count, self.hidden_size)
        return (self.fc_hidden(Hn) + e[:, None, :]).reshape(T, -1)

    def residual(self, residual: mx.array, next_embeds: mx.array, state: Qwen4MTPState) -> mx.array:
        """The head's residual after its layer(s) [T, hc*H]; advances `state` by T."""
        S = self.fuse(residual, next_embeds)
        for layer, st in zip(self.layers, state.layers, strict=True):
            S = layer(S, None, st, state.offset)
        state.offset += S.shape[0]
        state.last_residual = S
        return S

    def draft_logits(
        self, residual: mx.array, next_tokens: mx.array, state: Qwen4MTPState, trunk
    ) -> mx.array:
        """Draft logits [T, vocab] predicting t_{i+2} for positions i = state.offset..+T-1.

        `trunk` supplies the shared embedding and lm_head. The head's residual is kept in
        `state.last_residual` to chain further draft steps.
        """
        embeds = trunk.model.embed_tokens(next_tokens.reshape(-1))
        S = self.residual(residual, embeds, state)
        return trunk.logits_from_hidden(self.hyper_connection_mixer.read(S))
