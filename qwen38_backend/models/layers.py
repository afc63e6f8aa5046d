"""Layers shared by every model family: norms, RoPE, GQA attention (optionally gated), SwiGLU."""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn


class RMSNorm(nn.Module):
    """RMSNorm; `zero_centered` stores w and scales by (1 + w), with 1 + w kept in fp32."""

    def __init__(self, dims: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = mx.zeros((dims,)) if zero_centered else mx.ones((dims,))

    def __call__(self, x: mx.array) -> mx.array:
        if not self.zero_centered:
            return mx.fast.rms_norm(x, self.weight, self.eps)
        scale = 1.0 + self.weight.astype(mx.float32)
        return mx.fast.rms_norm(x.astype(mx.float32), scale, self.eps).astype(x.dtype)


@dataclass(frozen=True)
class RopeSpec:
    """How positions rotate a head: rotary dims, base, and optional precomputed frequencies."""

    dims: int
    theta: float
    scale: float = 1.0
    interleaved: bool = False
    freqs: mx.array | None = None

    def __call__(self, x: mx.array, offset: int) -> mx.array:
        """x: [1, heads, T, head_dim]; rotates the first `dims` features of every head."""
        base = None if self.freqs is not None else self.theta
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.interleaved,
            base=base,
            scale=self.scale,
            offset=offset,
            freqs=self.freqs,
        )


def rope_from_config(
    head_dim: int,
    theta: float,
    scaling: dict | None,
    partial_factor: float = 1.0,
    interleaved: bool = False,
) -> RopeSpec:
    """Build a RopeSpec from HF config fields (default, linear and llama3 scaling)."""
    dims = int(head_dim * partial_factor)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return RopeSpec(dims, theta, interleaved=interleaved)
    if kind == "linear":
        return RopeSpec(dims, theta, scale=1.0 / float(scaling["factor"]), interleaved=interleaved)
    if kind == "llama3":
        return RopeSpec(
            dims, theta, interleaved=interleaved, freqs=_llama3_freqs(dims, theta, scaling)
        )
    from ..errors import UnsupportedArchitectureError

    raise UnsupportedArchitectureError(
        f"rope_scaling type {kind!r} is not supported (supported: default, linear, llama3)"
    )


def _llama3_freqs(dims: int, theta: float, s: dict) -> mx.array:
    # Wavelength-dependent interpolation of Llama 3.1: long wavelengths scaled by `factor`,
    # short ones kept, a smooth blend between.
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    orig = float(s.get("original_max_position_embeddings", 8192))
    freqs = theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)  # 1 / inv_freq
    wavelen = 2 * math.pi * freqs
    smooth = (orig / wavelen - low) / (high - low)
    blended = freqs / ((1 - smooth) / factor + smooth)
    out = mx.where(wavelen > orig / low, freqs * factor, freqs)
    medium = (wavelen <= orig / low) & (wavelen >= orig / high)
    return mx.where(medium, blended, out)


class Attention(nn.Module):
    """GQA self-attention: optional qkv bias, q/k norm, per-head output gate, partial rotary.

    The KV store owns attention over the past (`kv.attend`), so the contiguous and the paged
    stores are interchangeable without touching this layer.
    """

    def __init__(
        self,
        hidden: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rope: RopeSpec,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
        zero_centered_norm: bool = False,
        output_gate: bool = False,
    ):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rope = rope
        self.output_gate = output_gate
        self.scale = head_dim**-0.5
        q_out = n_heads * head_dim * (2 if output_gate else 1)
        self.q_proj = nn.Linear(hidden, q_out, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, n_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(n_heads * head_dim, hidden, bias=o_bias)
        self.has_qk_norm = qk_norm_eps is not None
        if self.has_qk_norm:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, zero_centered_norm)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, zero_centered_norm)

    def project_qkv(
        self, x: mx.array, offset: int
    ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Return roped q [1,H,T,D], k and v [1,Hkv,T,D], and the gate [T, H*D] (or None)."""
        T = x.shape[0]
        H, D = self.n_heads, self.head_dim
        q = self.q_proj(x)
        gate = None
        if self.output_gate:
            q = q.reshape(T, H, 2 * D)
            q, gate = q[..., :D], q[..., D:].reshape(T, H * D)
        q = q.reshape(1, T, H, D)
        k = self.k_proj(x).reshape(1, T, self.n_kv_heads, D)
        v = self.v_proj(x).reshape(1, T, self.n_kv_heads, D)
        if self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rope(q.transpose(0, 2, 1, 3), offset)
        k = self.rope(k.transpose(0, 2, 1, 3), offset)
        return q, k, v.transpose(0, 2, 1, 3), gate

    def __call__(self, x: mx.array, kv, offset: int) -> mx.array:
        q, k, v, gate = self.project_qkv(x, offset)
        out = kv.attend(q, k, v, self.scale)
        out = out.transpose(0, 2, 1, 3).reshape(x.shape[0], -1)
        if gate is not None:
            out = out * mx.sigmoid(gate)
        return self.o_proj(out)


@mx.compile
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up as one fused kernel."""
    return nn.silu(gate) * up


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
