"""mx.fast.cuda_kernel with compact sources: comments, indentation and blank lines dropped.

Why: MLX (0.32.4, CUDA) hashes a custom kernel's whole generated source (header, signature,
body) every time it encodes a launch (CustomKernel::eval_gpu), and builds that source on
every call from Python. On the H200's host that hash was ~40% of a launch's encode, ~1 ms of
a 64-layer 27B decode step (py-spy, benchmarks/results/h200/pyspy_decode_64l_4k_folded.json):
a kernel's source length is host time per token. The compacted text compiles to the same
code (only comments and whitespace go; line breaks stay for the preprocessor). A kernel's
name carries a digest of its text, so MLX's compiled-kernel cache never serves an old one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import mlx.core as mx
import numpy as np


def compact(source: str) -> str:
    """`source` without // comments (outside string literals), leading and trailing blanks
    and empty lines."""
    lines = []
    for line in source.splitlines():
        line = _without_comment(line).strip()
        if line:
            lines.append(line)
    return "\n".join(lines) + "\n"


def _without_comment(line: str) -> str:
    quoted = False
    i = 0
    while i < len(line):
        c = line[i]
        if quoted and c == "\\":
            i += 2  # an escaped character inside a string literal
            continue
        if c == '"':
            quoted = not quoted
        elif not quoted and line.startswith("//", i):
            return line[:i]
        i += 1
    return line


def cuda_kernel(*, name: str, source: str, header: str = "", **options) -> Kernel:
    """mx.fast.cuda_kernel(name=..., source=..., header=..., **options) with both compacted
    and the name made unique to them (`versioned`), as a Kernel."""
    source, header = compact(source), compact(header)
    names = (options.get("input_names", ()), options.get("output_names", ()))
    name = versioned(name, source, header, *names)
    return Kernel(dict(name=name, source=source, header=header, **options))


class Kernel:
    """A custom kernel: its spec (what mx.fast.cuda_kernel takes) and, made at its first
    launch, MLX's kernel. Launched as MLX's is; while a capture is active (`capturing`), a
    launch is handed to it instead (kernels/fused.py composes several into one)."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self._kernel = None

    def __call__(self, **call) -> list[mx.array]:
        capture = _CAPTURE.get()
        if capture is not None:
            return capture(self, call)
        if self._kernel is None:  # made on first use: MLX refuses it without a CUDA backend
            self._kernel = mx.fast.cuda_kernel(**self.spec)
        return self._kernel(**call)


_CAPTURE: ContextVar = ContextVar("qwen38_kernel_capture", default=None)


@contextmanager
def capturing(capture) -> Iterator[None]:
    """Kernel launches inside go to capture(kernel, call) instead (returning its outputs)."""
    token = _CAPTURE.set(capture)
    try:
        yield
    finally:
        _CAPTURE.reset(token)


def versioned(name: str, source: str, header: str, inputs=(), outputs=()) -> str:
    """`name` with a digest of the kernel's text appended.

    Why: MLX compiles a custom kernel once per name (and template arguments) and keeps the
    result on disk under that name (MLX_PTX_CACHE_DIR, which loading.paths keeps across
    runs), so a kernel whose text changed under the same name would run its old compiled
    code, silently, after an upgrade (or in a benchmark carrying an earlier cache)."""
    text = "\0".join([source, header, ",".join(inputs), ",".join(outputs)])
    return f"{name}_{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def float32_literal(value: float) -> str:
    """`value` rounded to fp32, as an exact C hex literal (a constant baked into a source)."""
    return float(np.float32(value)).hex() + "f"
