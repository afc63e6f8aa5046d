"""Gated DeltaNet (the linear-attention layer of Qwen3.8-27B and Flash-Next).

Math (QWEN38.md, "Gated DeltaNet"): per value head a fp32 state S [Dk, Dv];
S = S * exp(g_t); delta = (v_t - S^T k_t) * beta_t; S = S + k_t delta^T; o_t = S^T q_t.

Two exact forms of that recurrence:
- `recurrent_gated_delta`: token by token (decode, MTP verify): a few small matmuls per
  token, every head at once.
- `chunked_gated_delta`: chunks of 64 tokens (prefill). Inside a chunk the deltas solve a unit
  lower-triangular system; its inverse is built by recursive block doubling (matmuls only, no
  powers of the system matrix, so it stays as stable as forward substitution), then a short
  scan over chunks carries the state.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from ..state import RewindError
from .layers import can_fuse, fuse_linears, split_outputs

CHUNK = 64


# ----- state ------------------------------------------------------------------------------
class GatedDeltaNetState:
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


# ----- the delta rule -----------------------------------------------------------------------
def _l2norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    # exact l2 norm (eps added to the sum of squares), as the reference does
    return x * mx.rsqrt(mx.sum(x * x, axis=-1, keepdims=True) + eps)


def prepare_qk(q: mx.array, k: mx.array, n_v_heads: int) -> tuple[mx.array, mx.array]:
    """fp32 l2-normed q (also scaled by Dk^-0.5) and k, repeated to the value heads.

    q, k: [T, Hk, Dk] -> [T, Hv, Dk]; value head i reads key head i // (Hv / Hk).
    """
    q, k = q.astype(mx.float32), k.astype(mx.float32)
    q = _l2norm(q) * (q.shape[-1] ** -0.5)
    k = _l2norm(k)
    rep = n_v_heads // k.shape[1]
    if rep > 1:
        q, k = mx.repeat(q, rep, axis=1), mx.repeat(k, rep, axis=1)
    return q, k


def _recurrent_step(q, k, v, g, beta, S):
    """One token, all heads. q,k [Hv,Dk]; v [Hv,Dv]; g,beta [Hv]; S [Hv,Dk,Dv] fp32."""
    S = S * mx.exp(g)[:, None, None]
    mem = (k[:, None, :] @ S)[:, 0]
    delta = (v - mem) * beta[:, None]
    S = S + k[:, :, None] * delta[:, None, :]
    o = (q[:, None, :] @ S)[:, 0]
    return o, S


_compiled_step = mx.compile(_recurrent_step)


def recurrent_gated_delta(
    q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, S: mx.array
) -> tuple[mx.array, mx.array]:
    """Token-by-token form. q,k [T,Hv,Dk] (prepared), v [T,Hv,Dv], g/beta [T,Hv] fp32.

    Returns (o [T, Hv, Dv] fp32, final state [Hv, Dk, Dv] fp32).
    """
    v = v.astype(mx.float32)
    outs = []
    for t in range(q.shape[0]):
        o, S = _compiled_step(q[t], k[t], v[t], g[t], beta[t], S)
        outs.append(o)
    return mx.stack(outs, axis=0), S


def _unit_lower_inverse(M: mx.array) -> mx.array:
    """Inverse of unit lower-triangular matrices M [..., n, n] (n a power of two).

    Recursive doubling on diagonal blocks: inv([[A, 0], [C, B]]) =
    [[A^-1, 0], [-B^-1 C A^-1, B^-1]], starting from 1x1 blocks (= 1).
    """
    *batch, n, _ = M.shape
    nb = n
    D = mx.ones((*batch, n, 1, 1), dtype=M.dtype)  # inverses of the 1x1 diagonal blocks
    b = 1
    while b < n:
        nb = n // b
        # block (r, c) of size b x b: M4[..., r, c]
        M4 = M.reshape(*batch, nb, b, nb, b).swapaxes(-3, -2)
        odd = mx.arange(1, nb, 2)
        C = M4[..., odd, odd - 1, :, :]  # sub-diagonal blocks of each merged pair
        A_inv, B_inv = D[..., 0::2, :, :], D[..., 1::2, :, :]
        lower = -(B_inv @ C @ A_inv)
        zeros = mx.zeros_like(A_inv)
        top = mx.concatenate([A_inv, zeros], axis=-1)
        bottom = mx.concatenate([lower, B_inv], axis=-1)
        D = mx.concatenate([top, bottom], axis=-2)
        b *= 2
    return D[..., 0, :, :]


def chunked_gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    S: mx.array,
    chunk: int = CHUNK,
) -> tuple[mx.array, mx.array]:
    """Chunked form, same arguments and results as `recurrent_gated_delta`."""
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    pad = (-T) % chunk
    v = v.astype(mx.float32)
    if pad:
        # zero g, beta and k: padded steps neither decay nor write the state
        q, k, v = (mx.pad(x, [(0, pad), (0, 0), (0, 0)]) for x in (q, k, v))
        g, beta = (mx.pad(x, [(0, pad), (0, 0)]) for x in (g, beta))
    N = (T + pad) // chunk
    # [H, N, C, *]
    q, k, v = (x.reshape(N, chunk, H, -1).transpose(2, 0, 1, 3) for x in (q, k, v))
    g, beta = (x.reshape(N, chunk, H).transpose(2, 0, 1) for x in (g, beta))

    gam = mx.cumsum(g, axis=-1)  # log of the decay from chunk start through t
    idx = mx.arange(chunk)
    causal = idx[:, None] >= idx[None, :]
    strict = idx[:, None] > idx[None, :]
    diff = gam[..., :, None] - gam[..., None, :]
    # mask before exp: above the diagonal the difference is positive and could overflow
    decay_incl = mx.exp(mx.where(causal, diff, -mx.inf))
    decay_strict = mx.where(strict, decay_incl, 0.0)

    kk = k @ k.swapaxes(-1, -2)
    eye = mx.eye(chunk, dtype=mx.float32)
    system = eye + beta[..., :, None] * kk * decay_strict  # (I + A) delta = rhs
    inv = _unit_lower_inverse(system)

    Gam = mx.exp(gam)[..., None]
    u = inv @ (v * beta[..., None])  # deltas if the incoming state were zero
    w = inv @ (k * (beta[..., None] * Gam))  # how the incoming state shifts them
    q_dec = q * Gam
    qk = (q @ k.swapaxes(-1, -2)) * decay_incl
    k_tail = k * mx.exp(gam[..., -1:] - gam)[..., None]
    chunk_decay = mx.exp(gam[..., -1])[..., None, None]

    outs = []
    for n in range(N):
        delta = u[:, n] - w[:, n] @ S
        outs.append(q_dec[:, n] @ S + qk[:, n] @ delta)
        S = S * chunk_decay[:, n] + k_tail[:, n].swapaxes(-1, -2) @ delta
    o = mx.stack(outs, axis=1).reshape(H, N * chunk, Dv).transpose(1, 0, 2)
    return o[:T], S


# ----- the layer -----------------------------------------------------------------------------
class RMSNormGated(nn.Module):
    """y = w * rmsnorm(o) (plain, not zero-centred) * act(z); the norm statistic in fp32."""

    def __init__(self, dims: int, eps: float, activation: str = "silu"):
        super().__init__()
        if activation not in ("silu", "sigmoid"):
            raise ValueError(f"RMSNormGated activation must be silu or sigmoid, got {activation}")
        self.eps = eps
        self.activation = activation
        self.weight = mx.ones((dims,))

    def __call__(self, o: mx.array, z: mx.array) -> mx.array:
        dtype = o.dtype
        xh = mx.fast.rms_norm(o.astype(mx.float32), None, self.eps).astype(dtype)
        y = self.weight * xh
        zf = z.astype(mx.float32)
        gate = nn.silu(zf) if self.activation == "silu" else mx.sigmoid(zf)
        return (y * gate).astype(dtype)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer with HF parameter names (`linear_attn.*`)."""

    # At most this many tokens per call take the token-by-token path (decode, MTP verify).
    recurrent_max_tokens = 16

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
            raise ValueError(
                f"value heads ({n_v_heads}) must be a multiple of key heads ({n_k_heads})"
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
        state.conv = xp[-(K - 1) :]
        w = self.conv1d.weight[:, :, 0].astype(x.dtype)  # [C, K]
        T = x.shape[0]
        out = xp[0:T] * w[:, 0]
        for j in range(1, K):
            out = out + xp[j : j + T] * w[:, j]
        return nn.silu(out)

    def __call__(self, x: mx.array, state: GatedDeltaNetState) -> mx.array:
        """x [T, hidden] (already normed) -> [T, hidden]; advances `state`."""
        T = x.shape[0]
        if T <= self.recurrent_max_tokens:
            return self._recurrent_call(x, state)
        Hk, Hv, Dk, Dv = self.n_k_heads, self.n_v_heads, self.k_head_dim, self.v_head_dim
        qkv, z, b, a = self._project(x)
        qkv = self._conv(qkv, state)
        q = qkv[:, : self.key_dim].reshape(T, Hk, Dk)
        k = qkv[:, self.key_dim : 2 * self.key_dim].reshape(T, Hk, Dk)
        v = qkv[:, 2 * self.key_dim :].reshape(T, Hv, Dv)
        z = z.reshape(T, Hv, Dv)
        beta = mx.sigmoid(b.astype(mx.float32))
        a = a.astype(mx.float32)
        g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(
            a + self.dt_bias.astype(mx.float32)
        )
        q, k = prepare_qk(q, k, Hv)
        S = state.recurrent
        # the state is kept as [Hv, Dv, Dk] (the fused kernel's layout); the chunked form
        # works on [Hv, Dk, Dv]
        S = mx.zeros((Hv, Dk, Dv), mx.float32) if S is None else S.swapaxes(-1, -2)
        o, S = chunked_gated_delta(q, k, v, g, beta, S)
        state.recurrent = S.swapaxes(-1, -2)
        state.length += T
        o = self.norm(o.astype(x.dtype), z)
        return self.out_proj(o.reshape(T, self.value_dim))

    def _recurrent_call(self, x: mx.array, state: GatedDeltaNetState) -> mx.array:
        """Few tokens (decode, MTP verify): one fused step per token via
        mx.fast.gated_delta_update."""
        conv, recurrent = self.initial_state(state, x.dtype)
        self.prepare_decode(x.dtype)
        out, state.conv, state.recurrent = self.step(x, conv, recurrent)
        state.length += x.shape[0]
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
        kernels = _kernel_module()
        usable = kernels is not None and kernels.available(self._core_spec(), dtype)
        self._kernel_for = str(dtype) if usable else ""
        self._kernel_checked = str(dtype)

    def step(self, x: mx.array, conv: mx.array, recurrent: mx.array):
        """Pure form of the few-token path: (output [T, hidden], new conv, new recurrent)."""
        spec = self._core_spec()
        if x.shape[0] != 1:
            core = partial(_gdn_core, spec=spec)
        elif getattr(self, "_kernel_for", "") == str(x.dtype):
            core = partial(_kernel_module().gdn_decode_step, spec=spec)
        else:
            core = _decode_core(spec)
        o, conv, recurrent = core(
            *self._project(x),
            conv,
            self.conv1d.weight[:, :, 0].astype(x.dtype),
            self.A_log,
            self.dt_bias,
            recurrent,
            self.norm.weight,
        )
        return self.out_proj(o), conv, recurrent

    _PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")

    def _project(self, x: mx.array) -> list[mx.array]:
        """qkv, z, b, a: one fused matmul once `fuse()` ran, else four."""
        if "in_proj_all" in self:
            sizes = [self.conv_dim, self.value_dim, self.n_v_heads, self.n_v_heads]
            return split_outputs(self.in_proj_all(x), sizes)
        return [self[name](x) for name in self._PROJECTIONS]

    def fuse(self) -> None:
        """The four input projections as one matmul (after loading)."""
        parts = [self[name] for name in self._PROJECTIONS]
        if not can_fuse(parts):
            return
        self.in_proj_all = fuse_linears(parts)
        for name in self._PROJECTIONS:
            del self[name]

    def _core_spec(self) -> tuple:
        return (
            self.n_k_heads,
            self.n_v_heads,
            self.k_head_dim,
            self.v_head_dim,
            self.norm.eps,
            self.norm.activation,
        )


def _kernel_module():
    """kernels/gdn_decode.py, or None in a source tree that was not installed (the package
    maps `kernels/` to `qwen38_backend.kernels` at install); the op path then runs."""
    try:
        from ..kernels import gdn_decode
    except ImportError:
        return None
    return gdn_decode


def _gdn_core(qkv, z, b, a, hist, conv_w, A_log, dt_bias, S, norm_w, spec):
    """Conv + SiLU, gates, l2-normed q/k, the fused delta-rule kernel and the gated norm.

    Same arithmetic as the layer's chunked path (and the reference recurrence); S is
    [Hv, Dv, Dk] fp32. Returns (normed output [T, Hv*Dv], new conv history, new S).
    """
    Hk, Hv, Dk, Dv, eps, activation = spec
    T, dtype = qkv.shape[0], qkv.dtype
    K = conv_w.shape[1]
    xp = mx.concatenate([hist, qkv], axis=0)
    conv = xp[0:T] * conv_w[:, 0]
    for j in range(1, K):
        conv = conv + xp[j : j + T] * conv_w[:, j]
    conv = nn.silu(conv)
    q = conv[:, : Hk * Dk].reshape(T, Hk, Dk).astype(mx.float32)
    k = conv[:, Hk * Dk : 2 * Hk * Dk].reshape(T, Hk, Dk).astype(mx.float32)
    v = conv[:, 2 * Hk * Dk :].reshape(T, Hv, Dv).astype(mx.float32)
    q = _l2norm(q) * (Dk**-0.5)
    k = _l2norm(k)
    beta = mx.sigmoid(b.astype(mx.float32))
    g = -mx.exp(A_log.astype(mx.float32)) * nn.softplus(
        a.astype(mx.float32) + dt_bias.astype(mx.float32)
    )
    o, S = mx.fast.gated_delta_update(
        q[None], k[None], v[None], mx.exp(g)[None], beta[None], S[None]
    )
    o = o[0].astype(dtype)
    xh = mx.fast.rms_norm(o.astype(mx.float32), None, eps).astype(dtype)
    y = norm_w * xh
    zf = z.reshape(T, Hv, Dv).astype(mx.float32)
    gate = nn.silu(zf) if activation == "silu" else mx.sigmoid(zf)
    return (y * gate).astype(dtype).reshape(T, Hv * Dv), xp[-(K - 1) :], S[0]


_COMPILED: dict[tuple, Callable] = {}


def _decode_core(spec: tuple) -> Callable:
    """`_gdn_core` compiled for one token: ~40 elementwise ops fuse into a few kernels."""
    if spec not in _COMPILED:
        _COMPILED[spec] = mx.compile(partial(_gdn_core, spec=spec))
    return _COMPILED[spec]
