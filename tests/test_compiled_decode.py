"""The compiled single-token step (PreNormBlock / Qwen3.5 DeltaNet blocks) against the same
blocks built op by op: same logits, same greedy stream, and replaced weights are seen."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qwen38_backend.kv import PagedKV
from qwen38_backend.kv.contiguous import ContiguousKV
from qwen38_backend.models.layers import PreNormBlock
from tests.helpers import DENSE_ARCHS
from tests.test_paged_kv import load_dense_net, prompt


@pytest.fixture
def op_by_op(monkeypatch):
    """Call to switch the compiled decode step off for the rest of the test."""
    return lambda: monkeypatch.setattr(PreNormBlock, "compile_decode", False)


def decode_logits(net, ids: list[int], steps: int, factory=ContiguousKV) -> np.ndarray:
    """Prefill ids[:-steps] in one call, then feed the rest one token at a time."""
    state = net.make_state(kv_factory=factory)
    head = ids[:-steps]
    net(mx.array(head), state, last_only=True)
    state.advance(head)
    rows = []
    for token in ids[-steps:]:
        rows.append(net(mx.array([token]), state, last_only=True)[-1])
        state.advance([token])
    return np.array(mx.stack(rows).astype(mx.float32))  # exact for bf16 logits


def tiny_qwen3_5(tmp_path):
    import qwen38_backend
    from qwen38_backend.testing import make_tiny_weights

    path = make_tiny_weights("qwen3_5", tmp_path / "q", seed=5)
    return qwen38_backend.load(str(path), dtype="float32").net


def nets(tmp_path):
    yield from ((arch, load_dense_net(arch)) for arch in DENSE_ARCHS)
    yield "qwen3_5", tiny_qwen3_5(tmp_path)


@pytest.mark.parametrize("factory", [ContiguousKV, lambda: PagedKV(page_tokens=8, budget=24)])
def test_compiled_step_equals_op_by_op(tmp_path, op_by_op, factory):
    """Contiguous store, and the paged one with a Quest budget (sparse from 24 tokens)."""
    ids = prompt(50, 256, seed=1)
    compiled = {name: decode_logits(net, ids, 30, factory) for name, net in nets(tmp_path)}
    op_by_op()
    for name, net in nets(tmp_path):
        reference = decode_logits(net, ids, 30, factory)
        np.testing.assert_allclose(compiled[name], reference, atol=1e-5, rtol=0, err_msg=name)


def test_bf16_compiled_step_equals_op_by_op_bit_for_bit(tmp_path, op_by_op):
    """In bf16 the compiled step (its block outputs and sums held in fp32, exact: no cast
    between the blocks, residual_step) gives the op-by-op blocks' logits bit for bit."""
    import qwen38_backend
    from qwen38_backend.testing import make_tiny_weights

    path = make_tiny_weights("qwen3_5", tmp_path / "q", seed=5, dtype="bfloat16")
    ids = prompt(24, 256, seed=4)
    compiled = decode_logits(qwen38_backend.load(str(path), dtype="bfloat16").net, ids, 6)
    op_by_op()
    reference = decode_logits(qwen38_backend.load(str(path), dtype="bfloat16").net, ids, 6)
    np.testing.assert_array_equal(compiled, reference)


def test_compiled_step_sees_replaced_weights(tmp_path, op_by_op):
    """The step reads the module's current parameters, not the ones it was traced with."""
    net = tiny_qwen3_5(tmp_path)
    ids = prompt(20, net.config.vocab_size, seed=2)
    before = decode_logits(net, ids, 4)
    for block in net.model.layers:
        block.mlp.down_proj.weight = block.mlp.down_proj.weight * 1.5
    after = decode_logits(net, ids, 4)
    assert np.abs(after - before).max() > 1e-3  # the change reached the compiled step
    op_by_op()
    np.testing.assert_allclose(after, decode_logits(net, ids, 4), atol=1e-5, rtol=0)


def tiny_flash_next(tmp_path):
    import qwen38_backend
    from qwen38_backend.testing import make_tiny_weights

    return qwen38_backend.load(str(make_tiny_weights("qwen4_exp", tmp_path / "f", seed=3))).net


def detour_then_decode(net, ids: list[int], steps: int, factory) -> np.ndarray:
    """decode_logits after a detour: the last `steps` tokens are decoded in reverse order
    first, then the state rewinds to the prompt (a save point) and decodes them in order, so
    the QSA index buffers hold stale rows past the visible blocks."""
    state = net.make_state(kv_factory=factory)
    head = ids[:-steps]
    net(mx.array(head), state, last_only=True)
    state.advance(head)
    state.save_point()
    for token in reversed(ids[-steps:]):
        net(mx.array([token]), state, last_only=True)
        state.advance([token])
    state.truncate(len(head))
    rows = []
    for token in ids[-steps:]:
        rows.append(net(mx.array([token]), state, last_only=True)[-1])
        state.advance([token])
    return np.array(mx.stack(rows).astype(mx.float32))  # exact for bf16 logits


def compiled_methods(module) -> set[str]:
    return {key[0] for key in module.__dict__.get("_compiled_methods", {})}  # (method, ...)


@pytest.mark.parametrize("paged", [False, True])
def test_flash_next_compiled_step_equals_op_by_op(tmp_path, monkeypatch, paged):
    """Flash-Next's compiled decode steps (whole Gated DeltaNet layers, each adding the MoE
    output the layer before left; QSA before and after its gather, its selection and block
    pooling; PLE's mixing; the final stream mix) give the
    op-by-op step's logits bit for bit on this CPU: past QSA's dense threshold (the QSA layers
    select), with index buffers grown while decoding (2-row steps: a new compiled selection
    per capacity) and stale rows in them after a rewind. (Both modes run the selection
    compiled, as both run Gated DeltaNet's compiled core: test_qwen4_exp compares it with the
    op-by-op selection and the mask.)"""
    from qwen38_backend.models.qsa import QSAState
    from qwen38_backend.models.qwen4_exp import Qwen4ExpBlock

    monkeypatch.setattr(QSAState, "step", 2)
    net = tiny_flash_next(tmp_path)
    budget = net.model.layers[3].self_attn.n_blocks * net.model.layers[3].self_attn.ratio
    ids = prompt(budget + 40, net.config.vocab_size, seed=3)
    factory = (lambda: PagedKV(page_tokens=8)) if paged else ContiguousKV
    compiled = detour_then_decode(net, ids, 12, factory)
    for block in net.model.layers:  # the compiled pieces did run
        if block.is_linear:
            assert compiled_methods(block) == {"_linear_step"}
        else:
            assert compiled_methods(block) == {"_attention_in", "_attention_out"}
            assert compiled_methods(block.self_attn) == {"pool"}
        if block.has_ple:  # the step before left its MoE for the PLE layer to add
            assert compiled_methods(block.ple) == {"mix"}
            assert compiled_methods(block.attn_hyper_connection) == {"close"}
    # the last layer's MoE is added before the final stream mix
    assert compiled_methods(net.model.hyper_connection_mixer) == {"close", "read"}
    monkeypatch.setattr(Qwen4ExpBlock, "compile_decode", False)
    np.testing.assert_array_equal(compiled, detour_then_decode(net, ids, 12, factory))


def test_flash_next_verify_rows_take_the_compiled_step(tmp_path, monkeypatch):
    """A forward of a few rows (a speculative verify) runs Flash-Next's compiled step graphs,
    as a plain step does (on a GPU the fused graphs round differently from ops built one by
    one, so a verify built op by op could not match the steps: probe_rows_flash_gpu.py),
    past QSA's dense threshold, and gives the op-by-op forward's logits on this CPU."""
    from qwen38_backend.models.qwen4_exp import Qwen4ExpBlock

    net = tiny_flash_next(tmp_path)
    budget = net.model.layers[3].self_attn.n_blocks * net.model.layers[3].self_attn.ratio
    ids = prompt(budget + 40, net.config.vocab_size, seed=5)

    def verify() -> np.ndarray:
        state = net.make_state(kv_factory=ContiguousKV)
        net(mx.array(ids[:-5]), state)  # past STEP_MAX_ROWS: the prefill path
        state.advance(ids[:-5])
        return np.array(net(mx.array(ids[-5:]), state))

    rows = verify()
    attention = next(b for b in net.model.layers if not b.is_linear)
    assert compiled_methods(attention) == {"_attention_in", "_attention_out"}
    assert compiled_methods(net.model.hyper_connection_mixer) == {"close", "read"}
    monkeypatch.setattr(Qwen4ExpBlock, "compile_decode", False)
    np.testing.assert_array_equal(rows, verify())


def zero_centred_norms(net) -> list:
    from qwen38_backend.models.layers import RMSNorm

    return [
        m
        for name, m in net.named_modules()
        if isinstance(m, RMSNorm) and m.zero_centered and not name.startswith("mtp")
    ]  # the MTP head keeps its tensors' layout (fuse_projections)


def test_folded_norms_and_a_weight_set_after(tmp_path, op_by_op):
    """After loading, a zero-centred norm holds 1 + w (fp32) as its parameter (a compiled step
    on a GPU would otherwise derive it every token: test_gpu counts the nodes); a weight set
    after that is the newer and reaches the compiled step, as the op-by-op one."""
    net = tiny_qwen3_5(tmp_path)
    ids = prompt(20, net.config.vocab_size, seed=4)
    norms = zero_centred_norms(net)
    assert norms and all("weight" not in m and m.scale() is m.folded for m in norms)
    folded = decode_logits(net, ids, 4)
    for norm in norms:
        norm.weight = norm.folded - 0.75
    changed = decode_logits(net, ids, 4)
    assert np.abs(changed - folded).max() > 1e-3
    op_by_op()
    np.testing.assert_allclose(changed, decode_logits(net, ids, 4), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_folded_norm_is_exact(dtype):
    """fuse() changes no bit of a zero-centred norm; a weight set after it is seen."""
    from qwen38_backend.models.layers import RMSNorm

    norm = RMSNorm(64, 1e-6, zero_centered=True)
    norm.weight = mx.random.normal((64,), key=mx.random.key(1)).astype(dtype)
    x = mx.random.normal((3, 64), key=mx.random.key(2)).astype(dtype)
    before = norm(x)
    norm.fuse()
    assert "weight" not in norm and norm.folded.dtype == mx.float32
    after = norm(x)
    assert after.dtype == dtype
    assert mx.array_equal(before, after).item()
    norm.weight = mx.zeros((64,), dtype=dtype)
    plain = mx.fast.rms_norm(x.astype(mx.float32), None, 1e-6).astype(dtype)
    assert mx.array_equal(norm(x), plain).item()


@pytest.mark.parametrize("kind", ["linear", "quantized", "embedding"])
def test_product_of_fp32_rows_rounds_them_first(kind):
    """rows.project of a norm's fp32 rows (RMSNorm.for_product) into a half-precision linear
    equals the product of the rows cast to its dtype, bit for bit (a plain fp32 product
    would not: HF's linear sees the cast rows)."""
    import mlx.nn as nn

    from qwen38_backend.models.layers import RMSNorm
    from qwen38_backend.rows import project

    if kind == "embedding":
        table = nn.Embedding(96, 64)
        table.set_dtype(mx.bfloat16)
        linear = table.as_linear
    else:
        linear = nn.Linear(64, 96)
        linear.set_dtype(mx.bfloat16)
        if kind == "quantized":
            linear = nn.QuantizedLinear.from_linear(linear, group_size=32, bits=4)
    norm = RMSNorm(64, 1e-6, zero_centered=True)
    norm.weight = mx.random.normal((64,), key=mx.random.key(3)) * 0.1
    norm.fuse()
    x = mx.random.normal((2, 64), key=mx.random.key(4)).astype(mx.bfloat16)
    wide = norm.for_product(x)
    assert wide.dtype == mx.float32
    got = project(linear, wide)
    assert got.dtype == mx.bfloat16
    assert mx.array_equal(got, project(linear, norm(x))).item()
    assert not mx.array_equal(got, linear(wide).astype(mx.bfloat16)).item()


def test_residual_step_sums_once_per_consumer():
    """residual_step holds s = h + out_proj(a) and its output in the norm's fp32 (no shared
    bf16 sum of its own: the sum fuses with the cast the norm needs, the cast back with the
    last sum: one kernel fewer than the plain form) and gives the plain form's bits (the op
    path; the kernel's epilogues: tests/test_gpu.py)."""
    import mlx.nn as nn

    from qwen38_backend.models.layers import RMSNorm, SwiGLU, residual_step

    norm = RMSNorm(64, 1e-6, zero_centered=True)
    norm.weight = mx.random.normal((64,), key=mx.random.key(5)) * 0.1
    norm.fuse()
    out_proj = nn.Linear(64, 64, bias=False)
    mlp = SwiGLU(64, 128)
    for module in (out_proj, mlp):
        module.set_dtype(mx.bfloat16)
    mlp.fuse()

    def plain(h, a):
        s = h + out_proj(a)
        return s + mlp(norm(s))

    def fused(h, a):
        return residual_step(h, a, out_proj, norm, mlp)

    h, a = (mx.random.normal((1, 64), key=mx.random.key(k)).astype(mx.bfloat16) for k in (7, 8))
    mx.eval(h, a, out_proj.parameters(), mlp.parameters(), norm.parameters())
    got = mx.compile(fused)(h, a)
    assert got.dtype == mx.float32  # the norm's dtype, holding bf16 values
    assert mx.array_equal(got, mx.compile(plain)(h, a).astype(mx.float32)).item()
    assert mx.array_equal(got.astype(mx.bfloat16).astype(mx.float32), got).item()

    def nodes(fn) -> list[str]:
        return _graph_labels(mx.compile(fn)(h, a))

    before, after = nodes(plain), nodes(fused)
    assert before.count("Add") == 2 and "Add" not in after  # the shared sum, the last add
    assert len(after) == len(before) - 1


def test_swiglu_is_one_fused_node():
    """layers.swiglu is compiled: silu(gate) * up reaches the graph as one Compiled node (a
    decorator lost in an edit once made it three kernels a call on a GPU)."""
    from qwen38_backend.models.layers import swiglu

    gate, up = (mx.random.normal((1, 32), key=mx.random.key(k)) for k in (1, 2))
    mx.eval(gate, up)
    labels = _graph_labels(swiglu(gate, up))
    assert len(labels) == 1 and labels[0].startswith("Compiled"), labels


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_sum_fp32_adds_in_fp32_in_order_and_rounds_once(dtype):
    """layers.sum_fp32 (the MoE's weighted sum, the streams' mean): the CPU's own sum bit
    for bit, over a middle or an inner axis; and it rounds once, at the end: 1 and four
    quarter-ulps sum to the next value of the dtype, where a sum rounded add by add (MLX's
    CUDA sum of a half type) stays at 1."""
    from qwen38_backend.models.layers import sum_fp32

    x = (3 * mx.random.normal((6, 10, 64), key=mx.random.key(2))).astype(dtype)
    for axis in (1, -2, -1):
        assert mx.array_equal(sum_fp32(x, axis), x.sum(axis=axis)).item(), axis
    if dtype == mx.float32:
        return
    ulp = 2.0**-7 if dtype == mx.bfloat16 else 2.0**-10
    column = mx.array([1.0] + [ulp / 4] * 4, dtype=dtype)[None, :, None]
    assert sum_fp32(column, 1).item() == 1.0 + ulp
    stepwise = column[:, 0]
    for j in range(1, 5):
        stepwise = stepwise + column[:, j]  # each add rounded to the dtype
    assert stepwise.item() == 1.0


def _graph_labels(out: mx.array) -> list[str]:
    """The primitives of out's graph (mx.export_to_dot's node labels)."""
    import re
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "g.dot"
        mx.export_to_dot(str(path), out)
        return re.findall(r'label\s*=\s*"([^"]+)", shape=rectangle', path.read_text())
