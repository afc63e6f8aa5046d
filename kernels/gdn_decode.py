"""One CUDA kernel for a Gated DeltaNet decode step (after the input projections): one token,
or the few rows of a speculative verify one after another in the same launch.

Why: on the CUDA backend `mx.fast.gated_delta_update` has no kernel and decomposes into
dozens of small ops, and the host encodes every op of every layer each token (measured on the
H200: ~20 ms of host encoding per 27B token, longer than the device's work). This kernel does
conv + SiLU, the q/k l2 norms, the gates, the delta rule and the gated RMSNorm of one layer in
one launch.

Arithmetic follows `qwen38_backend.models.gated_delta.gdn_core` (the op path): fp32 state and gate
math, rounding to the model dtype where that path rounds (conv output, delta-rule output, the
normalised value, the weighted norm). `available()` probes the kernel once against that path;
any mismatch or error disables it (the exact op path then runs).

One block per value head, 256 threads (8 warps); each warp updates rows of the head's
[Dv, Dk] state with a lane holding Dk/32 consecutive columns (one 16-byte load of a row at
Dk 128), all its rows loaded before the first is updated (ncu on the H200: 16 us a layer
with each row's loads waited for in turn).
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx

from qwen38_backend.models.gated_delta import CoreSpec, gdn_core

from .jit import cuda_kernel
from .switch import switched

THREADS = 256

_SOURCE = """
    constexpr int HK = {hk}, HV = {hv}, DK = {dk}, DV = {dv}, KW = {kw};
    constexpr int KEY_DIM = HK * DK, CONV_DIM = 2 * KEY_DIM + HV * DV;
    constexpr int PER_LANE = DK / 32;
    const float eps = {eps};
    const int h = blockIdx.x;
    const int hk = h / (HV / HK);
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    constexpr int WARPS = {threads} / 32;
    const int NT = qkv_shape[0];  // the step's rows, one token after another

    __shared__ float q_s[DK], k_s[DK], v_s[DV], o_s[DV], red[2 * WARPS], gates[2];

    // row j of the conv input [history (KW - 1 rows); the step's qkv rows]
    auto conv_in = [&](int j, int c) -> T {{
        return j < KW - 1 ? hist[j * CONV_DIM + c] : qkv[(j - (KW - 1)) * CONV_DIM + c];
    }};

    for (int t = 0; t < NT; ++t) {{
    // causal conv over [history; x] + SiLU for this head's q, k (its key head) and v channels
    for (int i = tid; i < 2 * DK + DV; i += {threads}) {{
        int c;
        if (i < DK) c = hk * DK + i;
        else if (i < 2 * DK) c = KEY_DIM + hk * DK + (i - DK);
        else c = 2 * KEY_DIM + h * DV + (i - 2 * DK);
        T acc = T(0.0f);
        for (int j = 0; j < KW; ++j) {{
            T xj = conv_in(t + j, c);
            acc = T(static_cast<float>(acc) + static_cast<float>(T(
                static_cast<float>(xj) * static_cast<float>(conv_w[c * KW + j]))));
        }}
        // silu as the op path rounds it: sigmoid in T, then the product in T
        float a = static_cast<float>(acc);
        float sg = static_cast<float>(T(1.0f / (1.0f + expf(-a))));
        float y = static_cast<float>(T(a * sg));
        if (i < DK) q_s[i] = y;
        else if (i < 2 * DK) k_s[i - DK] = y;
        else v_s[i - 2 * DK] = y;
        // history after the last row: the newest KW - 1 conv inputs; q/k channels are
        // written by the group's first head
        if (t == NT - 1 && (i >= 2 * DK || h % (HV / HK) == 0)) {{
            for (int j = 0; j < KW - 1; ++j)
                hist_out[j * CONV_DIM + c] = conv_in(NT + j, c);
        }}
    }}
    if (tid == 0) {{
        float bb = static_cast<float>(b[t * HV + h]);
        float aa = static_cast<float>(a_in[t * HV + h]) + static_cast<float>(dt_bias[h]);
        float sp = aa > 20.0f ? aa : log1pf(expf(aa));
        gates[0] = 1.0f / (1.0f + expf(-bb));                                  // beta
        gates[1] = expf(-expf(static_cast<float>(A_log[h])) * sp);            // exp(g)
    }}
    __syncthreads();

    // l2 norms of q and k (eps inside the sum of squares)
    float sq = 0.0f, sk = 0.0f;
    for (int i = tid; i < DK; i += {threads}) {{ sq += q_s[i] * q_s[i]; sk += k_s[i] * k_s[i]; }}
    for (int off = 16; off > 0; off /= 2) {{
        sq += __shfl_xor_sync(0xffffffff, sq, off);
        sk += __shfl_xor_sync(0xffffffff, sk, off);
    }}
    if (lane == 0) {{ red[warp] = sq; red[WARPS + warp] = sk; }}
    __syncthreads();
    float tq = 0.0f, tk = 0.0f;
    for (int w = 0; w < WARPS; ++w) {{ tq += red[w]; tk += red[WARPS + w]; }}
    const float q_scale = rsqrtf(tq + 1e-6f) * rsqrtf((float)DK);
    const float k_scale = rsqrtf(tk + 1e-6f);
    const float beta = gates[0], decay = gates[1];

    // a lane's columns: PER_LANE consecutive ones, so a state row comes as one 16-byte load
    // per lane (DK 128), not PER_LANE scalar ones
    float qr[PER_LANE], kr[PER_LANE];
    for (int e = 0; e < PER_LANE; ++e) {{
        qr[e] = q_s[lane * PER_LANE + e] * q_scale;
        kr[e] = k_s[lane * PER_LANE + e] * k_scale;
    }}
    auto load_cols = [](const float* p, float (&v)[PER_LANE]) {{
        if constexpr (PER_LANE == 4) {{
            const float4 u = *reinterpret_cast<const float4*>(p);
            v[0] = u.x; v[1] = u.y; v[2] = u.z; v[3] = u.w;
        }} else if constexpr (PER_LANE == 2) {{
            const float2 u = *reinterpret_cast<const float2*>(p);
            v[0] = u.x; v[1] = u.y;
        }} else {{
            for (int e = 0; e < PER_LANE; ++e) v[e] = p[e];
        }}
    }};
    auto store_cols = [](float* p, const float (&v)[PER_LANE]) {{
        if constexpr (PER_LANE == 4) {{
            *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
        }} else if constexpr (PER_LANE == 2) {{
            *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
        }} else {{
            for (int e = 0; e < PER_LANE; ++e) p[e] = v[e];
        }}
    }};
    // delta rule: the warp's state rows (value dims warp, warp + WARPS, ...) all loaded first,
    // so their loads overlap (row by row, each waited for its own: the step's longest part);
    // the state after row t is S_out[t] (the row before reads S_out[t - 1], written by this
    // same thread)
    constexpr int ROWS = (DV + WARPS - 1) / WARPS;
    const size_t state = (size_t)HV * DV * DK;
    const float* rows_in = (t == 0 ? S : S_out + (t - 1) * state) + (size_t)h * DV * DK;
    float* rows_out = S_out + t * state + (size_t)h * DV * DK;
    float s[ROWS][PER_LANE];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {{
        const int r = warp + i * WARPS;
        if (r < DV) load_cols(rows_in + (size_t)r * DK + lane * PER_LANE, s[i]);
    }}
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {{
        const int r = warp + i * WARPS;
        if (r >= DV) break;
        float mem = 0.0f;
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {{
            s[i][e] = s[i][e] * decay;
            mem += s[i][e] * kr[e];
        }}
        for (int off = 16; off > 0; off /= 2) mem += __shfl_xor_sync(0xffffffff, mem, off);
        const float delta = (v_s[r] - mem) * beta;
        float o = 0.0f;
#pragma unroll
        for (int e = 0; e < PER_LANE; ++e) {{
            s[i][e] += kr[e] * delta;
            o += s[i][e] * qr[e];
        }}
        store_cols(rows_out + (size_t)r * DK + lane * PER_LANE, s[i]);
        for (int off = 16; off > 0; off /= 2) o += __shfl_xor_sync(0xffffffff, o, off);
        if (lane == 0) o_s[r] = static_cast<float>(T(o));
    }}
    __syncthreads();

    // gated RMSNorm over the head's value dims
    float so = 0.0f;
    for (int i = tid; i < DV; i += {threads}) so += o_s[i] * o_s[i];
    for (int off = 16; off > 0; off /= 2) so += __shfl_xor_sync(0xffffffff, so, off);
    if (lane == 0) red[warp] = so;
    __syncthreads();
    float to = 0.0f;
    for (int w = 0; w < WARPS; ++w) to += red[w];
    const float inv = rsqrtf(to / DV + eps);
    for (int i = tid; i < DV; i += {threads}) {{
        float xh = static_cast<float>(T(o_s[i] * inv));
        float y = static_cast<float>(T(static_cast<float>(norm_w[i]) * xh));
        float zf = static_cast<float>(z[t * HV * DV + h * DV + i]);
        float gate = {gate};
        out[t * HV * DV + h * DV + i] = T(y * gate);
    }}
    __syncthreads();  // the next row reuses the shared buffers
    }}
"""

_GATES = {"silu": "zf / (1.0f + expf(-zf))", "sigmoid": "1.0f / (1.0f + expf(-zf))"}


@functools.cache
def _kernel(spec: tuple):
    hk, hv, dk, dv, kw, eps, activation = spec
    source = _SOURCE.format(
        hk=hk,
        hv=hv,
        dk=dk,
        dv=dv,
        kw=kw,
        eps=repr(float(eps)) + "f",
        threads=THREADS,
        gate=_GATES[activation],
    )
    return cuda_kernel(
        name=f"qwen38_gdn_decode_{hk}_{hv}_{dk}_{dv}_{kw}_{activation}",
        input_names=["qkv", "hist", "conv_w", "z", "b", "a_in", "A_log", "dt_bias", "S", "norm_w"],
        output_names=["out", "hist_out", "S_out"],
        source=source,
    )


def gdn_decode_rows(
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
    """The rows of a step, one token after another, in one launch: qkv [T, C], z [T, Hv*Dv],
    b/a [T, Hv], hist [K-1, C], conv_w [C, K], S [Hv, Dv, Dk] fp32. Returns (out [T, Hv*Dv],
    the history after the last row, the state after each row [T, Hv, Dv, Dk]). Each row runs
    the same code whatever T is, so a row's bits do not depend on the rows with it."""
    hk, hv, dk, dv, eps, activation = spec
    kw = conv_w.shape[1]
    dtype = qkv.dtype
    rows = qkv.shape[0]
    return _kernel((hk, hv, dk, dv, kw, eps, activation))(
        inputs=[qkv, hist, conv_w, z, b, a, A_log, dt_bias, S, norm_w],
        template=[("T", dtype)],
        grid=(hv * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, hv * dv), hist.shape, (rows, *S.shape)],
        output_dtypes=[dtype, dtype, mx.float32],
    )


def gdn_decode_step(*operands: mx.array, spec: CoreSpec) -> tuple[mx.array, mx.array, mx.array]:
    """`gated_delta.gdn_core`'s operands and results for T tokens (the state after the last):
    `gdn_decode_rows` without the per-row states."""
    out, hist_out, states = gdn_decode_rows(*operands, spec=spec)
    return out, hist_out, states[-1:].reshape(states.shape[1:])  # a slice: no gather copy


def supported(spec: CoreSpec) -> bool:
    """Whether this device and layer shape can run the kernel at all (no probe)."""
    hk, hv, dk, dv, _, activation = spec
    return (
        mx.default_device() == mx.gpu
        and mx.cuda.is_available()
        and dk % 32 == 0
        and hv % hk == 0
        and activation in _GATES
    )


@functools.cache
def available(spec: CoreSpec, dtype: mx.Dtype) -> bool:
    """True when the kernel runs here and agrees with the op path on random inputs (probed
    once per shape and dtype); else False, with a warning when it ran but disagreed."""
    # QWEN38_GDN_KERNEL: auto | off | force (skip the probe)
    decided = switched("QWEN38_GDN_KERNEL", lambda: supported(spec))
    if decided is not None:
        return decided
    hk, hv, dk, dv, _, _ = spec
    kw = 4
    conv_dim = 2 * hk * dk + hv * dv
    keys = mx.random.split(mx.random.key(7), 9)
    args = [
        mx.random.normal((1, conv_dim), key=keys[0]).astype(dtype),
        mx.random.normal((1, hv * dv), key=keys[1]).astype(dtype),
        mx.random.normal((1, hv), key=keys[2]).astype(dtype),
        mx.random.normal((1, hv), key=keys[3]).astype(dtype),
        mx.random.normal((kw - 1, conv_dim), key=keys[4]).astype(dtype),
        (0.5 * mx.random.normal((conv_dim, kw), key=keys[5])).astype(dtype),
        mx.random.uniform(0.0, 2.0, (hv,), key=keys[6]).astype(dtype),
        mx.random.uniform(-1.0, 1.0, (hv,), key=keys[7]).astype(dtype),
        0.1 * mx.random.normal((hv, dv, dk), key=keys[8]),
        mx.ones((dv,), dtype=dtype),
    ]
    try:
        got = gdn_decode_step(*args, spec=spec)
        want = gdn_core(*args, spec=spec)
        mx.eval(got, want)
    except Exception as e:  # noqa: BLE001 - any failure means: use the op path
        warnings.warn(f"GDN decode kernel unavailable ({e}); using the op path", stacklevel=2)
        return False
    # fp32: elementwise. Half precision: relative to the tensor's norm (the two paths may
    # round a value an ulp apart, and the delta rule's v - S k can amplify that locally).
    errors = []
    for g, w in zip(got, want, strict=True):
        g, w = g.astype(mx.float32), w.astype(mx.float32)
        if dtype == mx.float32:
            errors.append(mx.abs(g - w).max().item())
        else:
            errors.append((mx.linalg.norm(g - w) / mx.linalg.norm(w)).item())
    tol = 1e-4 if dtype == mx.float32 else 2.0**-7
    if max(errors) > tol:
        warnings.warn(
            f"GDN decode kernel disagrees with the op path (max errors {errors}); using the "
            "op path",
            stacklevel=2,
        )
        return False
    return True
