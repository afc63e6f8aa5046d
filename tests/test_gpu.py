"""Checks that only mean something on a GPU (opt in with --run-gpu; run on the H200)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def on_gpu():
    if mx.default_device() == mx.cpu:
        pytest.fail("--run-gpu needs MLX with a GPU backend (metal or cuda)")


def test_zero_centred_norm_mixed_precision_equals_cast_first():
    """RMSNorm feeds bf16 x straight to the fused kernel with the fp32 (1 + w); it must give
    the same bits as casting x to fp32 first (QWEN38.md's definition)."""
    for seed in range(3):
        mx.random.seed(seed)
        x = (3 * mx.random.normal((16, 5120))).astype(mx.bfloat16)
        scale = 1.0 + 0.1 * mx.random.normal((5120,))
        fast = mx.fast.rms_norm(x, scale, 1e-6).astype(mx.bfloat16)
        ref = mx.fast.rms_norm(x.astype(mx.float32), scale, 1e-6).astype(mx.bfloat16)
        assert (fast != ref).sum().item() == 0


def test_fused_delta_rule_matches_the_recurrence_on_gpu():
    from qwen38_backend.models.gated_deltanet import prepare_qk, recurrent_gated_delta

    T, Hk, Hv, D = 5, 16, 48, 128
    mx.random.seed(0)
    q, k = mx.random.normal((T, Hk, D)), mx.random.normal((T, Hk, D))
    v = mx.random.normal((T, Hv, D))
    g = -mx.random.uniform(0.01, 1.0, (T, Hv))
    beta = mx.random.uniform(0.0, 1.0, (T, Hv))
    S0 = 0.1 * mx.random.normal((Hv, D, D))
    qp, kp = prepare_qk(q, k, Hv)
    o_ref, S_ref = recurrent_gated_delta(qp, kp, v, g, beta, S0)
    qn = q * mx.rsqrt((q * q).sum(-1, keepdims=True) + 1e-6) * D**-0.5
    kn = k * mx.rsqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    o, S = mx.fast.gated_delta_update(
        qn[None], kn[None], v[None], mx.exp(g)[None], beta[None], S0.swapaxes(-1, -2)[None]
    )
    assert np.abs(np.array(o[0]) - np.array(o_ref)).max() < 1e-4
    assert np.abs(np.array(S[0].swapaxes(-1, -2)) - np.array(S_ref)).max() < 1e-4


def test_greedy_decode_equals_full_forward_argmax_fp32(tmp_path):
    """fp32 on the GPU: the cached decode path picks the same tokens as fresh full forwards."""
    from helpers import dense_fixture

    import qwen38_backend

    model = qwen38_backend.load(dense_fixture("qwen3", tmp_path), dtype="float32")
    prompt = [11, 12, 13, 200]
    ours = list(model.generate_tokens(prompt, max_tokens=16, stop_token_ids=[]))
    ids = list(prompt)
    for _ in range(16):
        ids.append(int(np.argmax(model.logits(ids)[-1])))
    assert ours == ids[len(prompt) :]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gdn_decode_kernel_matches_the_op_path(dtype):
    """The fused CUDA decode step against `_gdn_core` over 8 chained steps (27B dims)."""
    from qwen38_backend.kernels import gdn_decode

    from qwen38_backend.models.gated_deltanet import _gdn_core

    if not mx.cuda.is_available():
        pytest.skip("the fused Gated DeltaNet decode kernel is CUDA-only")
    hk, hv, dk, dv, kw = 16, 48, 128, 128, 4
    spec = (hk, hv, dk, dv, 1e-6, "silu")
    assert gdn_decode.available(spec, dtype)
    conv_dim = 2 * hk * dk + hv * dv
    mx.random.seed(1)
    conv_w = (0.5 * mx.random.normal((conv_dim, kw))).astype(dtype)
    A_log = mx.random.uniform(0.0, 2.0, (hv,)).astype(dtype)
    dt_bias = mx.random.uniform(-1.0, 1.0, (hv,)).astype(dtype)
    norm_w = (1 + 0.1 * mx.random.normal((dv,))).astype(dtype)
    ours = ref = (mx.zeros((kw - 1, conv_dim), dtype), mx.zeros((hv, dv, dk)))
    for _ in range(8):
        x = [
            mx.random.normal(shape).astype(dtype)
            for shape in ((1, conv_dim), (1, hv * dv), (1, hv), (1, hv))
        ]
        o1, *ours = gdn_decode.gdn_decode_step(
            *x, ours[0], conv_w, A_log, dt_bias, ours[1], norm_w, spec=spec
        )
        o2, *ref = _gdn_core(*x, ref[0], conv_w, A_log, dt_bias, ref[1], norm_w, spec=spec)
        assert (ours[0] != ref[0]).sum().item() == 0  # the conv history is a copy
        for a, b in ((ours[1], ref[1]), (o1, o2)):
            a, b = a.astype(mx.float32), b.astype(mx.float32)
            if dtype == mx.float32:
                assert mx.abs(a - b).max().item() < 1e-4
            else:  # the paths may round a value an ulp apart: compare norms
                assert (mx.linalg.norm(a - b) / mx.linalg.norm(b)).item() < 2.0**-7
        ours = [ours[0], ours[1]]
        ref = [ref[0], ref[1]]
