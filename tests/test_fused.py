"""kernels/fused.py under the CPU emulation: launches captured through their modules' own
launch code and run as one persistent launch (phases, grid barriers) give the separate
launches' bits; what cannot be fused is refused before anything runs."""

from __future__ import annotations

import shutil

import mlx.core as mx
import pytest
from cuda_emulator import clear_caches, emulate
from helpers import greedy_off_on, random_gated_residual, random_linear_block
from mlx.utils import tree_flatten, tree_unflatten
from qwen38_backend.kernels import (
    expert_qmv,
    fused,
    gdn_decode,
    grid_sync,
    jit,
    moe_route,
    qk_norm_rope,
    rows_matmul,
    stream_mix,
)

PHASE_MODULES = (stream_mix, rows_matmul, moe_route)


@pytest.fixture
def emulation(monkeypatch):
    """switch(on): the phase modules' kernels emulated (separate launches) or real jit
    Kernels (captured, never launched here); the fused launch is always emulated."""
    if shutil.which("g++") is None:
        pytest.fail("the emulated kernels need g++ on PATH")
    emulate(monkeypatch, fused)
    emulate(monkeypatch, grid_sync)

    def switch(on: bool) -> None:
        for module in PHASE_MODULES:
            if on:
                emulate(monkeypatch, module)
            else:
                monkeypatch.setattr(module, "cuda_kernel", jit.cuda_kernel)
                clear_caches(module)

    yield switch
    for module in (*PHASE_MODULES, fused, grid_sync):
        clear_caches(module)


LAYER_MODULES = (
    stream_mix,
    rows_matmul,
    gdn_decode,
    moe_route,
    expert_qmv,
    qk_norm_rope,
    fused,
    grid_sync,
)


@pytest.fixture
def emulated_layer(monkeypatch):
    """Every step kernel of a Flash-Next layer emulated and forced on (the expert kernels'
    bf16 probe cannot pass on the CPU: kernels/expert_qmv.py), two persistent blocks, the
    fusion probed (auto); afterwards `_restore`."""
    if shutil.which("g++") is None:
        pytest.fail("the emulated kernels need g++ on PATH")
    for module in LAYER_MODULES:
        emulate(monkeypatch, module)
    monkeypatch.setattr(grid_sync, "sm_count", lambda: 2)
    for switch in ("ROWS_KERNEL", "ROWS_EPILOGUES"):
        monkeypatch.setenv(f"QWEN38_{switch}", "force")
    for name in ("STREAM", "GATES", "MIX", "GDN", "ROUTE", "EXPERT", "QK"):
        monkeypatch.setenv(f"QWEN38_{name}_KERNEL", "force")
    monkeypatch.setenv("QWEN38_FUSED_KERNEL", "auto")
    yield
    _restore(monkeypatch)


def _restore(monkeypatch) -> None:
    """Patches undone, the kernels' caches cleared, the products' plan decided again for
    this machine (rows.prepare's plan is process-wide: a forced kernel would outlive us)."""
    from qwen38_backend import rows

    monkeypatch.undo()
    for module in LAYER_MODULES:
        clear_caches(module)
    rows.prepare(mx.float32)


def _gated_residual_open(hc, R, inj, out, then):
    """What a Flash-Next step launches around a mixer: the close with the next residual's
    norm, its down / inject product with the gates, its up product with the mix."""
    L, S = then.lowrank, then.hc_count
    closed, normed = stream_mix.closed_norm(R, inj, out, then.hc_norm.weight, S, then.hc_norm.eps)
    gated = rows_matmul.rows_matmul(normed, then.down_inject_proj.weight, gates=(L, S))
    return closed, normed, gated


def _operands(dtype, hidden=64, streams=4, low_rank=16):
    hc = random_gated_residual(hidden, streams, low_rank, 1e-6, seed=5)
    then = random_gated_residual(hidden, streams, low_rank, 1e-6, seed=7)
    hc.set_dtype(dtype)
    then.set_dtype(dtype)
    keys = mx.random.split(mx.random.key(6), 3)
    R = (2 * mx.random.normal((1, hidden * streams), key=keys[0])).astype(dtype)
    inj = mx.random.normal((1, streams), key=keys[1]).astype(dtype)
    out = mx.random.normal((1, hidden), key=keys[2]).astype(dtype)
    return hc, then, R, inj, out


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("blocks", [1, 3])
def test_a_close_norm_and_two_products_fuse_bit_for_bit(emulation, dtype, blocks):
    """The close + norm, the gated down / inject product and the mixed up product (whose
    input is the first columns of the gated output) as one launch of 1 or 3 blocks (virtual blocks
    in turn) equal the three launches bit for bit, every output, and every block arrived at
    both barriers."""
    hc, then, R, inj, out = _operands(dtype)
    L, S = then.lowrank, then.hc_count
    up = then.input_mix_weight_up.weight

    def build(view):
        closed, normed, gated = _gated_residual_open(hc, R, inj, out, then)
        x = rows_matmul.rows_matmul(view(gated, 0, (1, L)), up, mix=(normed, S))
        return [closed, normed, gated, x]

    emulation(True)
    want = build(fused.whole_view)
    mx.eval(want)
    emulation(False)
    with fused.capture() as taken:
        stand_ins = build(taken.view)
    assert len(taken.phases) == 3
    emulation(True)  # (the fused launch is emulated either way)
    real = fused.launch(taken, blocks)
    got = [real(s) for s in stand_ins]
    assert real.barrier.tolist() == [2 * blocks, 0]
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert mx.array_equal(g, w).item()


def test_the_probe_passes_fused_launches_and_refuses_a_wrong_one(emulation, monkeypatch):
    """agrees(): a composition equal to its launches passes (off unless switched on); one
    whose phase reads its input four values short (a wrong shape constant) is refused with
    a warning."""
    hc, then, R, inj, out = _operands(mx.float32)
    L, S = then.lowrank, then.hc_count
    up = then.input_mix_weight_up.weight

    def build(view):
        # agrees() captures build with the modules as they are: jit Kernels while captured,
        # the emulation while not
        emulation(jit._CAPTURE.get() is None)
        closed, normed, gated = _gated_residual_open(hc, R, inj, out, then)
        x = rows_matmul.rows_matmul(view(gated, 0, (1, L)), up, mix=(normed, S))
        return [closed, normed, gated, x]

    fused.agrees.cache_clear()
    assert not fused.agrees("default", build, blocks=2)  # off by default
    monkeypatch.setenv("QWEN38_FUSED_KERNEL", "auto")
    assert fused.agrees("ok", build, blocks=2)
    monkeypatch.setattr(
        fused,
        "_shape_constants",
        lambda name, shape, body: (
            [f"__device__ constexpr int {name}_shape[] = {{{shape[0]}, {shape[1] - 4}}};"]
            if f"{name}_shape" in body
            else []
        ),
    )
    clear_caches(fused)
    with pytest.warns(UserWarning, match="equal to the separate launches: False"):
        assert not fused.agrees("wrong", build, blocks=2)


def test_what_cannot_fuse_is_refused_before_it_runs(emulation):
    """Phases of different thread counts (a product's 256 beside a kernel of 128), or
    nothing captured, are refused by name."""
    emulation(False)
    x = mx.zeros((1, 64))
    narrow = jit.cuda_kernel(name="narrow", input_names=["x"], output_names=["y"], source="")
    with fused.capture() as taken:
        rows_matmul.rows_matmul(x, mx.zeros((8, 64)))
        narrow(
            inputs=[x],
            grid=(128, 1, 1),
            threadgroup=(128, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.float32],
        )
    with pytest.raises(ValueError, match="one 1-D thread count"):
        fused.launch(taken, 2)
    with fused.capture() as empty:
        pass
    with pytest.raises(ValueError, match="nothing was captured"):
        fused.launch(empty, 2)


@pytest.mark.slow  # ~4 min: every kernel of four generations emulated, twice
def test_flash_next_steps_fuse_their_close_and_open(monkeypatch, tmp_path):
    """A tiny Flash-Next (fp32) decoding with the stream kernels and the product epilogues
    emulated: with QWEN38_FUSED_KERNEL on, every one-row step's close + norm + gated + mixed
    products run as one fused launch where its products take the row-invariant kernel (the
    trunk's; the MTP head's drafts run on the op path), rows of several (prefill, verify)
    run them apart, and the greedy tokens are those of the separate launches."""
    import qwen38_backend
    from qwen38_backend.models.hyper_connections import GatedResidual
    from qwen38_backend.testing import make_tiny_weights

    if shutil.which("g++") is None:
        pytest.fail("the emulated kernels need g++ on PATH")
    for module in (stream_mix, rows_matmul, fused, grid_sync):
        emulate(monkeypatch, module)
    monkeypatch.setattr(grid_sync, "sm_count", lambda: 2)
    for switch in ("ROWS_KERNEL", "ROWS_EPILOGUES", "STREAM_KERNEL", "GATES_KERNEL", "MIX_KERNEL"):
        monkeypatch.setenv(f"QWEN38_{switch}", "force")
    path = make_tiny_weights("qwen4_exp", tmp_path / "flash", dtype="float32")
    prompt = [(3 * i + 5) % 200 + 2 for i in range(7)]
    events = []
    launch, close_then_open = fused.launch, GatedResidual.close_then_open
    monkeypatch.setattr(
        fused, "launch", lambda *a, **kw: events.append("fused") or launch(*a, **kw)
    )

    def recorded_close_then_open(self, R, *args):
        events.append(("open", R.shape[0]))
        return close_then_open(self, R, *args)

    monkeypatch.setattr(GatedResidual, "close_then_open", recorded_close_then_open)

    def reset() -> None:
        for module in (stream_mix, rows_matmul, fused):
            clear_caches(module)

    try:
        separate, together = greedy_off_on(
            monkeypatch, path, prompt, "QWEN38_FUSED_KERNEL", "auto", reset, 4,
            between=lambda: events.append("marker"),
        )  # fmt: skip
    finally:
        _restore(monkeypatch)
    assert together == separate
    split = events.index("marker")
    assert "fused" not in events[:split]  # nothing fused while off
    after = events[split + 1 :]
    # the trunk's last step (one row) opened twice a layer, but for the first layer's and
    # each PLE layer's mixer (nothing left to close: its close ran before), each fused
    blocks = qwen38_backend.load(str(path), dtype="float32").net.model.layers
    opens = 2 * len(blocks) - 1 - sum(b.has_ple for b in blocks)
    assert after[-2 * opens :] == [("open", 1), "fused"] * opens
    for i, e in enumerate(after):  # prefill and verify rows open apart
        if isinstance(e, tuple) and e[1] > 1:
            assert after[i + 1 : i + 2] != ["fused"]


@pytest.mark.slow  # ~4 min: the products and the Gated DeltaNet kernel emulated, twice
def test_27b_steps_fuse_their_layers(monkeypatch, tmp_path):
    """A tiny 27B (fp32, key and value heads of 32) decoding with its products (their norm
    prologues and epilogues) and the Gated DeltaNet kernel emulated: with
    QWEN38_FUSED_KERNEL on, every Gated DeltaNet layer's one-row step runs as one fused
    launch, and every attention layer's from o_proj on, rows of several (prefill, verify)
    apart, and the greedy tokens are those of the launches apart."""
    import qwen38_backend
    from qwen38_backend.models.qwen3_5 import Qwen35Block
    from qwen38_backend.testing import make_tiny_weights

    if shutil.which("g++") is None:
        pytest.fail("the emulated kernels need g++ on PATH")
    modules = (rows_matmul, gdn_decode, fused, grid_sync)
    for module in modules:
        emulate(monkeypatch, module)
    monkeypatch.setattr(grid_sync, "sm_count", lambda: 2)
    for switch in ("ROWS_KERNEL", "ROWS_EPILOGUES", "ROWS_NORM", "GDN_KERNEL"):
        monkeypatch.setenv(f"QWEN38_{switch}", "force")
    for switch in ("GATES_KERNEL", "MIX_KERNEL"):  # Flash-Next's epilogues: not the 27B's
        monkeypatch.setenv(f"QWEN38_{switch}", "off")
    path = make_tiny_weights(
        "qwen3_5", tmp_path / "27b", linear_key_head_dim=32, linear_value_head_dim=32
    )
    prompt = [(3 * i + 5) % 200 + 2 for i in range(7)]
    launches, steps = _count(monkeypatch, fused, "launch"), []

    def recorded(method: str):  # (rows, fused launches in the call)
        real = getattr(Qwen35Block, method)

        def call(self, h, *args):
            before = len(launches)
            out = real(self, h, *args)
            steps.append((h.shape[0], len(launches) - before))
            return out

        monkeypatch.setattr(Qwen35Block, method, call)

    recorded("_linear_step")
    recorded("_attention_out")

    def reset() -> None:
        for module in modules:
            clear_caches(module)

    try:
        separate, together = greedy_off_on(
            monkeypatch, path, prompt, "QWEN38_FUSED_KERNEL", "auto", reset, 4,
            between=lambda: steps.append("marker"),
        )  # fmt: skip
    finally:
        _restore(monkeypatch)
    assert together == separate
    split = steps.index("marker")
    assert all(fused == 0 for _, fused in steps[:split])  # nothing fused while off
    after = steps[split + 1 :]
    layers = qwen38_backend.load(str(path), dtype="float32").net.model.layers
    assert after[-len(layers) :] == [(1, 1)] * len(layers)  # the last token's: one launch each
    assert all(fused == (rows == 1) for rows, fused in after)  # several rows apart


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_phases_sharing_helpers_define_them_once(emulation, dtype):
    """A plain product and a gated one (headers sharing the row helpers, one with MLX's ops
    first) fuse with each helper defined once, and give the two launches' bits; the
    splitting into top-level pieces keeps braces inside literals."""
    keys = mx.random.split(mx.random.key(9), 3)
    x = mx.random.normal((1, 64), key=keys[0]).astype(dtype)
    w = (mx.random.normal((24, 64), key=keys[1]) / 8).astype(dtype)
    wg = (mx.random.normal((20, 64), key=keys[2]) / 8).astype(dtype)

    def build():
        return [rows_matmul.rows_matmul(x, w), rows_matmul.rows_matmul(x, wg, gates=(16, 4))]

    emulation(True)
    want = build()
    mx.eval(want)
    emulation(False)
    with fused.capture() as taken:
        stand_ins = build()
    spec = fused.compose(taken)[0]
    assert spec["header"].count("struct Bytes;") == 1
    assert spec["header"].count("load_x(") == 1
    emulation(True)
    real = fused.launch(taken, 2)
    for s, w_ in zip(stand_ins, want, strict=True):
        assert mx.array_equal(real(s), w_).item()
    units = fused.header_units("namespace a {\nconst char* s = \"{\";\nchar c = '}';\n}\n#x\n")
    assert units == ["namespace a {\nconst char* s = \"{\";\nchar c = '}';\n}\n", "#x\n"]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_a_gated_deltanet_side_fuses_bit_for_bit(emulated_layer, monkeypatch, dtype):
    """A Flash-Next Gated DeltaNet layer's one-row step (key and value heads of 32, the
    kernels' smallest) with the close, its mixer's open and the Gated DeltaNet (in-projection
    split into four views of one output, the kernel, out_proj) as one launch: its probe
    passes (the six launches' outputs fused equal them apart, bit for bit), and in fp32 every
    output of the whole step (streams, MoE side, conv history, recurrent state) equals the
    step with them apart."""
    from qwen38_backend import rows

    block, (R, inj, out, conv, recurrent) = random_linear_block(dtype)
    hc = block.attn_hyper_connection
    with rows.unpadded():
        rows.prepare(dtype)
        block.prepare_decode(dtype)
        # both probes passed: the six launches fused equal them apart, bit for bit
        assert hc._fuse_for and block._fuse_linear_for
        if dtype != mx.float32:
            return  # the step's MoE runs on the op path here: MLX's CPU gather_mm is fp32 only
        launches = []
        real = fused.launch
        monkeypatch.setattr(fused, "launch", lambda *a, **kw: launches.append(1) or real(*a))
        together = block._linear_step(R, inj, out, conv, recurrent)
        mx.eval(together)
        assert len(launches) == 2  # the mixer side, then the MoE side's open
        block._fuse_linear_for = hc._fuse_for = block.mlp_hyper_connection._fuse_for = ""
        apart = block._linear_step(R, inj, out, conv, recurrent)
    assert len(together) == len(apart)
    for a, b in zip(together, apart, strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b).item()


def test_a_moe_side_fuses_bit_for_bit(emulated_layer, monkeypatch):
    """A Flash-Next layer's one-row MoE side (8 experts of 64, 4-bit, 2 a token, its shared
    expert fused into the expert kernels), bf16, with everything emulated: the close, the
    MoE's open, the router product, the routing and the experts' up launch as one launch,
    then the down launch; its probe passes, and every output of the whole step equals the
    step with the launches apart, bit for bit."""
    from qwen38_backend import rows

    dtype = mx.bfloat16
    block, (R, inj, out, conv, recurrent) = random_linear_block(dtype, quantized_moe=True)
    with rows.unpadded():
        rows.prepare(dtype)
        block.prepare_decode(dtype)
        assert block._fuse_moe_for and block._fuse_linear_for  # every probe passed
        launches = _count(monkeypatch, fused, "launch")
        downs = _count(monkeypatch, expert_qmv, "summed")
        together = block._linear_step(R, inj, out, conv, recurrent)
        mx.eval(together)
        assert (len(launches), len(downs)) == (2, 1)  # the mixer side, the MoE side; down
        block._fuse_moe_for = block._fuse_linear_for = ""
        for hc in (block.attn_hyper_connection, block.mlp_hyper_connection):
            hc._fuse_for = ""
        apart = block._linear_step(R, inj, out, conv, recurrent)
    assert len(launches) == 2  # none fused apart
    for a, b in zip(together, apart, strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b).item()


def _count(monkeypatch, module, name: str) -> list:
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def test_a_composition_not_resident_at_two_blocks_an_sm_runs_at_one(emulation, monkeypatch):
    """The probe tries BLOCKS_PER_SM (2) blocks an SM first; where a barrier wait gives up
    (here: a barrier made to wait for one block more whenever the grid has more than 2, as
    when a block cannot be resident), it runs the composition at one an SM, and launches of
    it take that count."""
    hc, then, R, inj, out = _operands(mx.float32)
    L, S = then.lowrank, then.hc_count
    up = then.input_mix_weight_up.weight
    monkeypatch.setattr(grid_sync, "sm_count", lambda: 2)
    crowded = grid_sync.GRID_BARRIER.replace(
        "passed * blocks", "passed * blocks + (blocks > 2 ? 1u : 0u)"
    ).replace(  # a crowded grid gives up soon; the one at one an SM keeps the whole limit
        f"{grid_sync.SPIN_LIMIT}u", f"(blocks > 2 ? 2000u : {grid_sync.SPIN_LIMIT}u)"
    )
    monkeypatch.setattr(grid_sync, "GRID_BARRIER", crowded)
    monkeypatch.setenv("QWEN38_FUSED_KERNEL", "auto")

    def build(view):
        emulation(jit._CAPTURE.get() is None)
        closed, normed, gated = _gated_residual_open(hc, R, inj, out, then)
        return [closed, rows_matmul.rows_matmul(view(gated, 0, (1, L)), up, mix=(normed, S))]

    fused.agrees.cache_clear()
    assert fused.agrees("crowded", build)
    (per_sm,) = fused._PER_SM.values()
    assert per_sm == 1
    emulation(False)
    with fused.capture() as taken:
        build(taken.view)
    emulation(True)
    assert fused.launch(taken).barrier.tolist() == [2 * 2, 0]  # 2 blocks, 2 barriers, no give-up


def _random_27b_block(dtype, kind: str, **config):
    """A 27B block of `kind` (the tiny config with Gated DeltaNet key and value heads of 32,
    its kernel's smallest; `config`: more overrides) with random weights in `dtype` (the
    norms' too), fused as loaded."""
    from qwen38_backend.config import Qwen35Config
    from qwen38_backend.models.layers import fuse_projections
    from qwen38_backend.models.qwen3_5 import Qwen35Block
    from qwen38_backend.testing.tiny_qwen3_5 import text_config

    heads = {"linear_key_head_dim": 32, "linear_value_head_dim": 32, **config}
    cfg = Qwen35Config.from_dict(text_config(**heads))
    mx.random.seed(7)
    block = Qwen35Block(cfg, kind)
    for name, value in tree_flatten(block.parameters()):  # norms off their ones
        if "norm" in name:
            block.update(tree_unflatten([(name, 0.3 * mx.random.normal(value.shape))]))
    block.set_dtype(dtype)
    fuse_projections(block)
    return block


def _random_27b_linear_block(dtype):
    """A 27B Gated DeltaNet block (_random_27b_block) and a one-row step's conv history and
    recurrent state."""
    from qwen38_backend.config import LINEAR

    block = _random_27b_block(dtype, LINEAR)
    mixer = block.linear_attn
    keys = mx.random.split(mx.random.key(8), 2)
    conv = mx.random.normal((mixer.conv_kernel - 1, mixer.conv_dim), key=keys[0]).astype(dtype)
    shape = (mixer.n_v_heads, mixer.v_head_dim, mixer.k_head_dim)
    return block, conv, 0.1 * mx.random.normal(shape, key=keys[1])


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_a_27b_gated_deltanet_layer_fuses_bit_for_bit(emulated_layer, monkeypatch, dtype):
    """A 27B Gated DeltaNet block's one-row step (the input norm, the in-projection, the
    Gated DeltaNet kernel, out_proj with the residual, the post-mixer norm, gate / up with
    the swiglu, down with the residual) as one launch: its probe passes for block inputs of
    fp32 (the layers after the first) and of the model's dtype (the first), and every output
    of the step (the block's output, conv history, recurrent state) equals the step with its
    launches apart (the norms in the products' prologues), bit for bit."""
    from qwen38_backend import rows

    monkeypatch.setenv("QWEN38_ROWS_NORM", "force")
    block, conv, recurrent = _random_27b_linear_block(dtype)
    H = block.linear_attn.out_proj.weight.shape[0]
    h = 2 * mx.random.normal((1, H), key=mx.random.key(9))
    launches = _count(monkeypatch, fused, "launch")
    norms = _count(monkeypatch, rows_matmul, "norm_rows")
    with rows.unpadded():
        rows.prepare(dtype)
        for rows_in in {mx.float32, dtype}:
            x = h.astype(rows_in)
            block._decide_fusion(rows_in)
            assert str(rows_in) in block._fuse_linear_for  # the probe passed
            launches.clear(), norms.clear()
            together = block._linear_step(x, conv, recurrent)
            mx.eval(together)
            assert (len(launches), len(norms)) == (1, 2)  # both norms phases of their own
            block._fuse_linear_for = frozenset()
            apart = block._linear_step(x, conv, recurrent)
            mx.eval(apart)
            assert (len(launches), len(norms)) == (1, 2)  # apart: in the prologues
            assert len(together) == len(apart) == 4
            for a, b in zip(together, apart, strict=True):
                assert a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item()


def test_a_27b_layer_stays_apart_where_its_norms_are_ops(emulated_layer, monkeypatch):
    """With the norm prologue off (QWEN38_ROWS_NORM's default), the step norms its rows as
    ops, which a fused launch cannot hold: the probe refuses nothing, there is nothing to
    fuse, and the step runs apart."""
    from qwen38_backend import rows

    monkeypatch.setenv("QWEN38_ROWS_NORM", "off")
    block, conv, recurrent = _random_27b_linear_block(mx.float32)
    with rows.unpadded():
        rows.prepare(mx.float32)
        block._decide_fusion(mx.float32)
    assert block._fusion_decided == {str(mx.float32)} and not block._fuse_linear_for


@pytest.mark.parametrize("dtype", [mx.bfloat16])  # (fp32 rows: the Gated DeltaNet test's)
def test_a_27b_attention_output_fuses_bit_for_bit(emulated_layer, monkeypatch, dtype):
    """A 27B attention block's one-row step after its attention (o_proj with the residual,
    the post-attention norm, gate / up with the swiglu, down with the residual) as one
    launch: its probe passes, and the block's output equals the step with its launches apart,
    bit for bit (the attention's gate applied first, as ops, in both)."""
    from qwen38_backend import rows
    from qwen38_backend.config import FULL

    monkeypatch.setenv("QWEN38_ROWS_NORM", "force")
    block = _random_27b_block(dtype, FULL)
    attn = block.self_attn
    heads, width = attn.n_heads, attn.head_dim
    keys = mx.random.split(mx.random.key(10), 3)
    H = attn.o_proj.weight.shape[0]
    h = 2 * mx.random.normal((1, H), key=keys[0])
    out = mx.random.normal((1, heads, 1, width), key=keys[1]).astype(dtype)
    gate = mx.random.normal((1, heads * width), key=keys[2]).astype(dtype)
    launches = _count(monkeypatch, fused, "launch")
    with rows.unpadded():
        rows.prepare(dtype)
        for rows_in in (mx.float32,):  # its input: the layers before add in fp32
            x = h.astype(rows_in)
            block.self_attn.prepare_decode()
            block._decide_fusions(rows_in)
            assert str(rows_in) in block._fuse_out_for  # the probe passed
            launches.clear()
            together = block._attention_out(x, out, gate)
            mx.eval(together)
            assert len(launches) == 1
            block._fuse_out_for = frozenset()
            apart = block._attention_out(x, out, gate)
            assert len(launches) == 1
            assert together.dtype == apart.dtype and mx.array_equal(together, apart).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16])  # (fp32 rows: the Gated DeltaNet test's)
def test_a_27b_attention_input_fuses_bit_for_bit(emulated_layer, monkeypatch, dtype):
    """A 27B attention block's one-row q/k/v side (the input norm, the fused q/k/v product,
    the q/k norm + RoPE kernel; heads of 256, the products' block) as one launch: its probe
    passes, and q, k, v and the gate equal the step's with its launches apart, bit for bit."""
    from qwen38_backend import rows
    from qwen38_backend.config import FULL

    monkeypatch.setenv("QWEN38_ROWS_NORM", "force")
    heads = {"head_dim": 256, "num_attention_heads": 2, "mrope_section": [16, 8, 8]}
    block = _random_27b_block(dtype, FULL, **heads)
    H = block.self_attn.o_proj.weight.shape[0]
    h = 2 * mx.random.normal((1, H), key=mx.random.key(11))
    offset = mx.array(29, dtype=mx.int32)
    launches = _count(monkeypatch, fused, "launch")
    with rows.unpadded():
        rows.prepare(dtype)
        block.self_attn.prepare_decode()
        for rows_in in (mx.float32,):  # its input: the layers before add in fp32
            x = h.astype(rows_in)
            block._decide_fusions(rows_in)
            assert str(rows_in) in block._fuse_in_for  # the probe passed
            launches.clear()
            together = block._attention_in(x, offset)
            mx.eval(together)
            assert len(launches) == 1
            block._fuse_in_for = frozenset()
            apart = block._attention_in(x, offset)
            assert len(launches) == 1 and len(together) == len(apart) == 4
            for a, b in zip(together, apart, strict=True):
                assert a.shape == b.shape and mx.array_equal(a, b).item()


def test_a_qsa_input_side_fuses_bit_for_bit(emulated_layer, monkeypatch):
    """A Flash-Next QSA layer's one-row input side (the close, the attention's gated residual
    open, the indexer's product, the q/k/v product and the q/k norm + RoPE kernel; heads of
    256, the products' block), bf16, as one launch: its probe passes, and every output of
    the step's compiled input part (streams, inject weights, indexer queries and keys, q, k,
    v, gate) equals the launches apart, bit for bit."""
    from helpers import random_qsa_block

    from qwen38_backend import rows

    dtype = mx.bfloat16
    block = random_qsa_block(dtype)
    hc = block.attn_hyper_connection
    R, unclosed = hc.step_operands(dtype, 13)
    offset = mx.array(41, dtype=mx.int32)
    launches = _count(monkeypatch, fused, "launch")
    with rows.unpadded():
        rows.prepare(dtype)
        block.prepare_decode(dtype)
        assert block._fuse_attention_for == str(dtype)  # the probe passed
        launches.clear()
        together = block._attention_in(R, offset, *unclosed)
        mx.eval(together)
        assert len(launches) == 1
        block._fuse_attention_for = hc._fuse_for = ""
        apart = block._attention_in(R, offset, *unclosed)
    assert len(launches) == 1 and len(together) == len(apart) == 8
    for a, b in zip(together, apart, strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b).item()
