"""The q/k norm + RoPE kernel's reference (kernels/qk_norm_rope.py) on the CPU: it is what
the GPU tests and the kernel's probe compare against, so it must be the attention layer's
own op path, and the layer must keep that path where the kernel cannot run."""

from __future__ import annotations

import mlx.core as mx
import pytest
from qwen38_backend.kernels import qk_norm_rope as kernel

from qwen38_backend.models.layers import Attention, rope_from_config


def _attention(gated: bool, interleaved: bool, dtype: mx.Dtype) -> Attention:
    rope = rope_from_config(64, 1e6, None, partial_factor=0.5, interleaved=interleaved)
    attn = Attention(
        96, 4, 2, 64, rope, qk_norm_eps=1e-6, zero_centered_norm=True, output_gate=gated
    )
    keys = mx.random.split(mx.random.key(3), 2)
    attn.q_norm.weight = 0.3 * mx.random.normal((64,), key=keys[0])
    attn.k_norm.weight = 0.3 * mx.random.normal((64,), key=keys[1])
    attn.set_dtype(dtype)
    attn.fuse()
    for norm in (attn.q_norm, attn.k_norm):
        norm.fuse()
    return attn


@pytest.mark.parametrize("gated, interleaved", [(True, False), (False, True)])
def test_reference_is_the_layers_op_path(gated, interleaved):
    """reference() of the fused projection's rows == Attention.project_qkv's q, k and gate
    (zero-centred q/k norms, partial rotary, deep offset), bit for bit."""
    dtype = mx.bfloat16
    attn = _attention(gated, interleaved, dtype)
    x = mx.random.normal((3, 96), key=mx.random.key(4)).astype(dtype)
    offset = mx.array(70_001, dtype=mx.int32)
    q, k, _, gate = attn.project_qkv(x, offset)
    layout = kernel.HeadLayout(4, 2, 64, gated, 1e-6, 32, 1e6, 1.0, interleaved)
    want = kernel.reference(
        attn.qkv_proj(x), attn.q_norm.scale(), attn.k_norm.scale(), offset, layout
    )
    assert mx.array_equal(q, want[0]).item()
    assert mx.array_equal(k, want[1]).item()
    assert (gate is None) == (want[2] is None)
    if gate is not None:
        assert mx.array_equal(gate, want[2]).item()


def test_the_layer_keeps_the_op_path_without_the_kernel():
    """On a device the kernel does not run on, prepare_decode leaves the step on the op path."""
    attn = _attention(True, False, mx.float32)
    attn.prepare_decode()
    assert attn._qk_kernel_for == ""
    assert not kernel.supported(kernel.HeadLayout(4, 2, 64, True, 1e-6, 32, 1e6, 1.0, False))


def test_within_ulps_can_fail():
    """The tests' closeness rule rejects a value three ulps off and takes one two ulps off."""
    want = mx.array([1.0, -2.0, 0.5], dtype=mx.bfloat16)
    two = mx.array([1.0 + 2 * 2.0**-7, -2.0, 0.5], dtype=mx.float32)
    three = mx.array([1.0, -2.0 - 3 * 2.0**-6, 0.5], dtype=mx.float32)
    assert kernel.within_ulps(two, want, 2)
    assert not kernel.within_ulps(three, want, 2)
