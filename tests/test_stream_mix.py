"""The stream-mix kernels (kernels/stream_mix.py) on the CPU: their reference is the gated
residual's own op path, and the layer keeps that path where the kernels are off (their
default) or cannot run. The kernels run in tests/test_gpu.py (--run-gpu) and compile in
tests/test_kernel_sources.py (--run-nvcc)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import random_gated_residual
from qwen38_backend.kernels import stream_mix as kernel

from qwen38_backend.models.hyper_connections import GatedResidual, gate_down

HIDDEN, STREAMS, LOW_RANK, EPS = 32, 4, 8, 1e-6


def _residual() -> GatedResidual:
    return random_gated_residual(HIDDEN, STREAMS, LOW_RANK, EPS, seed=8)


def test_the_reference_is_the_layers_op_path():
    """open() on the op path == the reference's pieces chained as open chains them."""
    hc = _residual()
    R = 2 * mx.random.normal((3, HIDDEN * STREAMS), key=mx.random.key(1))
    x, inj = hc.open(R)
    normed = hc.hc_norm(R)
    y = hc.down_inject_proj(normed)
    up = hc.input_mix_weight_up(gate_down(y[:, :LOW_RANK], STREAMS))
    want_normed, _, want_inj, want_x = kernel.reference(
        R, hc.hc_norm.weight, y, up, STREAMS, LOW_RANK, EPS
    )
    assert mx.array_equal(normed, want_normed).item()
    assert mx.array_equal(inj, want_inj).item()
    assert mx.array_equal(x, want_x).item()


@pytest.mark.parametrize("value", [None, "auto", "off"])
def test_the_layer_keeps_its_op_path_where_the_kernels_are_off(monkeypatch, value):
    """Off by default, and unavailable off CUDA even when switched on."""
    if value is None:
        monkeypatch.delenv("QWEN38_STREAM_KERNEL", raising=False)
    else:
        monkeypatch.setenv("QWEN38_STREAM_KERNEL", value)
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
