"""The split-KV decode attention kernel's CPU side: the module imports without CUDA, the
probe says no, the stores' one-token path is mx.fast.scaled_dot_product_attention, and bad
shapes are refused before any work. (The kernel itself: tests/test_gpu.py, --run-gpu.)"""

from __future__ import annotations

import mlx.core as mx
import pytest
from qwen38_backend.kernels import decode_attention as kernel

from qwen38_backend.kv import PagedKV, one_token
from qwen38_backend.kv.contiguous import ContiguousKV

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU fallback")


def qkv(hq=6, hkv=2, length=40, d=64, dtype=mx.float32):
    keys = mx.random.split(mx.random.key(3), 3)
    q = mx.random.normal((1, hq, 1, d), key=keys[0]).astype(dtype)
    k = mx.random.normal((1, hkv, length, d), key=keys[1]).astype(dtype)
    v = mx.random.normal((1, hkv, length, d), key=keys[2]).astype(dtype)
    return q, k, v


def test_no_kernel_on_cpu():
    q, k, v = qkv()
    kernel.check_shapes(q, k, v)  # a shape the kernel takes ...
    assert not kernel.supported(q, k, v)  # ... but not on this device
    assert not kernel.usable(q, k, v)
    assert not kernel.available(mx.float32, mx.float32, 64, 3)


def test_one_token_attention_is_the_mlx_op_on_cpu(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the CUDA kernel ran on CPU")

    monkeypatch.setattr(kernel, "decode_attention", refuse)
    q, k, v = qkv()
    got = one_token.attend_one_token(q, k, v, 0.125)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
    assert mx.array_equal(got, want)
    for store in (ContiguousKV(), PagedKV(page_tokens=8, budget=16, always_select=True)):
        store.attend(q, k[:, :, :-1], v[:, :, :-1], 0.125)  # prefill 39 rows
        out = store.attend(q, k[:, :, -1:], v[:, :, -1:], 0.125)
        assert out.shape == q.shape and mx.isfinite(out).all().item()


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (((1, 6, 10, 64), (1, 2, 9, 64), (1, 2, 9, 64)), "q must be"),  # more rows than keys
        (((1, 6, 1, 64), (2, 2, 9, 64), (2, 2, 9, 64)), "k must be"),
        (((1, 6, 1, 64), (1, 2, 9, 64), (1, 2, 8, 64)), "must have k's shape"),
        (((1, 6, 1, 64), (1, 2, 9, 32), (1, 2, 9, 32)), "head_dim 64 != k head_dim 32"),
        (((1, 6, 1, 64), (1, 2, 0, 64), (1, 2, 0, 64)), "no keys"),
        (((1, 6, 1, 64), (1, 4, 9, 64), (1, 4, 9, 64)), "not a multiple"),
        (((1, 6, 1, 48), (1, 2, 9, 48), (1, 2, 9, 48)), "head_dim 48"),
    ],
)
def test_bad_shapes_are_refused(shapes, message):
    q, k, v = (mx.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        kernel.decode_attention(q, k, v, 1.0)
    assert not kernel.supported(q, k, v)


def test_a_large_group_runs_in_parts():
    """No group is refused: one too large for a form is split into the fewest equal parts it
    takes (tensor cores: 8 heads a block; fp32 FMAs at D 64: 16 heads' queries)."""
    assert kernel.head_parts(6, 256, mx.bfloat16, True) == 1
    assert kernel.head_parts(12, 256, mx.bfloat16, True) == 2
    assert kernel.head_parts(9, 256, mx.bfloat16, True) == 3
    assert kernel.head_parts(64, 64, mx.float32, False) == 4
    assert kernel.head_parts(12, 256, mx.float32, False) == 2
    q, k, v = mx.zeros((1, 64, 1, 64)), mx.zeros((1, 1, 9, 64)), mx.zeros((1, 1, 9, 64))
    kernel.check_shapes(q, k, v)


def test_bad_dtypes_and_splits_are_refused():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="dtypes"):
        kernel.decode_attention(q, k.astype(mx.bfloat16), v, 1.0)
    with pytest.raises(ValueError, match="dtypes"):
        kernel.decode_attention(q, k.astype(mx.int32), v.astype(mx.int32), 1.0)
    with pytest.raises(ValueError, match="splits=41"):
        kernel.decode_attention(q, k, v, 1.0, splits=41)


def test_split_count():
    wave = kernel.SMS * kernel.BLOCKS_PER_SM // 4
    assert kernel.n_splits(1, 4) == 1
    assert kernel.n_splits(kernel.MIN_SPLIT_ROWS, 4) == 1
    assert kernel.n_splits(kernel.MIN_SPLIT_ROWS + 1, 4) == 2
    assert kernel.n_splits(1 << 20, 4) == wave
    assert kernel.n_splits(1 << 20, 4, tensor_cores=True) == kernel.MMA_BLOCKS // 4
    assert kernel.n_splits(kernel.MMA_MIN_SPLIT_ROWS, 4, tensor_cores=True) == 1
    assert kernel.n_splits(2048, 4, tensor_cores=True) == 2048 // kernel.MMA_MIN_SPLIT_ROWS
    for length in (1, 7, 255, 4096, 33000, 262144):
        for tensor_cores in (False, True):
            s = kernel.n_splits(length, 4, tensor_cores)
            assert 1 <= s <= length and -(-length // s) * (s - 1) < length  # no empty split


@pytest.mark.parametrize(
    "variable", ["QWEN38_QUEST_KERNEL", "QWEN38_ROWS_KERNEL", "QWEN38_DECODE_ATTN_KERNEL"]
)
def test_an_unknown_kernel_switch_is_refused_by_name(monkeypatch, variable):
    """auto | off | force, read by one helper: a typo is an error naming the variable and
    the choices, not a silent auto."""
    from qwen38_backend.kernels import decode_attention, rows_matmul
    from qwen38_backend.kernels.switch import kernel_switch

    from qwen38_backend.kv import quest

    monkeypatch.setenv(variable, "Off ")
    assert kernel_switch(variable) == "off"
    monkeypatch.setenv(variable, "yes")
    with pytest.raises(ValueError, match=f"{variable}='yes': must be one of auto, off, force"):
        kernel_switch(variable)
    with pytest.raises(ValueError, match=variable):
        if variable == "QWEN38_QUEST_KERNEL":
            q, meta = mx.zeros((4, 64)), mx.zeros((2, 8, 64))
            quest.kernel_usable(q, meta, meta)
        elif variable == "QWEN38_ROWS_KERNEL":
            rows_matmul.available.__wrapped__(mx.float32)
        else:
            decode_attention.enabled()


def test_gathered_attention_is_gqa_attention_with_the_heads_as_rows():
    """QSA's one-token attention over its gathered keys (Flash-Next: 12 query heads per KV
    head) equals MLX's GQA attention of every head, in head order."""
    q, k, v = qkv(hq=24, hkv=2)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
    got = one_token.attend_gathered(q, k, v, 0.125)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-6).item()
