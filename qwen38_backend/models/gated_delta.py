"""The gated delta rule: the pure math of a Gated DeltaNet layer (no modules, no state objects).

Math (QWEN38.md, "Gated DeltaNet"): per value head a fp32 state S [Dk, Dv];
S = S * exp(g_t); delta = (v_t - S^T k_t) * beta_t; S = S + k_t delta^T; o_t = S^T q_t.

Exact forms of that recurrence:
- `recurrent_gated_delta`: token by token: a few small matmuls per token, every head at once
  (the reference the others are tested against).
- `chunked_gated_delta`: chunks of 64 tokens (prefill). Inside a chunk the deltas solve a unit
  lower-triangular system; its inverse is built by recursive block doubling (matmuls only, no
  powers of the system matrix, so it stays as stable as forward substitution), then a short
  scan over chunks carries the state.
- `gdn_core`: the few-token path of the layer (decode, MTP verify) from its projections:
  conv, gates, `mx.fast.gated_delta_update`, gated norm. `decode_core` is it compiled for one
  token; the CUDA kernel (kernels/gdn_decode.py) is checked against it. The layer
  (gated_deltanet.py) and the kernel both import this module, which imports neither.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import mlx.core as mx
import mlx.nn as nn

CHUNK = 64
# Peak of a Gated DeltaNet block over a prefill chunk, in fp32 rows of its value heads
# (Hv x Dv x 4 bytes) per chunk token: the chunked form's [H, N, C, *] tensors (q, k, v
# repeated to the value heads, u, w, q_dec, qk, k_tail, the outputs), all fp32 whatever the
# model dtype. Measured on the CPU (benchmarks/prefill_peak_cpu.py): 22-23 at 27B dims in
# fp32 and bf16 and at the test dims of tests/test_prefill_memory.py; admission plans with it.
PREFILL_ROWS_LIVE = 23


def l2norm(x: mx.array, eps: float = 1e-6) -> mx.array:
    """x over its l2 norm on the last axis; exact (eps added to the sum of squares), as the
    reference does."""
    return x * mx.rsqrt(mx.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(xp: mx.array, w: mx.array) -> mx.array:
    """Causal depthwise conv + SiLU: xp [K - 1 + T, C] (the history, then T rows), w [C, K]
    -> [T, C], in xp's dtype."""
    K = w.shape[1]
    T = xp.shape[0] - K + 1
    out = xp[0:T] * w[:, 0]
    for j in range(1, K):
        out = out + xp[j : j + T] * w[:, j]
    return nn.silu(out)


def gates(
    a: mx.array, b: mx.array, A_log: mx.array, dt_bias: mx.array
) -> tuple[mx.array, mx.array]:
    """(g, beta) fp32 [T, Hv] from the a and b projections: the log decay
    g = -exp(A_log) softplus(a + dt_bias) and the write strength beta = sigmoid(b)."""
    f32 = mx.float32
    g = -mx.exp(A_log.astype(f32)) * nn.softplus(a.astype(f32) + dt_bias.astype(f32))
    return g, mx.sigmoid(b.astype(f32))


def gated_rms_norm(
    o: mx.array, z: mx.array, weight: mx.array, eps: float, activation: str
) -> mx.array:
    """weight * rmsnorm(o) (statistic in fp32) * act(z), in o's dtype; o, z [T, Hv, Dv]."""
    dtype = o.dtype
    xh = mx.fast.rms_norm(o.astype(mx.float32), None, eps).astype(dtype)
    zf = z.astype(mx.float32)
    gate = nn.silu(zf) if activation == "silu" else mx.sigmoid(zf)
    return (weight * xh * gate).astype(dtype)


# The pieces compiled once for every layer (module-level: a trace per input shape, shared by
# all layers): the prefill path's elementwise chains fuse into one kernel each instead of
# ~10 passes over [T, C] (its conv was 0.6 ms of a 6.2 ms 27B block per 2048-token chunk on
# the H200, benchmarks/results/h200/profile_prefill_4k_solve_kernel.json).
compiled_conv = mx.compile(causal_conv)
compiled_gates = mx.compile(gates)
_COMPILED_WITH: dict[tuple, Callable] = {}


def compiled_with(fn: Callable, **constants: object) -> Callable:
    """`fn` with keyword `constants` bound, compiled once per distinct constants."""
    key = (fn, *sorted(constants.items()))
    if key not in _COMPILED_WITH:
        _COMPILED_WITH[key] = mx.compile(partial(fn, **constants))
    return _COMPILED_WITH[key]


def prepare_qk(q: mx.array, k: mx.array, n_v_heads: int) -> tuple[mx.array, mx.array]:
    """fp32 l2-normed q (also scaled by Dk^-0.5) and k, repeated to the value heads.

    q, k: [T, Hk, Dk] -> [T, Hv, Dk]; value head i reads key head i // (Hv / Hk).
    """
    q, k = q.astype(mx.float32), k.astype(mx.float32)
    q = l2norm(q) * (q.shape[-1] ** -0.5)
    k = l2norm(k)
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


def scan_chunks(
    u: mx.array,
    w: mx.array,
    q_dec: mx.array,
    qk: mx.array,
    k_tail: mx.array,
    decay: mx.array,
    S: mx.array,
) -> tuple[mx.array, mx.array]:
    """The chunked form's scan over chunks: per chunk n, delta = u - w S; o = q_dec S +
    qk delta; S = S decay + k_tail^T delta. u [H, N, C, Dv], w / q_dec / k_tail [H, N, C, Dk],
    qk [H, N, C, C], decay [H, N], S [H, Dk, Dv] (fp32). Returns (o [H, N, C, Dv], S).
    (kernels/gdn_prefill.py's chunk_scan is the same scan in one CUDA launch.)"""
    outs = []
    for n in range(u.shape[1]):
        delta = u[:, n] - w[:, n] @ S
        outs.append(q_dec[:, n] @ S + qk[:, n] @ delta)
        S = S * decay[:, n, None, None] + k_tail[:, n].swapaxes(-1, -2) @ delta
    return mx.stack(outs, axis=1), S


def solve_chunks(
    k: mx.array, v: mx.array, beta: mx.array, gam: mx.array
) -> tuple[mx.array, mx.array]:
    """Each chunk's deltas if its incoming state were zero (u) and how that state shifts them
    (w): with A[t, s] = beta_t (k_t . k_s) exp(gam_t - gam_s) for s < t, (I + A) u = v beta
    and (I + A) w = k beta exp(gam). k [H, N, C, Dk], v [H, N, C, Dv], beta / gam (the
    cumulative log decay) [H, N, C], fp32. The unit lower-triangular inverse is built by
    recursive block doubling (_unit_lower_inverse). (kernels/gdn_prefill.py's chunk_solve
    solves by forward substitution in one CUDA launch.)"""
    chunk = k.shape[-2]
    idx = mx.arange(chunk)
    strict = idx[:, None] > idx[None, :]
    # mask before exp: above the diagonal the difference is positive and could overflow
    decay = mx.exp(mx.where(strict, gam[..., :, None] - gam[..., None, :], -mx.inf))
    system = mx.eye(chunk, dtype=mx.float32) + beta[..., :, None] * (k @ k.swapaxes(-1, -2)) * decay
    inv = _unit_lower_inverse(system)
    u = inv @ (v * beta[..., None])
    w = inv @ (k * (beta * mx.exp(gam))[..., None])
    return u, w


Scan = Callable[..., tuple[mx.array, mx.array]]
Solve = Callable[..., tuple[mx.array, mx.array]]


def chunked_gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    S: mx.array,
    chunk: int = CHUNK,
    solve: Solve = solve_chunks,
    scan: Scan = scan_chunks,
) -> tuple[mx.array, mx.array]:
    """Chunked form, same arguments and results as `recurrent_gated_delta`; `solve` and
    `scan`: the per-chunk solve and the scan over chunks (`solve_chunks`'s and
    `scan_chunks`' arguments and results)."""
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
    u, w = solve(k, v, beta, gam)
    idx = mx.arange(chunk)
    causal = idx[:, None] >= idx[None, :]
    # mask before exp: above the diagonal the difference is positive and could overflow
    decay_incl = mx.exp(mx.where(causal, gam[..., :, None] - gam[..., None, :], -mx.inf))
    q_dec = q * mx.exp(gam)[..., None]
    qk = (q @ k.swapaxes(-1, -2)) * decay_incl
    k_tail = k * mx.exp(gam[..., -1:] - gam)[..., None]
    o, S = scan(u, w, q_dec, qk, k_tail, mx.exp(gam[..., -1]), S)
    o = o.reshape(H, N * chunk, Dv).transpose(1, 0, 2)
    return o[:T], S


# (n_k_heads, n_v_heads, k_head_dim, v_head_dim, norm eps, gate activation) of one layer
CoreSpec = tuple[int, int, int, int, float, str]


def gdn_core(
    qkv: mx.array,
    z: mx.array,
    b: mx.array,
    a: mx.array,
    hist: mx.array,
    conv_w: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    S: mx.array,
    norm_w: mx.array,
    spec: CoreSpec,
) -> tuple[mx.array, mx.array, mx.array]:
    """Conv + SiLU, gates, l2-normed q/k, the fused delta-rule kernel and the gated norm.

    qkv, z, b, a: the layer's input projections for T tokens; hist: the conv history
    [K-1, C]; conv_w [C, K]. Same arithmetic as the layer's chunked path (and the reference
    recurrence); S is [Hv, Dv, Dk] fp32. Returns (normed output [T, Hv*Dv], new conv
    history, new S).
    """
    Hk, Hv, Dk, Dv, eps, activation = spec
    T, dtype = qkv.shape[0], qkv.dtype
    K = conv_w.shape[1]
    xp = mx.concatenate([hist, qkv], axis=0)
    conv = causal_conv(xp, conv_w)
    q = conv[:, : Hk * Dk].reshape(T, Hk, Dk).astype(mx.float32)
    k = conv[:, Hk * Dk : 2 * Hk * Dk].reshape(T, Hk, Dk).astype(mx.float32)
    v = conv[:, 2 * Hk * Dk :].reshape(T, Hv, Dv).astype(mx.float32)
    q = l2norm(q) * (Dk**-0.5)
    k = l2norm(k)
    g, beta = gates(a, b, A_log, dt_bias)
    o, S = mx.fast.gated_delta_update(
        q[None], k[None], v[None], mx.exp(g)[None], beta[None], S[None]
    )
    o = gated_rms_norm(o[0].astype(dtype), z.reshape(T, Hv, Dv), norm_w, eps, activation)
    return o.reshape(T, Hv * Dv), xp[-(K - 1) :], S[0]


_COMPILED: dict[CoreSpec, Callable] = {}


def decode_core(spec: CoreSpec) -> Callable:
    """`gdn_core` compiled for one token: ~40 elementwise ops fuse into a few kernels."""
    if spec not in _COMPILED:
        _COMPILED[spec] = mx.compile(partial(gdn_core, spec=spec))
    return _COMPILED[spec]
