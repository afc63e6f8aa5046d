"""The expert kernels' reference (kernels/expert_qmv.py) on the CPU: the GPU tests and the
kernels' probe compare against it, so it must be the MoE layer's own op path; and the layer
keeps that path where the kernels are off (their default) or cannot run."""

from __future__ import annotations

import mlx.core as mx
import pytest
from qwen38_backend.kernels import expert_qmv as kernel

from qwen38_backend.models.moe import SparseMoE


def _moe(quantized: bool = True) -> SparseMoE:
    moe = SparseMoE(256, 8, 3, 128, 64)
    keys = mx.random.split(mx.random.key(2), 3)
    moe.experts.gate_up_proj = 0.06 * mx.random.normal((8, 256, 256), key=keys[0])
    moe.experts.down_proj = 0.09 * mx.random.normal((8, 256, 128), key=keys[1])
    moe.gate.weight = 0.1 * mx.random.normal((8, 256), key=keys[2])
    if quantized:
        moe.experts = moe.experts.to_quantized(group_size=64, bits=4)
    return moe


@pytest.mark.parametrize("rows", [1, 3])
def test_reference_is_the_layers_op_path(rows):
    """reference() computes what SparseMoE's routed experts compute, bit for bit."""
    moe = _moe()
    x = mx.random.normal((rows, 256), key=mx.random.key(rows))
    inds, weights = moe.route(x)
    routed = moe.experts(x, inds)
    want = (routed * weights[..., None].astype(routed.dtype)).sum(axis=1)
    e = moe.experts
    got = kernel.reference(x, inds, weights, e.gate_up_proj, e.down_proj, e.group_size)
    assert mx.array_equal(got, want).item()


def test_the_layer_keeps_its_op_path_where_the_kernels_are_off(monkeypatch):
    """Off by default: prepare_decode chooses nothing and the routed experts run as ops."""
    monkeypatch.delenv("QWEN38_EXPERT_KERNEL", raising=False)
    kernel.available.cache_clear()
    moe = _moe()
    moe.prepare_decode()
    assert moe._kernel_for == ""
    x = mx.random.normal((2, 256), key=mx.random.key(5))
    assert not moe._fused(x)


def test_unknown_switch_values_are_refused(monkeypatch):
    monkeypatch.setenv("QWEN38_EXPERT_KERNEL", "sometimes")
    kernel.available.cache_clear()
    with pytest.raises(ValueError, match="QWEN38_EXPERT_KERNEL"):
        _moe().prepare_decode()
    kernel.available.cache_clear()


def test_fits_names_what_the_kernels_take():
    """4-bit affine experts with half-precision scales and rows; not float experts, other
    widths of x, or 8-bit experts."""
    moe = _moe()
    moe.set_dtype(mx.bfloat16)
    x = mx.zeros((1, 256), dtype=mx.bfloat16)
    assert kernel.fits(x, moe.experts, 3)
    assert not kernel.fits(x.astype(mx.float32), moe.experts, 3)
    assert not kernel.fits(mx.zeros((1, 128), dtype=mx.bfloat16), moe.experts, 3)
    assert not kernel.fits(x, _moe(quantized=False).experts, 3)
    eight = _moe(quantized=False)
    eight.experts = eight.experts.to_quantized(group_size=64, bits=8)
    eight.set_dtype(mx.bfloat16)
    assert not kernel.fits(x, eight.experts, 3)
