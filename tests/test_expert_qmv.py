"""The expert kernels (kernels/expert_qmv.py) on the CPU: the layout their CUDA code assumes
(MLX's 4-bit packing, groups, gate rows before up rows) against the MoE layer's op path, and
the layer keeping that path where the kernels are off or cannot run (on by default)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import random_moe, set_switch
from qwen38_backend.kernels import expert_qmv as kernel

from qwen38_backend.models.moe import SparseMoE


def _moe(quantized: bool = True) -> SparseMoE:
    return random_moe(256, 8, 3, 128, seed=2, quantized=quantized)


def _kernel_model(x, inds, weights, experts) -> np.ndarray:
    """The kernels' arithmetic in numpy fp32, as their lanes do it: word w of a packed row
    holds elements 8w .. 8w + 7 (element 8w + i in bits 4i .. 4i + 3), each group's scale
    times sum(x q) plus its bias times sum(x); gate rows first, then up rows; silu(gate) * up;
    down; the routing-weighted sum."""

    def products(stack: dict, rows: np.ndarray, e: int) -> np.ndarray:
        words = np.array(stack["weight"][e]).astype(np.uint64)  # [N, K / 8]
        q = (words[:, :, None] >> (4 * np.arange(8, dtype=np.uint64))) & 0xF
        q = q.reshape(words.shape[0], -1).astype(np.float32)  # [N, K]
        groups = np.array(stack["scales"][e]).shape[1]
        scale = np.repeat(np.array(stack["scales"][e]), q.shape[1] // groups, axis=1)
        bias = np.repeat(np.array(stack["biases"][e]), q.shape[1] // groups, axis=1)
        return (scale * q + bias) @ rows

    out = []
    inter = experts.intermediate
    for t in range(x.shape[0]):
        total = 0.0
        for j in range(inds.shape[1]):
            e = int(inds[t, j])
            gu = products(experts.gate_up_proj, np.array(x[t]), e)
            gate, up = gu[:inter], gu[inter:]
            h = gate / (1 + np.exp(-gate)) * up
            total = total + float(weights[t, j]) * products(experts.down_proj, h, e)
        out.append(total)
    return np.stack(out)


@pytest.mark.parametrize("rows", [1, 3])
def test_the_kernels_layout_is_the_op_paths(rows):
    """A numpy model of the kernels' word-by-word arithmetic gives the layer's op path
    (reference, fp32) to fp32 rounding: the packing, group and gate / up layout the CUDA
    kernels assume are MLX's."""
    moe = _moe()
    x = mx.random.normal((rows, 256), key=mx.random.key(rows))
    inds, weights = moe.route(x)
    want = np.array(kernel.reference(x, inds, weights, moe.experts))
    got = _kernel_model(x, np.array(inds), np.array(weights), moe.experts)
    assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)


@pytest.mark.parametrize("value", [None, "auto", "off"])
def test_the_layer_keeps_its_op_path_where_the_kernels_are_off(monkeypatch, value):
    """Switched off, or unavailable off CUDA when on (the default): prepare_decode chooses
    nothing and the routed experts run as ops."""
    set_switch(monkeypatch, "QWEN38_EXPERT_KERNEL", value)
    kernel.available.cache_clear()
    moe = _moe()
    moe.prepare_decode()
    assert moe._kernel_for == ""
    x = mx.random.normal((2, 256), key=mx.random.key(5))
    assert not moe._fused(x)
    kernel.available.cache_clear()


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
