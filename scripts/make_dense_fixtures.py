"""Regenerate tests/fixtures/dense: tiny random llama / qwen2 / qwen3 weights saved with
transformers' save_pretrained, plus their fp32 logits on a fixed token sequence.

    python scripts/make_dense_fixtures.py

Needs torch==2.13.0 and transformers==5.23.0 (the project's `test` extra).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "dense"
TOKENS = [1, 17, 300, 45, 2, 99, 511, 0, 256, 128, 77, 3, 400, 12, 250, 6]

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,  # a window tests can fill (RoPE logits do not depend on it)
    rms_norm_eps=1e-5,
)

VARIANTS = {
    "llama": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(tie_word_embeddings=True, rope_theta=10000.0),
    ),
    "qwen2": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(tie_word_embeddings=False, rope_theta=1000000.0),
    ),
    "qwen3": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(tie_word_embeddings=False, head_dim=32, rope_theta=1000000.0),
    ),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """HF init leaves norms at 1 and biases at 0: randomize every parameter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.2 if "norm" not in name else 0.1
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + scale * torch.randn(p.shape, generator=gen))


def main() -> None:
    for i, (name, (cfg_cls, model_cls, extra)) in enumerate(VARIANTS.items()):
        cfg = cfg_cls(**COMMON, **extra)
        model = model_cls(cfg).eval().to(torch.float32)
        randomize(model, seed=1000 + i)
        target = OUT / name
        model.save_pretrained(target, safe_serialization=True)
        with torch.no_grad():
            logits = model(torch.tensor([TOKENS])).logits[0].numpy().astype(np.float32)
        np.save(target / "reference_logits.npy", logits)
        (target / "reference_tokens.json").write_text(json.dumps(TOKENS))
        print(f"{name}: {logits.shape} -> {target}", file=sys.stderr)


if __name__ == "__main__":
    main()
