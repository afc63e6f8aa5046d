"""A Gated DeltaNet prefill's chunked form (`gated_delta.chunked_gated_delta`) on CUDA: its
per-chunk solve and its scan over chunks, one launch each.

Why: the op path runs the scan as a Python loop of ~8 small ops per 64-token chunk (32 chunks
per 2048-token prefill chunk, every Gated DeltaNet layer), and the solve as ~50 small ops
(recursive doubling of a unit lower-triangular inverse), so on the H200 a 27B layer's
chunked core took 4.8 ms of a 10 ms block, 57% of a 4K prefill, bound by launches
(benchmarks/results/h200/profile_prefill_4k.json).

`chunk_scan`: one block per (head, 32 value columns). The columns of the state S [Dk, Dv]
are independent (delta, o and S's update of column j read only column j of S and of delta),
so a block holds S[:, cols] (Dk x 32 fp32) and the chunk's delta[:, cols] in shared memory
for the whole scan; the chunk's operands (w, q_dec, qk, k_tail) pass through a shared
64 x 64 tile, loaded coalesced. Lanes run over the 32 columns and each warp over 8 rows with
8 independent accumulators (the tile's row broadcast to the warp).

`chunk_solve`: one block per (head, chunk). The strictly lower A = beta_t (k_t . k_s)
exp(gam_t - gam_s) is built in shared memory (k through two 64-column halves), then each
thread solves (I + A) x = b for one right-hand column (of v beta | k beta exp(gam)) by
forward substitution, its 64 unknowns in registers.

fp32 throughout, fmaf in ascending index order: equal to the op path to fp32 rounding (its
matmuls sum in another order; its solve goes through the inverse). `available()` probes
each kernel once against the op path; any error or mismatch leaves that part to the op path.
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx

from qwen38_backend.models.gated_delta import scan_chunks, solve_chunks

from .jit import cuda_kernel
from .switch import switched

THREADS = 256
COLUMNS = 32  # value columns per block: one warp's lanes

_SCAN = """
    constexpr int C = {c}, DK = {dk}, DV = {dv}, DVB = {dvb}, NB = DV / DVB;
    constexpr int WARPS = {threads} / 32, TILE = 64;
    constexpr int RPW = C / WARPS;  // chunk rows per warp (phases 1, 2)
    constexpr int JPW = TILE / WARPS;  // state rows per warp and tile (phase 3)
    static_assert(DVB == 32 && C == TILE && DK % TILE == 0, "shape");
    const int h = blockIdx.x / NB, c0 = (blockIdx.x % NB) * DVB;
    const int col = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int N = u_shape[1];
    __shared__ float S_s[DK * DVB];
    __shared__ float d_s[C * DVB];
    __shared__ __align__(16) float t_s[TILE * TILE];

    // t_s = rows [0, 64) x columns [j0, j0 + 64) of a row-major [64, width] matrix
    auto load_tile = [&](const float* src, int width, int j0) {{
        __syncthreads();  // the tile before is read
        for (int e = threadIdx.x; e < TILE * TILE / 4; e += {threads}) {{
            int r = e / (TILE / 4), q = e % (TILE / 4);
            reinterpret_cast<float4*>(t_s)[e] =
                *reinterpret_cast<const float4*>(src + (long long)r * width + j0 + 4 * q);
        }}
        __syncthreads();
    }};
    // acc[i] += t_s[row i of this warp] . S_s[j0 .. j0 + 64)[col]
    auto rows_times_state = [&](float* acc, int j0) {{
        for (int j = 0; j < TILE; j += 4) {{
            float s0 = S_s[(j0 + j) * DVB + col], s1 = S_s[(j0 + j + 1) * DVB + col];
            float s2 = S_s[(j0 + j + 2) * DVB + col], s3 = S_s[(j0 + j + 3) * DVB + col];
            #pragma unroll
            for (int i = 0; i < RPW; ++i) {{
                float4 t = reinterpret_cast<const float4*>(t_s + (warp + WARPS * i) * TILE + j)[0];
                acc[i] = fmaf(t.w, s3, fmaf(t.z, s2, fmaf(t.y, s1, fmaf(t.x, s0, acc[i]))));
            }}
        }}
    }};

    for (int j = warp; j < DK; j += WARPS)
        S_s[j * DVB + col] = S[((long long)h * DK + j) * DV + c0 + col];

    for (int n = 0; n < N; ++n) {{
        const long long hn = (long long)h * N + n;
        float acc[RPW];
        // delta = u - w S
        #pragma unroll
        for (int i = 0; i < RPW; ++i) acc[i] = 0.0f;
        for (int j0 = 0; j0 < DK; j0 += TILE) {{
            load_tile(w + hn * C * DK, DK, j0);
            rows_times_state(acc, j0);
        }}
        #pragma unroll
        for (int i = 0; i < RPW; ++i) {{
            int r = warp + WARPS * i;
            d_s[r * DVB + col] = u[(hn * C + r) * DV + c0 + col] - acc[i];
        }}
        // o = q_dec S + qk delta (qk is zero above the diagonal)
        #pragma unroll
        for (int i = 0; i < RPW; ++i) acc[i] = 0.0f;
        for (int j0 = 0; j0 < DK; j0 += TILE) {{
            load_tile(q_dec + hn * C * DK, DK, j0);
            rows_times_state(acc, j0);
        }}
        load_tile(qk + hn * C * C, C, 0);  // also: every delta row is written
        for (int m = 0; m < C; ++m) {{
            float dm = d_s[m * DVB + col];
            #pragma unroll
            for (int i = 0; i < RPW; ++i)
                acc[i] = fmaf(t_s[(warp + WARPS * i) * TILE + m], dm, acc[i]);
        }}
        #pragma unroll
        for (int i = 0; i < RPW; ++i)
            o[(hn * C + warp + WARPS * i) * DV + c0 + col] = acc[i];
        // S = S decay + k_tail^T delta; each thread updates its own elements of S
        const float dec = decay[hn];
        for (int j0 = 0; j0 < DK; j0 += TILE) {{
            load_tile(k_tail + hn * C * DK, DK, j0);  // also: S is no longer read
            float upd[JPW];
            #pragma unroll
            for (int i = 0; i < JPW; ++i) upd[i] = 0.0f;
            for (int m = 0; m < C; ++m) {{
                float dm = d_s[m * DVB + col];
                #pragma unroll
                for (int i = 0; i < JPW; ++i)
                    upd[i] = fmaf(t_s[m * TILE + warp + WARPS * i], dm, upd[i]);
            }}
            #pragma unroll
            for (int i = 0; i < JPW; ++i) {{
                int j = j0 + warp + WARPS * i;
                S_s[j * DVB + col] = S_s[j * DVB + col] * dec + upd[i];
            }}
        }}
    }}
    __syncthreads();
    for (int j = warp; j < DK; j += WARPS)
        S_out[((long long)h * DK + j) * DV + c0 + col] = S_s[j * DVB + col];
"""


_SOLVE = """
    constexpr int C = {c}, DK = {dk}, DV = {dv}, HALF = 64, PAD = HALF + 1;
    static_assert(C == 64 && DK % HALF == 0, "shape");
    const long long hn = blockIdx.x;  // (head, chunk)
    const int tid = threadIdx.x;
    __shared__ float k_s[C * PAD];  // k's rows, 64 of its columns at a time (padded rows)
    __shared__ float A_s[C * C];
    __shared__ float b_s[C], g_s[C];
    if (tid < C) {{
        b_s[tid] = beta[hn * C + tid];
        g_s[tid] = gam[hn * C + tid];
    }}
    // A[r][m] = beta_r (k_r . k_m) exp(gam_r - gam_m) for m < r: 16 entries per thread
    constexpr int PER = C * C / {threads};
    float dot[PER];
    #pragma unroll
    for (int i = 0; i < PER; ++i) dot[i] = 0.0f;
    for (int j0 = 0; j0 < DK; j0 += HALF) {{
        __syncthreads();
        for (int e = tid; e < C * HALF; e += {threads})
            k_s[(e / HALF) * PAD + e % HALF] = k[(hn * C + e / HALF) * DK + j0 + e % HALF];
        __syncthreads();
        #pragma unroll
        for (int i = 0; i < PER; ++i) {{
            int e = tid + {threads} * i, r = e / C, m = e % C;
            if (m < r)
                for (int j = 0; j < HALF; ++j)
                    dot[i] = fmaf(k_s[r * PAD + j], k_s[m * PAD + j], dot[i]);
        }}
    }}
    #pragma unroll
    for (int i = 0; i < PER; ++i) {{
        int e = tid + {threads} * i, r = e / C, m = e % C;
        A_s[e] = m < r ? b_s[r] * dot[i] * expf(g_s[r] - g_s[m]) : 0.0f;
    }}
    __syncthreads();
    // (I + A) x = b per right-hand column: v beta (u), then k beta exp(gam) (w)
    for (int col = tid; col < DV + DK; col += {threads}) {{
        float x[C];
        #pragma unroll
        for (int r = 0; r < C; ++r) {{
            float acc = col < DV ? v[(hn * C + r) * DV + col] * b_s[r]
                                 : k[(hn * C + r) * DK + col - DV] * (b_s[r] * expf(g_s[r]));
            #pragma unroll
            for (int m = 0; m < r; ++m) acc = fmaf(-A_s[r * C + m], x[m], acc);
            x[r] = acc;
            if (col < DV) u[(hn * C + r) * DV + col] = acc;
            else w[(hn * C + r) * DK + col - DV] = acc;
        }}
    }}
"""


@functools.cache
def _scan_kernel(c: int, dk: int, dv: int):
    source = _SCAN.format(c=c, dk=dk, dv=dv, dvb=COLUMNS, threads=THREADS)
    return cuda_kernel(
        name=f"qwen38_gdn_chunk_scan_{c}_{dk}_{dv}",
        input_names=["u", "w", "q_dec", "qk", "k_tail", "decay", "S"],
        output_names=["o", "S_out"],
        source=source,
    )


@functools.cache
def _solve_kernel(c: int, dk: int, dv: int):
    source = _SOLVE.format(c=c, dk=dk, dv=dv, threads=THREADS)
    return cuda_kernel(
        name=f"qwen38_gdn_chunk_solve_{c}_{dk}_{dv}",
        input_names=["k", "v", "beta", "gam"],
        output_names=["u", "w"],
        source=source,
    )


def chunk_solve(
    k: mx.array, v: mx.array, beta: mx.array, gam: mx.array
) -> tuple[mx.array, mx.array]:
    """`gated_delta.solve_chunks` in one launch (same arguments and results, all fp32)."""
    H, N, C, Dk = k.shape
    Dv = v.shape[-1]
    ops = [mx.contiguous(x.astype(mx.float32)) for x in (k, v, beta, gam)]
    return _solve_kernel(C, Dk, Dv)(
        inputs=ops,
        grid=(H * N * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(H, N, C, Dv), (H, N, C, Dk)],
        output_dtypes=[mx.float32, mx.float32],
    )


def chunk_scan(
    u: mx.array,
    w: mx.array,
    q_dec: mx.array,
    qk: mx.array,
    k_tail: mx.array,
    decay: mx.array,
    S: mx.array,
) -> tuple[mx.array, mx.array]:
    """`gated_delta.scan_chunks` in one launch (same arguments and results, all fp32)."""
    H, N, C, Dv = u.shape
    Dk = w.shape[-1]
    ops = [mx.contiguous(x.astype(mx.float32)) for x in (u, w, q_dec, qk, k_tail, decay, S)]
    return _scan_kernel(C, Dk, Dv)(
        inputs=ops,
        grid=(H * (Dv // COLUMNS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(H, N, C, Dv), (H, Dk, Dv)],
        output_dtypes=[mx.float32, mx.float32],
    )


def supported(dk: int, dv: int, chunk: int) -> bool:
    """Whether this device and shape can run the kernels (no probe): 64-token chunks, Dk a
    multiple of 64 (tiles of 64 x 64), shared memory for S[:, 32 columns] within 48 KiB."""
    return (
        mx.default_device() == mx.gpu
        and mx.cuda.is_available()
        and dv % COLUMNS == 0
        and chunk == 64
        and dk % 64 == 0
        and (dk + chunk) * COLUMNS * 4 + 64 * 64 * 4 <= 48 * 1024
    )


@functools.cache
def available(kind: str, dk: int, dv: int, chunk: int) -> bool:
    """True when kernel `kind` ("solve" or "scan") runs here and agrees with the op path on
    random inputs (`probe`, once per shape); else False, with a warning when it ran but
    disagreed. QWEN38_GDN_PREFILL_KERNEL: auto | off | force (skip the probe)."""
    decided = switched("QWEN38_GDN_PREFILL_KERNEL", lambda: supported(dk, dv, chunk))
    if decided is not None:
        return decided
    why = probe(kind, dk, dv, chunk)
    if why is not None:
        warnings.warn(f"GDN chunk {kind} kernel {why}; using the op path", stacklevel=2)
    return why is None


def probe(kind: str, dk: int, dv: int, chunk: int) -> str | None:
    """Run kernel `kind` and the op path on the same random operands: None when they agree
    to fp32 rounding, else why not (an error, or the relative errors)."""
    args = probe_inputs(heads=3, chunks=3, chunk=chunk, dk=dk, dv=dv)
    kernel, ops = (chunk_solve, solve_chunks) if kind == "solve" else (chunk_scan, scan_chunks)
    args = args[:4] if kind == "solve" else args[4:]
    try:
        got, want = kernel(*args), ops(*args)
        mx.eval(got, want)
    except Exception as e:  # noqa: BLE001 - any failure means: use the op path
        return f"unavailable ({e})"
    pairs = zip(got, want, strict=True)
    errors = [(mx.abs(g - x).max() / mx.abs(x).max()).item() for g, x in pairs]
    if max(errors) > 1e-4:
        return f"disagrees with the op path (relative errors {errors})"
    return None


def probe_inputs(heads: int, chunks: int, chunk: int, dk: int, dv: int, seed: int = 5):
    """Random operands shaped and scaled as a layer's: the solve's (k with unit rows, v, beta
    in (0, 1), gam a cumulative log decay), then the scan's (u, w, q_dec, qk lower
    triangular, k_tail, decays in (0.5, 1], S)."""
    keys = mx.random.split(mx.random.key(seed), 11)
    shape_k, shape_v = (heads, chunks, chunk, dk), (heads, chunks, chunk, dv)
    k = mx.random.normal(shape_k, key=keys[7])
    k = k * mx.rsqrt((k * k).sum(-1, keepdims=True))
    v = mx.random.normal(shape_v, key=keys[8])
    beta = mx.random.uniform(0.0, 1.0, (heads, chunks, chunk), key=keys[9])
    gam = mx.cumsum(-mx.random.uniform(0.01, 0.5, (heads, chunks, chunk), key=keys[10]), -1)
    u = mx.random.normal(shape_v, key=keys[0])
    w = mx.random.normal(shape_k, key=keys[1]) / dk**0.5
    q_dec = mx.random.normal(shape_k, key=keys[2]) / dk**0.5
    k_tail = mx.random.normal(shape_k, key=keys[3]) / dk**0.5
    lower = mx.tril(mx.ones((chunk, chunk)))
    qk = mx.random.normal((heads, chunks, chunk, chunk), key=keys[4]) * lower / chunk**0.5
    decay = mx.random.uniform(0.5, 1.0, (heads, chunks), key=keys[5])
    S = mx.random.normal((heads, dk, dv), key=keys[6])
    return k, v, beta, gam, u, w, q_dec, qk, k_tail, decay, S
