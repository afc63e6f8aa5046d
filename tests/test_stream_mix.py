"""The stream-mix kernels (kernels/stream_mix.py) on the CPU: their reference is the gated
residual's own op path, and the layer keeps that path where the kernels are off or cannot
run (on by default). The kernels run in tests/test_gpu.py (--run-gpu) and compile in
tests/test_kernel_sources.py (--run-nvcc)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import random_gated_residual, set_switch
from qwen38_backend.kernels import stream_mix as kernel

from qwen38_backend.models.hyper_connections import GatedResidual, gate_down

HIDDEN, STREAMS, LOW_RANK, EPS = 32, 4, 8, 1e-6


def _residual() -> GatedResidual:
    return random_gated_residual(HIDDEN, STREAMS, LOW_RANK, EPS, seed=8)


def test_the_reference_is_the_layers_op_path():
    """open() and close() on the op path == the reference's pieces chained as they chain
    them."""
    hc = _residual()
    R = 2 * mx.random.normal((3, HIDDEN * STREAMS), key=mx.random.key(1))
    x, inj = hc.open(R)
    normed = hc.hc_norm(R)
    y = hc.down_inject_proj(normed)
    up = hc.input_mix_weight_up(gate_down(y[:, :LOW_RANK], STREAMS))
    out = mx.random.normal((3, HIDDEN), key=mx.random.key(2))
    want = kernel.reference(R, hc.hc_norm.weight, y, up, out, STREAMS, LOW_RANK, EPS)
    assert mx.array_equal(normed, want[0]).item()
    assert mx.array_equal(inj, want[2]).item()
    assert mx.array_equal(x, want[3]).item()
    assert mx.array_equal(hc.close(R, inj, out), want[4]).item()
    closed, then_normed = hc.close_then_norm(R, inj, out, _residual())
    assert then_normed is None  # the kernels are off: the next open norms it
    assert mx.array_equal(closed, want[4]).item()


@pytest.mark.parametrize("value", [None, "auto", "off"])
def test_the_layer_keeps_its_op_path_where_the_kernels_are_off(monkeypatch, value):
    """Off where switched off, and unavailable off CUDA when on (the default)."""
    set_switch(monkeypatch, "QWEN38_STREAM_KERNEL", value)
    kernel.available.cache_clear()
    hc = _residual()
    hc.prepare_decode(mx.float32)
    assert hc._kernel_for == ""
    assert hc._kernels(mx.zeros((1, HIDDEN * STREAMS))) is None
    kernel.available.cache_clear()


def test_unknown_switch_values_are_refused(monkeypatch):
    monkeypatch.setenv("QWEN38_STREAM_KERNEL", "sometimes")
    kernel.available.cache_clear()
    with pytest.raises(ValueError, match="QWEN38_STREAM_KERNEL"):
        _residual().prepare_decode(mx.bfloat16)
    kernel.available.cache_clear()
