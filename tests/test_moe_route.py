"""The routing kernel (kernels/moe_route.py) on the CPU: the comparison its probe makes, the
shapes it takes, and the MoE layer keeping the op path where the kernel is off or cannot
run (on by default). The kernel itself runs in tests/test_gpu.py (--run-gpu) and compiles in
tests/test_kernel_sources.py (--run-nvcc)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers import set_switch
from qwen38_backend.kernels import moe_route as kernel

from qwen38_backend.models.moe import SparseMoE, route


def _routing(rows: int = 4, experts: int = 64, k: int = 6):
    logits = 2 * mx.random.normal((rows, experts), key=mx.random.key(rows))
    return logits, route(logits, k, True)


def test_same_routes_takes_the_experts_in_any_order():
    _, (inds, weights) = _routing()
    flipped = (inds[:, ::-1], weights[:, ::-1])
    assert kernel.same_routes(flipped, (inds, weights))


def test_same_routes_refuses_another_expert():
    _, (inds, weights) = _routing()
    other = mx.where(mx.arange(inds.shape[1]) == 0, (inds + 1) % 64, inds).astype(mx.uint32)
    assert not mx.array_equal(other, inds).item()
    assert not kernel.same_routes((other, weights), (inds, weights))


def test_same_routes_allows_a_few_ulps_and_no_more():
    _, (inds, weights) = _routing()
    assert kernel.same_routes((inds, weights * (1 + 3 * 2.0**-23)), (inds, weights))
    assert not kernel.same_routes((inds, weights * (1 + 128 * 2.0**-23)), (inds, weights))
    # one weight moved to another expert of the row: the weights no longer pair up
    swapped = mx.concatenate([weights[:, 1:2], weights[:, :1], weights[:, 2:]], axis=1)
    assert not kernel.same_routes((inds, swapped), (inds, weights))


def test_fits_names_what_the_kernel_takes():
    assert kernel.fits(mx.zeros((3, 512), mx.bfloat16), 10)
    assert kernel.fits(mx.zeros((1, 8), mx.float32), 8)
    assert not kernel.fits(mx.zeros((1, 8), mx.float32), 9)  # more experts than there are
    assert not kernel.fits(mx.zeros((1, 2048), mx.float32), 10)  # over a warp's registers
    assert not kernel.fits(mx.zeros((1, 512), mx.int32), 10)
    assert not kernel.fits(mx.zeros((2, 3, 512), mx.float32), 10)


def _moe() -> SparseMoE:
    moe = SparseMoE(64, 16, 4, 32, 32)
    moe.gate.weight = 0.2 * mx.random.normal((16, 64), key=mx.random.key(3))
    return moe


@pytest.mark.parametrize("value", [None, "auto", "off"])
def test_the_layer_routes_with_ops_where_the_kernel_is_off(monkeypatch, value):
    """Switched off, or unavailable off CUDA when on (the default): prepare_decode chooses
    nothing and route() is moe.route over the router's logits, bit for bit."""
    moe = _moe()
    x = mx.random.normal((3, 64), key=mx.random.key(4))
    set_switch(monkeypatch, "QWEN38_ROUTE_KERNEL", value)
    kernel.available.cache_clear()
    moe.prepare_decode()
    assert moe._route_for == ""
    inds, weights = moe.route(x)
    want_inds, want_weights = route(moe.gate(x), 4, True)
    assert mx.array_equal(inds, want_inds).item()
    assert mx.array_equal(weights, want_weights).item()
    kernel.available.cache_clear()


def test_unknown_switch_values_are_refused(monkeypatch):
    monkeypatch.setenv("QWEN38_ROUTE_KERNEL", "sometimes")
    kernel.available.cache_clear()
    with pytest.raises(ValueError, match="QWEN38_ROUTE_KERNEL"):
        _moe().prepare_decode()
    kernel.available.cache_clear()
