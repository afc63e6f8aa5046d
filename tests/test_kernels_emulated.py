"""The step kernels' CUDA sources run on the CPU (tests/cuda_emulator.py: g++ and an
emulation of CUDA's threads, warps and shared memory) through their modules' own launch
code and probes, against the op path: Flash-Next's routing (kernels/moe_route.py), stream
mixes (kernels/stream_mix.py) and routed experts (kernels/expert_qmv.py), and the 27B's
Gated DeltaNet step (kernels/gdn_decode.py) and row-invariant products
(kernels/rows_matmul.py). What this cannot show (a GPU's own math, speed) the GPU tests and
benchmarks do."""

from __future__ import annotations

import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from cuda_emulator import clear_caches, emulate
from helpers import greedy_off_on, random_gated_residual, random_moe
from qwen38_backend.kernels import (
    decode_attention,
    expert_qmv,
    gdn_decode,
    gdn_prefill,
    moe_route,
    qk_norm_rope,
    quest_select,
    rows_matmul,
    stream_mix,
    top_select,
)
from qwen38_backend.kernels.qk_norm_rope import within_ulps

from qwen38_backend.kv import quest
from qwen38_backend.models import qsa
from qwen38_backend.models.hyper_connections import stream_mean
from qwen38_backend.models.moe import QuantizedExperts, route, weighted_experts

MODULES = (moe_route, stream_mix, expert_qmv)


@pytest.fixture
def emulated(monkeypatch):
    if shutil.which("g++") is None:
        pytest.fail("the emulated kernels need g++ on PATH")
    for module in MODULES:
        emulate(monkeypatch, module)
    for name in ("ROUTE", "STREAM", "EXPERT"):
        monkeypatch.setenv(f"QWEN38_{name}_KERNEL", "auto")
    yield
    for module in MODULES:
        clear_caches(module)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("normalize", [True, False])
def test_routing_kernel_routes_as_the_op_path(emulated, dtype, normalize):
    """The probe passes (rows equal one-row launches, the op path's experts and weights);
    a row of 40 experts (not whole lanes) too; ties go to the lower expert."""
    assert moe_route.available(512, 10, normalize, dtype)
    logits = (2 * mx.random.normal((3, 40), key=mx.random.key(2))).astype(dtype)
    assert moe_route.same_routes(moe_route.route(logits, 5, normalize), route(logits, 5, normalize))
    inds, weights = moe_route.route(mx.zeros((2, 40), dtype), 4, normalize)
    assert inds.tolist() == [[0, 1, 2, 3]] * 2
    assert (weights == (0.25 if normalize else 1 / 40)).all().item()
    logits = mx.zeros((1, 40), dtype).at[0, 37].add(3.0).at[0, 5].add(3.0)
    assert moe_route.route(logits, 4, normalize)[0][0, :3].tolist() == [5, 37, 0]


def test_routing_kernel_refuses_a_wrong_answer(emulated, monkeypatch):
    """The probe can fail: a kernel that picks the k lowest-probability experts is refused."""
    monkeypatch.setattr(
        moe_route,
        "_SOURCE",
        moe_route._SOURCE.replace("p[i] > best", "p[i] < best && p[i] >= 0.0f"),
    )
    with pytest.warns(UserWarning, match="routing kernel disagrees"):
        assert not moe_route.available(64, 4, True, mx.float32)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_stream_mix_kernels_match_the_gated_residual(emulated, dtype):
    """The probe passes; a GatedResidual's open with the kernels is within the kernels'
    tolerance of its op path (the normaliser's sums in another order), twice that for the
    block input (after a product of normed rows); its close in one launch with the next
    residual's norm: the close within tolerance, the norm the norm kernel's bit for bit."""
    hidden, streams, low_rank, eps = 64, 4, 16, 1e-6
    assert stream_mix.available(hidden, streams, low_rank, eps, dtype)
    hc = random_gated_residual(hidden, streams, low_rank, eps, seed=5)
    hc.set_dtype(dtype)
    width = hidden * streams
    keys = mx.random.split(mx.random.key(6), 2)
    R = (2 * mx.random.normal((3, width), key=keys[1])).astype(dtype)
    want_x, want_inj = hc.open(R)
    hc.prepare_decode(dtype)
    assert hc._kernels(R) is not None
    x, inj = hc.open(R)
    ulps = stream_mix.tolerance(dtype)
    assert within_ulps(inj, want_inj, ulps)
    assert within_ulps(x, want_x, 2 * ulps)
    out = (2 * mx.random.normal((3, hidden), key=keys[0])).astype(dtype)
    then = random_gated_residual(hidden, streams, low_rank, eps, seed=7)
    then.set_dtype(dtype)
    then.prepare_decode(dtype)
    closed, then_normed = hc.close_then_norm(R, inj, out, then)
    assert within_ulps(closed, hc.close(R, inj, out), ulps)
    assert mx.array_equal(then_normed, stream_mix.norm(closed, then.hc_norm.weight, 4, eps)).item()
    normed = stream_mix.norm(R, hc.hc_norm.weight, streams, eps)
    up = (2 * mx.random.normal((3, width), key=keys[0])).astype(dtype)
    assert within_ulps(stream_mix.mix(up, normed, streams), stream_mean(up, normed, streams), ulps)


def _fp32(experts: QuantizedExperts) -> QuantizedExperts:
    """The same 4-bit stacks with their scales and biases widened to fp32 (exactly)."""
    wide = QuantizedExperts.__new__(QuantizedExperts)
    nn.Module.__init__(wide)
    for name in ("num_experts", "hidden", "intermediate", "group_size", "bits", "mode"):
        setattr(wide, name, getattr(experts, name))
    for name in ("gate_up_proj", "down_proj"):
        stack = experts[name]
        setattr(
            wide, name, {k: v if k == "weight" else v.astype(mx.float32) for k, v in stack.items()}
        )
    return wide


def test_expert_kernels_match_an_fp32_reference(emulated, monkeypatch):
    """At a reduced shape (hidden 256, intermediate 128, 3 of 8 experts, 4-bit groups of
    64), bf16: every row equals a one-row call; the routed sum is within bf16 rounding of
    the op path on the same operands in fp32 (MLX's CPU gather_qmm in bf16 is itself ~3%
    off, so the probe's bf16 comparison cannot pass here: kernels/expert_qmv.py); the
    shared expert's gated output is added in the last launch as the ops add it, or the
    shared expert itself runs as each row's last pair, as close; a SparseMoE step with the
    routing and expert kernels forced on (its shared expert fused, so run in them) is as
    close."""
    moe = random_moe(256, 8, 3, 128, seed=2)
    moe.set_dtype(mx.bfloat16)
    x = mx.random.normal((4, 256), key=mx.random.key(3)).astype(mx.bfloat16)
    inds, weights = moe.route(x)
    e = moe.experts
    got = expert_qmv.routed_sum(x, inds, weights, e.gate_up_proj, e.down_proj, 64)
    for t in range(4):
        one = expert_qmv.routed_sum(
            x[t : t + 1], inds[t : t + 1], weights[t : t + 1], e.gate_up_proj, e.down_proj, 64
        )
        assert mx.array_equal(one, got[t : t + 1]).item(), t
    want = weighted_experts(_fp32(e), x.astype(mx.float32), inds, weights)

    def rel(a: mx.array, b: mx.array) -> float:
        return (mx.linalg.norm(a.astype(mx.float32) - b) / mx.linalg.norm(b)).item()

    assert rel(got, want) < 2.0**-6
    gate, values = moe.shared_expert_gate(x), moe.shared_expert(x)
    with_shared = expert_qmv.routed_sum(
        x, inds, weights, e.gate_up_proj, e.down_proj, 64, (gate, values)
    )
    # the shared expert's output added to the kernel's own routed sum as the ops add it
    # (within two ulps: the emulation's sigmoid is not MLX's CPU one)
    assert within_ulps(with_shared, got + mx.sigmoid(gate) * values, 2)
    # the shared expert run on each row's last pair: its dense rows, in fp32 for reference
    moe.shared_expert.fuse()
    se = moe.shared_expert
    assert expert_qmv.runs_shared(se, mx.bfloat16)
    ran = expert_qmv.routed_sum(
        x,
        inds,
        weights,
        e.gate_up_proj,
        e.down_proj,
        64,
        shared_weights=(gate, se.gate_up_proj.weight, se.down_proj.weight),
    )
    g, u = mx.split(x.astype(mx.float32) @ se.gate_up_proj.weight.astype(mx.float32).T, 2, -1)
    shared = (nn.silu(g) * u) @ se.down_proj.weight.astype(mx.float32).T
    assert rel(ran, want + mx.sigmoid(gate.astype(mx.float32)) * shared) < 2.0**-6
    monkeypatch.setenv("QWEN38_EXPERT_KERNEL", "force")
    moe.prepare_decode()
    assert moe._fused(x) and moe._route_for
    assert rel(moe(x), want + moe._shared(x, moe.logits(x)[1]).astype(mx.float32)) < 2.0**-6


@pytest.mark.slow  # ~30 s: every step's kernels emulated
def test_flash_next_greedy_with_the_step_kernels(emulated, tmp_path, monkeypatch):
    """A tiny Flash-Next (fp32; its traces uncompiled, so the emulated kernels see values)
    with the routing and stream-mix kernels on: every layer chooses them, its greedy tokens
    are the op path's, a verify's rows equal its plain steps bit for bit, and a step adds
    each layer's MoE output in the next layer's norm launch (but the PLE layer's)."""
    import numpy as np

    import qwen38_backend
    from qwen38_backend.testing import make_tiny_weights

    path = make_tiny_weights("qwen4_exp", tmp_path / "flash", dtype="float32")
    prompt = [(7 * i + 3) % 200 + 2 for i in range(11)]

    def tokens(model) -> list[int]:
        return list(model.generate_tokens(prompt, max_tokens=6, stop_token_ids=[]))

    mx.disable_compile()
    try:
        for switch in ("off", "auto"):
            for name in ("ROUTE", "STREAM"):
                monkeypatch.setenv(f"QWEN38_{name}_KERNEL", switch)
            for module in MODULES:
                clear_caches(module)
            if switch == "off":
                plain = tokens(qwen38_backend.load(str(path), dtype="float32"))
        model = qwen38_backend.load(str(path), dtype="float32")
        assert tokens(model) == plain
        for layer in model.net.model.layers:
            assert layer.mlp._route_for == "mlx.core.float32"
            assert layer.attn_hyper_connection._kernel_for == "mlx.core.float32"
        one, many = model.new_state(), model.new_state()
        model.prefill(prompt, one)
        model.prefill(prompt, many)
        steps = [np.array(model.forward([t], one)[-1]) for t in (5, 6, 7)]
        rows = np.array(model.net.logits_from_features(model.forward_features([5, 6, 7], many)))
        for i, step in enumerate(steps):
            assert np.array_equal(rows[i], step), i
        closes = []
        real = stream_mix.closed_norm
        monkeypatch.setattr(stream_mix, "closed_norm", lambda *a: closes.append(1) or real(*a))
        model.forward([5], one)
        layers = model.net.model.layers
        # every mixer's close, and every MoE's but the last one's and the one before PLE
        assert len(closes) == 2 * len(layers) - 1 - sum(b.has_ple for b in layers[1:])
    finally:
        mx.enable_compile()


# ----- QSA's decode selection (kernels/top_select.py) ---------------------------------------
@pytest.fixture
def emulated_select(monkeypatch):
    if shutil.which("g++") is None:
        pytest.fail("the emulated kernels need g++ on PATH")
    emulate(monkeypatch, top_select)
    monkeypatch.setenv("QWEN38_QSA_SELECT_KERNEL", "auto")
    yield
    clear_caches(top_select)


@pytest.mark.parametrize(
    "n, visible, n_blocks, width",
    [
        (40, 40, 40, 0),  # every block chosen
        (300, 290, 7, 3),  # tied scores, masked slots
        (2500, 2300, 512, 2),  # more blocks than threads: runs of 3 per thread
        (1500, 1100, 1024, 1),  # ties across the boundary of a large choice
    ],
)
def test_qsa_select_kernel_chooses_as_the_op_path(emulated_select, n, visible, n_blocks, width):
    """Ties broken towards the lower block id (+-0.0 equal), -inf past the visible blocks,
    more blocks than threads: the kernel's token ids are the op path's, and its probe
    passes."""
    for seed in range(2):
        scores = top_select.probe_scores(n, visible, seed)
        tail = mx.arange(width, dtype=mx.int32) + 4 * visible
        got = top_select.decode_tokens(scores, tail, n_blocks, 4)
        want = qsa.op_decode_tokens(scores, tail, n_blocks, 4)
        assert got.tolist() == want.tolist()
    assert top_select.qsa_available(n_blocks, 4)


def test_qsa_select_kernel_refuses_a_wrong_answer(emulated_select, monkeypatch):
    """The probe can fail: a kernel that breaks ties towards the higher block id is refused."""
    form = dict(top_select._FROM_SCORES)
    form["__KEY_OF__"] = form["__KEY_OF__"].replace("(0xFFFFFFFFull - (unsigned)i)", "i")
    assert form != top_select._FROM_SCORES
    monkeypatch.setattr(top_select, "_FROM_SCORES", form)
    with pytest.warns(UserWarning, match="QSA selection kernel unavailable"):
        assert not top_select.qsa_available(16, 4)


def test_flash_next_greedy_with_the_qsa_select_kernel(emulated_select, tmp_path, monkeypatch):
    """A tiny Flash-Next (fp32, 2-block budget; its traces uncompiled, so the emulated kernel
    sees values) decoding past its dense threshold: its steps choose through the kernel, and
    the greedy tokens are the op path's."""
    from qwen38_backend.testing import make_tiny_weights

    path = make_tiny_weights("qwen4_exp", tmp_path / "flash", dtype="float32")
    prompt = [(7 * i + 3) % 200 + 2 for i in range(12)]
    calls = []
    real = top_select.decode_tokens
    monkeypatch.setattr(top_select, "decode_tokens", lambda *a: calls.append(1) or real(*a))

    def reset() -> None:
        top_select.qsa_available.cache_clear()
        qsa._DECODE_TOKENS.clear()

    plain, selected = greedy_off_on(
        monkeypatch, path, prompt, "QWEN38_QSA_SELECT_KERNEL", "auto", reset, 6,
        between=lambda: calls.append(len(calls)),
    )  # fmt: skip
    assert calls[0] == 0  # the op path made no call
    assert selected == plain
    assert len(calls) > 7  # the probe's calls, then the steps'


@pytest.mark.slow  # ~40 s: every attention of four generations emulated
@pytest.mark.parametrize(
    "store", [{}, {"kv_paged": "on", "kv_page_tokens": 8}], ids=["contiguous", "paged"]
)
def test_flash_next_reads_its_chosen_blocks_in_place(emulated_select, monkeypatch, tmp_path, store):
    """A tiny Flash-Next (fp32, a 2-block budget) decoding past its dense threshold with the
    split-KV kernel emulated: each QSA step reads its chosen blocks and tail in the store's
    own buffers (blocks of 4 rows as the kernel's pages, through the page table when paged),
    and the greedy tokens are those of the gathered path."""
    import qwen38_backend
    from qwen38_backend.kv import one_token
    from qwen38_backend.testing import make_tiny_weights

    emulate(monkeypatch, decode_attention)
    monkeypatch.setattr(decode_attention, "TENSOR_CORES", False)
    monkeypatch.setenv("QWEN38_DECODE_ATTN_KERNEL", "force")  # its probe: its own tests
    path = make_tiny_weights("qwen4_exp", tmp_path / "flash", dtype="float32")
    prompt = [(7 * i + 3) % 200 + 2 for i in range(12)]
    block_reads = []
    real = decode_attention.decode_attention

    def counted(*args, **kwargs):
        block_reads.append(kwargs.get("page_tokens") == 4 and kwargs["pages"].shape[1] == 3)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode_attention, "decode_attention", counted)

    def tokens(in_place: bool) -> list[int]:
        monkeypatch.setattr(one_token, "READ_PAGES_IN_PLACE", in_place)
        qsa._DECODE_TOKENS.clear()
        model = qwen38_backend.load(str(path), dtype="float32")
        return list(model.generate_tokens(prompt, max_tokens=6, stop_token_ids=[], **store))

    mx.disable_compile()
    try:
        gathered = tokens(False)
        assert not any(block_reads)
        block_reads.clear()
        assert tokens(True) == gathered
    finally:
        mx.enable_compile()
        clear_caches(decode_attention)
    assert sum(block_reads) >= 5  # QSA steps past the threshold (n_blocks 2 + the tail's)


def test_flash_next_steps_norm_and_rope_qk_in_one_launch(monkeypatch, tmp_path):
    """A tiny Flash-Next (fp32) decoding with the q/k norm + RoPE kernel emulated: every
    QSA layer's step runs it (its gated heads, partial rotary dims), and the greedy tokens
    are the op path's. Forced: the emulation's fp32 frequencies are the C library's, not
    MLX's CPU RoPE's, so its probe (two ulps at position 4,093) runs on the GPU only."""
    from qwen38_backend.testing import make_tiny_weights

    if shutil.which("g++") is None:
        pytest.fail("the emulated kernels need g++ on PATH")
    emulate(monkeypatch, qk_norm_rope)
    path = make_tiny_weights("qwen4_exp", tmp_path / "flash", dtype="float32")
    prompt = [(5 * i + 2) % 200 + 2 for i in range(9)]
    calls = []
    real = qk_norm_rope.qk_norm_rope
    monkeypatch.setattr(qk_norm_rope, "qk_norm_rope", lambda *a: calls.append(a[-1]) or real(*a))

    plain, fused = greedy_off_on(
        monkeypatch, path, prompt, "QWEN38_QK_KERNEL", "force",
        lambda: clear_caches(qk_norm_rope), 5, between=lambda: calls.append(None),
    )  # fmt: skip
    assert calls[0] is None  # the op path made no call
    assert fused == plain
    layout = calls[-1]
    assert layout.gated and layout.dims < layout.head_dim  # QSA's gate, partial rotation
    assert len(calls) >= 5  # the marker, then one a QSA layer a step


@pytest.mark.parametrize(
    "rows, n, n_select",
    [(1, 300, 16), (4, 700, 64), (1, 2600, 128), (2, 1500, 1000)],
)
def test_quest_top_kernel_picks_as_top_pages(emulated_select, rows, n, n_select):
    """Order keys of tied scores with dead pages (quest.order_keys), one round of top_pages
    and two, shared and per-head rows: the kernel's pages are top_pages', and its probe
    passes."""
    scores = mx.stack([top_select.probe_scores(n, n - 40, r) for r in range(rows)])
    keys = quest.order_keys(scores)
    assert top_select.top_ids(keys, n_select).tolist() == quest.top_pages(keys, n_select).tolist()
    assert top_select.top_available(n_select)


def _quest_operands(seed: int) -> tuple[mx.array, ...]:
    """A Quest selection's operands at 27B heads (24 query, 4 KV of 256): q, bf16 page
    bounds of a 1,500 capacity, 1,300 live pages."""
    keys = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((24, 256), key=keys[0]).astype(mx.bfloat16)
    lo = mx.random.normal((4, 1500, 256), key=keys[1])
    hi = lo + mx.abs(mx.random.normal((4, 1500, 256), key=keys[2]))
    return (q, *quest.outward_bf16(lo, hi), mx.array(1300, dtype=mx.int32))


@pytest.mark.parametrize("shared", [True, False])
def test_quest_selection_through_both_kernels(emulated_select, monkeypatch, shared):
    """A whole Quest selection (quest.selector) with the page-key and top-k kernels emulated
    picks the op path's pages: 27B heads (24 query, 4 KV of 256), 1,300 live pages of a
    1,500 capacity, sinks and a recent window."""
    emulate(monkeypatch, quest_select)
    monkeypatch.setenv("QWEN38_QUEST_KERNEL", "force")  # the page keys' probe: its own test
    q, kmin, kmax, n_pages = _quest_operands(3)
    try:
        got = quest.selector(96, 1, 2, shared)(q, kmin, kmax, n_pages)
        assert quest.top_kernel_usable(1500, 96)
        quest.selector.cache_clear()
        monkeypatch.setenv("QWEN38_QUEST_KERNEL", "off")
        monkeypatch.setenv("QWEN38_QUEST_TOP_KERNEL", "off")
        top_select.top_available.cache_clear()
        want = quest.selector(96, 1, 2, shared)(q, kmin, kmax, n_pages)
        assert got.tolist() == want.tolist()
    finally:
        quest.selector.cache_clear()
        clear_caches(quest_select)


# ----- kernels whose last changes have not yet run on a GPU (session 27) -------------------
@pytest.fixture
def emulated_27b(monkeypatch):
    if shutil.which("g++") is None:
        pytest.fail("the emulated kernels need g++ on PATH")
    for module in (gdn_decode, rows_matmul):
        emulate(monkeypatch, module)
    for name in ("GDN_KERNEL", "ROWS_KERNEL", "ROWS_EPILOGUES"):
        monkeypatch.setenv(f"QWEN38_{name}", "auto")
    yield
    for module in (gdn_decode, rows_matmul):
        clear_caches(module)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_gdn_decode_kernel_matches_the_op_path(emulated_27b, dtype):
    """Its probe passes at the 27B's heads (16 key, 48 value heads of 128) and a small
    sigmoid-gated shape; three rows in one launch equal three one-row launches chained
    (each row's output and state, bit for bit)."""
    assert gdn_decode.available((16, 48, 128, 128, 1e-6, "silu"), dtype)
    spec = (2, 4, 64, 32, 1e-6, "sigmoid")
    assert gdn_decode.available(spec, dtype)
    conv = 2 * 2 * 64 + 4 * 32
    keys = mx.random.split(mx.random.key(3), 10)
    qkv = mx.random.normal((3, conv), key=keys[0]).astype(dtype)
    z = mx.random.normal((3, 4 * 32), key=keys[1]).astype(dtype)
    b = mx.random.normal((3, 4), key=keys[2]).astype(dtype)
    a = mx.random.normal((3, 4), key=keys[3]).astype(dtype)
    hist = mx.random.normal((3, conv), key=keys[4]).astype(dtype)
    conv_w = (0.5 * mx.random.normal((conv, 4), key=keys[5])).astype(dtype)
    A_log = mx.random.uniform(0.0, 2.0, (4,), key=keys[6]).astype(dtype)
    dt_bias = mx.random.uniform(-1.0, 1.0, (4,), key=keys[7]).astype(dtype)
    S = 0.1 * mx.random.normal((4, 32, 64), key=keys[8])
    norm_w = mx.ones((32,), dtype=dtype)
    fixed = (conv_w, A_log, dt_bias)
    out, _, states = gdn_decode.gdn_decode_rows(qkv, z, b, a, hist, *fixed, S, norm_w, spec=spec)
    for t in range(3):
        row = (qkv[t : t + 1], z[t : t + 1], b[t : t + 1], a[t : t + 1])
        one, hist, S = gdn_decode.gdn_decode_step(*row, hist, *fixed, S, norm_w, spec=spec)
        assert mx.array_equal(one, out[t : t + 1]).item(), t
        assert mx.array_equal(S, states[t]).item(), t


@pytest.mark.slow  # ~30 s a dtype: every walk and prologue of the product, emulated
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_rows_matmul_kernel_matches_its_probe(emulated_27b, monkeypatch, dtype):
    """Its probe passes (1, 3 and 8 rows, the register and the staged walks, fp32 rows
    rounded as they are copied); its residual epilogues store what the ops compute, bit for
    bit; its swiglu epilogue within two ulps (the emulation's sigmoid is not MLX's); its norm
    prologue gives each row the stand-alone norm kernel's bits, close to the op path."""
    assert rows_matmul.available(dtype)
    keys = mx.random.split(mx.random.key(13), 3)
    k = 64 * (16 // dtype.size)
    x = mx.random.normal((3, k), key=keys[0]).astype(dtype)
    w = (mx.random.normal((2 * 301, k), key=keys[1]) * k**-0.5).astype(dtype)
    res = (4 * mx.random.normal((3, 2 * 301), key=keys[2])).astype(dtype)
    plain = rows_matmul.rows_matmul(x, w)
    assert mx.array_equal(rows_matmul.rows_matmul(x, w, residual=res), res + plain).item()
    gate, up = mx.split(plain, 2, axis=-1)
    swiglu = rows_matmul.rows_matmul(x, w, swiglu=True)
    assert within_ulps(swiglu, nn.silu(gate) * up, 2)
    monkeypatch.setenv("QWEN38_ROWS_NORM", "auto")
    monkeypatch.setenv("QWEN38_ROWS_EPILOGUES", "force")  # (bit-equal swiglu: the GPU's)
    assert rows_matmul.norm_available(dtype)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_rows_matmul_gates_epilogue_stores_the_gates_launch(emulated_27b, monkeypatch, dtype):
    """The gates epilogue (Flash-Next's gated residuals: low rank 320, 4 streams, one row and
    three) stores what the product then the stream kernels' gates launch give, bit for bit
    (both through the emulation's MLX ops), within two ulps of the ops (the emulation's
    sigmoid is not MLX's); a mutation of its split between gate and inject fails it."""
    emulate(monkeypatch, stream_mix)
    monkeypatch.setenv("QWEN38_ROWS_KERNEL", "force")
    keys = mx.random.split(mx.random.key(3), 2)
    k, low, streams = 64 * (16 // dtype.size), 320, 4
    w = (4 * mx.random.normal((low + streams, k), key=keys[1]) * k**-0.5).astype(dtype)
    for rows in (1, 3):
        x = mx.random.normal((rows, k), key=keys[0]).astype(dtype)
        plain = rows_matmul.rows_matmul(x, w)
        gated = rows_matmul.rows_matmul(x, w, gates=(low, streams))
        gate, inject = stream_mix.gates(plain, low, streams, True)
        assert mx.array_equal(gated, mx.concatenate([gate, inject], axis=1)).item()
        assert within_ulps(gated, rows_matmul._gates(low, streams)(plain), 2)
        one = rows_matmul.rows_matmul(x[-1:], w, gates=(low, streams))
        assert mx.array_equal(one, gated[-1:]).item()
    clear_caches(stream_mix)
    shifted = rows_matmul.rows_matmul(x, w, gates=(low - 1, streams))
    assert not mx.array_equal(shifted, gated).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_rows_matmul_mix_epilogue_stores_the_mix_launch(emulated_27b, monkeypatch, dtype):
    """The mix epilogue (Flash-Next's gated residuals: an up product of low rank 320 into 4
    streams, one row and three) stores what the product then the stream kernels' mix launch
    give, bit for bit, and a row alone its row of three; its probe passes; mixing the
    streams of the wrong hidden index (a mutation of its row map) fails it."""
    emulate(monkeypatch, stream_mix)
    monkeypatch.setenv("QWEN38_ROWS_KERNEL", "force")
    keys = mx.random.split(mx.random.key(5), 3)
    low, streams, hidden = 320, 4, 96
    w = (mx.random.normal((streams * hidden, low), key=keys[0]) * low**-0.5).astype(dtype)
    for rows in (1, 3):
        x = mx.random.normal((rows, low), key=keys[1]).astype(dtype)
        normed = mx.random.normal((rows, streams * hidden), key=keys[2]).astype(dtype)
        plain = rows_matmul.rows_matmul(x, w)
        mixed = rows_matmul.rows_matmul(x, w, mix=(normed, streams))
        assert mixed.shape == (rows, hidden)
        assert mx.array_equal(mixed, stream_mix.mix(plain, normed, streams)).item()
        one = rows_matmul.rows_matmul(x[-1:], w, mix=(normed[-1:], streams))
        assert mx.array_equal(one, mixed[-1:]).item()
    assert rows_matmul.mix_available(dtype)
    rows_matmul.mix_available.cache_clear()
    monkeypatch.setitem(rows_matmul.ROWS, "mix", "(n0 / MS + 1) % (N / MS) + j * (N / MS)")
    clear_caches(rows_matmul)
    shifted = rows_matmul.rows_matmul(x, w, mix=(normed, streams))
    assert not mx.array_equal(shifted, mixed).item()
    with pytest.warns(UserWarning, match="mix epilogue"):
        assert not rows_matmul.mix_available(dtype)
    rows_matmul.mix_available.cache_clear()


@pytest.mark.slow  # ~60 s each: every product of four generations emulated
@pytest.mark.parametrize("epilogue", ["gates", "mix"])
def test_flash_next_steps_take_the_product_epilogues(monkeypatch, tmp_path, epilogue):
    """A tiny Flash-Next (fp32) decoding with the row-invariant products emulated: its gated
    residuals' gates ride their down / inject products, or (with the stream kernels, also
    emulated) their block inputs' mix rides the up products (one launch each), and the
    greedy tokens are those of the product then the ops / the mix launch apart."""
    import qwen38_backend
    from qwen38_backend.testing import make_tiny_weights

    if shutil.which("g++") is None:
        pytest.fail("the emulated kernels need g++ on PATH")
    emulate(monkeypatch, rows_matmul)
    monkeypatch.setenv("QWEN38_ROWS_KERNEL", "force")  # its probes: the tests above
    monkeypatch.setenv("QWEN38_ROWS_EPILOGUES", "force")
    if epilogue == "mix":
        emulate(monkeypatch, stream_mix)
        monkeypatch.setenv("QWEN38_STREAM_KERNEL", "force")
    path = make_tiny_weights("qwen4_exp", tmp_path / "flash", dtype="float32")
    prompt = [(3 * i + 5) % 200 + 2 for i in range(7)]
    fused_calls = []
    real = rows_matmul.rows_matmul
    monkeypatch.setattr(
        rows_matmul,
        "rows_matmul",
        lambda *a, **kw: fused_calls.append(kw.get(epilogue)) or real(*a, **kw),
    )

    def reset() -> None:
        clear_caches(rows_matmul)
        clear_caches(stream_mix)

    plain, fused = greedy_off_on(
        monkeypatch, path, prompt, f"QWEN38_{epilogue.upper()}_KERNEL", "force", reset, 4,
        between=lambda: fused_calls.append("marker"),
    )  # fmt: skip
    split = fused_calls.index("marker")
    assert split and not any(c is not None for c in fused_calls[:split])  # plain products
    assert fused == plain
    fused_calls = fused_calls[split + 1 :]
    model = qwen38_backend.load(str(path), dtype="float32")
    opens = 2 * len(model.net.model.layers) + 1  # two gated residuals a layer, the read
    assert sum(c is not None for c in fused_calls) >= 3 * opens  # every step's, from the first


@pytest.mark.slow  # ~10 s a dtype (its last change, the combine's unroll, passes here)
@pytest.mark.parametrize("kv_dtype", [mx.bfloat16, mx.float32])
def test_decode_attention_kernels_match_sdpa(monkeypatch, kv_dtype):
    """The split-KV partial (the fp32-FMA form) and combine kernels on their probe's cases
    (prefix and offset views, a gather, one row, a partial tile, several splits): within
    tolerance of mx.fast.scaled_dot_product_attention; three rows equal one-row calls; paged
    calls equal calls on the gathered rows (the view strides are the contiguous copy's
    here: the emulation passes copies)."""
    if shutil.which("g++") is None:
        pytest.fail("the emulated kernels need g++ on PATH")
    emulate(monkeypatch, decode_attention)
    monkeypatch.setattr(decode_attention, "TENSOR_CORES", False)
    try:
        cases = decode_attention.probe_cases(kv_dtype, kv_dtype, 128, 3)
        for q, k, v, scale in cases:
            got = decode_attention.decode_attention(q, k, v, scale)
            want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
            assert decode_attention.mismatch(got, want) <= 1.0, k.shape
        assert decode_attention.rows_are_steps(*cases[2])
        assert decode_attention.paged_matches(*cases[2], 16)
    finally:
        clear_caches(decode_attention)


@pytest.mark.slow
def test_decode_attention_splits_a_large_group_into_parts(monkeypatch):
    """Flash-Next's 12 query heads a KV head (fp32 K/V of 256: the FMA form holds 8 heads'
    queries) run as two parts of 6, each its own row of blocks over the same K/V: within
    tolerance of mx.fast.scaled_dot_product_attention, and a paged call over blocks of 4
    rows (QSA's selected blocks, a partial last one) equals the call on the gathered rows."""
    if shutil.which("g++") is None:
        pytest.fail("the emulated kernels need g++ on PATH")
    emulate(monkeypatch, decode_attention)
    monkeypatch.setattr(decode_attention, "TENSOR_CORES", False)
    try:
        assert decode_attention.head_parts(12, 256, mx.float32, False) == 2
        keys = mx.random.split(mx.random.key(4), 3)
        k = mx.random.normal((1, 2, 96, 256), key=keys[0])
        v = mx.random.normal((1, 2, 96, 256), key=keys[1])
        q = mx.random.normal((1, 24, 1, 256), key=keys[2])
        for length in (1, 70, 96):
            got = decode_attention.decode_attention(q, k[:, :, :length], v[:, :, :length], 0.0625)
            want = mx.fast.scaled_dot_product_attention(
                q, k[:, :, :length], v[:, :, :length], scale=0.0625
            )
            assert decode_attention.mismatch(got, want) <= 1.0, length
        assert decode_attention.paged_matches(q, k, v, 0.0625, 4)
    finally:
        clear_caches(decode_attention)


# ----- kernels the H200 has run: emulated too (--run-slow), so a CPU-only change to them is
# checked before a GPU sees it -------------------------------------------------------------------
@pytest.mark.slow
def test_qk_norm_rope_kernel_passes_its_probe(monkeypatch):
    """The 27B's gated heads (24 of 256, 4 KV heads, 64 rotary dims) and an ungated,
    interleaved layout: rows equal one-row launches at their positions, within two ulps of
    the op path."""
    emulate(monkeypatch, qk_norm_rope)
    monkeypatch.setenv("QWEN38_QK_KERNEL", "auto")
    try:
        for gated, head_dim, dims, interleaved in ((True, 256, 64, False), (False, 128, 128, True)):
            layout = qk_norm_rope.HeadLayout(
                24, 4, head_dim, gated, 1e-6, dims, 1e7, 1.0, interleaved
            )
            assert qk_norm_rope.available(layout, mx.bfloat16)
    finally:
        clear_caches(qk_norm_rope)


@pytest.mark.slow
@pytest.mark.parametrize(
    "hq, hkv, d, meta",
    [(24, 4, 256, mx.bfloat16), (8, 2, 64, mx.bfloat16), (8, 2, 128, mx.float32)],
)
def test_quest_page_keys_kernel_passes_its_probe(monkeypatch, hq, hkv, d, meta):
    """The page keys of the 27B's heads (24 query, 4 KV heads of 256), of narrower heads and
    of fp32 metadata, shared and per head: the op path's selection, bounds within fp32
    rounding, forced and dead pages alike."""
    emulate(monkeypatch, quest_select)
    try:
        assert quest.kernel_mismatch(hq, hkv, d, mx.bfloat16, meta) is None
    finally:
        clear_caches(quest_select)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["solve", "scan"])
def test_gdn_prefill_kernels_pass_their_probe(monkeypatch, kind):
    """A chunk's solve and scan at the 27B's head widths (Dk = Dv = 128): within fp32
    rounding of the op path."""
    emulate(monkeypatch, gdn_prefill)
    try:
        assert gdn_prefill.probe(kind, 128, 128, 64) is None
    finally:
        clear_caches(gdn_prefill)


@pytest.mark.parametrize("shared", [True, False])
def test_a_quest_selection_fuses_its_two_launches(emulated_select, monkeypatch, shared):
    """With QWEN38_FUSED_KERNEL on, a Quest selection's page keys and top-k run as one
    persistent launch (kernels/fused.py: a grid barrier between them; its probe passes on
    these operands) and pick the pages of the two launches apart: 27B heads, 1,300 live
    pages of a 1,500 capacity."""
    from qwen38_backend.kernels import fused, grid_sync

    for module in (quest_select, fused, grid_sync):
        emulate(monkeypatch, module)
    monkeypatch.setattr(grid_sync, "sm_count", lambda: 2)
    monkeypatch.setenv("QWEN38_QUEST_KERNEL", "force")  # the page keys' probe: its own test
    q, kmin, kmax, n_pages = _quest_operands(4)
    launches = []
    real = fused.launch
    monkeypatch.setattr(fused, "launch", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    mx.disable_compile()  # the emulated kernels run on values, not on a trace's
    try:
        for choice in ("off", "auto"):
            monkeypatch.setenv("QWEN38_FUSED_KERNEL", choice)
            quest.selector.cache_clear()
            fused.agrees.cache_clear()
            got = quest.selector(96, 1, 2, shared)(q, kmin, kmax, n_pages)
            if choice == "off":
                apart = got
                assert not launches
        assert len(launches) == 2  # the probe's, the selection's
        assert got.tolist() == apart.tolist()
    finally:
        mx.enable_compile()
        quest.selector.cache_clear()
        for module in (quest_select, fused, grid_sync):
            clear_caches(module)
