"""Test helpers: tiny dense weights with a tokenizer, ready to load."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures"
DENSE_ARCHS = ("llama", "qwen2", "qwen3")


def dense_fixture(arch: str, target: Path) -> Path:
    """Copy committed tiny dense weights into target and give it the tiny tokenizer."""
    from qwen38_backend.templates import write_tiny_tokenizer

    src = FIXTURES / "dense" / arch
    dst = target / arch
    shutil.copytree(src, dst)
    write_tiny_tokenizer(dst)
    return dst


def dense_reference(arch: str) -> tuple[list[int], np.ndarray]:
    d = FIXTURES / "dense" / arch
    return json.loads((d / "reference_tokens.json").read_text()), np.load(
        d / "reference_logits.npy"
    )


@contextlib.contextmanager
def recorded(module, *names: str):
    """Inside: each call of module.<name> (for `names`) is appended to the yielded list by
    name, in order, then made as usual."""
    calls: list[str] = []
    real = {name: getattr(module, name) for name in names}

    def recorder(name):
        def call(*args, **kwargs):
            calls.append(name)
            return real[name](*args, **kwargs)

        return call

    for name in names:
        setattr(module, name, recorder(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(module, name, fn)


def random_moe(
    hidden: int, n_experts: int, top_k: int, inter: int, seed: int, quantized: bool = True
):
    """A SparseMoE with random weights scaled by their fan-in (shared expert as wide as a
    routed one), its experts 4-bit (groups of 64) unless not `quantized`."""
    import mlx.core as mx

    from qwen38_backend.models.moe import SparseMoE

    moe = SparseMoE(hidden, n_experts, top_k, inter, inter)
    keys = mx.random.split(mx.random.key(seed), 3)
    shapes = ((n_experts, 2 * inter, hidden), (n_experts, hidden, inter))
    moe.experts.gate_up_proj = hidden**-0.5 * mx.random.normal(shapes[0], key=keys[0])
    moe.experts.down_proj = inter**-0.5 * mx.random.normal(shapes[1], key=keys[1])
    moe.gate.weight = 1.6 * hidden**-0.5 * mx.random.normal((n_experts, hidden), key=keys[2])
    if quantized:
        moe.experts = moe.experts.to_quantized(group_size=64, bits=4)
    return moe


def random_gated_residual(hidden: int, streams: int, low_rank: int, eps: float, seed: int):
    """A GatedResidual (hyper-connections) with random weights scaled by their fan-in, its
    down and inject projections fused as after loading."""
    import mlx.core as mx

    from qwen38_backend.models.hyper_connections import GatedResidual

    hc = GatedResidual(hidden, streams, low_rank, eps)
    width = hidden * streams
    keys = mx.random.split(mx.random.key(seed), 4)
    hc.hc_norm.weight = 0.2 * mx.random.normal((width,), key=keys[0])
    down = (low_rank, width)
    hc.input_mix_weight_down.weight = width**-0.5 * mx.random.normal(down, key=keys[1])
    up = (width, low_rank)
    hc.input_mix_weight_up.weight = low_rank**-0.5 * mx.random.normal(up, key=keys[2])
    inject = (streams, width)
    hc.block_inject_weight.weight = width**-0.5 * mx.random.normal(inject, key=keys[3])
    hc.fuse()
    return hc


def set_switch(monkeypatch, variable: str, value: str | None) -> None:
    """Set a kernel switch (QWEN38_*_KERNEL) for one test; None: unset (its default)."""
    if value is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, value)


def greedy_off_on(
    monkeypatch, path, prompt: list[int], switch: str, on: str, reset, max_tokens: int, between
) -> tuple[list[int], list[int]]:
    """The greedy tokens of a tiny fp32 model at `path`, freshly loaded with the environment
    `switch` off, then `on` (reset() before each and after: the kernel's cached probes;
    between() in between), its traces uncompiled so that emulated kernels see values."""
    import mlx.core as mx

    import qwen38_backend

    def tokens(choice: str) -> list[int]:
        monkeypatch.setenv(switch, choice)
        reset()
        model = qwen38_backend.load(str(path), dtype="float32")
        return list(model.generate_tokens(prompt, max_tokens=max_tokens, stop_token_ids=[]))

    mx.disable_compile()
    try:
        plain = tokens("off")
        between()
        return plain, tokens(on)
    finally:
        mx.enable_compile()
        reset()


def random_linear_block(dtype, seed: int = 3, quantized_moe: bool = False):
    """A Flash-Next Gated DeltaNet layer (the tiny config with key and value heads of 32,
    the Gated DeltaNet kernel's smallest) with random weights in `dtype`, fused as loaded,
    and a one-row step's operands for its `_linear_step`: (R, the layer before's inject
    weights and output, conv history, recurrent state). `quantized_moe`: its MoE 8 experts
    of 64 in 4-bit, 2 a token, the shared expert fused (what the expert kernels run)."""
    import mlx.core as mx

    from qwen38_backend.config import LINEAR, Qwen4ExpConfig
    from qwen38_backend.models.layers import fuse_projections
    from qwen38_backend.models.qwen4_exp import Qwen4ExpBlock
    from qwen38_backend.testing.tiny_qwen4_exp import text_config

    config = text_config("tiny")
    config.update(linear_key_head_dim=32, linear_value_head_dim=32)
    cfg = Qwen4ExpConfig.from_dict(config)
    mx.random.seed(seed)
    block = Qwen4ExpBlock(cfg, LINEAR)
    if quantized_moe:
        block.mlp = random_moe(cfg.hidden_size, 8, 2, 64, seed=seed + 1)
    block.set_dtype(dtype)
    fuse_projections(block)
    mixer = block.linear_attn
    H, S = cfg.hidden_size, cfg.hc_count
    keys = mx.random.split(mx.random.key(seed + 5), 5)
    R = mx.random.normal((1, S * H), key=keys[0]).astype(dtype)
    inj = mx.random.normal((1, S), key=keys[1]).astype(dtype)
    out = mx.random.normal((1, H), key=keys[2]).astype(dtype)
    conv = mx.random.normal((mixer.conv_kernel - 1, mixer.conv_dim), key=keys[3]).astype(dtype)
    shape = (mixer.n_v_heads, mixer.v_head_dim, mixer.k_head_dim)
    recurrent = 0.1 * mx.random.normal(shape, key=keys[4])
    return block, (R, inj, out, conv, recurrent)


def random_qsa_block(dtype, seed: int = 12):
    """A Flash-Next QSA layer (the tiny config with attention heads of 256, the products'
    block, so its q/k/v side can fuse: two gated heads and one KV head; indexer heads of 64)
    with random weights in `dtype`, fused as loaded."""
    import mlx.core as mx

    from qwen38_backend.config import QSA, Qwen4ExpConfig
    from qwen38_backend.models.layers import fuse_projections
    from qwen38_backend.models.qwen4_exp import Qwen4ExpBlock
    from qwen38_backend.testing.tiny_qwen4_exp import text_config

    config = text_config("tiny")
    config.update(head_dim=256, num_attention_heads=2, num_key_value_heads=1, indexer_head_dim=64)
    config["rope_parameters"]["mrope_section"] = [16, 8, 8]
    mx.random.seed(seed)
    block = Qwen4ExpBlock(Qwen4ExpConfig.from_dict(config), QSA)
    block.set_dtype(dtype)
    fuse_projections(block)
    return block
