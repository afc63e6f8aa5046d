"""Flash-Next hyper-connections: the residual is `hc_count` streams of `hidden` features,
stream-major ([T, hc_count * hidden]). A gated residual (GR) mixes the streams into one
block input and injects the block output back into every stream; `read` is the mixer alone.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class GroupedRMSNorm(nn.Module):
    """Zero-centred RMSNorm with one statistic per `group`-wide slice; weight spans all groups."""

    def __init__(self, dims: int, group: int, eps: float):
        super().__init__()
        self.group, self.eps = group, eps
        self.weight = mx.zeros((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        shape = x.shape
        xf = x.astype(mx.float32).reshape(*shape[:-1], -1, self.group)
        y = mx.fast.rms_norm(xf, None, self.eps).reshape(shape)
        # (1 + w) stays in fp32: folding +1 into a half-precision weight loses bits.
        return (y * (1.0 + self.weight.astype(mx.float32))).astype(x.dtype)


class GatedResidual(nn.Module):
    """`hc_norm`, `input_mix_weight_down/up`, and `block_inject_weight` unless read-only."""

    def __init__(self, hidden: int, hc_count: int, lowrank: int, eps: float, inject: bool = True):
        super().__init__()
        self.hidden, self.hc_count = hidden, hc_count
        width = hidden * hc_count
        self.hc_norm = GroupedRMSNorm(width, hidden, eps)
        self.input_mix_weight_down = nn.Linear(width, lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(lowrank, width, bias=False)
        if inject:
            self.block_inject_weight = nn.Linear(width, hc_count, bias=False)
        self.inject = inject

    def mix(self, R: mx.array) -> tuple[mx.array, mx.array]:
        """(block input x [T, hidden], normed streams Rn [T, hc*hidden])."""
        Rn = self.hc_norm(R)
        gm = nn.silu(self.input_mix_weight_down(Rn) / self.hc_count)
        G = mx.sigmoid(self.input_mix_weight_up(gm))
        shape = (*R.shape[:-1], self.hc_count, self.hidden)
        x = (G.reshape(shape) * Rn.reshape(shape)).mean(axis=-2)
        return x, Rn

    def read(self, R: mx.array) -> mx.array:
        """The mixed block input only (the final mixer before lm_head)."""
        return self.mix(R)[0]

    def __call__(self, R: mx.array, block) -> mx.array:
        """R + inj[s] * block(x) on every stream s (added to the un-normed R)."""
        x, Rn = self.mix(R)
        inj = 2.0 * mx.sigmoid(self.block_inject_weight(Rn) / self.hc_count)  # [T, hc]
        out = block(x)
        add = inj[..., :, None] * out[..., None, :]
        return R + add.reshape(R.shape).astype(R.dtype)
