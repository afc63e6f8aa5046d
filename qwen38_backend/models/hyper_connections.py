"""Flash-Next hyper-connections: the residual is `hc_count` streams of `hidden` features,
stream-major ([T, hc_count * hidden]). A gated residual (GR) mixes the streams into one
block input and injects the block output back into every stream; `read` is the mixer alone.
"""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx
import mlx.nn as nn

from ..kernel_import import kernel_module
from ..rows import STEP_MAX_ROWS, gated_product, mixed_product, per_row
from .layers import can_fuse, fuse_linears, split_outputs, sum_fp32


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


def gate_down(down: mx.array, streams: int) -> mx.array:
    """The low-rank gate silu(down / S) (the up projection's input)."""
    return nn.silu(down / streams)


def gate_inject(inject: mx.array, streams: int) -> mx.array:
    """The inject weights 2 sigmoid(inject / S), one per stream."""
    return 2.0 * mx.sigmoid(inject / streams)


def stream_mean(up: mx.array, normed: mx.array, streams: int) -> mx.array:
    """mean over the streams of sigmoid(up) * normed: [..., S * H] -> [..., H]."""
    # the product before the reshape: the sigmoid and the product fuse (one kernel); the
    # mean as MLX's mean forms it: the sum rounded, times 1 / S in the dtype
    summed = sum_fp32((mx.sigmoid(up) * normed).reshape(*up.shape[:-1], streams, -1), axis=-2)
    return summed * (1.0 / streams)


def stream_close(R: mx.array, inj: mx.array, out: mx.array) -> mx.array:
    """R + inj[s] * out on every stream s (added to the un-normed R): [T, S * H]."""
    add = (inj[..., :, None] * out[..., None, :]).astype(R.dtype)
    # added per stream before the reshape: the product and the sum fuse (one kernel)
    streams = R.reshape(add.shape)
    return (streams + add).reshape(R.shape)


class GatedResidual(nn.Module):
    """`hc_norm`, `input_mix_weight_down/up`, and `block_inject_weight` unless read-only."""

    _checked = ""  # the dtype prepare_decode decided for
    _kernel_for = ""  # the dtype whose steps run kernels/stream_mix.py ("": none)
    _fuse_for = ""  # the dtype whose one-row close + open is one launch (kernels/fused.py)

    def __init__(self, hidden: int, hc_count: int, lowrank: int, eps: float, inject: bool = True):
        super().__init__()
        self.hidden, self.hc_count, self.lowrank = hidden, hc_count, lowrank
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

    def prepare_decode(self, dtype: mx.Dtype) -> None:
        """Decide (outside any compiled trace: the probe runs ops) whether a step's norm,
        gates and mix of streams of `dtype` run as kernels/stream_mix.py's launches."""
        if self._checked == str(dtype):
            return  # decided once per dtype: this runs every step
        self._checked, self._kernel_for, self._fuse_for = str(dtype), "", ""
        kernel = kernel_module("stream_mix")
        shape = (self.hidden, self.hc_count, self.lowrank, self.hc_norm.eps)
        if kernel is not None and kernel.available(*shape, dtype):
            self._kernel_for = str(dtype)
            if self._fuses(dtype):
                self._fuse_for = str(dtype)

    def _fuses(self, dtype: mx.Dtype) -> bool:
        """Whether a one-row close (of streams of `dtype`) with this residual's norm, gated
        and mixed products runs as one launch with the bits of the three (kernels/fused.py;
        its probe on random streams, once per shape and weights' type)."""
        fused = kernel_module("fused")
        if fused is None or "down_inject_proj" not in self:
            return False
        R, (inj, out) = self.step_operands(dtype, 41)
        products = (self.down_inject_proj, self.input_mix_weight_up)
        weights = [(type(p).__name__, str(p.weight.dtype)) for p in products]
        shape = (self.hidden, self.hc_count, self.lowrank, self.hc_norm.eps)
        key = ("gated residual open", shape, str(dtype), weights)
        return fused.agrees(str(key), lambda view: self._open_launches(R, inj, out, view))

    def step_operands(self, dtype: mx.Dtype, seed: int) -> tuple[mx.array, tuple]:
        """Random one-row streams R and a block's (inject weights, output) to close them
        with, in `dtype`: what the fused launches' probes run on."""
        H, S = self.hidden, self.hc_count
        keys = mx.random.split(mx.random.key(seed), 3)
        R = mx.random.normal((1, S * H), key=keys[0]).astype(dtype)
        inj = mx.random.normal((1, S), key=keys[1]).astype(dtype)
        return R, (inj, mx.random.normal((1, H), key=keys[2]).astype(dtype))

    def _open_launches(self, R: mx.array, inj: mx.array, out: mx.array, view):
        """[the closed streams, the block input, the gated down / inject product] of the
        close of R with (inj, out) then this residual's open, as three launches (the stream
        kernels' closed norm, the gated and the mixed products), or None where a product
        does not take its kernel; `view(a, offset, shape)`: a stretch of an output (fused.py)."""
        L, S = self.lowrank, self.hc_count
        streams = kernel_module("stream_mix")
        norm = self.hc_norm
        closed, normed = streams.closed_norm(R, inj, out, norm.weight, S, norm.eps)
        gated = gated_product(self.down_inject_proj, normed, L, S)
        if gated is None:
            return None
        x = mixed_product(self.input_mix_weight_up, view(gated, 0, (1, L)), normed, S)
        return None if x is None else [closed, x, gated]

    def _kernels(self, R: mx.array) -> ModuleType | None:
        """The stream-mix kernels where prepare_decode chose them for a step of R's rows."""
        if self._kernel_for != str(R.dtype) or R.ndim != 2 or R.shape[0] > STEP_MAX_ROWS:
            return None
        return kernel_module("stream_mix")

    def _norm(self, R: mx.array, kernels: ModuleType | None) -> mx.array:
        if kernels is None:
            return self.hc_norm(R)
        return kernels.norm(R, self.hc_norm.weight, self.hc_count, self.hc_norm.eps)

    def _mixed(self, normed: mx.array, gate: mx.array, kernels: ModuleType | None) -> mx.array:
        """The block input x [T, hidden] from the normed streams and the low-rank gate."""
        if kernels is not None:  # the up product and the mix launch's bits in one launch
            x = mixed_product(self.input_mix_weight_up, gate, normed, self.hc_count)
            if x is not None:
                return x
        # per_row: a verify row's products are a plain step's on the CPU (rows.py)
        up = per_row(self.input_mix_weight_up, gate)
        if kernels is None or up.dtype != normed.dtype:  # (the kernel takes one dtype)
            return stream_mean(up, normed, self.hc_count)
        return kernels.mix(up, normed, self.hc_count)

    def read(self, R: mx.array) -> mx.array:
        """The mixed block input only (the final mixer before lm_head)."""
        kernels = self._kernels(R)
        normed = self._norm(R, kernels)
        gate = gated_product(self.input_mix_weight_down, normed, self.lowrank, self.hc_count)
        if gate is None:  # the product, then its gate apart
            down = per_row(self.input_mix_weight_down, normed)
            if kernels is None:
                gate = gate_down(down, self.hc_count)
            else:
                gate, _ = kernels.gates(down, self.lowrank, self.hc_count, False)
        return self._mixed(normed, gate, kernels)

    def open(self, R: mx.array, normed: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """(block input x [T, hidden], inject weights inj [T, hc]): what precedes the block;
        `normed`: R's normed streams where the close before computed them."""
        kernels = self._kernels(R)
        if normed is None:
            normed = self._norm(R, kernels)
        if "down_inject_proj" in self:
            L = self.lowrank
            gated = gated_product(self.down_inject_proj, normed, L, self.hc_count)
            if gated is not None:  # the gates in the product's epilogue: one launch
                return self._mixed(normed, gated[:, :L], kernels), gated[:, L:]
            down_inject = per_row(self.down_inject_proj, normed)
            if kernels is not None:
                gate, inj = kernels.gates(down_inject, self.lowrank, self.hc_count, True)
                return self._mixed(normed, gate, kernels), inj
            down, inj = split_outputs(down_inject, self._down_sizes)
        else:
            down = per_row(self.input_mix_weight_down, normed)
            inj = per_row(self.block_inject_weight, normed)
        gate = gate_down(down, self.hc_count)
        return self._mixed(normed, gate, kernels), gate_inject(inj, self.hc_count)

    def close(self, R: mx.array, inj: mx.array, out: mx.array) -> mx.array:
        """R + inj[s] * out on every stream s (added to the un-normed R)."""
        return stream_close(R, inj, out)

    def close_then_norm(
        self, R: mx.array, inj: mx.array, out: mx.array, then: GatedResidual
    ) -> tuple[mx.array, mx.array | None]:
        """(close(R, inj, out), `then`'s normed streams of it) in one launch where both take
        the stream kernels (kernels/stream_mix.py), else (the close, None: `then` norms it
        when it opens)."""
        kernels = self._kernels(R) and then._kernels(R)
        if kernels is None or not (inj.dtype == out.dtype == R.dtype):  # one dtype, as above
            return self.close(R, inj, out), None
        norm = then.hc_norm
        return kernels.closed_norm(R, inj, out, norm.weight, self.hc_count, norm.eps)

    def closes_fused(self, R: mx.array, inj: mx.array, out: mx.array) -> bool:
        """Whether this residual's close of R by (inj, out) can open a fused launch: a step's
        one row, one dtype, the stream kernels chosen (a fused launch's first phase is their
        closed norm; kernels/fused.py)."""
        one_row = R.ndim == 2 and R.shape[0] == 1
        return one_row and inj.dtype == out.dtype == R.dtype and self._kernels(R) is not None

    def close_then_open(
        self, R: mx.array, inj: mx.array, out: mx.array, then: GatedResidual
    ) -> tuple[mx.array, mx.array, mx.array]:
        """(close(R, inj, out), then's block input and inject weights of it): the close,
        then's norm and both its products in one launch where `then` fuses them for R's
        dtype (a step's one row: prepare_decode), else close_then_norm and then.open."""
        if then._fuse_for == str(R.dtype) and self.closes_fused(R, inj, out):
            fused = kernel_module("fused").run(lambda v: then._open_launches(R, inj, out, v))
            if fused is not None:
                closed, x, gated = fused
                return closed, x, gated[:, then.lowrank :]
        R, normed = self.close_then_norm(R, inj, out, then)
        x, inj = then.open(R, normed)
        return R, x, inj

    def __call__(self, R: mx.array, block, normed: mx.array | None = None) -> mx.array:
        """R + inj[s] * block(x) on every stream s; open and close split it for a caller
        that runs the block apart (QSA's decode step compiles each side); `normed`: as
        open takes it."""
        x, inj = self.open(R, normed)
        return self.close(R, inj, block(x))
