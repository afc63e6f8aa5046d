"""Every CUDA kernel's source compiles with a local nvcc (sm_90), in the variants the engine
launches, before any device run: each module's `cuda_kernel` is replaced by a recorder, and
the recorded body goes into a stand-in of the signature MLX generates (its inputs typed;
`<name>_shape`, `_strides` and `_ndim` where the body reads them; template constants at the
top) with stand-ins of the MLX device ops the product epilogues use. Why: a kernel that fails
to compile only shows on the H200, where its probe then falls back to the op path (session
27: the ungated q/k kernel named an output it did not have). Opt in with --run-nvcc (needs
nvcc on PATH)."""

from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import pytest
from qwen38_backend.kernels import (
    decode_attention,
    expert_qmv,
    gdn_decode,
    gdn_prefill,
    grid_sync,
    jit,
    moe_route,
    qk_norm_rope,
    quest_select,
    rows_matmul,
    stream_mix,
    top_select,
)
from qwen38_backend.kernels.fused import C_TYPES, template_constant

pytestmark = pytest.mark.nvcc

MODULES = (
    decode_attention,
    expert_qmv,
    grid_sync,
    gdn_decode,
    gdn_prefill,
    moe_route,
    qk_norm_rope,
    quest_select,
    top_select,
    rows_matmul,
    stream_mix,
)
# every cached kernel factory: cleared before and after, so no recorder result outlives a test
FACTORIES = (
    decode_attention._partial_kernel,
    decode_attention._partial_kernel_mma,
    decode_attention._combine_kernel,
    expert_qmv._up_kernel,
    expert_qmv._down_kernel,
    gdn_decode._kernel,
    gdn_prefill._scan_kernel,
    gdn_prefill._solve_kernel,
    grid_sync._chain_kernel,
    grid_sync._phase_kernel,
    grid_sync._sms_kernel,
    moe_route._kernel,
    qk_norm_rope._kernel,
    top_select._kernel,
    quest_select._keys_kernel,
    rows_matmul._kernel,
    rows_matmul._norm_kernel,
    stream_mix._norm_kernel,
    stream_mix._gates_kernel,
    stream_mix._mix_kernel,
)
# what MLX's headers give the product epilogues (binary_ops.cuh, unary_ops.cuh), in shape only
MLX_OPS = """
namespace mlx::core::cu {
struct Add { template <typename T> __device__ T operator()(T a, T b) { return a + b; } };
struct Multiply { template <typename T> __device__ T operator()(T a, T b) { return a * b; } };
struct Divide { template <typename T> __device__ T operator()(T a, T b) { return a / b; } };
struct Sigmoid {
  template <typename T> __device__ T operator()(T x) {
    return T(1.0f / (1.0f + expf(-static_cast<float>(x))));
  }
};
}
"""


@pytest.fixture
def recorded(monkeypatch) -> dict:
    """kernel name -> what the module handed cuda_kernel (body, header, names)."""
    if shutil.which("nvcc") is None:
        pytest.fail("--run-nvcc needs nvcc on PATH")
    seen: dict = {}

    def record(*, source, header="", name, input_names, output_names, **_):
        seen[name] = {
            "body": jit.compact(source),
            "header": jit.compact(header),
            "inputs": input_names,
            "outputs": output_names,
        }
        return name

    for module in MODULES:
        monkeypatch.setattr(module, "cuda_kernel", record)
    for factory in FACTORIES:
        factory.cache_clear()
    yield seen
    for factory in FACTORIES:
        factory.cache_clear()


def compiles(tmp_path, kernel: dict, types: dict, template: list) -> None:
    """nvcc compiles `kernel` with these argument types (name -> C type) and constants."""
    args = []
    for name in kernel["inputs"]:
        args.append(f"const {types[name]}* {name}")
        if f"{name}_shape" in kernel["body"]:
            args.append(f"const int* {name}_shape")
        if f"{name}_strides" in kernel["body"]:
            args.append(f"const int64_t* {name}_strides")
        if f"{name}_ndim" in kernel["body"]:
            args.append(f"int {name}_ndim")
    args += [f"{types[name]}* {name}" for name in kernel["outputs"]]
    constants = [template_constant(name, value) for name, value in template]
    lines = kernel["header"].splitlines()
    header = "\n".join(line for line in lines if not line.startswith('#include "mlx/'))
    # MLX's device ops only where the kernel includes them (a kernel naming them without
    # the include would not compile on the GPU)
    ops = MLX_OPS if any(line.startswith('#include "mlx/') for line in lines) else ""
    text = "\n".join(
        [
            "#include <cuda_bf16.h>",
            "#include <cuda_fp16.h>",
            "#include <cstdint>",
            ops,
            header,
            "namespace mlx::core::cu {",
            f"__global__ void kernel({', '.join(args)}) {{",
            *constants,
            kernel["body"],
            "}",
            "}",
        ]
    )
    path = tmp_path / "kernel.cu"
    path.write_text(text)
    run = subprocess.run(
        ["nvcc", "-std=c++17", "-arch=sm_90", "-c", str(path), "-o", str(tmp_path / "k.o")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[:4000]


BF16 = C_TYPES[mx.bfloat16]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize(
    "spec", [(16, 48, 128, 128, 4, 1e-6, "silu"), (2, 4, 64, 32, 4, 1e-6, "sigmoid")]
)
def test_gdn_decode_compiles(recorded, tmp_path, dtype, spec):
    gdn_decode._kernel(spec)
    (kernel,) = recorded.values()
    t = C_TYPES[dtype]
    types = {n: t for n in kernel["inputs"] + kernel["outputs"]}
    types.update(S="float", S_out="float")
    compiles(tmp_path, kernel, types, [("T", dtype)])


@pytest.mark.parametrize("epilogue", ["", "residual", "swiglu", "gates", "mix"])
@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("norm", [False, True])
def test_rows_matmul_compiles(recorded, tmp_path, epilogue, staged, norm):
    rows_matmul._kernel(staged, 4096, epilogue, 1e-6 if norm else None)
    (kernel,) = recorded.values()
    rows = 3 if staged else 1
    walk = [("S", 4)] if staged else [("U", 4)]
    for x_dtype in (mx.bfloat16, mx.float32):
        for in_shared in (False, True):
            types = {"x": C_TYPES[x_dtype], "w": BF16, "scale": "float", "res": "float", "y": BF16}
            types["streams"] = BF16
            template = [
                ("T", mx.bfloat16),
                ("X", x_dtype),
                ("C", 8),
                ("SWIGLU", epilogue == "swiglu"),
            ]
            template += [("O", mx.float32)] if epilogue == "residual" else []
            template += [("GL", 320), ("GS", 4)] if epilogue == "gates" else []
            template += [("MS", 4)] if epilogue == "mix" else []
            nw = 4 if epilogue == "mix" else 2
            template += [("R", rows), ("NW", nw), ("KS", 4), ("XS", in_shared), ("XO", 0), *walk]
            compiles(tmp_path, kernel, types, template)


def test_rows_norm_kernel_compiles(recorded, tmp_path):
    rows_matmul._norm_kernel(1e-6)
    (kernel,) = recorded.values()
    types = {"x": "float", "scale": "float", "y": BF16}
    compiles(tmp_path, kernel, types, [("T", mx.bfloat16), ("X", mx.float32)])


@pytest.mark.parametrize("form", ["fma", "mma", "mma8"])
def test_decode_attention_compiles(recorded, tmp_path, form):
    if form.startswith("mma"):  # mma8: 8 warps a block, one tile in flight each
        decode_attention._partial_kernel_mma(mx.bfloat16, 256, 6, 8 if form == "mma8" else 4)
    else:
        decode_attention._partial_kernel(mx.bfloat16, 256, 6)
    decode_attention._combine_kernel()
    partial = recorded[f"qwen38_decode_attention_partial{'_mma' if form != 'fma' else ''}"]
    types = {"q": "float" if form == "fma" else BF16, "k": BF16, "v": BF16, "scale": "float"}
    types.update(splits="int32_t", pages="int32_t", n_keys="int32_t")
    types.update(o_part="float", m_part="float", l_part="float")
    for paged, sub in ((0, 1), (16, 1), (4, 2)):  # (4, 2): Flash-Next's QSA blocks
        template = [("T", mx.bfloat16), ("D", 256), ("G", 6), ("SUB", sub), ("P", paged)]
        compiles(tmp_path, partial, types, template)
    types = {"o_part": "float", "m_part": "float", "l_part": "float", "splits": "int32_t"}
    types["out"] = BF16
    combine = recorded["qwen38_decode_attention_combine"]
    compiles(tmp_path, combine, types, [("O", mx.bfloat16), ("D", 256), ("G", 6)])


@pytest.mark.parametrize("gated", [True, False])
def test_qk_norm_rope_compiles(recorded, tmp_path, gated):
    head_dim = 256 if gated else 128
    layout = qk_norm_rope.HeadLayout(
        24, 4, head_dim, gated, 1e-6, 64 if gated else 128, 1e7, 1.0, not gated
    )
    qk_norm_rope._kernel(layout)
    (kernel,) = recorded.values()
    types = {"qkv": BF16, "q_scale": "float", "k_scale": "float", "offset": "int32_t"}
    types.update(q=BF16, k=BF16, gate=BF16)
    compiles(tmp_path, kernel, types, [("T", mx.bfloat16)])


def test_quest_page_keys_compile(recorded, tmp_path):
    quest_select._keys_kernel()
    (kernel,) = recorded.values()
    types = {"q": BF16, "kmin": BF16, "kmax": BF16, "counts": "int32_t", "keys": "uint64_t"}
    for shared in (0, 1):
        template = [("M", mx.bfloat16), ("HKV", 4), ("GROUP", 6), ("D", 256), ("SINKS", 1)]
        template += [("RECENT", 2), ("SHARED", shared)]
        compiles(tmp_path, kernel, types, template)


def test_top_select_compiles(recorded, tmp_path):
    top_select._kernel(False)
    top_select._kernel(True)
    qsa, quest = recorded["qwen38_qsa_select"], recorded["qwen38_top_keys"]
    types = {"scores": "float", "tail": "int32_t", "tokens": "int32_t", "keys": "uint64_t"}
    # Flash-Next's 2,048-token budget in blocks of 4, with a causal tail or none
    for tail in (0, 3):
        compiles(tmp_path, qsa, types, [("N_SEL", 512), ("RATIO", 4), ("TAIL", tail)])
    # the 27B's 2,048-token Quest budget in pages of 16
    compiles(tmp_path, quest, types, [("N_SEL", 128), ("RATIO", 1), ("TAIL", 0)])


@pytest.mark.parametrize("kind", ["solve", "scan"])
def test_gdn_prefill_compiles(recorded, tmp_path, kind):
    factory = gdn_prefill._solve_kernel if kind == "solve" else gdn_prefill._scan_kernel
    factory(64, 128, 128)
    (kernel,) = recorded.values()
    types = {n: "float" for n in kernel["inputs"] + kernel["outputs"]}
    compiles(tmp_path, kernel, types, [])


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_expert_kernels_compile(recorded, tmp_path, dtype):
    expert_qmv._up_kernel()
    expert_qmv._up_kernel(True)
    for shared in ("", "values", "weights"):
        expert_qmv._down_kernel(shared)
    t = C_TYPES[dtype]
    types = {"x": t, "h": t, "out": t, "scales": t, "biases": t, "weights": "float"}
    types.update(shared=t, shared_gate=t, shared_gate_up=t, shared_down=t)
    types.update(inds="uint32_t", w="uint32_t")
    # Flash-Next's experts: hidden 2560, intermediate 640, groups of 64, 10 a token
    template = [("T", dtype), ("H", 2560), ("I", 640), ("G", 64), ("KT", 10)]
    for name, kernel in recorded.items():
        pairs = 11 if name.endswith("_shared") or name.endswith("_weights") else 10
        compiles(tmp_path, kernel, types, [*template, ("PAIRS", pairs)])


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("normalize", [True, False])
def test_moe_route_compiles(recorded, tmp_path, dtype, normalize):
    moe_route._kernel()
    (kernel,) = recorded.values()
    types = {"logits": C_TYPES[dtype], "inds": "uint32_t", "weights": "float"}
    # Flash-Next's router: 512 experts, 10 a token; and a width that is not whole lanes
    for experts, k in ((512, 10), (40, 3)):
        template = [("T", dtype), ("E", experts), ("KT", k), ("NORM", normalize)]
        compiles(tmp_path, kernel, types, template)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_stream_mix_compiles(recorded, tmp_path, dtype):
    stream_mix._norm_kernel(1e-6)
    stream_mix._norm_kernel(1e-6, True)
    stream_mix._gates_kernel(True)
    stream_mix._gates_kernel(False)
    stream_mix._mix_kernel()
    t = C_TYPES[dtype]
    # Flash-Next's streams: 4 of 2560, low rank 320
    for name, kernel in recorded.items():
        types = {n: t for n in kernel["inputs"] + kernel["outputs"]}
        template = [("T", dtype), ("H", 2560), ("S", 4), ("L", 320)]
        template.append(("INJ", 4 if name.endswith("_inject") else 0))
        compiles(tmp_path, kernel, types, template)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_grid_sync_kernels_compile(recorded, tmp_path, dtype):
    grid_sync._chain_kernel()
    grid_sync._phase_kernel()
    grid_sync._sms_kernel()
    t = C_TYPES[dtype]
    for name, kernel in recorded.items():
        types = {n: t for n in kernel["inputs"] + kernel["outputs"]}
        types.update(
            barrier="uint32_t",
            report="uint32_t",
            sms="uint32_t",
            x=t if name != "qwen38_grid_sms" else "float",
        )
        template = [("T", dtype)]
        if name == "qwen38_grid_chain":  # the low-rank pair's shapes, work and barriers alone
            for work in (True, False):
                compiles(
                    tmp_path,
                    kernel,
                    types,
                    [*template, ("P", 8), ("N", 320), ("K", 10240), ("WORK", work)],
                )
        else:
            compiles(tmp_path, kernel, types, template)


def _real_kernels(monkeypatch, *modules):
    """kernels/fused.py, with `modules` making real jit Kernels to capture (nvcc on PATH)."""
    if shutil.which("nvcc") is None:
        pytest.fail("--run-nvcc needs nvcc on PATH")
    from qwen38_backend.kernels import fused

    for module in modules:
        monkeypatch.setattr(module, "cuda_kernel", jit.cuda_kernel)
    for factory in FACTORIES:
        factory.cache_clear()
    return fused


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("side", ["open", "gated deltanet", "moe"])
def test_fused_flash_next_launches_compile(tmp_path, monkeypatch, dtype, side):
    """kernels/fused.py's compositions at Flash-Next's shapes (4 streams of 2560, low rank
    320; Gated DeltaNet 16 / 48 heads of 128): a step's close + norm, gated down / inject
    product and mixed up product ("open"), and with the layer's in-projection, Gated DeltaNet
    kernel (its inputs four views of one output) and out_proj ("gated deltanet"): the
    phases as device functions, their constants in namespaces, grid barriers between them;
    "moe": the open with the router product (512 experts + the shared gate), the routing
    kernel (its inputs views of that output) and the experts' up launch (4-bit, 10 a
    token, 640 wide, the shared expert's pair last)."""
    fused = _real_kernels(monkeypatch, stream_mix, rows_matmul, gdn_decode, moe_route, expert_qmv)
    H, S, L = 2560, 4, 320
    hk, hv, d = 16, 48, 128
    conv_dim, value_dim = 2 * hk * d + hv * d, hv * d

    def zeros(*shape, dt=dtype):
        return mx.zeros(shape, dt)

    with fused.capture() as taken:
        closed, normed = stream_mix.closed_norm(
            zeros(1, S * H), zeros(1, S), zeros(1, H), zeros(S * H), S, 1e-6
        )
        gated = rows_matmul.rows_matmul(normed, zeros(L + S, S * H), gates=(L, S))
        x = rows_matmul.rows_matmul(taken.view(gated, 0, (1, L)), zeros(S * H, L), mix=(normed, S))
        if side == "gated deltanet":
            y = rows_matmul.rows_matmul(x, zeros(conv_dim + value_dim + 2 * hv, H))
            parts, at = [], 0
            for size in (conv_dim, value_dim, hv, hv):
                parts.append(taken.view(y, at, (1, size)))
                at += size
            o, _, _ = gdn_decode.gdn_decode_rows(
                *parts, zeros(3, conv_dim), zeros(conv_dim, 4), zeros(hv), zeros(hv),
                zeros(hv, d, d, dt=mx.float32), zeros(d), spec=(hk, hv, d, d, 1e-6, "sigmoid"),
            )  # fmt: skip
            rows_matmul.rows_matmul(o, zeros(H, value_dim))
        if side == "moe":
            E, k, inter, g = 512, 10, 640, 64
            y = rows_matmul.rows_matmul(x, zeros(E + 1, H))
            inds, _ = moe_route.route(taken.view(y, 0, (1, E)), k, True)
            stack = {
                "weight": zeros(E, 2 * inter, H // 8, dt=mx.uint32),
                "scales": zeros(E, 2 * inter, H // g),
                "biases": zeros(E, 2 * inter, H // g),
            }
            expert_qmv.activations(x, inds, stack, g, zeros(2 * inter, H))
    _compiles_fused(tmp_path, fused, taken)


def _compiles_fused(tmp_path, fused, taken) -> None:
    """nvcc compiles the fused kernel of these captured launches."""
    spec, inputs, _, _ = fused.compose(taken)
    dtypes = [a.dtype for a in inputs] + [mx.uint32]  # the barrier's state
    dtypes += [d for p in taken.phases for d in p.call["output_dtypes"]] + [mx.uint32]
    names = spec["input_names"] + spec["output_names"]
    kernel = {
        "body": spec["source"],
        "header": spec["header"],
        "inputs": spec["input_names"],
        "outputs": spec["output_names"],
    }
    compiles(tmp_path, kernel, {n: C_TYPES[d] for n, d in zip(names, dtypes, strict=True)}, [])
    for factory in FACTORIES:
        factory.cache_clear()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_a_fused_27b_gated_deltanet_layer_compiles(tmp_path, monkeypatch, dtype):
    """kernels/fused.py's composition of a 27B Gated DeltaNet block's one-row step at its
    shapes (hidden 5120, Gated DeltaNet 16 / 48 heads of 128, intermediate 17408): the input
    norm, the in-projection (its output four views for the kernel), the Gated DeltaNet
    kernel, out_proj with the fp32 residual, the post-mixer norm, gate / up with the swiglu,
    down with the residual (Qwen35Block._linear_launches)."""
    fused = _real_kernels(monkeypatch, rows_matmul, gdn_decode)
    H, inter, hk, hv, d = 5120, 17408, 16, 48, 128
    conv_dim, value_dim = 2 * hk * d + hv * d, hv * d

    def zeros(*shape, dt=dtype):
        return mx.zeros(shape, dt)

    scale = zeros(H, dt=mx.float32)
    with fused.capture() as taken:
        h = zeros(1, H, dt=mx.float32)
        y = rows_matmul.rows_matmul(
            rows_matmul.norm_rows(h, scale, 1e-6, dtype), zeros(conv_dim + value_dim + 2 * hv, H)
        )
        parts, at = [], 0
        for size in (conv_dim, value_dim, hv, hv):
            parts.append(taken.view(y, at, (1, size)))
            at += size
        o, _, _ = gdn_decode.gdn_decode_rows(
            *parts, zeros(3, conv_dim), zeros(conv_dim, 4), zeros(hv), zeros(hv),
            zeros(hv, d, d, dt=mx.float32), zeros(d), spec=(hk, hv, d, d, 1e-6, "silu"),
        )  # fmt: skip
        s = rows_matmul.rows_matmul(o, zeros(H, value_dim), residual=h, dtype=mx.float32)
        normed = rows_matmul.norm_rows(s, scale, 1e-6, dtype)
        act = rows_matmul.rows_matmul(normed, zeros(2 * inter, H), swiglu=True)
        rows_matmul.rows_matmul(act, zeros(H, inter), residual=s, dtype=mx.float32)
    assert len(taken.phases) == 7
    _compiles_fused(tmp_path, fused, taken)


@pytest.mark.parametrize("shared", [True, False])
def test_a_fused_quest_selection_compiles(tmp_path, monkeypatch, shared):
    """kernels/fused.py's composition of a Quest selection at the 27B's shapes (24 query
    heads, 4 KV heads of 256, bf16 metadata of 8,192 pages, 2,048 tokens of pages of 16):
    the page keys at the top-k's 1,024 threads, then the top-k (kv/quest.py's `together`)."""
    fused = _real_kernels(monkeypatch, quest_select, top_select)
    meta = mx.zeros((4, 8192, 256), mx.bfloat16)
    with fused.capture() as taken:
        keys = quest_select.page_keys(
            mx.zeros((24, 256), mx.bfloat16), meta, meta, mx.array(8000, mx.int32), 1, 2,
            shared, threads=top_select.THREADS,
        )  # fmt: skip
        top_select.top_ids(keys, 128)
    assert len(taken.phases) == 2
    _compiles_fused(tmp_path, fused, taken)


@pytest.mark.parametrize("model", ["27b", "flash"])
def test_a_fused_attention_input_side_compiles(tmp_path, monkeypatch, model):
    """kernels/fused.py's composition of an attention layer's one-row input side at the real
    shapes, bf16: the 27B's input norm, q/k/v product (24 gated heads and 4 KV heads of 256)
    and q/k norm + RoPE kernel (PreNormBlock._attention_in); Flash-Next's close, gated
    residual open (4 streams of 2,560, low rank 320), indexer product (4 heads + a key of
    128), q/k/v product (24 gated heads, 2 KV heads of 256) and q/k kernel
    (Qwen4ExpBlock._attention_in_launches)."""
    fused = _real_kernels(monkeypatch, stream_mix, rows_matmul, qk_norm_rope)
    dtype = mx.bfloat16

    def zeros(*shape, dt=dtype):
        return mx.zeros(shape, dt)

    heads, kv, d = 24, 4 if model == "27b" else 2, 256
    H = 5120 if model == "27b" else 2560
    layout = qk_norm_rope.HeadLayout(heads, kv, d, True, 1e-6, 64, 1e7, 1.0, False)
    with fused.capture() as taken:
        if model == "27b":
            x = rows_matmul.norm_rows(
                zeros(1, H, dt=mx.float32), zeros(H, dt=mx.float32), 1e-6, dtype
            )
        else:
            S, L = 4, 320
            _, normed = stream_mix.closed_norm(
                zeros(1, S * H), zeros(1, S), zeros(1, H), zeros(S * H), S, 1e-6
            )
            gated = rows_matmul.rows_matmul(normed, zeros(L + S, S * H), gates=(L, S))
            x = rows_matmul.rows_matmul(
                taken.view(gated, 0, (1, L)), zeros(S * H, L), mix=(normed, S)
            )
            rows_matmul.rows_matmul(x, zeros(4 * 128 + 128, H))
        qkv = rows_matmul.rows_matmul(x, zeros(layout.q_width() + 2 * kv * d, H))
        qk_norm_rope.qk_norm_rope(
            qkv, zeros(d, dt=mx.float32), zeros(d, dt=mx.float32), mx.array(5, mx.int32), layout
        )
    _compiles_fused(tmp_path, fused, taken)
