"""Gated DeltaNet (the linear-attention layer of Qwen3.8-27B and Flash-Next): its per-sequence
state and the `nn.Module` with HF parameter names. The recurrence itself (recurrent, chunked
and few-token forms) is gated_delta.py.

Prefill (more than `recurrent_max_tokens` tokens) runs the chunked form; a step of a few rows
(decode, a speculative verify) runs the one-token core row after row (rows.py: each row is
what a one-row step computes), on CUDA the fused kernel of kernels/gdn_decode.py when its
probe passes.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..errors import ConfigError
from ..kernel_import import kernel_module
from ..rows import STEP_MAX_ROWS, kernel_product, project
from ..state import Replayable, RewindError
from .gated_delta import (
    CHUNK,
    CoreSpec,
    chunked_gated_delta,
    compiled_conv,
    compiled_gates,
    compiled_with,
    decode_core,
    gated_rms_norm,
    gdn_core,
    prepare_qk,
)
from .gated_delta import recurrent_gated_delta as recurrent_gated_delta
from .layers import can_fuse, compiled, fuse_linears, split_outputs
from .parallel import part_of, ranks, require_divisible, split_outputs_of, summed_over

# tests/test_gpu.py imports `_gdn_core` and `recurrent_gated_delta` from this module; their
# home is gated_delta.py (these two names are only re-exports)
_gdn_core = gdn_core


# ----- state ------------------------------------------------------------------------------
class GatedDeltaNetState(Replayable):
    """Per-sequence state of one Gated DeltaNet layer.

    conv: the last (kernel - 1) inputs of the causal conv, [kernel-1, conv_dim] (model dtype).
    recurrent: [Hv, Dv, Dk] fp32 (the layout of mx.fast.gated_delta_update). Recurrent state
    cannot be truncated: rewinds need snapshots.
    """

    can_truncate = False

    def __init__(self) -> None:
        self.conv: mx.array | None = None
        self.recurrent: mx.array | None = None
        self.length = 0
        self._rows: tuple[mx.array, mx.array, mx.array] | None = None

    def advance(self, last: mx.array, inputs: mx.array, states: mx.array) -> None:
        """After a step of T rows (GatedDeltaNet.step): `last` the conv history after the last
        row, `inputs` the conv inputs [history; rows] for T > 1 (the history after row t is
        its rows t+1 .. t+K-1), `states` [T, Hv, Dv, Dk] the recurrent state after each row.
        While recording (a speculative verify) they are kept, so a rollback to any row is a
        lookup; nothing is sliced per row unless a rollback needs it."""
        rows = states.shape[0]
        self.conv, self.recurrent = last, _row(states, rows - 1)
        self.length += rows
        if self.recording:
            self._rows = (last, inputs, states)

    def mark(self) -> tuple:
        """What back_to() needs to undo the steps taken after it (SequenceState.run_layers:
        a step run again from an earlier layer); arrays are values, so references suffice."""
        return (self.conv, self.recurrent, self.length, self._rows, self._kept)

    def back_to(self, mark: tuple) -> None:
        self.conv, self.recurrent, self.length, self._rows, self._kept = mark

    def replay(self, n: int) -> None:
        """After a restore to the recorded step's start: the state after its first n rows."""
        if self._rows is None:
            super().replay(n)
            return
        last, inputs, states = self._rows
        rows = states.shape[0]
        self.conv = last if n == rows else inputs[n : n + inputs.shape[0] - rows]
        self.recurrent = _row(states, n - 1)
        self.length += n

    def set_record(self, on: bool) -> None:
        super().set_record(on)
        if not on:
            self._rows = None

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.conv, self.recurrent) if a is not None)

    def snapshot(self) -> dict[str, mx.array]:
        if self.recurrent is None:
            return {}
        # MLX arrays are immutable values: holding references is a consistent copy.
        return {
            "conv": self.conv,
            "recurrent": self.recurrent,
            "length": mx.array(self.length, dtype=mx.int64),
        }

    def restore(self, tensors: dict[str, mx.array]) -> None:
        if not tensors:
            self.conv = self.recurrent = None
            self.length = 0
            return
        self.conv = tensors["conv"]
        self.recurrent = tensors["recurrent"].astype(mx.float32)
        self.length = int(tensors["length"].item())

    def truncate(self, length: int) -> None:
        if length != self.length:
            raise RewindError(
                f"Gated DeltaNet state holds {self.length} tokens and cannot be truncated to "
                f"{length}: restore a snapshot taken at that position instead"
            )


# ----- the layer -----------------------------------------------------------------------------
class RMSNormGated(nn.Module):
    """y = w * rmsnorm(o) (plain, not zero-centred) * act(z); the norm statistic in fp32."""

    def __init__(self, dims: int, eps: float, activation: str = "silu"):
        super().__init__()
        if activation not in ("silu", "sigmoid"):
            raise ConfigError(
                f"Gated DeltaNet output gate activation must be silu or sigmoid, got {activation!r}"
            )
        self.eps = eps
        self.activation = activation
        self.weight = mx.ones((dims,))

    def __call__(self, o: mx.array, z: mx.array) -> mx.array:
        norm = compiled_with(gated_rms_norm, eps=self.eps, activation=self.activation)
        return norm(o, z, self.weight)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer with HF parameter names (`linear_attn.*`)."""

    # At most this many tokens per call take the token-by-token path (decode, MTP verify).
    recurrent_max_tokens = STEP_MAX_ROWS

    def __init__(
        self,
        hidden: int,
        n_k_heads: int,
        n_v_heads: int,
        k_head_dim: int,
        v_head_dim: int,
        conv_kernel: int = 4,
        eps: float = 1e-6,
        gate_activation: str = "silu",
    ):
        super().__init__()
        if n_v_heads % n_k_heads:
            raise ConfigError(
                f"Gated DeltaNet value heads ({n_v_heads}) must be a multiple of key heads "
                f"({n_k_heads})"
            )
        self.n_k_heads, self.n_v_heads = n_k_heads, n_v_heads
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        self.key_dim = n_k_heads * k_head_dim
        self.value_dim = n_v_heads * v_head_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hidden, n_v_heads, bias=False)
        self.in_proj_a = nn.Linear(hidden, n_v_heads, bias=False)
        # depthwise; MLX layout [C, kernel, 1] (HF stores [C, 1, kernel]); newest tap last
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False
        )
        self.A_log = mx.zeros((n_v_heads,))
        self.dt_bias = mx.ones((n_v_heads,))
        self.norm = RMSNormGated(v_head_dim, eps, gate_activation)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def _conv(self, x: mx.array, state: GatedDeltaNetState) -> mx.array:
        """Causal depthwise conv + SiLU over x [T, C]; keeps the last kernel-1 inputs."""
        K = self.conv_kernel
        hist = state.conv
        if hist is None:
            hist = mx.zeros((K - 1, x.shape[1]), dtype=x.dtype)
        xp = mx.concatenate([hist.astype(x.dtype), x], axis=0)
        # a copy: a slice would be a view that keeps the whole chunk's xp [T + K - 1, C]
        # alive in the state until the next chunk (every layer's, at a prefill's peak)
        state.conv = mx.contiguous(xp[-(K - 1) :])
        return compiled_conv(xp, self.conv1d.weight[:, :, 0].astype(x.dtype))

    def __call__(self, x: mx.array, state: GatedDeltaNetState) -> mx.array:
        """x [T, hidden] (already normed) -> [T, hidden]; advances `state`."""
        T = x.shape[0]
        if T <= self.recurrent_max_tokens:
            return self._recurrent_call(x, state)
        state.keep(self, x)  # a speculative verify's rows, for a rollback's replay
        Hk, Hv, Dk, Dv = self.n_k_heads, self.n_v_heads, self.k_head_dim, self.v_head_dim
        qkv, z, b, a = self._project(x)
        qkv = self._conv(qkv, state)
        q = qkv[:, : self.key_dim].reshape(T, Hk, Dk)
        k = qkv[:, self.key_dim : 2 * self.key_dim].reshape(T, Hk, Dk)
        v = qkv[:, 2 * self.key_dim :].reshape(T, Hv, Dv)
        z = z.reshape(T, Hv, Dv)
        g, beta = compiled_gates(a, b, self.A_log, self.dt_bias)
        q, k = compiled_with(prepare_qk, n_v_heads=Hv)(q, k)
        S = state.recurrent
        # the state is kept as [Hv, Dv, Dk] (the fused kernel's layout); the chunked form
        # works on [Hv, Dk, Dv]
        S = mx.zeros((Hv, Dk, Dv), mx.float32) if S is None else S.swapaxes(-1, -2)
        o, S = chunked_gated_delta(q, k, v, g, beta, S, **_chunk_parts(Dk, Dv))
        state.recurrent = S.swapaxes(-1, -2)
        state.length += T
        o = self.norm(o.astype(x.dtype), z)
        return self.out_proj(o.reshape(T, self.value_dim))

    def _recurrent_call(self, x: mx.array, state: GatedDeltaNetState) -> mx.array:
        """Few tokens (decode, MTP verify): the one-token core row after row."""
        conv, recurrent = self.initial_state(state, x.dtype)
        self.prepare_decode(x.dtype)
        out, *rows = self.step(x, conv, recurrent)
        state.advance(*rows)
        return out

    def initial_state(self, state: GatedDeltaNetState, dtype: mx.Dtype):
        """(conv history in `dtype`, recurrent state) of `state`, zeros before the first token."""
        if state.recurrent is None:
            state.recurrent = mx.zeros((self.n_v_heads, self.v_head_dim, self.k_head_dim))
            state.conv = mx.zeros((self.conv_kernel - 1, self.conv_dim), dtype=dtype)
        return state.conv.astype(dtype), state.recurrent

    def prepare_decode(self, dtype: mx.Dtype) -> None:
        """Decide (outside any compiled trace: the check runs a probe) whether single-token
        steps use the fused CUDA kernel. Decided once per dtype: this runs every token."""
        if getattr(self, "_kernel_checked", None) == str(dtype):
            return
        kernels = kernel_module("gdn_decode")
        usable = kernels is not None and kernels.available(self._core_spec(), dtype)
        self._kernel_for = str(dtype) if usable else ""
        self._kernel_checked = str(dtype)

    def step(self, x: mx.array, conv: mx.array, recurrent: mx.array):
        """Pure form of the few-token path: (output [T, hidden], then what step_rows
        returns after its rows)."""
        o, *rest = self.step_rows(x, conv, recurrent)
        return project(self.out_proj, o), *rest

    def step_rows(
        self, x: mx.array, conv: mx.array, recurrent: mx.array, norm: nn.Module | None = None
    ):
        """The few-token path before out_proj: (out_proj's input rows [T, value_dim], then what
        GatedDeltaNetState.advance takes: the conv history after the last row, the conv
        inputs [history; rows] (T > 1; else the history), the recurrent state after each row
        [T, Hv, Dv, Dk]). Row i is what a one-row step at its position computes: the CUDA
        kernel (where it passed its probe) runs the rows one after another in one launch, the
        same code for any T; elsewhere the one-token core runs per row. With `norm` (an
        RMSNorm), of norm.for_product(x) (rows.project)."""
        spec = self._core_spec()
        # x may be a norm's fp32 rows (RMSNorm.for_product): the products' dtype is the step's
        qkv, z, b, a = self._project(x, norm)
        dtype = qkv.dtype
        weights = (self.conv1d.weight[:, :, 0].astype(dtype), self.A_log, self.dt_bias)
        T = x.shape[0]
        if getattr(self, "_kernel_for", "") == str(dtype):
            o, last, states = kernel_module("gdn_decode").gdn_decode_rows(
                qkv, z, b, a, conv, *weights, recurrent, self.norm.weight, spec=spec
            )
        else:
            core = decode_core(spec)
            outs, rows = [], []
            last = conv
            for t in range(T):
                row = slice(t, t + 1)
                o, last, recurrent = core(
                    qkv[row], z[row], b[row], a[row], last, *weights, recurrent, self.norm.weight
                )
                outs.append(o)
                rows.append(recurrent)
            o = outs[0] if T == 1 else mx.concatenate(outs, axis=0)
            states = mx.stack(rows)
        inputs = mx.concatenate([conv, qkv], axis=0) if T > 1 else last
        return o, last, inputs, states

    def step_launches(self, x: mx.array, conv: mx.array, recurrent: mx.array, view):
        """A one-row step as its three launches (the fused in-projection, the Gated DeltaNet
        kernel, out_proj): [the output [1, hidden], the conv history after, the recurrent
        state after [1, Hv, Dv, Dk]], the bits of `step`'s; None where the step does not run
        them (core_launches)."""
        core = self.core_launches(x, conv, recurrent, view)
        out = None if core is None else kernel_product(self.out_proj, core[0])
        return None if out is None else [out, *core[1:]]

    def core_launches(
        self, x: mx.array, conv: mx.array, recurrent: mx.array, view, norm: nn.Module | None = None
    ):
        """A one-row step up to out_proj as its launches (the fused in-projection, with
        `norm` in its prologue, then the Gated DeltaNet kernel): [out_proj's input row, the
        conv history after, the recurrent state after [1, Hv, Dv, Dk]], the in-projection's
        parts taken by `view(a, offset, shape)` (kernels/fused.py), the bits of
        `step_rows`'; None where the step does not run them (the products off the
        row-invariant kernel, the kernel not chosen)."""
        if "in_proj_all" not in self or x.ndim != 2 or x.shape[0] != 1:
            return None
        y = kernel_product(self.in_proj_all, x, norm=norm)
        if y is None or getattr(self, "_kernel_for", "") != str(y.dtype):
            return None
        parts, at = [], 0
        for size in (self.conv_dim, self.value_dim, self.n_v_heads, self.n_v_heads):
            parts.append(view(y, at, (1, size)))
            at += size
        weights = (self.conv1d.weight[:, :, 0].astype(y.dtype), self.A_log, self.dt_bias)
        o, last, states = kernel_module("gdn_decode").gdn_decode_rows(
            *parts, conv, *weights, recurrent, self.norm.weight, spec=self._core_spec()
        )
        return [o, last, states]

    _PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def shard(self, group: mx.distributed.Group) -> None:
        """Keep this rank's key heads and the value heads that read them (before `fuse`).

        Value head i reads key head i // (Hv / Hk), so equal contiguous cuts of both keep
        every pair on one rank. q | k | v rows of in_proj_qkv and the conv channels are cut
        per segment; out_proj's output is summed over the group."""
        _, size = ranks(group)
        require_divisible("Gated DeltaNet key heads", self.n_k_heads, size)
        require_divisible("Gated DeltaNet value heads", self.n_v_heads, size)
        cuts = (self.key_dim, 2 * self.key_dim)
        split_outputs_of(self.in_proj_qkv, group, cuts)
        for name in ("in_proj_z", "in_proj_b", "in_proj_a"):
            split_outputs_of(self[name], group)
        self.conv1d.weight = part_of(self.conv1d.weight, 0, group, cuts)
        self.A_log = part_of(self.A_log, 0, group)
        self.dt_bias = part_of(self.dt_bias, 0, group)
        self.out_proj = summed_over(self.out_proj, group)
        self.n_k_heads //= size
        self.n_v_heads //= size
        self.key_dim //= size
        self.value_dim //= size
        self.conv_dim //= size

    def _project(self, x: mx.array, norm: nn.Module | None = None) -> list[mx.array]:
        """qkv, z, b, a of x's rows (with `norm`: of norm.for_product(x)): one fused matmul
        once `fuse()` ran, else four."""
        if "in_proj_all" in self:
            sizes = [self.conv_dim, self.value_dim, self.n_v_heads, self.n_v_heads]
            return split_outputs(project(self.in_proj_all, x, norm=norm), sizes)
        x = x if norm is None else norm.for_product(x)
        return [project(self[name], x) for name in self._PROJECTIONS]

    def fuse(self) -> None:
        """The four input projections as one matmul (after loading)."""
        parts = [self[name] for name in self._PROJECTIONS]
        if not can_fuse(parts):
            return
        self.in_proj_all = fuse_linears(parts)
        for name in self._PROJECTIONS:
            del self[name]

    def _core_spec(self) -> CoreSpec:
        return (
            self.n_k_heads,
            self.n_v_heads,
            self.k_head_dim,
            self.v_head_dim,
            self.norm.eps,
            self.norm.activation,
        )


def decode_step(
    block: nn.Module, h: mx.array, state: GatedDeltaNetState, *carried, outputs: int = 1
) -> tuple[mx.array, ...]:
    """A step of a few rows through a block whose `_linear_step(h, *carried, conv,
    recurrent)` runs its Gated DeltaNet mixer `block.linear_attn` (and whatever surrounds
    it) as one compiled graph, returning its `outputs` outputs, then what
    GatedDeltaNetState.advance takes; advances `state`. Returns the `outputs` outputs."""
    mixer = block.linear_attn
    # the step's dtype is the model's (its conv weights'): h may come wider from the block
    # before (layers.residual_step)
    dtype = mixer.conv1d.weight.dtype
    conv, recurrent = mixer.initial_state(state, dtype)
    mixer.prepare_decode(dtype)  # outside the trace: the kernel probe runs ops
    results = compiled(block, "_linear_step")(h, *carried, conv, recurrent)
    state.advance(*results[outputs:])
    return tuple(results[:outputs])


def _row(states: mx.array, i: int) -> mx.array:
    """Row i of [T, ...] as a slice (integer indexing would gather a copy)."""
    return states[i : i + 1].reshape(states.shape[1:])


def _chunk_parts(dk: int, dv: int) -> dict:
    """The chunked form's per-chunk solve and scan over chunks: kernels/gdn_prefill.py's
    launches where they run and agree with the op path (each probed once per shape), else
    the op path's."""
    gdn_prefill = kernel_module("gdn_prefill")
    if gdn_prefill is None:
        return {}
    parts = {}
    if gdn_prefill.available("solve", dk, dv, CHUNK):
        parts["solve"] = gdn_prefill.chunk_solve
    if gdn_prefill.available("scan", dk, dv, CHUNK):
        parts["scan"] = gdn_prefill.chunk_scan
    return parts
