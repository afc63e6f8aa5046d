"""Regenerate tests/fixtures/qwen4_exp: fp32 reference logits and QSA selections from
transformers' Qwen4ExpForCausalLM on the tiny random weights of
`qwen38_backend.testing.tiny_qwen4_exp.write_tiny_qwen4_exp(seed=SEED)`.

    python scripts/make_qwen4_exp_fixtures.py

Only small arrays are committed (logits, tokens, selections) plus a sha256 fingerprint of the
generated weights: tests regenerate the weights from the seed and check the fingerprint.
Needs torch==2.13.0 and transformers==5.23.0 (the project's `test` extra).
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from qwen38_backend.testing.tiny_qwen4_exp import write_tiny_qwen4_exp  # noqa: E402

OUT = ROOT / "tests" / "fixtures" / "qwen4_exp"
SEED = 0
EOS = 7
LENGTHS = (10, 40, 64)


def fingerprint(directory: Path) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        h.update((directory / name).read_bytes())
    return h.hexdigest()


def prompt(length: int) -> list[int]:
    """Random ids with EOS inside (and never at 0) so the n-gram reset is exercised."""
    rng = np.random.default_rng(1000 + length)
    ids = rng.integers(8, 512, size=length).tolist()
    for p in {length // 3, (2 * length) // 3}:
        ids[p] = EOS
    return ids


def hf_model(directory: Path) -> hf.Qwen4ExpForCausalLM:
    cfg = json.loads((directory / "config.json").read_text())["text_config"]
    cfg = {k: v for k, v in cfg.items() if k not in ("mtp_num_hidden_layers",)}
    config = Qwen4ExpTextConfig(**cfg)
    config._attn_implementation = "eager"
    model = hf.Qwen4ExpForCausalLM(config).eval().to(torch.float32)
    weights = load_file(str(directory / "model.safetensors"))
    state: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[int, np.ndarray]] = {}
    for name, w in weights.items():
        if name.startswith("mtp."):
            continue  # no HF reference for MTP
        name = name.replace("model.language_model.", "model.", 1)
        m = re.match(r"(.*ngram_embedding)\.shard_(\d+)\.weight$", name)
        if m:
            shards.setdefault(m.group(1), {})[int(m.group(2))] = w
            continue
        state[name] = torch.from_numpy(np.array(w))
    for prefix, parts in shards.items():
        state[prefix + ".weight"] = torch.from_numpy(
            np.concatenate([parts[i] for i in sorted(parts)], axis=0)
        )
    missing, unexpected = model.load_state_dict(state, strict=False)
    # rotary inv_freq buffers are not persistent; everything else must match exactly
    missing = [n for n in missing if "inv_freq" not in n]
    if missing or unexpected:
        raise SystemExit(f"name mismatch: missing={missing} unexpected={unexpected}")
    return model


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        weights_dir = write_tiny_qwen4_exp(Path(tmp) / "weights", seed=SEED)
        model = hf_model(weights_dir)
        fp = fingerprint(weights_dir)

    captured: dict[int, np.ndarray] = {}

    def hook(module, args, output):
        captured[module.layer_idx] = output[0, 0].numpy().astype(bool)  # [T, S]

    for layer in model.model.layers:
        if hasattr(layer, "self_attn"):
            layer.self_attn.indexer.register_forward_hook(hook)

    arrays: dict[str, np.ndarray] = {}
    tokens: dict[str, list[int]] = {}
    for n in LENGTHS:
        ids = prompt(n)
        captured.clear()
        with torch.no_grad():
            logits = model(torch.tensor([ids]), use_cache=False).logits[0]
        arrays[f"logits_{n}"] = logits.numpy().astype(np.float32)
        for layer_idx, mask in captured.items():
            arrays[f"selection_{n}_layer{layer_idx}"] = np.packbits(mask, axis=-1)
        tokens[str(n)] = ids
        print(f"length {n}: logits {tuple(logits.shape)}, layers {sorted(captured)}")
    np.savez_compressed(OUT / "reference.npz", **arrays)
    meta = {
        "seed": SEED,
        "fingerprint_sha256": fp,
        "tokens": tokens,
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "note": "selection_N_layerL: np.packbits of the reference indexer's [T, T] token mask",
    }
    (OUT / "reference.json").write_text(json.dumps(meta, indent=1))
    print(f"fingerprint {fp} -> {OUT}")


if __name__ == "__main__":
    main()
