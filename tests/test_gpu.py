"""Checks that only mean something on a GPU (opt in with --run-gpu; run on the H200)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import random_gated_residual, random_moe

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def on_gpu():
    if mx.default_device() == mx.cpu:
        pytest.fail("--run-gpu needs MLX with a GPU backend (metal or cuda)")


def test_zero_centred_norm_mixed_precision_equals_cast_first():
    """RMSNorm feeds bf16 x straight to the fused kernel with the fp32 (1 + w); it must give
    the same bits as casting x to fp32 first (QWEN38.md's definition)."""
    for seed in range(3):
        mx.random.seed(seed)
        x = (3 * mx.random.normal((16, 5120))).astype(mx.bfloat16)
        scale = 1.0 + 0.1 * mx.random.normal((5120,))
        fast = mx.fast.rms_norm(x, scale, 1e-6).astype(mx.bfloat16)
        ref = mx.fast.rms_norm(x.astype(mx.float32), scale, 1e-6).astype(mx.bfloat16)
        assert (fast != ref).sum().item() == 0


def test_fused_delta_rule_matches_the_recurrence_on_gpu():
    from qwen38_backend.models.gated_deltanet import prepare_qk, recurrent_gated_delta

    T, Hk, Hv, D = 5, 16, 48, 128
    mx.random.seed(0)
    q, k = mx.random.normal((T, Hk, D)), mx.random.normal((T, Hk, D))
    v = mx.random.normal((T, Hv, D))
    g = -mx.random.uniform(0.01, 1.0, (T, Hv))
    beta = mx.random.uniform(0.0, 1.0, (T, Hv))
    S0 = 0.1 * mx.random.normal((Hv, D, D))
    qp, kp = prepare_qk(q, k, Hv)
    o_ref, S_ref = recurrent_gated_delta(qp, kp, v, g, beta, S0)
    qn = q * mx.rsqrt((q * q).sum(-1, keepdims=True) + 1e-6) * D**-0.5
    kn = k * mx.rsqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    o, S = mx.fast.gated_delta_update(
        qn[None], kn[None], v[None], mx.exp(g)[None], beta[None], S0.swapaxes(-1, -2)[None]
    )
    assert np.abs(np.array(o[0]) - np.array(o_ref)).max() < 1e-4
    assert np.abs(np.array(S[0].swapaxes(-1, -2)) - np.array(S_ref)).max() < 1e-4


def test_greedy_decode_equals_full_forward_argmax_fp32(tmp_path):
    """fp32 on the GPU: the cached decode path picks the same tokens as fresh full forwards."""
    from helpers import dense_fixture

    import qwen38_backend

    model = qwen38_backend.load(dense_fixture("qwen3", tmp_path), dtype="float32")
    prompt = [11, 12, 13, 200]
    ours = list(model.generate_tokens(prompt, max_tokens=16, stop_token_ids=[]))
    ids = list(prompt)
    for _ in range(16):
        ids.append(int(np.argmax(model.logits(ids)[-1])))
    assert ours == ids[len(prompt) :]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gdn_decode_kernel_matches_the_op_path(dtype):
    """The fused CUDA decode step against `_gdn_core` over 8 chained steps (27B dims)."""
    from qwen38_backend.kernels import gdn_decode

    from qwen38_backend.models.gated_deltanet import _gdn_core

    if not mx.cuda.is_available():
        pytest.skip("the fused Gated DeltaNet decode kernel is CUDA-only")
    hk, hv, dk, dv, kw = 16, 48, 128, 128, 4
    spec = (hk, hv, dk, dv, 1e-6, "silu")
    assert gdn_decode.available(spec, dtype)
    conv_dim = 2 * hk * dk + hv * dv
    mx.random.seed(1)
    conv_w = (0.5 * mx.random.normal((conv_dim, kw))).astype(dtype)
    A_log = mx.random.uniform(0.0, 2.0, (hv,)).astype(dtype)
    dt_bias = mx.random.uniform(-1.0, 1.0, (hv,)).astype(dtype)
    norm_w = (1 + 0.1 * mx.random.normal((dv,))).astype(dtype)
    ours = ref = (mx.zeros((kw - 1, conv_dim), dtype), mx.zeros((hv, dv, dk)))
    for _ in range(8):
        x = [
            mx.random.normal(shape).astype(dtype)
            for shape in ((1, conv_dim), (1, hv * dv), (1, hv), (1, hv))
        ]
        o1, *ours = gdn_decode.gdn_decode_step(
            *x, ours[0], conv_w, A_log, dt_bias, ours[1], norm_w, spec=spec
        )
        o2, *ref = _gdn_core(*x, ref[0], conv_w, A_log, dt_bias, ref[1], norm_w, spec=spec)
        assert (ours[0] != ref[0]).sum().item() == 0  # the conv history is a copy
        for a, b in ((ours[1], ref[1]), (o1, o2)):
            a, b = a.astype(mx.float32), b.astype(mx.float32)
            if dtype == mx.float32:
                assert mx.abs(a - b).max().item() < 1e-4
            else:  # the paths may round a value an ulp apart: compare norms
                assert (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item() < 2.0**-7
        ours = [ours[0], ours[1]]
        ref = [ref[0], ref[1]]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gdn_decode_kernel_rows_are_single_steps(dtype):
    """5 rows in one launch give, bit for bit, 5 one-row launches: outputs, the state after
    each row and the final conv history (27B dims)."""
    from qwen38_backend.kernels import gdn_decode

    if not mx.cuda.is_available():
        pytest.skip("the fused Gated DeltaNet decode kernel is CUDA-only")
    hk, hv, dk, dv, kw, rows = 16, 48, 128, 128, 4, 5
    spec = (hk, hv, dk, dv, 1e-6, "silu")
    conv_dim = 2 * hk * dk + hv * dv
    mx.random.seed(2)
    weights = (
        (0.5 * mx.random.normal((conv_dim, kw))).astype(dtype),
        mx.random.uniform(0.0, 2.0, (hv,)).astype(dtype),
        mx.random.uniform(-1.0, 1.0, (hv,)).astype(dtype),
    )
    norm_w = (1 + 0.1 * mx.random.normal((dv,))).astype(dtype)
    x = [
        mx.random.normal(shape).astype(dtype)
        for shape in ((rows, conv_dim), (rows, hv * dv), (rows, hv), (rows, hv))
    ]
    hist = mx.random.normal((kw - 1, conv_dim)).astype(dtype)
    state = 0.1 * mx.random.normal((hv, dv, dk))
    out, last, states = gdn_decode.gdn_decode_rows(*x, hist, *weights, state, norm_w, spec=spec)
    for t in range(rows):
        o, hist, state = gdn_decode.gdn_decode_step(
            *(a[t : t + 1] for a in x), hist, *weights, state, norm_w, spec=spec
        )
        assert mx.array_equal(out[t : t + 1], o).item(), f"row {t} output"
        assert mx.array_equal(states[t], state).item(), f"row {t} state"
    assert mx.array_equal(last, hist).item()


def test_decode_attention_kernel_rows_are_single_steps():
    """Rows of one multi-row call equal one-row calls at their lengths, bit for bit."""
    kernel = _decode_kernel()
    for length, rows in ((40, 5), (4096, 8), (33000, 3)):
        k, v = _kv_views(4, length, 256, mx.bfloat16, seed=length)
        q = mx.random.normal((1, 24, 1, 256), key=mx.random.key(length)).astype(mx.bfloat16)
        assert kernel.rows_are_steps(q, k, v, 256**-0.5, rows=rows), (length, rows)


def _kv_views(hkv, length, d, dtype, seed, layout="store"):
    """K/V [1, Hkv, L, D] laid out as a store passes them: `store` a prefix of a larger
    buffer (ContiguousKV), `pool` the paged pool's head-major prefix, `gathered` a fresh
    gather (Quest), `misaligned` rows not 16-byte aligned (the element-copy path)."""
    keys = mx.random.split(mx.random.key(seed), 2)
    cap = length + 100
    if layout == "pool":
        k = mx.random.normal((hkv, cap, d), key=keys[0]).astype(dtype)[:, :length][None]
        v = mx.random.normal((hkv, cap, d), key=keys[1]).astype(dtype)[:, :length][None]
        return k, v
    wide = d + 1 if layout == "misaligned" else d
    big_k = mx.random.normal((1, hkv, cap, wide), key=keys[0]).astype(dtype)
    big_v = mx.random.normal((1, hkv, cap, wide), key=keys[1]).astype(dtype)
    if layout == "misaligned":
        return big_k[:, :, :length, 1:], big_v[:, :, :length, 1:]
    if layout == "gathered":
        rows = mx.arange(cap - length, cap)
        return mx.take(big_k, rows, axis=2), mx.take(big_v, rows, axis=2)
    return big_k[:, :, :length], big_v[:, :, :length]


def _decode_kernel():
    from qwen38_backend.kernels import decode_attention

    if not mx.cuda.is_available():
        pytest.skip("the split-KV decode attention kernel is CUDA-only")
    return decode_attention


def _check_decode_attention(
    kernel, hq, hkv, length, d, dtype, layout, splits=None, seed=0, warps=None
):
    q = mx.random.normal((1, hq, 1, d), key=mx.random.key(seed + 1)).astype(dtype)
    k, v = _kv_views(hkv, length, d, dtype, seed, layout)
    scale = d**-0.5
    got = kernel.decode_attention(q, k, v, scale, splits=splits, warps=warps)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
    # an fp32 reference from plain ops, independent of both
    qf, kf, vf = (x.astype(mx.float32) for x in (q, k, v))
    qg = qf.reshape(hkv, hq // hkv, d)
    p = mx.softmax((qg @ kf[0].swapaxes(-1, -2)) * scale, axis=-1)
    exact = (p @ vf[0]).reshape(1, hq, 1, d)
    assert got.shape == want.shape and got.dtype == q.dtype
    assert mx.isfinite(got.astype(mx.float32)).all().item()
    assert kernel.mismatch(got, want) <= 1.0, (length, dtype, layout)
    assert kernel.mismatch(got, exact.astype(dtype)) <= 1.0, (length, dtype, layout)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("length", [1, 7, 255, 4096, 33000])
def test_decode_attention_kernel_matches_sdpa(dtype, length):
    """27B full-attention shapes (24 query heads, 4 KV heads, D 256), the contiguous store's
    layout, lengths with a partial last tile and one row, against the MLX op and fp32 math."""
    kernel = _decode_kernel()
    assert kernel.available(dtype, dtype, 256, 6)
    _check_decode_attention(kernel, 24, 4, length, 256, dtype, "store", seed=length)


@pytest.mark.parametrize("layout", ["pool", "gathered", "misaligned"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_decode_attention_kernel_layouts(layout, dtype):
    kernel = _decode_kernel()
    for length in (1, 33, 2048, 5000):
        _check_decode_attention(kernel, 24, 4, length, 256, dtype, layout, seed=length)


@pytest.mark.parametrize(
    ("hq", "hkv", "d"),
    [(24, 4, 128), (24, 4, 64), (8, 8, 128), (16, 2, 64), (8, 4, 32), (24, 2, 256)],
)
def test_decode_attention_kernel_other_heads(hq, hkv, d):
    kernel = _decode_kernel()
    for dtype in (mx.bfloat16, mx.float16):
        assert kernel.available(dtype, dtype, d, hq // hkv)
        for length in (1, 300, 9000):
            _check_decode_attention(kernel, hq, hkv, length, d, dtype, "store", seed=length)


@pytest.mark.parametrize("tensor_cores", [True, False])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_decode_attention_kernel_both_forms(tensor_cores, dtype, monkeypatch):
    """Half-precision K/V run the tensor-core kernel (TENSOR_CORES) or the fp32-FMA one:
    each against the MLX op and fp32 math at lengths around its 16-row tiles and its warps'
    shares, rows equal to one-row calls, and pages read in place equal to gathered rows."""
    kernel = _decode_kernel()
    monkeypatch.setattr(kernel, "TENSOR_CORES", tensor_cores)
    q = mx.zeros((1, 24, 1, 256), dtype=dtype)
    assert kernel.uses_tensor_cores(q, q[:, :4]) == tensor_cores
    for length in (1, 15, 16, 17, 63, 64, 65, 2047, 2048, 70001):
        _check_decode_attention(kernel, 24, 4, length, 256, dtype, "pool", seed=length)
    k, v = _kv_views(4, 3000, 256, dtype, seed=5)
    q = mx.random.normal((1, 24, 1, 256), key=mx.random.key(6)).astype(dtype)
    assert kernel.rows_are_steps(q, k, v, 256**-0.5, rows=5)
    pool_k = mx.random.normal((1, 4, 4096, 256), key=mx.random.key(7)).astype(dtype)
    pool_v = mx.random.normal((1, 4, 4096, 256), key=mx.random.key(8)).astype(dtype)
    assert kernel.paged_matches(q, pool_k, pool_v, 256**-0.5, 32)


def test_decode_attention_kernel_any_split_count():
    """Forced split counts (one, uneven, empty last splits, one row each) give the same
    answer: the log-sum-exp merge and the chunk arithmetic."""
    kernel = _decode_kernel()
    for length, splits in ((1000, 1), (1000, 7), (1000, 333), (129, 129), (4096, 64)):
        _check_decode_attention(kernel, 24, 4, length, 256, mx.bfloat16, "store", splits)


@pytest.mark.parametrize("warps", [2, 4, 8])
@pytest.mark.parametrize("d", [256, 128])
def test_decode_attention_kernel_warps_a_block(warps, d):
    """The tensor-core kernel with other warps a block (fewer tiles in flight each where
    their rings would not fit): split counts around a Quest budget's 2,048 rows, a partial
    last tile, more warps than a split's tiles; and a paged call equal to its gathered
    rows."""
    kernel = _decode_kernel()
    for length, splits in ((2048, 16), (2048, 32), (2047, 16), (5000, 8), (33, 4), (40, 1)):
        _check_decode_attention(
            kernel, 24, 4, length, d, mx.bfloat16, "pool", splits, seed=length, warps=warps
        )
    q = mx.random.normal((1, 24, 1, d), key=mx.random.key(2)).astype(mx.bfloat16)
    pool_k = mx.random.normal((1, 4, 4096, d), key=mx.random.key(3)).astype(mx.bfloat16)
    pool_v = mx.random.normal((1, 4, 4096, d), key=mx.random.key(4)).astype(mx.bfloat16)
    pages = mx.broadcast_to(mx.arange(127, -1, -2, dtype=mx.int32)[None], (4, 64))
    got = kernel.decode_attention(q, pool_k, pool_v, d**-0.5, 32, pages, 32, 2040, warps)
    rows = (pages[0, :, None] * 32 + mx.arange(32)).reshape(-1)[:2040]
    want = mx.fast.scaled_dot_product_attention(
        q, pool_k[:, :, rows], pool_v[:, :, rows], scale=d**-0.5
    )
    assert kernel.mismatch(got, want) <= 1.0


@pytest.mark.parametrize("page_tokens", [32, 16, 64])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_paged_decode_attention_equals_gathered_rows(page_tokens, dtype):
    """The Quest path's call: the kernel reading a page list of the pool in place gives the
    bits of the call on those rows gathered first (27B shapes: 24 query / 4 KV heads, D 256;
    a shared list in scrambled order, a list per KV head, a partial last page), and the
    paged probe passes."""
    kernel = _decode_kernel()
    assert kernel.paged_available(dtype, dtype, 256, 6, page_tokens)
    slots = 4096 // page_tokens
    key = mx.random.key(page_tokens)
    pool_k = mx.random.normal((1, 4, slots * page_tokens, 256), key=key).astype(dtype)
    pool_v = mx.random.normal((1, 4, slots * page_tokens, 256), key=mx.random.key(9)).astype(dtype)
    q = mx.random.normal((1, 24, 1, 256), key=mx.random.key(3)).astype(dtype)
    assert kernel.paged_matches(q, pool_k, pool_v, 256**-0.5, page_tokens)
    # and against the MLX op on the gathered rows (the page list of a Quest budget of 2048)
    pages = mx.broadcast_to(mx.arange(slots - 1, -1, -2, dtype=mx.int32)[None], (4, slots // 2))
    length = slots // 2 * page_tokens - 5
    got = kernel.decode_attention(q, pool_k, pool_v, 256**-0.5, None, pages, page_tokens, length)
    rows = (pages[0, :, None] * page_tokens + mx.arange(page_tokens)).reshape(-1)[:length]
    keys, values = pool_k[:, :, rows], pool_v[:, :, rows]
    want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=256**-0.5)
    assert kernel.mismatch(got, want) <= 1.0


def _count_calls(monkeypatch, module, name: str, record=lambda *_, **__: 1) -> list:
    """A list that gets record(*args, **kwargs) for every call of module.name from now on
    (the function still runs)."""
    calls: list = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(record(*args, **kwargs))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def _quest_kernel():
    from qwen38_backend.kernels import quest_select

    if not mx.cuda.is_available():
        pytest.skip("the Quest page-key kernel is CUDA-only")
    return quest_select


@pytest.mark.parametrize("q_dtype", [mx.bfloat16, mx.float32])
def test_quest_page_keys_kernel_matches_the_op_path(q_dtype):
    """27B shapes (24 query / 4 KV heads, D 256) at a 262K-token capacity (8192 pages of 32):
    the kernel's keys give the op path's selection, forced / dead pages included, and its
    bounds agree to fp32 rounding; the probe passes."""
    from qwen38_backend.kv import quest

    kernel = _quest_kernel()
    assert quest.kernel_mismatch(24, 4, 256, q_dtype, quest.META_DTYPE) is None
    keys = mx.random.split(mx.random.key(7), 3)
    q = mx.random.normal((24, 256), key=keys[0]).astype(q_dtype)
    lo = mx.random.normal((4, 8192, 256), key=keys[1])
    hi = lo + mx.abs(mx.random.normal((4, 8192, 256), key=keys[2]))
    kmin, kmax = quest.outward_bf16(lo, hi)
    for live, shared in ((8192, True), (5000, True), (5000, False)):
        n_pages = mx.array(live, dtype=mx.int32)
        got = kernel.page_keys(q, kmin, kmax, n_pages, 4, 8, shared)
        want = quest.op_page_keys(q, kmin, kmax, n_pages, 4, 8, shared)
        assert mx.array_equal(quest.top_pages(got, 64), quest.top_pages(want, 64)).item()
        g, w = quest.key_scores(got), quest.key_scores(want)
        finite = mx.isfinite(w)
        assert mx.array_equal(mx.isfinite(g), finite).item()
        diff = mx.abs(mx.where(finite, g - w, 0.0)).max().item()
        assert diff <= 1e-5 * mx.abs(mx.where(finite, w, 0.0)).max().item()


def test_quest_page_keys_kernel_keeps_greedy_tokens(tmp_path, monkeypatch):
    """A tiny fp32 model under Quest decodes the same tokens with the page-key kernel on as
    off, and the kernel did run when on."""
    from helpers import dense_fixture

    import qwen38_backend

    calls = _count_calls(monkeypatch, _quest_kernel(), "page_keys")
    model = qwen38_backend.load(dense_fixture("qwen3", tmp_path), dtype="float32")
    prompt = [(7 * i + 3) % 500 + 2 for i in range(300)]
    options = {"kv_paged": "on", "kv_topk": 32, "kv_page_tokens": 8, "kv_sinks": 8, "kv_recent": 8}
    runs = {}
    for choice in ("auto", "off"):
        monkeypatch.setenv("QWEN38_QUEST_KERNEL", choice)
        calls.clear()
        runs[choice] = list(
            model.generate_tokens(prompt, max_tokens=24, stop_token_ids=[], **options)
        )
        assert bool(calls) == (choice == "auto"), (choice, len(calls))
    assert runs["auto"] == runs["off"]


def test_decode_attention_tensor_cores_keep_bf16_steps(tmp_path, monkeypatch):
    """The tensor-core form in a bf16 model's decode steps (teacher-forced on the MLX op's
    greedy tokens, contiguous store and paged Quest): logits within a few bf16 roundings of
    the op path's, and the same greedy token wherever the op path's top two differ by more
    than that (a tiny random model in bf16 has ties at one rounding, so tokens alone would
    test the ties)."""
    from helpers import dense_fixture

    import qwen38_backend

    kernel = _decode_kernel()
    calls = _count_calls(monkeypatch, kernel, "decode_attention")
    model = qwen38_backend.load(dense_fixture("qwen3", tmp_path), dtype="bfloat16")
    q = mx.zeros((1, 4, 1, 32), dtype=mx.bfloat16)
    assert kernel.uses_tensor_cores(q, q[:, :2])
    prompt = [(7 * i + 3) % 500 + 2 for i in range(100)]
    stores = [{}, {"kv_paged": "on", "kv_topk": 16, "kv_page_tokens": 8, "kv_sinks": 8}]

    def steps(options: dict, choice: str, tokens: list[int] | None) -> tuple[list, list[int]]:
        monkeypatch.setenv("QWEN38_DECODE_ATTN_KERNEL", choice)
        state = model.new_state(**options)
        logits = model.prefill(prompt, state)
        rows, fed = [], []
        for i in range(12):
            row = logits.reshape(-1).astype(mx.float32)
            rows.append(row)
            fed.append(int(mx.argmax(row).item()) if tokens is None else tokens[i])
            logits = model.forward(mx.array([fed[-1]]), state, last_only=True)
        return rows, fed

    for options in stores:
        want, tokens = steps(options, "off", None)
        calls.clear()
        got, _ = steps(options, "auto", tokens)
        assert len(calls) >= 11, options
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            ulp = 2.0**-7 * mx.abs(w).max().item()  # one bf16 rounding at the logits' scale
            diff = mx.abs(w - g).max().item()
            assert diff <= 4 * ulp, (options, i, diff, ulp)
            top2 = mx.sort(w)[-2:]
            if (top2[1] - top2[0]).item() > 2 * diff:
                assert mx.argmax(g).item() == tokens[i], (options, i)


def test_decode_attention_kernel_keeps_greedy_tokens(tmp_path, monkeypatch):
    """A tiny fp32 model decodes the same tokens with the kernel on as off (contiguous store,
    paged dense, paged Quest), and the kernel did run when on (its fp32-FMA form)."""
    from helpers import dense_fixture

    import qwen38_backend

    calls = _count_calls(monkeypatch, _decode_kernel(), "decode_attention")
    model = qwen38_backend.load(dense_fixture("qwen3", tmp_path), dtype="float32")
    prompt = [(7 * i + 3) % 500 + 2 for i in range(100)]
    stores = [
        {},
        {"kv_paged": "on", "kv_topk": 4096},
        {"kv_paged": "on", "kv_topk": 16, "kv_page_tokens": 8, "kv_sinks": 8, "kv_recent": 8},
    ]
    for options in stores:
        runs = {}
        for choice in ("auto", "off"):
            monkeypatch.setenv("QWEN38_DECODE_ATTN_KERNEL", choice)
            calls.clear()
            runs[choice] = list(
                model.generate_tokens(prompt, max_tokens=16, stop_token_ids=[], **options)
            )
            assert bool(calls) == (choice == "auto"), (options, choice, len(calls))
        assert runs["auto"] == runs["off"], options


# ----- the row-invariant step product (kernels/rows_matmul.py) --------------------------------
@pytest.mark.parametrize("chunk_bytes", [16, 8])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_rows_matmul_rows_equal_one_row_calls(dtype, chunk_bytes, monkeypatch):
    """Each row of a 2..16-row product equals the one-row call bit for bit, and the product
    is an fp32-accumulated x @ w.T (27B shapes and a small odd one), for either chunk."""
    from qwen38_backend.kernels import rows_matmul as kernel

    assert kernel.available(dtype)
    monkeypatch.setattr(kernel, "CHUNK_BYTES", chunk_bytes)
    for n, k in ((17408, 5120), (5120, 6144), (1003, 264)):
        kx, kw = mx.random.split(mx.random.key(n))
        x = mx.random.normal((16, k), key=kx).astype(dtype)
        w = (mx.random.normal((n, k), key=kw) * k**-0.5).astype(dtype)
        alone = mx.concatenate([kernel.rows_matmul(x[i : i + 1], w) for i in range(16)])
        for rows in (2, 3, 5, 8, 9, 16):
            got = kernel.rows_matmul(x[:rows], w)
            assert mx.array_equal(got, alone[:rows]).item(), (n, k, rows)
        want = x.astype(mx.float32) @ w.astype(mx.float32).T
        ulp = 2.0**-23 if dtype == mx.float32 else 2.0**-10 if dtype == mx.float16 else 2.0**-7
        err = mx.abs(alone.astype(mx.float32) - want) - (2 * ulp * mx.abs(want) + 1e-4)
        assert (err <= 0).all().item(), (n, k)


@pytest.mark.parametrize("chunk_bytes", [16, 8])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_rows_matmul_rounds_fp32_rows_as_a_cast(dtype, chunk_bytes, monkeypatch):
    """fp32 rows (a norm's before its cast back, RMSNorm.for_product) give the products of
    the rows cast to w's dtype bit for bit, at every row count, halfway values included,
    for either chunk."""
    from qwen38_backend.kernels import rows_matmul as kernel

    assert kernel.available(dtype)
    monkeypatch.setattr(kernel, "CHUNK_BYTES", chunk_bytes)
    for n, k in ((17408, 5120), (1003, 264)):
        kx, kw = mx.random.split(mx.random.key(n + 1))
        narrow = (3 * mx.random.normal((16, k), key=kx)).astype(dtype)
        up = (narrow.view(mx.uint16) + 1).view(dtype)  # the next value of dtype (same sign)
        halfway = (narrow.astype(mx.float32) + up.astype(mx.float32)) / 2  # ties
        between = narrow.astype(mx.float32) * (1 + 2.0**-12)
        w = (mx.random.normal((n, k), key=kw) * k**-0.5).astype(dtype)
        for wide in (halfway, between, mx.concatenate([halfway[:8], between[8:]])):
            for rows in (1, 2, 5, 9, 16):
                got = kernel.rows_matmul(wide[:rows], w)
                assert got.dtype == dtype
                want = kernel.rows_matmul(wide[:rows].astype(dtype), w)
                assert mx.array_equal(got, want).item(), (n, k, rows)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_rows_matmul_epilogues_store_what_the_ops_compute(dtype):
    """The product's epilogues give, bit for bit and at every row count, what the ops after
    a plain product compute: residual + product (residual of w's dtype, or fp32 holding its
    values, output cast to fp32) and the compiled silu(gate) * up of a fused [gate; up]
    product; their rows equal one-row launches."""
    from qwen38_backend.kernels import rows_matmul as kernel

    from qwen38_backend.models.layers import swiglu

    assert kernel.epilogues_available(dtype)
    for n, k in ((2 * 17408, 5120), (5120, 6144), (2 * 501, 264)):
        kx, kw, kr = mx.random.split(mx.random.key(n + 2), 3)
        x = mx.random.normal((16, k), key=kx).astype(dtype)
        w = (mx.random.normal((n, k), key=kw) * k**-0.5).astype(dtype)
        res = (4 * mx.random.normal((16, n), key=kr)).astype(dtype)
        one = [kernel.rows_matmul(x[i : i + 1], w, swiglu=True) for i in range(16)]
        alone = mx.concatenate(one)
        for rows in (1, 2, 3, 5, 9, 16):
            plain = kernel.rows_matmul(x[:rows], w)
            fused = kernel.rows_matmul(x[:rows], w, swiglu=True)
            assert mx.array_equal(fused, swiglu(*mx.split(plain, 2, axis=-1))).item(), (n, rows)
            assert mx.array_equal(fused, alone[:rows]).item(), (n, rows)
            got = kernel.rows_matmul(x[:rows], w, residual=res[:rows])
            assert got.dtype == dtype
            assert mx.array_equal(got, res[:rows] + plain).item(), (n, rows)
            wide = res[:rows].astype(mx.float32)
            got = kernel.rows_matmul(x[:rows], w, residual=wide, dtype=mx.float32)
            assert got.dtype == mx.float32
            assert mx.array_equal(got, (res[:rows] + plain).astype(mx.float32)).item(), (n, rows)


def test_step_epilogues_keep_the_step_and_drop_its_sums(tmp_path, monkeypatch):
    """A bf16 decode step with the products' epilogues gives the logits of the same step
    with the sums and silu(gate) * up as ops after the products, bit for bit, and its graph
    has fewer nodes (each model loaded apart: a compiled piece keeps what it traced)."""
    import re

    from qwen38_backend.kernels import rows_matmul as kernel

    import qwen38_backend
    from qwen38_backend.testing import make_tiny_weights

    path = make_tiny_weights("qwen3_5", tmp_path / "q", dtype="bfloat16")

    monkeypatch.setenv("QWEN38_ROWS_NORM", "off")  # its own test: it rounds apart from the op

    def step(epilogues: str) -> tuple[mx.array, int]:
        monkeypatch.setenv("QWEN38_ROWS_EPILOGUES", epilogues)
        kernel.epilogues_available.cache_clear()
        kernel.norm_available.cache_clear()
        model = qwen38_backend.load(str(path), dtype="bfloat16")
        state = model.new_state()
        mx.eval(model.forward([5, 6, 7, 8], state, last_only=True))
        model.forward([9], state, last_only=True)  # the first step traces the pieces
        logits = model.forward([10], state, last_only=True)
        dot = tmp_path / f"step_{epilogues}.dot"
        mx.export_to_dot(str(dot), logits)
        mx.eval(logits)
        return logits, len(re.findall(r"shape=rectangle", dot.read_text()))

    try:
        fused, fused_nodes = step("auto")
        plain, plain_nodes = step("off")
    finally:
        kernel.epilogues_available.cache_clear()
        kernel.norm_available.cache_clear()
    assert mx.array_equal(fused, plain).item()
    assert fused_nodes < plain_nodes, (fused_nodes, plain_nodes)


def test_step_products_take_the_norms_fp32_rows(tmp_path, monkeypatch):
    """A bf16 decode step hands the zero-centred norms' fp32 rows to the row-invariant
    products (no cast kernel between them), and its graph has no per-token 1 + w: fewer nodes
    than the same step with every norm's scale derived from its weight (one per norm of the
    compiled pieces)."""
    import re

    from qwen38_backend.kernels import rows_matmul as kernel

    import qwen38_backend
    from qwen38_backend.models.layers import RMSNorm
    from qwen38_backend.testing import make_tiny_weights

    # the norms' own rows, not the products' norm prologue
    monkeypatch.setattr(kernel, "norm_available", lambda dtype: False)
    model = qwen38_backend.load(
        str(make_tiny_weights("qwen3_5", tmp_path / "q", dtype="bfloat16")), dtype="bfloat16"
    )
    state = model.new_state()
    mx.eval(model.forward([5, 6, 7, 8], state, last_only=True))
    state.save_point()  # each step below goes back to it
    seen = []  # x's dtype per product as the first step traces its compiled pieces
    run = kernel.rows_matmul
    monkeypatch.setattr(
        kernel, "rows_matmul", lambda x, w, **kw: seen.append(x.dtype) or run(x, w, **kw)
    )

    def step_nodes() -> int:
        logits = model.forward([9], state, last_only=True)
        path = tmp_path / "step.dot"
        mx.export_to_dot(str(path), logits)
        mx.eval(logits)
        state.truncate(4)
        return len(re.findall(r"shape=rectangle", path.read_text()))

    step_nodes()  # traces the compiled pieces
    folded = step_nodes()
    cfg = model.net.config
    layers, attention = cfg.num_hidden_layers, cfg.layer_types.count("full_attention")
    assert seen.count(mx.float32) >= 2 * layers  # each block's two norms feed products
    norms = [
        m
        for name, m in model.net.named_modules()
        if isinstance(m, RMSNorm) and m.zero_centered and "folded" in m
    ]
    for norm in norms:
        norm.weight = norm.folded - 1.0
    step_nodes()
    assert step_nodes() - folded >= 2 * layers + 2 * attention


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_rows_matmul_norm_prologue(dtype, monkeypatch):
    """Products of zero-centred-RMS-normed rows (the norm in the product's prologue, or in a
    kernel of its own where a launch's rows are too wide for shared memory): every row equal
    to a one-row launch bit for bit at every row count (both paths), close to the op path's
    norm then product, and the epilogues on normed rows equal the ops after the normed
    product, for fp32 and half-precision rows."""
    from qwen38_backend.kernels import rows_matmul as kernel

    from qwen38_backend.models.layers import swiglu

    monkeypatch.setenv("QWEN38_ROWS_NORM", "auto")  # off by default (slower on the H200)
    kernel.norm_available.cache_clear()
    assert kernel.norm_available(dtype)
    kernel.norm_available.cache_clear()
    eps = 1e-6
    for n, k in ((2 * 17408, 5120), (2 * 501, 264)):
        kx, kw, ks, kr = mx.random.split(mx.random.key(n + 5), 4)
        scale = 1 + 0.3 * mx.random.normal((k,), key=ks)
        w = (mx.random.normal((n, k), key=kw) * k**-0.5).astype(dtype)
        res = (4 * mx.random.normal((16, n), key=kr)).astype(mx.float32)
        wide = 3 * mx.random.normal((16, k), key=kx)
        for x in (wide, wide.astype(dtype)):
            norm = (scale, eps)
            alone = mx.concatenate(
                [kernel.rows_matmul(x[i : i + 1], w, norm=norm) for i in range(16)]
            )
            normed = mx.fast.rms_norm(x.astype(mx.float32), scale, eps).astype(dtype)
            want = normed.astype(mx.float32) @ w.astype(mx.float32).T
            err = mx.abs(alone.astype(mx.float32) - want)
            assert (err <= 2**-6 * mx.abs(want) + 2e-2).all().item(), (n, x.dtype)
            for rows in (1, 2, 3, 5, 9, 16):
                got = kernel.rows_matmul(x[:rows], w, norm=norm)
                assert mx.array_equal(got, alone[:rows]).item(), (n, rows, x.dtype)
                fused = kernel.rows_matmul(x[:rows], w, norm=norm, swiglu=True)
                assert mx.array_equal(fused, swiglu(*mx.split(got, 2, axis=-1))).item()
                summed = kernel.rows_matmul(
                    x[:rows], w, norm=norm, residual=res[:rows], dtype=mx.float32
                )
                want_sum = (res[:rows].astype(dtype) + got).astype(mx.float32)
                assert mx.array_equal(summed, want_sum).item(), (n, rows)


def test_step_norm_prologue_keeps_the_greedy_tokens(tmp_path, monkeypatch):
    """A bf16 tiny Qwen3.5 decoding with its blocks' norms in the products' prologues picks
    the greedy tokens of the op norms, its logits within bf16 rounding of them at every step,
    with fewer nodes a step."""
    from qwen38_backend.kernels import rows_matmul as kernel

    tokens, logits, nodes = _decode_with(tmp_path, monkeypatch, "QWEN38_ROWS_NORM", kernel)
    assert tokens["auto"] == tokens["off"]
    for a, b in zip(logits["auto"], logits["off"], strict=True):
        assert mx.allclose(a, b, rtol=2e-2, atol=2e-2).item()
    assert nodes["auto"] < nodes["off"], nodes


def _decode_with(
    tmp_path,
    monkeypatch,
    switch: str,
    module,
    arch: str = "qwen3_5",
    models: dict | None = None,
    **config,
) -> tuple[dict, dict, dict]:
    """Greedy tokens, each step's logits and a step's node count of a bf16 tiny `arch`
    (`config`: its overrides) with `switch` auto and off (a model loaded for each: a
    compiled piece keeps what it traced; the probes of `module` cleared around each;
    `models` gets each choice's)."""
    import re

    import qwen38_backend
    from qwen38_backend.testing import make_tiny_weights

    path = make_tiny_weights(arch, tmp_path / "q", dtype="bfloat16", **config)
    probes = [
        getattr(module, name)
        for name in ("available", "norm_available", "gates_available", "mix_available", "agrees")
        if hasattr(module, name)
    ]
    tokens, logits, nodes = {}, {}, {}
    try:
        for choice in ("auto", "off"):
            monkeypatch.setenv(switch, choice)
            for probe in probes:
                probe.cache_clear()
            model = qwen38_backend.load(str(path), dtype="bfloat16")
            if models is not None:
                models[choice] = model
            state = model.new_state()
            out = model.forward([5, 6, 7, 8], state, last_only=True)
            tokens[choice], logits[choice] = [], []
            for _ in range(12):
                token = int(mx.argmax(out[-1]).item())
                tokens[choice].append(token)
                out = model.forward([token], state, last_only=True)
                logits[choice].append(out.astype(mx.float32))
            dot = tmp_path / f"step_{choice}.dot"
            mx.export_to_dot(str(dot), model.forward([tokens[choice][-1]], state, last_only=True))
            nodes[choice] = len(re.findall(r"shape=rectangle", dot.read_text()))
    finally:
        for probe in probes:
            probe.cache_clear()
    return tokens, logits, nodes


# ----- a step's routed experts in two launches (kernels/expert_qmv.py) -------------------------
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_expert_kernels_match_the_op_path(dtype, monkeypatch):
    """Flash-Next's expert shapes (hidden 2560, intermediate 640, 10 of 64 experts a token,
    4-bit groups of 64): the probe passes; every row equals a one-row call bit for bit; the
    routed sum is within bf16 rounding of gather_qmm's; and a SparseMoE step takes the
    kernels once they are switched on, its output close to the op path's, with the shared
    expert's output added in them and with the shared expert run in them."""
    from qwen38_backend.kernels import expert_qmv as kernel

    monkeypatch.setenv("QWEN38_EXPERT_KERNEL", "auto")  # the default, set for a run with it off
    kernel.available.cache_clear()
    assert kernel.available(2560, 640, 64, 10, 64, dtype)
    moe = random_moe(2560, 64, 10, 640, seed=9)
    moe.set_dtype(dtype)
    x = mx.random.normal((5, 2560), key=mx.random.key(3)).astype(dtype)
    inds, weights = moe.route(x)
    e = moe.experts
    got = kernel.routed_sum(x, inds, weights, e.gate_up_proj, e.down_proj, 64)
    want = kernel.reference(x, inds, weights, e)
    for t in range(5):
        one = kernel.routed_sum(
            x[t : t + 1], inds[t : t + 1], weights[t : t + 1], e.gate_up_proj, e.down_proj, 64
        )
        assert mx.array_equal(one, got[t : t + 1]).item(), t
    g, w = got.astype(mx.float32), want.astype(mx.float32)
    assert (mx.linalg.norm(g - w) / mx.linalg.norm(w)).item() < 2.0**-7
    op_path = moe(x)
    moe.prepare_decode()
    assert moe._fused(x)
    for fuse_shared in (False, True):  # its output added, then the shared expert run there
        if fuse_shared:
            moe.shared_expert.fuse()
            assert kernel.runs_shared(moe.shared_expert, dtype)
        fused = moe(x).astype(mx.float32)
        want_step = op_path.astype(mx.float32)
        rel = mx.linalg.norm(fused - want_step) / mx.linalg.norm(want_step)
        assert rel.item() < 2.0**-7, fuse_shared
    kernel.available.cache_clear()


# ----- a step's expert routing in one launch (kernels/moe_route.py) ---------------------------
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("normalize", [True, False])
def test_moe_route_kernel_matches_the_op_path(dtype, normalize, monkeypatch):
    """Flash-Next's router (10 of 512 experts): the probe passes; for 1..16 rows the
    experts are the op path's with weights within its ulps, every row equal to a one-row
    launch; ties go to the lower expert (all logits equal: experts 0..9, weights exactly
    1/512 or 1/10; a tie at the top: the lower of the two first)."""
    from qwen38_backend.kernels import moe_route as kernel

    from qwen38_backend.models.moe import route

    monkeypatch.setenv("QWEN38_ROUTE_KERNEL", "auto")  # the default, set for a run with it off
    kernel.available.cache_clear()
    assert kernel.available(512, 10, normalize, dtype)
    for rows in (1, 5, 16):
        logits = (2 * mx.random.normal((rows, 512), key=mx.random.key(rows))).astype(dtype)
        got = kernel.route(logits, 10, normalize)
        assert kernel.same_routes(got, route(logits, 10, normalize))
        for t in range(rows):
            one = kernel.route(logits[t : t + 1], 10, normalize)
            assert all(mx.array_equal(one[j], got[j][t : t + 1]).item() for j in range(2)), t
    inds, weights = kernel.route(mx.zeros((2, 512), dtype), 10, normalize)
    assert inds.tolist() == [list(range(10))] * 2
    assert (weights == (0.1 if normalize else 2.0**-9)).all().item()
    logits = mx.zeros((1, 512), dtype).at[0, 7].add(3.0).at[0, 3].add(3.0)
    inds, _ = kernel.route(logits, 10, normalize)
    assert inds[0, :3].tolist() == [3, 7, 0]
    kernel.available.cache_clear()


@pytest.mark.parametrize("switches", [("ROUTE",), ("STREAM",), ("ROUTE", "STREAM")])
def test_flash_next_steps_with_its_step_kernels_on_gpu(tmp_path, monkeypatch, switches):
    """A fresh tiny Flash-Next with the routing and / or stream-mix kernels switched on (its
    traces made with them): the layers choose them, the greedy tokens of a short run are
    the op path's model's, and a verify's rows equal its plain steps bit for bit."""
    from qwen38_backend.kernels import moe_route, stream_mix

    import qwen38_backend
    from qwen38_backend.testing import make_tiny_weights

    path = make_tiny_weights("qwen4_exp", tmp_path / "flash", dtype="bfloat16")
    prompt = [(7 * i + 3) % 200 + 2 for i in range(19)]

    def tokens(model) -> list[int]:
        return list(model.generate_tokens(prompt, max_tokens=12, stop_token_ids=[]))

    for name in ("ROUTE", "STREAM"):  # the op path's model first
        monkeypatch.setenv(f"QWEN38_{name}_KERNEL", "off")
    plain = tokens(qwen38_backend.load(str(path), dtype="bfloat16"))
    for name in ("ROUTE", "STREAM"):
        monkeypatch.setenv(f"QWEN38_{name}_KERNEL", "auto" if name in switches else "off")
    moe_route.available.cache_clear()
    stream_mix.available.cache_clear()
    model = qwen38_backend.load(str(path), dtype="bfloat16")
    assert tokens(model) == plain
    for layer in model.net.model.layers:
        assert bool(layer.mlp._route_for) == ("ROUTE" in switches)
        for hc in (layer.attn_hyper_connection, layer.mlp_hyper_connection):
            assert bool(hc._kernel_for) == ("STREAM" in switches)
    assert_verify_rows_equal_steps(model, 37, STORES["contiguous"])
    moe_route.available.cache_clear()
    stream_mix.available.cache_clear()


# ----- QSA's decode selection in one launch (kernels/top_select.py) ---------------------------
@pytest.mark.parametrize(
    "n, visible, n_blocks, width",
    [(300, 290, 7, 2), (1280, 1030, 512, 3), (65792, 65536, 512, 0), (4096, 4000, 2048, 1)],
)
def test_qsa_select_kernel_matches_the_op_path_on_gpu(n, visible, n_blocks, width):
    """Tied scores (+-0.0 among them), -inf past the visible blocks, up to 262,144 tokens'
    blocks: the kernel's token ids equal the op path's, eager and inside a compiled graph."""
    from qwen38_backend.kernels import top_select

    from qwen38_backend.models import qsa

    compiled = mx.compile(lambda s, t: top_select.decode_tokens(s, t, n_blocks, 4))
    for seed in range(3):
        scores = top_select.probe_scores(n, visible, seed)
        tail = mx.arange(width, dtype=mx.int32) + 4 * visible
        want = qsa.op_decode_tokens(scores, tail, n_blocks, 4)
        assert mx.array_equal(top_select.decode_tokens(scores, tail, n_blocks, 4), want).item()
        assert mx.array_equal(compiled(scores, tail), want).item()
    assert top_select.qsa_available(n_blocks, 4)


@pytest.mark.parametrize("rows, n, n_select", [(1, 1000, 128), (1, 8200, 128), (4, 16400, 128)])
def test_quest_top_kernel_matches_top_pages_on_gpu(rows, n, n_select):
    """Order keys of tied scores with dead pages, up to 262,144 tokens' pages of 16, shared
    and per-head rows: the kernel's pages are quest.top_pages', eager and compiled."""
    from qwen38_backend.kernels import top_select

    from qwen38_backend.kv import quest

    compiled = mx.compile(lambda k: top_select.top_ids(k, n_select))
    for seed in range(3):
        scores = mx.stack([top_select.probe_scores(n, n - 40, seed + r) for r in range(rows)])
        keys = quest.order_keys(scores)
        want = quest.top_pages(keys, n_select)
        assert mx.array_equal(top_select.top_ids(keys, n_select), want).item()
        assert mx.array_equal(compiled(keys), want).item()
    assert top_select.top_available(n_select)


def test_flash_next_greedy_with_the_qsa_select_kernel_on_gpu(tmp_path, monkeypatch):
    """A tiny Flash-Next (bf16, 2-block budget) decoding past its dense threshold with the
    selection kernel: its compiled steps take the kernel, the greedy tokens are the op
    path's, and a verify's rows equal its plain steps bit for bit."""
    from qwen38_backend.kernels import top_select

    import qwen38_backend
    from qwen38_backend.models import qsa
    from qwen38_backend.testing import make_tiny_weights

    path = make_tiny_weights("qwen4_exp", tmp_path / "flash", dtype="bfloat16")
    prompt = [(7 * i + 3) % 200 + 2 for i in range(19)]
    calls = []
    real = top_select.decode_tokens
    monkeypatch.setattr(top_select, "decode_tokens", lambda *a: calls.append(1) or real(*a))

    def model_for(switch: str):
        monkeypatch.setenv("QWEN38_QSA_SELECT_KERNEL", switch)
        top_select.qsa_available.cache_clear()
        qsa._DECODE_TOKENS.clear()
        return qwen38_backend.load(str(path), dtype="bfloat16")

    def tokens(model) -> list[int]:
        return list(model.generate_tokens(prompt, max_tokens=12, stop_token_ids=[]))

    plain = tokens(model_for("off"))
    assert not calls
    model = model_for("auto")
    assert tokens(model) == plain
    assert len(calls) > 2  # the probe's two, then the steps' traces
    assert_verify_rows_equal_steps(model, 37, STORES["contiguous"])
    top_select.qsa_available.cache_clear()
    qsa._DECODE_TOKENS.clear()


@pytest.mark.parametrize("store", ["contiguous", "paged"])
def test_flash_next_reads_its_chosen_blocks_in_place_on_gpu(tmp_path, monkeypatch, store):
    """A tiny Flash-Next (bf16, 2-block budget) past its dense threshold: its QSA steps read
    the chosen blocks and tail in the store's buffers through the split-KV kernel (blocks of
    4 rows as pages), and the greedy tokens are the gathered path's."""
    import qwen38_backend
    from qwen38_backend.kv import one_token
    from qwen38_backend.models import qsa
    from qwen38_backend.testing import make_tiny_weights

    kernel = _decode_kernel()
    path = make_tiny_weights("qwen4_exp", tmp_path / "flash", dtype="bfloat16")
    prompt = [(7 * i + 3) % 200 + 2 for i in range(19)]
    reads = _count_calls(
        monkeypatch, kernel, "decode_attention", lambda *_, **kw: kw.get("page_tokens") == 4
    )

    def tokens(in_place: bool) -> list[int]:
        monkeypatch.setattr(one_token, "READ_PAGES_IN_PLACE", in_place)
        qsa._DECODE_TOKENS.clear()
        model = qwen38_backend.load(str(path), dtype="bfloat16")
        return list(
            model.generate_tokens(prompt, max_tokens=12, stop_token_ids=[], **STORES[store])
        )

    gathered = tokens(False)
    assert not any(reads)
    assert tokens(True) == gathered
    assert sum(reads) >= 10
    qsa._DECODE_TOKENS.clear()


# ----- a gated residual's norm, gates and mix in three launches (kernels/stream_mix.py) ----
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_stream_mix_kernels_match_the_op_path(dtype, monkeypatch):
    """Flash-Next's streams (4 of 2560, low rank 320): the probe passes; for 1..16 rows each
    output is within the kernels' tolerance of the gated residual's ops (the gates and the
    mix, whose roundings the kernels follow op by op; in half precision nearly all equal) and every
    row equals a one-row launch; a GatedResidual step with them on: its inject weights
    within that tolerance, its block input close to the op path's."""
    from qwen38_backend.kernels import stream_mix as kernel
    from qwen38_backend.kernels.qk_norm_rope import within_ulps

    from qwen38_backend.models.hyper_connections import stream_close, stream_mean

    monkeypatch.setenv("QWEN38_STREAM_KERNEL", "auto")
    kernel.available.cache_clear()
    assert kernel.available(2560, 4, 320, 1e-6, dtype)
    width = 4 * 2560
    for rows in (1, 5, 16):
        keys = mx.random.split(mx.random.key(rows), 4)
        x = (3 * mx.random.normal((rows, width), key=keys[0])).astype(dtype)
        weight = (0.2 * mx.random.normal((width,), key=keys[1])).astype(dtype)
        y = (2 * mx.random.normal((rows, 324), key=keys[2])).astype(dtype)
        up = (2 * mx.random.normal((rows, width), key=keys[3])).astype(dtype)
        normed = kernel.norm(x, weight, 4, 1e-6)
        gate, inj = kernel.gates(y, 320, 4, True)
        mixed = kernel.mix(up, normed, 4)
        out = (2 * mx.random.normal((rows, 2560), key=keys[1])).astype(dtype)
        want = kernel.reference(x, weight, y, up, out, 4, 320, 1e-6)
        closed, closed_normed = kernel.closed_norm(x, inj, out, weight, 4, 1e-6)
        assert mx.array_equal(closed_normed, kernel.norm(closed, weight, 4, 1e-6)).item()
        got = (normed, gate, inj, mixed, closed)
        # the close as a step computes it: inside a compiled graph, whose fused kernel on
        # CUDA rounds x + inj * out once, as the kernel does (session 30: the eager ops
        # round the product first and equal it in ~73% of half-precision values)
        closes = mx.compile(stream_close)(x, inj, out)
        mine = (*want[:3], stream_mean(up, normed, 4), closes)
        names = ("norm", "gate", "inject", "mix", "close")
        for name, g, w in zip(names, got, mine, strict=True):
            assert within_ulps(g, w, kernel.tolerance(dtype)), name
            # MLX's own device ops in the kernels: the elementwise steps' bits are the ops';
            # a normaliser an fp32 ulp apart seldom moves a half
            if dtype != mx.float32:
                assert mx.mean((g == w).astype(mx.float32)).item() > 0.99, name
        for t in range(rows):
            one = (
                kernel.norm(x[t : t + 1], weight, 4, 1e-6),
                *kernel.gates(y[t : t + 1], 320, 4, True),
                kernel.mix(up[t : t + 1], normed[t : t + 1], 4),
                kernel.closed_norm(x[t : t + 1], inj[t : t + 1], out[t : t + 1], weight, 4, 1e-6)[
                    0
                ],
            )
            for a, g in zip(one, got, strict=True):
                assert mx.array_equal(a, g[t : t + 1]).item(), t
    hc = random_gated_residual(2560, 4, 320, 1e-6, seed=3)
    hc.set_dtype(dtype)
    R = (2 * mx.random.normal((3, width), key=mx.random.key(4))).astype(dtype)
    op_x, op_inj = hc.open(R)
    hc.prepare_decode(dtype)
    assert hc._kernels(R) is not None
    x, inj = hc.open(R)
    assert within_ulps(inj, op_inj, kernel.tolerance(dtype))
    rel = mx.linalg.norm((x - op_x).astype(mx.float32)) / mx.linalg.norm(op_x.astype(mx.float32))
    assert rel.item() < 2.0**-7
    kernel.available.cache_clear()


# ----- q/k norms + RoPE in one launch (kernels/qk_norm_rope.py) ------------------------------
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize(
    "gated, interleaved, dims, head_dim", [(True, False, 64, 256), (False, True, 128, 128)]
)
def test_qk_norm_rope_kernel_matches_the_op_path(dtype, gated, interleaved, dims, head_dim):
    """One launch gives the op path's q, k and gate: the gate bit for bit, q and k within
    two ulps (the normaliser's sums are added in the kernel's own order), nearly all equal;
    every row equal to a one-row launch at its position, at the 27B's heads and another
    layout, deep positions included."""
    from qwen38_backend.kernels import qk_norm_rope as kernel

    layout = kernel.HeadLayout(24, 4, head_dim, gated, 1e-6, dims, 1e7, 1.0, interleaved)
    assert kernel.available(layout, dtype)
    width = layout.q_width() + 2 * 4 * head_dim
    for rows, start in ((1, 0), (3, 4093), (8, 262_141)):
        keys = mx.random.split(mx.random.key(rows), 3)
        qkv = (3 * mx.random.normal((rows, width), key=keys[0])).astype(dtype)
        q_scale = 1 + 0.3 * mx.random.normal((head_dim,), key=keys[1])
        k_scale = 1 + 0.3 * mx.random.normal((head_dim,), key=keys[2])
        offset = mx.array(start, dtype=mx.int32)
        got = kernel.qk_norm_rope(qkv, q_scale, k_scale, offset, layout)
        want = kernel.reference(qkv, q_scale, k_scale, offset, layout)
        if gated:
            assert mx.array_equal(got[2], want[2]).item()
        else:
            assert got[2] is None and want[2] is None
        for g, w in zip(got[:2], want[:2], strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype
            assert kernel.within_ulps(g, w, 2), (rows, start)
            assert (g != w).astype(mx.float32).mean().item() < 0.01, (rows, start)
        for t in range(rows):
            one = kernel.qk_norm_rope(qkv[t : t + 1], q_scale, k_scale, offset + t, layout)
            assert mx.array_equal(one[0], got[0][:, :, t : t + 1]).item(), (rows, t)
            assert mx.array_equal(one[1], got[1][:, :, t : t + 1]).item(), (rows, t)
            if gated:
                assert mx.array_equal(one[2], got[2][t : t + 1]).item(), (rows, t)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen4_exp"])
def test_step_qk_kernel_keeps_the_greedy_tokens(tmp_path, monkeypatch, arch):
    """A bf16 tiny Qwen3.5 / Flash-Next decoding with its attention (QSA) layers' q/k norms
    and RoPE in one launch picks the greedy tokens of the op path, its logits within bf16
    rounding of them at every step; the Qwen3.5 step has fewer nodes (Flash-Next's step
    hands its layers to the device as they are built, so its last graph is a few nodes:
    there, every QSA layer chose the kernel)."""
    from qwen38_backend.kernels import qk_norm_rope as kernel

    models: dict = {}
    tokens, logits, nodes = _decode_with(
        tmp_path, monkeypatch, "QWEN38_QK_KERNEL", kernel, arch, models
    )
    assert tokens["auto"] == tokens["off"]
    for a, b in zip(logits["auto"], logits["off"], strict=True):
        assert mx.allclose(a, b, rtol=2e-2, atol=2e-2).item()
    if arch == "qwen3_5":
        assert nodes["auto"] < nodes["off"], nodes
        return
    chose = {
        choice: [b.self_attn._qk_kernel_for for b in m.net.model.layers if not b.is_linear]
        for choice, m in models.items()
    }
    assert chose["off"] and not any(chose["off"]), chose
    assert all(chose["auto"]), chose


@pytest.mark.parametrize("epilogue", ["gates", "mix"])
def test_product_epilogues_keep_flash_next_steps_bit_for_bit(tmp_path, monkeypatch, epilogue):
    """A bf16 tiny Flash-Next decoding with its gated residuals' gates in the down / inject
    products' epilogue (kernels/rows_matmul.py, GATES), or their block inputs mixed in the up
    products' (MIX), picks the same greedy tokens with the same logits, bit for bit, as with
    the product and the gates' ops / the stream kernels' mix launch apart; its steps ran it."""
    from qwen38_backend.kernels import rows_matmul as kernel

    calls = _count_calls(monkeypatch, kernel, "rows_matmul", lambda *_, **kw: epilogue in kw)
    switch = f"QWEN38_{epilogue.upper()}_KERNEL"
    tokens, logits, _ = _decode_with(tmp_path, monkeypatch, switch, kernel, "qwen4_exp")
    assert any(calls)
    assert tokens["auto"] == tokens["off"]
    for a, b in zip(logits["auto"], logits["off"], strict=True):
        assert mx.array_equal(a, b).item()


def test_fused_opens_keep_flash_next_steps_bit_for_bit(tmp_path, monkeypatch):
    """A bf16 tiny Flash-Next decoding with each step's close, norm and gated residual
    products as one persistent launch (kernels/fused.py, grid barriers between the phases)
    picks the same greedy tokens with the same logits, bit for bit, as with the three
    launches; every gated residual with something to close chose it, and the steps ran it."""
    from qwen38_backend.kernels import fused as kernel

    calls = _count_calls(monkeypatch, kernel, "launch")
    models: dict = {}
    switch = "QWEN38_FUSED_KERNEL"
    tokens, logits, _ = _decode_with(tmp_path, monkeypatch, switch, kernel, "qwen4_exp", models)
    # the steps' traces took the launch (a compiled step replays it: no call each step)
    assert len(calls) >= len(models["auto"].net.model.layers)
    assert tokens["auto"] == tokens["off"]
    for a, b in zip(logits["auto"], logits["off"], strict=True):
        assert mx.array_equal(a, b).item()
    layers = models["auto"].net.model.layers
    assert all(layer.mlp_hyper_connection._fuse_for for layer in layers)


def test_fused_27b_steps_keep_their_bits(tmp_path, monkeypatch, request):
    """A bf16 tiny 27B (Gated DeltaNet heads of 32, its kernel's smallest; attention heads
    of 256, the products' block; the norm prologue on, which the fusion needs) decoding with
    each Gated DeltaNet block's one-row step, and each attention block's q/k/v side and its
    o_proj on, as one persistent launch each picks the same
    greedy tokens with the same logits, bit for bit, as with their launches apart; every
    block chose it, and its launches ran token after token (each leaves the barrier's state
    zeros for the next: a state left wrong would hang the next launch's waits or break its
    order)."""
    from qwen38_backend.kernels import fused as kernel
    from qwen38_backend.kernels import rows_matmul

    monkeypatch.setenv("QWEN38_ROWS_NORM", "auto")
    # decided once a process: an earlier test, with the prologue off, would leave it off here
    # (the session 37 H200 run: no block fused)
    rows_matmul.norm_available.cache_clear()
    request.addfinalizer(rows_matmul.norm_available.cache_clear)
    calls = _count_calls(monkeypatch, kernel, "launch")
    models: dict = {}
    heads = {"linear_key_head_dim": 32, "linear_value_head_dim": 32}
    heads.update(head_dim=256, num_attention_heads=2, mrope_section=[16, 8, 8])  # q/k/v fuse
    switch = "QWEN38_FUSED_KERNEL"
    tokens, logits, _ = _decode_with(
        tmp_path, monkeypatch, switch, kernel, "qwen3_5", models, **heads
    )
    layers = models["auto"].net.model.layers
    # every block's step traced its launch (a compiled step replays it: no call each step)
    assert len(calls) >= len(layers)
    assert tokens["auto"] == tokens["off"]
    for a, b in zip(logits["auto"], logits["off"], strict=True):
        assert mx.array_equal(a, b).item()
    for b in layers:
        assert b._fuse_linear_for if b.is_linear else b._fuse_in_for and b._fuse_out_for


def test_a_fused_qsa_input_side_keeps_its_bits(monkeypatch):
    """A bf16 Flash-Next QSA layer (attention heads of 256) whose one-row input side (the
    close, the attention open, the indexer's product, the q/k/v product and the q/k kernel)
    runs as one launch on the device: its probe passes, and every output equals the
    launches apart, bit for bit."""
    from helpers import random_qsa_block
    from qwen38_backend.kernels import fused

    from qwen38_backend import rows

    monkeypatch.setenv("QWEN38_FUSED_KERNEL", "auto")
    fused.agrees.cache_clear()
    dtype = mx.bfloat16
    block = random_qsa_block(dtype)
    hc = block.attn_hyper_connection
    R, unclosed = hc.step_operands(dtype, 13)
    offset = mx.array(41, dtype=mx.int32)
    with rows.unpadded():
        rows.prepare(dtype)
        block.prepare_decode(dtype)
        assert block._fuse_attention_for == str(dtype)
        together = block._attention_in(R, offset, *unclosed)
        block._fuse_attention_for = hc._fuse_for = ""
        apart = block._attention_in(R, offset, *unclosed)
    for a, b in zip(together, apart, strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b).item()
    fused.agrees.cache_clear()


def test_a_fused_flash_next_layer_step_keeps_its_bits(monkeypatch):
    """A bf16 Flash-Next Gated DeltaNet layer (heads of 32; 8 experts of 64 in 4-bit, its
    shared expert run in the expert kernels) whose one-row step runs as three launches
    (kernels/fused.py: the close, mixer open and Gated DeltaNet as one; the close, MoE open,
    router, routing and experts' up launch as one; the experts' down launch): every fusion
    probe passes on the device, and every output of the step equals the step with the
    launches apart, bit for bit."""
    from helpers import random_linear_block
    from qwen38_backend.kernels import fused

    from qwen38_backend import rows

    monkeypatch.setenv("QWEN38_FUSED_KERNEL", "auto")
    fused.agrees.cache_clear()
    dtype = mx.bfloat16
    block, (R, inj, out, conv, recurrent) = random_linear_block(dtype, quantized_moe=True)
    calls = _count_calls(monkeypatch, fused, "launch")
    with rows.unpadded():
        rows.prepare(dtype)
        block.prepare_decode(dtype)
        assert block._fuse_linear_for and block._fuse_moe_for
        probes = len(calls)
        together = block._linear_step(R, inj, out, conv, recurrent)
        mx.eval(together)
        assert len(calls) == probes + 2  # the mixer side, the MoE side
        block._fuse_linear_for = block._fuse_moe_for = ""
        for hc in (block.attn_hyper_connection, block.mlp_hyper_connection):
            hc._fuse_for = ""
        apart = block._linear_step(R, inj, out, conv, recurrent)
    for a, b in zip(together, apart, strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b).item()
    fused.agrees.cache_clear()


def test_steps_take_the_rows_kernel(gpu_models):
    """A bf16 forward on CUDA chooses the row-invariant kernel (its probe passed), so the
    verify tests below run it rather than padded products."""
    from qwen38_backend import rows

    model = gpu_models["tiny"]
    model.forward([3], model.new_state())
    assert rows.kernel_dtype() == mx.bfloat16


# ----- the Gated DeltaNet prefill kernels (kernels/gdn_prefill.py) ----------------------------
@pytest.mark.parametrize("kind", ["solve", "scan"])
def test_gdn_prefill_kernels_match_the_op_path(kind):
    """One launch == the op path (the solve through its inverse, the scan's loop over
    chunks), to fp32 rounding, at 27B's head dims (48 value heads, a 2048-token prefill
    chunk: 32 chunks of 64)."""
    from qwen38_backend.kernels import gdn_prefill as kernel

    from qwen38_backend.models.gated_delta import scan_chunks, solve_chunks

    assert kernel.probe(kind, 128, 128, 64) is None
    args = kernel.probe_inputs(heads=48, chunks=32, chunk=64, dk=128, dv=128, seed=1)
    if kind == "solve":
        got, want = kernel.chunk_solve(*args[:4]), solve_chunks(*args[:4])
    else:
        got, want = kernel.chunk_scan(*args[4:]), scan_chunks(*args[4:])
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert (mx.abs(g - w).max() / mx.abs(w).max()).item() <= 1e-5


def test_chunked_form_with_the_kernels_equals_the_recurrence():
    """The whole chunked form with both kernels against the token-by-token reference (a
    partial last chunk included)."""
    from qwen38_backend.kernels import gdn_prefill as kernel

    from qwen38_backend.models.gated_deltanet import (
        chunked_gated_delta,
        prepare_qk,
        recurrent_gated_delta,
    )

    T, Hk, Hv, D = 300, 16, 48, 128
    keys = mx.random.split(mx.random.key(3), 5)
    q, k = mx.random.normal((T, Hk, D), key=keys[0]), mx.random.normal((T, Hk, D), key=keys[1])
    v = mx.random.normal((T, Hv, D), key=keys[2])
    g = -mx.random.uniform(0.01, 0.5, (T, Hv), key=keys[3])
    beta = mx.random.uniform(0.0, 1.0, (T, Hv), key=keys[4])
    S0 = 0.1 * mx.random.normal((Hv, D, D))
    qp, kp = prepare_qk(q, k, Hv)
    o_ref, S_ref = recurrent_gated_delta(qp, kp, v, g, beta, S0)
    o, S = chunked_gated_delta(
        qp, kp, v, g, beta, S0, solve=kernel.chunk_solve, scan=kernel.chunk_scan
    )
    assert mx.abs(o - o_ref).max().item() < 1e-4
    assert mx.abs(S - S_ref).max().item() < 1e-4


def test_gdn_prefill_kernels_keep_prefill_logits(gpu_models, monkeypatch):
    """A bf16 prefill (27B dims, 4 layers) with the kernels (auto: both, each after its
    probe; force: both, unprobed) and with the op path: the same last-position logits to bf16
    rounding and the same greedy token; the kernels really ran."""
    from qwen38_backend.kernels import gdn_prefill as kernel

    model = gpu_models["27b"]
    prompt = [(7 * i + 5) % 30000 + 2 for i in range(300)]
    calls = []
    for name in ("chunk_solve", "chunk_scan"):
        real = getattr(kernel, name)
        spy = lambda *a, real=real, name=name: calls.append(name) or real(*a)  # noqa: E731
        monkeypatch.setattr(kernel, name, spy)
    logits = {}
    both = {"chunk_solve", "chunk_scan"}
    ran = {"auto": both, "force": both, "off": set()}
    for choice in ran:
        monkeypatch.setenv("QWEN38_GDN_PREFILL_KERNEL", choice)
        kernel.available.cache_clear()
        calls.clear()
        out = model.prefill(prompt, model.new_state(), chunk=128)
        logits[choice] = np.array(out.astype(mx.float32))
        assert set(calls) == ran[choice], choice
    kernel.available.cache_clear()
    b = logits["off"]
    for a in (logits["auto"], logits["force"]):
        assert np.abs(a - b).max() <= 0.02 * np.abs(b).max()
        assert a.argmax() == b.argmax()


# ----- speculative verify rows == plain steps (rows.py) ----------------------------------------
@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    """Random qwen3_5 in bf16: the tiny test config, and 4 layers of the real 27B shapes
    (smaller vocabulary), both with an MTP head."""
    import qwen38_backend
    from qwen38_backend.testing import make_tiny_weights

    tiny = make_tiny_weights("qwen3_5", tmp_path_factory.mktemp("tiny"), dtype="bfloat16")
    big = make_tiny_weights(
        "qwen3_5",
        tmp_path_factory.mktemp("27b"),
        dims="27b",
        num_layers=4,
        vocab_size=32768,
        dtype="bfloat16",
    )
    import mlx.nn as nn

    quantized = qwen38_backend.load(str(big), dtype="bfloat16")
    nn.quantize(quantized.net, group_size=64, bits=4)  # its quantized products run unpadded
    return {
        "tiny": qwen38_backend.load(str(tiny), dtype="bfloat16"),
        "27b": qwen38_backend.load(str(big), dtype="bfloat16"),
        "27b-4bit": quantized,
    }


STORES = {"contiguous": {}, "paged": {"kv_paged": "on", "kv_page_tokens": 16}}


@pytest.mark.parametrize("store", list(STORES))
@pytest.mark.parametrize("dims", ["tiny", "27b", "27b-4bit"])
def test_verify_rows_equal_plain_steps_on_gpu(gpu_models, dims, store):
    """Row i of a verify forward of 5 positions has the logits of the plain step at that
    position, bit for bit (before rows.py the H200 differed by up to 0.5)."""
    from qwen38_backend import rows

    model = gpu_models[dims]
    if dims.endswith("4bit"):  # one-row quantized products, verified unpadded (rows.py)
        mode, _, most = rows.quantized_plan(model.net, model.dtype)
        assert mode == "unpadded" and most >= 5
    assert_verify_rows_equal_steps(model, 37, STORES[store])


def assert_verify_rows_equal_steps(model, history: int, store: dict) -> None:
    """A verify of 5 positions after `history` tokens vs the plain steps, bit for bit."""
    prefix, tail = [(5 * i + 3) % 200 + 2 for i in range(history)], [7, 8, 9, 10, 11]
    one, many = model.new_state(**store), model.new_state(**store)
    model.prefill(prefix, one)
    model.prefill(prefix, many)
    steps = [np.array(model.forward([t], one)[-1].astype(mx.float32)) for t in tail]
    feats = model.forward_features(tail, many)
    rows = np.array(model.net.logits_from_features(feats).astype(mx.float32))
    for i, step in enumerate(steps):
        assert np.array_equal(rows[i], step), f"row {i}: max diff {np.abs(rows[i] - step).max()}"


@pytest.fixture(scope="module")
def flash_model(tmp_path_factory):
    """Random tiny qwen4_exp (Flash-Next: QSA, experts, hyper-connections, PLE, MTP), bf16."""
    import qwen38_backend
    from qwen38_backend.testing import make_tiny_weights

    path = make_tiny_weights("qwen4_exp", tmp_path_factory.mktemp("flash"), dtype="bfloat16")
    return qwen38_backend.load(str(path), dtype="bfloat16")


@pytest.mark.parametrize("store", list(STORES))
@pytest.mark.parametrize("history", [3, 37])
def test_flash_next_verify_rows_equal_plain_steps_on_gpu(flash_model, history, store):
    """Flash-Next's verify rows are its plain steps', bit for bit, with the verify inside
    QSA's budget (8 tokens in the tiny config) and past it (each row's own selection): the
    same compiled step graphs, the row-invariant kernel or one row at a time for every
    product, one query at a time through the sparse attention."""
    assert flash_model.net.config.indexer_budget < 37
    assert_verify_rows_equal_steps(flash_model, history, STORES[store])


def test_flash_next_drafted_greedy_equals_plain_on_gpu(flash_model, monkeypatch):
    assert_drafted_greedy_equals_plain(flash_model, monkeypatch)


@pytest.mark.parametrize("dims", ["tiny", "27b", "27b-4bit"])
def test_drafted_greedy_equals_plain_on_gpu(gpu_models, dims, monkeypatch):
    assert_drafted_greedy_equals_plain(gpu_models[dims], monkeypatch)


def assert_drafted_greedy_equals_plain(model, monkeypatch) -> None:
    """Greedy with drafts == without, token for token: MTP drafts, and n-gram drafts from the
    plain stream with a third of their tokens corrupted (accepted and rejected rounds)."""
    from qwen38_backend import drafts

    prompt = [(11 * i + 5) % 300 + 2 for i in range(23)]

    def run(**options):
        stream = model.generate_tokens(prompt, max_tokens=40, stop_token_ids=[], **options)
        return list(stream), stream.stats

    plain, _ = run(draft="off")
    mtp, stats = run(draft="mtp")
    assert mtp == plain and stats.drafted > 0
    rng = np.random.default_rng(0)

    def draft(tokens, k):
        done = len(tokens) - len(prompt)
        out = list(plain[done : done + k])
        return [t if rng.random() > 0.35 else (t + 1) % 300 for t in out], 3

    monkeypatch.setattr(drafts.NgramIndex, "match", lambda index, k: draft(index.tokens, k))
    spec, stats = run(draft="ngram", draft_tokens=4)
    assert spec == plain
    assert 0 < stats.accepted < stats.drafted
