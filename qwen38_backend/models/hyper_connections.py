"""Flash-Next hyper-connections: the residual is `hc_count` streams of `hidden` features,
stream-major ([T, hc_count * hidden]). A gated residual (GR) mixes the streams into one
block input and injects the block output back into every stream; `read` is the mixer alone.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..rows import per_row
from .layers import can_fuse, fuse_linears, split_outputs


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

    def fuse(self) -> None:
        """The down and inject projections (both read the normed streams) as one matmul
        (after loading)."""
        parts = [self.input_mix_weight_down, self.block_inject_weight] if self.inject else []
        if not parts or not can_fuse(parts):
            return
        self._down_sizes = [p.weight.shape[0] for p in parts]
        if isinstance(parts[0], nn.QuantizedLinear):
            self._down_sizes = [p.scales.shape[0] for p in parts]
        self.down_inject_proj = fuse_linears(parts)
        del self["input_mix_weight_down"], self["block_inject_weight"]

    def _mixed(self, R: mx.array, Rn: mx.array, down: mx.array) -> mx.array:
        """The block input x [T, hidden] from the normed streams and their down projection."""
        gm = nn.silu(down / self.hc_count)
        # per_row: a verify row's products are a plain step's on the CPU (rows.py)
        G = mx.sigmoid(per_row(self.input_mix_weight_up, gm))
        # the product before the reshape: the sigmoid and the product fuse (one kernel)
        return (G * Rn).reshape(*R.shape[:-1], self.hc_count, self.hidden).mean(axis=-2)

    def read(self, R: mx.array) -> mx.array:
        """The mixed block input only (the final mixer before lm_head)."""
        Rn = self.hc_norm(R)
        return self._mixed(R, Rn, per_row(self.input_mix_weight_down, Rn))

    def open(self, R: mx.array) -> tuple[mx.array, mx.array]:
        """(block input x [T, hidden], inject weights inj [T, hc]): what precedes the block."""
        Rn = self.hc_norm(R)
        if "down_inject_proj" in self:
            down, inj = split_outputs(per_row(self.down_inject_proj, Rn), self._down_sizes)
        else:
            down = per_row(self.input_mix_weight_down, Rn)
            inj = per_row(self.block_inject_weight, Rn)
        return self._mixed(R, Rn, down), 2.0 * mx.sigmoid(inj / self.hc_count)

    def close(self, R: mx.array, inj: mx.array, out: mx.array) -> mx.array:
        """R + inj[s] * out on every stream s (added to the un-normed R)."""
        add = (inj[..., :, None] * out[..., None, :]).astype(R.dtype)
        # added per stream before the reshape: the product and the sum fuse (one kernel)
        streams = R.reshape(add.shape)
        return (streams + add).reshape(R.shape)

    def __call__(self, R: mx.array, block) -> mx.array:
        """R + inj[s] * block(x) on every stream s; open and close split it for a caller
        that runs the block apart (QSA's decode step compiles each side)."""
        x, inj = self.open(R)
        return self.close(R, inj, block(x))
