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
  to a kernel that reads them once and is faster than one row). On the CPU nothing is padded,
  but each row of a step's product is a one-row product of its own, the same call as a
  plain step's: MLX's CPU matmul is cblas_sgemm, and OpenBLAS (blas.py loads it when
  `qwen38_backend` is imported before MLX) picks its kernel by the row count and its thread
  count (0.3.21, Haswell kernels, on this CPU: with 1 thread a row of a 4..16-row product
  differs from that row alone at any width; with 2, from 4 rows at small widths and from 13
  at the demo's), so a verify row would not be the plain step's.
  Only MLX's bundled reference BLAS gives equal rows at any count; which BLAS MLX binds
  depends on import order, so the rows never rely on it. Cost, OpenBLAS only: a verify of T
  rows reads the dense weights T times (576x1536 fp32, 5 rows: 1.3 ms split vs 0.65 ms one
  product vs 0.3 ms one row; the bundled BLAS computes 5 rows in 2.8 ms either way).
- attention: each row attends over its own causal prefix through the one-token path
  (kv/one_token.py), so its split of the keys is the plain step's;
- Gated DeltaNet: the recurrence runs its one-token core row after row.
Forwards of up to `STEP_MAX_ROWS` rows take these paths; `exact_rows()` is how many rows a
verify may have and stay exact on this device.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import mlx.core as mx
import mlx.nn as nn

STEP_MAX_ROWS = 16  # forwards of at most this many rows run as steps (row by row where it matters)
GPU_PAD_ROWS = 8  # products of fewer rows are padded to this many on a GPU (module docstring)


_UNPADDED: ContextVar[bool] = ContextVar("qwen38_unpadded", default=False)
# How this forward's few-row products run, decided once by `prepare` (outside any compiled
# trace: the kernel's probe runs ops): (rows a product is padded to, the dtype whose dense
# step products run through kernels/rows_matmul.py or None, whether a step's rows are
# one-row products each: the CPU, module docstring).
_PLAN: ContextVar[tuple[int, mx.Dtype | None, bool]] = ContextVar(
    "qwen38_rows", default=(1, None, False)
)


def prepare(dtype: mx.Dtype) -> None:
    """Decide how this forward's few-row products run (a family's forward calls it first):
    through the row-invariant kernel where it runs and passed its probe, else padded to
    pad_rows() (read here once, not per product)."""
    kernels = _kernel_module()
    usable = kernels is not None and kernels.available(dtype)
    _PLAN.set((_device_pad(), dtype if usable else None, _splits()))


def kernel_dtype() -> mx.Dtype | None:
    """The dtype whose dense step products use the row-invariant kernel now (None: none)."""
    return _PLAN.get()[1]


def split_rows() -> bool:
    """Whether this forward's step products compute each row alone (the CPU: whatever BLAS
    MLX bound, a row is then the plain step's one-row product)."""
    return _PLAN.get()[2]


def forward_pad() -> int:
    """pad_rows() as `prepare` read it for this forward (unpadded() still applies)."""
    return 1 if _UNPADDED.get() else _PLAN.get()[0]


@contextmanager
def unpadded() -> Iterator[None]:
    """Products built inside are not padded: a family that never verifies on a GPU
    (CausalLM.rows_exact False) keeps its one-row kernels (on the H200 a 27B step with
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


def exact_rows() -> int:
    """The most rows a forward may have with each row equal to a one-row step here: a step
    (past STEP_MAX_ROWS Gated DeltaNet runs its chunked form), and on a GPU no more rows
    than a padded product has."""
    if pad_rows() > 1:
        return min(pad_rows(), STEP_MAX_ROWS)
    return STEP_MAX_ROWS if mx.default_device().type == mx.DeviceType.cpu else 1


def project(linear: nn.Module, x: mx.array) -> mx.array:
    """linear(x) for x [T, ..., in]: a step's dense product through the row-invariant kernel
    where `prepare` chose it, else fewer than pad_rows() rows padded; on the CPU each row of
    a step alone (module docstring)."""
    pad, kernel_for, _ = _PLAN.get()
    if kernel_for is not None and x.shape[0] <= STEP_MAX_ROWS and x.dtype == kernel_for:
        weight, bias = _dense_weight(linear)
        flat = x.reshape(-1, x.shape[-1])
        kernels = _kernel_module()
        if weight is not None and flat.shape[0] <= STEP_MAX_ROWS and kernels.fits(flat, weight):
            y = kernels.rows_matmul(flat, weight)
            y = y.reshape(*x.shape[:-1], weight.shape[0])
            return y if bias is None else y + bias
    pad = 1 if _UNPADDED.get() else pad
    return per_row(lambda part: _padded(linear, part, pad), x)


def per_row(fn: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
    """fn(x) for x [T, ...]; where this forward's plan splits rows (the CPU) and T is a
    step's (2..STEP_MAX_ROWS), fn of each row alone, concatenated: the plain step's call per
    row, so no BLAS kernel chosen by the row count changes a row's bits. For a step's
    products that do not go through `project` (a row-invariant fn needs neither)."""
    if _PLAN.get()[2] and 1 < x.shape[0] <= STEP_MAX_ROWS:
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


@functools.cache
def _kernel_module():
    """kernels/rows_matmul.py, or None in a source tree that was not installed (the package
    maps `kernels/` to `qwen38_backend.kernels` at install)."""
    try:
        from .kernels import rows_matmul
    except ImportError:
        return None
    return rows_matmul
