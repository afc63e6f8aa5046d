"""Row-exact few-row forwards: a forward of a few positions (a decode step, a speculative
verify) computes each row with the same bits as a forward of that row alone, on every backend.

Speculative decoding keeps its output byte-identical to plain decoding only if row i of a
verify forward is what the plain step at that position computes. Where a row's bits could
depend on the rows around it, a step does something that cannot:
- projections: on a GPU a matmul of one row (a gemv kernel) rounds differently from the same
  row among several (cuBLAS, quantized qmm). Dense weights go through a row-invariant kernel
  there (kernels/rows_matmul.py: every row computed the same way whatever the row count, the
  weights read once); any other product of fewer than `pad_rows()` rows is padded to that
  many (measured on the H200, MLX 0.32.4, 27B shapes, benchmarks/probe_rows_gpu.py: bf16
  rows are equal for 2..8 rows and an 8-row product costs ~12% more than a one-row one;
  4-bit rows are equal for 1..7 rows, which read the weights once per row, and 8 rows switch
  to a kernel that reads them once and is faster than one row). A quantized product is
  therefore not padded (a padded 4-bit step decoded 1.8x slower on the H200: 26.2 vs 47.4
  tok/s, benchmarks/results/h200/bench_gpu_27b_4bit_*.json): MLX's own product runs
  unpadded where `prepare` measured its rows equal to one-row products for every row count
  up to some R >= 2, and a verify then has at most R rows (`quantized_plan`). A
  row-invariant quantized kernel was written and measured (session 11,
  benchmarks/results/h200/probe_rows_qmatmul.json): slower than MLX's qmv for 1..3 rows on
  the H200 and off from the fp32 product, so it was removed.
  On the CPU nothing is padded,
  and a step's product runs whole only where this process measured its rows equal to the
  one-row products: MLX's CPU matmul is cblas_sgemm, and OpenBLAS (blas.py loads it when
  `qwen38_backend` is imported before MLX) picks its kernel by the row count and its thread
  count (0.3.21, Haswell kernels: with 1 thread a row of a 4..16-row product differs from
  that row alone at any width; with 2, from 4 rows at small widths and from 13 or 16 at the
  demo's). `prepare(dtype, net, rows)` probes each distinct linear of the model once per row
  count (`rows_agree`: random rows through the product whole and one by one, bit for bit;
  the kernel a BLAS picks depends on the shapes and threads, not on the values); a product
  that differs runs row by row, the plain step's call per row (a verify of T rows then reads
  those weights T times). Products outside `project` (Flash-Next's stream mixes, router,
  indexer, PLE) always run row by row on the CPU (`per_row`).
- attention: each row attends over its own causal prefix through the one-token path
  (kv/one_token.py), so its split of the keys is the plain step's;
- Gated DeltaNet: the recurrence runs its one-token core row after row.
Forwards of up to `STEP_MAX_ROWS` rows take these paths; `exact_rows()` is how many rows a
verify may have and stay exact on this device.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import mlx.core as mx
import mlx.nn as nn

from .kernel_import import kernel_module

STEP_MAX_ROWS = 16  # forwards of at most this many rows run as steps (row by row where it matters)
GPU_PAD_ROWS = 8  # products of fewer rows are padded to this many on a GPU (module docstring)


_UNPADDED: ContextVar[bool] = ContextVar("qwen38_unpadded", default=False)
# How this forward's few-row products run, decided once by `prepare` (outside any compiled
# trace: the kernel's probe runs ops): (rows a product is padded to, the dtype whose dense
# step products run through kernels/rows_matmul.py or None, whether a step's rows are
# one-row products each: the CPU, module docstring).
# Split: None (nothing runs row by row), or the linears (`_linear_key`) whose step products
# run row by row; "all" where the model's linears were not probed.
# Last: how the quantized linears' step products run on a GPU (quantized_plan):
# ("unpadded", keys) MLX's own product unpadded, or ("", empty) padded like any other.
Split = frozenset | str | None
Quantized = tuple[str, frozenset]
_NO_QUANTIZED: Quantized = ("", frozenset())
_PLAN: ContextVar[tuple[int, mx.Dtype | None, Split, Quantized]] = ContextVar(
    "qwen38_rows", default=(1, None, None, _NO_QUANTIZED)
)


def prepare(dtype: mx.Dtype, net: nn.Module | None = None, rows: int = 0) -> None:
    """Decide how this forward's few-row products run (a family's forward calls it first,
    outside any compiled trace: probes run ops): through the row-invariant kernel where it
    runs and passed its probe, else padded to pad_rows() (read here once, not per product);
    on the CPU, for a step of `rows` rows, row by row for the linears of `net` whose rows
    differ from one-row products (all of them when `net` or `rows` is not given)."""
    kernels = kernel_module("rows_matmul")
    usable = kernels is not None and kernels.available(dtype)
    if usable:  # probed here, read by each product in a trace
        kernels.epilogues_available(dtype)
        kernels.norm_available(dtype)
        kernels.gates_available(dtype)
        kernels.mix_available(dtype)
    pad = _device_pad()
    quantized = _NO_QUANTIZED
    if pad > 1 and net is not None:
        mode, keys, _ = quantized_plan(net, dtype)
        quantized = (mode, keys)
    _PLAN.set((pad, dtype if usable else None, _split_plan(dtype, net, rows), quantized))


def quantized_plan(net: nn.Module, dtype: mx.Dtype) -> tuple[str, frozenset, int]:
    """Where products are padded (a GPU): how `net`'s quantized linears run a step's
    products, as (mode, their keys, the most rows a step may then have):
    - "unpadded": MLX's own product unpadded, where every one gives each row of r rows the
      bits of that row alone for r = 2..R, R >= 2 (probed; the weights read once per row);
      R is the row limit;
    - "": padded like any other product (frozenset(), 0).
    Probed once per net and dtype (module docstring)."""
    plans = net.__dict__.setdefault("_row_plans", {})
    plan_key = ("quantized", str(dtype))
    if plan_key not in plans:
        plans[plan_key] = _quantized_plan(net, dtype)
    return plans[plan_key]


def _quantized_plan(net: nn.Module, dtype: mx.Dtype) -> tuple[str, frozenset, int]:
    linears = [(k, fn, w) for k, fn, w in _linears(net) if k[-1] is not None]
    if not linears:
        return "", frozenset(), 0
    keys = frozenset(k for k, _, _ in linears)
    most = 1
    for r in range(2, _device_pad() + 1):
        if not all(rows_agree(k, fn, w, dtype, r) for k, fn, w in linears):
            break
        most = r
    return ("unpadded", keys, most) if most >= 2 else ("", frozenset(), 0)


def _split_plan(dtype: mx.Dtype, net: nn.Module | None, rows: int) -> Split:
    if not _splits():
        # an unpadded forward (a family keeping its one-row kernels) on a GPU: each row of a
        # step's product the kernel does not take is a one-row product, as a plain step's is
        return "all" if _UNPADDED.get() and 1 < rows <= STEP_MAX_ROWS else None
    if net is None or rows == 0:  # nothing to probe: every step product row by row
        return "all"
    if not 1 < rows <= STEP_MAX_ROWS:
        return None
    plans = net.__dict__.setdefault("_row_plans", {})  # the net's linears, probed once
    plan_key = (str(dtype), rows)
    if plan_key not in plans:
        plans[plan_key] = frozenset(
            key for key, fn, width in _linears(net) if not rows_agree(key, fn, width, dtype, rows)
        )
    return plans[plan_key]


def _linears(net: nn.Module) -> list[tuple[tuple, Callable, int]]:
    """(key, product, input width) of each distinct linear map of `net` that `project` may
    run: its linears and its embeddings' as_linear (a tied head)."""
    out = {}
    for _, module in net.named_modules():
        if isinstance(module, nn.Embedding | nn.QuantizedEmbedding):
            fn = module.as_linear
        elif isinstance(module, nn.Linear | nn.QuantizedLinear):
            fn = module
        else:
            continue
        key = _linear_key(fn)
        if key is not None and key not in out:
            out[key] = (fn, _input_width(module))
    return [(key, fn, width) for key, (fn, width) in out.items()]


def _input_width(module: nn.Module) -> int:
    if isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
        return module.weight.shape[-1] * 32 // module.bits
    return module.weight.shape[-1]


def _linear_key(linear) -> tuple | None:
    """What decides how a product runs: the kind of map, its weight's shape and dtype, a
    bias, quantization. None for anything else (run row by row where rows split)."""
    cached = getattr(linear, "__dict__", {}).get("_rows_key")  # a step asks per product
    if cached is not None and cached[0] is linear.get("weight"):
        return cached[1]
    owner = getattr(linear, "__self__", None)
    module = owner if getattr(linear, "__name__", "") == "as_linear" else linear
    if not isinstance(module, _LINEAR_KINDS):
        return None
    weight = module.weight
    quant = (module.bits, module.group_size) if hasattr(module, "bits") else None
    kind = "head" if module is owner else type(module).__name__
    key = (kind, tuple(weight.shape), str(weight.dtype), "bias" in module, quant)
    if module is linear:
        module.__dict__["_rows_key"] = (weight, key)
    return key


_LINEAR_KINDS = (nn.Linear, nn.QuantizedLinear, nn.Embedding, nn.QuantizedEmbedding)
_AGREE: dict[tuple, bool] = {}


def rows_agree(key: tuple, fn: Callable, width: int, dtype: mx.Dtype, rows: int) -> bool:
    """Whether fn's product of `rows` rows gives each row the bits of that row alone (once
    per process, linear key, dtype and row count; random rows, no zeros)."""
    probe = (key, str(dtype), rows)
    if probe not in _AGREE:
        x = mx.random.normal((rows, width), key=mx.random.key(rows)).astype(dtype)
        whole = fn(x)
        alone = mx.concatenate([fn(x[i : i + 1]) for i in range(rows)])
        _AGREE[probe] = bool(mx.array_equal(whole, alone).item())
    return _AGREE[probe]


def kernel_dtype() -> mx.Dtype | None:
    """The dtype whose dense step products use the row-invariant kernel now (None: none)."""
    return _PLAN.get()[1]


def quantized_mode() -> str:
    """How this forward's quantized step products run (quantized_plan: "unpadded" or "")."""
    return _PLAN.get()[3][0]


def split_rows() -> Split:
    """Which of this forward's step products compute each row alone (module docstring)."""
    return _PLAN.get()[2]


def forward_pad() -> int:
    """pad_rows() as `prepare` read it for this forward (unpadded() still applies)."""
    return 1 if _UNPADDED.get() else _PLAN.get()[0]


@contextmanager
def unpadded() -> Iterator[None]:
    """Products built inside are not padded: a family that keeps its one-row kernels
    (Flash-Next: its experts' gather_qmm) runs a step's rows one at a time instead where the
    row-invariant kernel does not take them (`_split_plan`; on the H200 a 27B step with
    padded products decodes ~18% slower: benchmarks/results/h200/decode_padding.json)."""
    token = _UNPADDED.set(True)
    try:
        yield
    finally:
        _UNPADDED.reset(token)


def pad_rows() -> int:
    """Rows a projection of fewer rows is padded to: 1 (none) on the CPU, GPU_PAD_ROWS on a
    GPU. QWEN38_PAD_ROWS overrides it (tests run the padded path on the CPU)."""
    return 1 if _UNPADDED.get() else _device_pad()


def _splits() -> bool:
    """Whether a step's products compute each row alone here: on the CPU (module docstring)."""
    return mx.default_device().type == mx.DeviceType.cpu


def _device_pad() -> int:
    forced = os.environ.get("QWEN38_PAD_ROWS")
    if forced:
        return int(forced)
    return 1 if mx.default_device().type == mx.DeviceType.cpu else GPU_PAD_ROWS


def exact_rows(net: nn.Module | None = None, dtype: mx.Dtype | None = None) -> int:
    """The most rows a forward may have with each row equal to a one-row step here: a step
    (past STEP_MAX_ROWS Gated DeltaNet runs its chunked form), and on a GPU no more rows
    than a padded product has, nor than `net`'s unpadded quantized products stay exact for
    (quantized_plan, with activations of `dtype`)."""
    if pad_rows() > 1:
        most = min(pad_rows(), STEP_MAX_ROWS)
        if net is not None and dtype is not None:
            _, keys, quantized = quantized_plan(net, dtype)
            if keys:
                most = min(most, quantized)
        return most
    return STEP_MAX_ROWS if mx.default_device().type == mx.DeviceType.cpu else 1


def project(
    linear: nn.Module,
    x: mx.array,
    residual: mx.array | None = None,
    dtype: mx.Dtype | None = None,
    norm: nn.Module | None = None,
) -> mx.array:
    """linear(x) for x [T, ..., in]: a step's dense product through the row-invariant kernel
    where `prepare` chose it, a quantized one as `quantized_plan` decided, else fewer than
    pad_rows() rows padded; on the CPU each row of a step alone (module docstring).

    An fp32 x for a half-precision linear (a norm's rows before their cast back:
    RMSNorm.for_product) is rounded to the linear's dtype first, as a cast would (the kernel
    does it as it loads x: one launch fewer).

    `residual`: residual + linear(x) instead, the residual cast to the product's dtype first
    (exact where it is fp32 holding values of that dtype), then cast to `dtype` when given;
    the kernel adds it as it stores its outputs (one launch fewer).

    `norm` (an RMSNorm): the product of its rows, norm.for_product(x): in the kernel's
    prologue where it takes them (a zero-centred norm; one launch fewer), else the norm's op
    first."""
    if norm is not None:
        y = _normed_product(linear, x, norm, residual, dtype)
        if y is not None:
            return y
        x = norm.for_product(x)
    y = _kernel_product(linear, x, residual, dtype)
    if y is not None:
        return y
    x = _narrowed(linear, x)
    pad = 1 if _UNPADDED.get() else _PLAN.get()[0]
    mode, keys = _PLAN.get()[3]
    if pad > 1 and mode and x.shape[0] <= STEP_MAX_ROWS and _linear_key(linear) in keys:
        pad = 1  # MLX's product computes each of these few rows alone (quantized_plan)
    split = _PLAN.get()[2]
    if split is None or (split != "all" and _linear_key(linear) not in split):
        y = _padded(linear, x, pad)
    else:
        y = _row_by_row(lambda part: _padded(linear, part, pad), x)
    return _finished(y, residual, dtype)


def swiglu_product(
    linear: nn.Module, x: mx.array, norm: nn.Module | None = None
) -> mx.array | None:
    """silu(gate) * up of a fused [gate; up] linear's product with x (with `norm`: with
    norm.for_product(x), normed in the kernel's prologue), through the row-invariant kernel
    (its epilogue: one launch fewer) where this forward's plan runs it for these operands,
    else None (the caller norms x and splits project's output)."""
    if norm is not None:
        return _normed_product(linear, x, norm, swiglu=True)
    return _kernel_product(linear, x, swiglu=True)


def per_row(fn: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
    """fn(x) for x [T, ...]; where this forward's plan splits rows (the CPU) and T is a
    step's (2..STEP_MAX_ROWS), fn of each row alone, concatenated: the plain step's call per
    row, so no BLAS kernel chosen by the row count changes a row's bits; a dense linear
    through the row-invariant kernel where `prepare` chose it (on a GPU, a plain step's too).
    For a step's products that do not go through `project` (a row-invariant fn needs
    neither)."""
    y = _kernel_product(fn, x)
    if y is not None:
        return y
    if _PLAN.get()[2] is None:
        return fn(x)
    return _row_by_row(fn, x)


def _kernel_product(
    linear,
    x: mx.array,
    residual: mx.array | None = None,
    dtype: mx.Dtype | None = None,
    swiglu: bool = False,
) -> mx.array | None:
    """linear(x) through kernels/rows_matmul.py where this forward's plan runs it and it
    takes these operands (a dense weight of the kernel's dtype, a step's rows of that dtype
    or fp32), else None; `residual` (then `dtype`) and `swiglu` as project and
    swiglu_product take them: in the kernel's epilogues where they passed their probe (2-D
    rows, no bias), else a residual as ops after the kernel's product and no swiglu (None:
    the caller splits the product)."""
    weight, bias = _kernel_weight(linear, x)
    if weight is None:
        return None
    kernels = kernel_module("rows_matmul")
    fused = (residual is not None or swiglu) and bias is None and x.ndim == 2
    if fused and kernels.epilogues_available(weight.dtype):
        if kernels.fits(x, weight, residual, swiglu):
            return kernels.rows_matmul(x, weight, residual=residual, dtype=dtype, swiglu=swiglu)
    if swiglu:
        return None
    # a step's 2-D rows go in and come out as they are (a reshape is a node to encode too)
    flat = x if x.ndim == 2 else x.reshape(-1, x.shape[-1])
    if flat.shape[0] > STEP_MAX_ROWS or not kernels.fits(flat, weight):
        return None
    y = kernels.rows_matmul(flat, weight)
    if x.ndim != 2:
        y = y.reshape(*x.shape[:-1], weight.shape[0])
    return _finished(y if bias is None else y + bias, residual, dtype)


def kernel_product(
    linear,
    x: mx.array,
    residual: mx.array | None = None,
    dtype: mx.Dtype | None = None,
    swiglu: bool = False,
    norm: nn.Module | None = None,
) -> mx.array | None:
    """linear(x) as launches of the row-invariant kernel with nothing after them (a step's
    2-D rows, no bias; `residual`, `dtype` and `swiglu` in its epilogues as project and
    swiglu_product take them) where this forward's plan runs them for these operands, else
    None: what a fused launch takes as phases (kernels/fused.py); the bits of `project`'s
    and `swiglu_product`'s.

    `norm`: of norm.for_product(x), where the step's products take the norm in their
    prologue (_normed_product), as the stand-alone norm kernel then the product (the
    prologue's bits, rows_matmul.norm_available): in a fused launch the norm is a phase of
    its own, computed once instead of in every block."""
    weight = _unbiased_weight(linear, x)
    kernels = kernel_module("rows_matmul")
    if weight is None or x.shape[0] > STEP_MAX_ROWS:
        return None
    if norm is not None:
        if not getattr(norm, "zero_centered", False) or not kernels.norm_available(weight.dtype):
            return None
        scale = norm.scale()
        if not kernels.fits(x, weight, residual, swiglu, scale):
            return None
        x = kernels.norm_rows(x, scale, norm.eps, weight.dtype)
    if (residual is not None or swiglu) and not kernels.epilogues_available(weight.dtype):
        return None  # project would add the residual as ops after the product
    if not kernels.fits(x, weight, residual, swiglu):
        return None
    return kernels.rows_matmul(x, weight, residual=residual, dtype=dtype, swiglu=swiglu)


def gated_product(linear, x: mx.array, low_rank: int, streams: int) -> mx.array | None:
    """A gated residual's down (/ inject) product of a step's rows x [T, K] with its gates
    in the kernel's epilogue (kernels/rows_matmul.py, GATES): [T, N], silu(y / streams) in
    the first `low_rank` columns, 2 sigmoid(y / streams) in the rest, the bits of the product
    then the gates' ops; None where this forward's plan does not run the kernel for these
    operands or the epilogue did not pass its probe (the caller runs the gates apart)."""
    weight = _unbiased_weight(linear, x)
    kernels = kernel_module("rows_matmul")
    if weight is None or not kernels.gates_available(weight.dtype):
        return None
    if not kernels.fits(x, weight, gates=True):
        return None
    return kernels.rows_matmul(x, weight, gates=(low_rank, streams))


def mixed_product(linear, x: mx.array, streams: mx.array, count: int) -> mx.array | None:
    """A gated residual's block input from a step's low-rank gates x [T, L]: its up product
    mixed with the normed `streams` [T, count * H] in the kernel's epilogue
    (kernels/rows_matmul.py, MIX): [T, H], the bits of the product then the stream kernels'
    mix launch; None where this forward's plan does not run the kernel for these operands or
    the epilogue did not pass its probe (the caller mixes apart)."""
    weight = _unbiased_weight(linear, x)
    kernels = kernel_module("rows_matmul")
    mix = (streams, count)
    if weight is None or not kernels.mix_available(weight.dtype):
        return None
    if not kernels.fits(x, weight, mix=mix):
        return None
    return kernels.rows_matmul(x, weight, mix=mix)


def _unbiased_weight(linear, x: mx.array) -> mx.array | None:
    """linear's dense weight where this forward's plan runs the kernel for x's 2-D rows and
    linear has no bias (what the product epilogues take), else None."""
    weight, bias = _kernel_weight(linear, x)
    return weight if weight is not None and bias is None and x.ndim == 2 else None


def _normed_product(
    linear,
    x: mx.array,
    norm: nn.Module,
    residual: mx.array | None = None,
    dtype: mx.Dtype | None = None,
    swiglu: bool = False,
) -> mx.array | None:
    """linear(norm.for_product(x)) through the kernel with the norm in its prologue (and the
    epilogues as _kernel_product takes them) where this forward's plan runs the kernel, the
    prologue passed its probe and takes this norm (zero-centred: an fp32 scale) and these
    operands (2-D rows, a dense weight of the kernel's dtype, no bias), else None."""
    if not getattr(norm, "zero_centered", False):
        return None
    weight = _unbiased_weight(linear, x)
    if weight is None:
        return None
    kernels = kernel_module("rows_matmul")
    scale = norm.scale()
    if not kernels.norm_available(weight.dtype) or not kernels.fits(
        x, weight, residual, swiglu, scale
    ):
        return None
    return kernels.rows_matmul(
        x, weight, residual=residual, dtype=dtype, swiglu=swiglu, norm=(scale, norm.eps)
    )


def _kernel_weight(linear, x: mx.array) -> tuple[mx.array | None, mx.array | None]:
    """(weight, bias) of `linear` where this forward's plan runs the row-invariant kernel
    for it and rows x (a dense weight of the dtype its probe passed, a step's rows of that
    dtype or fp32), else (None, None)."""
    kernel_for = _PLAN.get()[1]
    if kernel_for is None or x.shape[0] > STEP_MAX_ROWS or x.dtype not in (kernel_for, mx.float32):
        return None, None
    weight, bias = _dense_weight(linear)
    if weight is None or weight.dtype != kernel_for:
        return None, None
    return weight, bias


def _finished(y: mx.array, residual: mx.array | None, dtype: mx.Dtype | None) -> mx.array:
    """residual + y (the residual cast to y's dtype first), then cast to `dtype`: project's
    epilogue as ops."""
    if residual is not None:
        y = residual.astype(y.dtype) + y
    return y if dtype is None else y.astype(dtype)


def _narrowed(linear, x: mx.array) -> mx.array:
    """x rounded to the half-precision dtype `linear` computes in (its weight's, a quantized
    one's scales'), where x is fp32; else x."""
    if x.dtype != mx.float32:
        return x
    owner = getattr(linear, "__self__", linear)  # an embedding's as_linear: the embedding
    if not isinstance(owner, nn.Module):
        return x
    held = owner.get("scales", owner.get("weight"))
    if held is None or held.dtype not in (mx.float16, mx.bfloat16):
        return x
    return x.astype(held.dtype)


def _row_by_row(fn: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
    if 1 < x.shape[0] <= STEP_MAX_ROWS:
        return mx.concatenate([fn(x[i : i + 1]) for i in range(x.shape[0])])
    return fn(x)


def _padded(linear: nn.Module, x: mx.array, pad: int) -> mx.array:
    """linear(x), x's rows padded to `pad` first when fewer."""
    rows = x.shape[0]
    if rows >= pad:
        return linear(x)
    return linear(mx.pad(x, [(0, pad - rows)] + [(0, 0)] * (x.ndim - 1)))[:rows]


def _dense_weight(linear) -> tuple[mx.array | None, mx.array | None]:
    """(weight [out, in], bias) of an unquantized linear map (nn.Linear, or an embedding's
    as_linear), else (None, None)."""
    if isinstance(linear, nn.Linear):
        return linear.weight, linear.get("bias")
    owner = getattr(linear, "__self__", None)
    if type(owner) is nn.Embedding and linear.__name__ == "as_linear":
        return owner.weight, None
    return None, None
