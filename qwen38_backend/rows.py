"""Row-exact few-row forwards: a forward of a few positions (a decode step, a speculative
verify) computes each row with the same bits as a forward of that row alone, on every backend.

Speculative decoding keeps its output byte-identical to plain decoding only if row i of a
verify forward is what the plain step at that position computes. Where a row's bits could
depend on the rows around it, a step does something that cannot:
- projections: on a GPU a matmul of one row (a gemv kernel) rounds differently from the same
  row among several (cuBLAS, quantized qmm), so every product of fewer than `pad_rows()` rows
  is padded to that many (measured on the H200, MLX 0.32.4, 27B shapes,
  benchmarks/probe_rows_gpu.py: bf16 rows are equal for 2..8 rows and an 8-row product costs
  ~12% more than a one-row one; 4-bit rows are equal for 1..7 rows, which read the weights
  once per row, and 8 rows switch to a kernel that reads them once and is faster than one
  row). On the CPU rows are equal at any count (tested), so nothing is padded there.
- attention: each row attends over its own causal prefix through the one-token path
  (kv/one_token.py), so its split of the keys is the plain step's;
- Gated DeltaNet: the recurrence runs its one-token core row after row.
Forwards of up to `STEP_MAX_ROWS` rows take these paths; `exact_rows()` is how many rows a
verify may have and stay exact on this device.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import mlx.core as mx
import mlx.nn as nn

STEP_MAX_ROWS = 16  # forwards of at most this many rows run as steps (row by row where it matters)
GPU_PAD_ROWS = 8  # products of fewer rows are padded to this many on a GPU (module docstring)


_UNPADDED: ContextVar[bool] = ContextVar("qwen38_unpadded", default=False)


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
    if _UNPADDED.get():
        return 1
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
    """linear(x) for x [T, ..., in]; fewer than pad_rows() rows are padded (module
    docstring)."""
    rows, pad = x.shape[0], pad_rows()
    if rows >= pad:
        return linear(x)
    return linear(mx.pad(x, [(0, pad - rows)] + [(0, 0)] * (x.ndim - 1)))[:rows]
