"""Regenerate tests/fixtures/qwen3_5: fp32 reference logits of transformers' Qwen3_5ForCausalLM
on the tiny random qwen3_5 weights (make_tiny_weights("qwen3_5", seed=SEED)).

    python scripts/make_qwen3_5_fixtures.py

Only the logits, the token ids and the weights' fingerprint are committed; the test
regenerates the weights from the seed and checks the fingerprint, so a drift in the
generator is caught. Needs torch==2.13.0 and transformers==5.23.0 (the `test` extra).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file

from qwen38_backend.testing import make_tiny_weights
from qwen38_backend.testing.tiny_qwen3_5 import fingerprint

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "qwen3_5"
SEED = 1234
LENGTHS = (10, 40, 64)


def tokens(n: int) -> list[int]:
    # fixed, spread over the whole vocab (512)
    return [int((37 * i * i + 101 * i + 7) % 512) for i in range(n)]


def hf_model(weights_dir: Path) -> transformers.Qwen3_5ForCausalLM:
    cfg_dict = json.loads((weights_dir / "config.json").read_text())["text_config"]
    cfg = transformers.Qwen3_5TextConfig(**cfg_dict)
    model = transformers.Qwen3_5ForCausalLM(cfg).eval().to(torch.float32)
    # the weights store the trunk under model.language_model.; the CausalLM under model.
    state = {}
    for name, arr in load_file(str(weights_dir / "model.safetensors")).items():
        if name.startswith("mtp."):
            continue
        state[name.replace("model.language_model.", "model.", 1)] = torch.from_numpy(arr.copy())
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise SystemExit(f"weights do not match: missing {missing}, unexpected {unexpected}")
    return model


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        weights_dir = make_tiny_weights("qwen3_5", Path(tmp) / "weights", seed=SEED)
        model = hf_model(weights_dir)
        meta = {
            "seed": SEED,
            "fingerprint": fingerprint(weights_dir),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "tokens": {},
        }
        for n in LENGTHS:
            ids = tokens(n)
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].numpy().astype(np.float32)
            np.save(OUT / f"logits_{n}.npy", logits)
            meta["tokens"][str(n)] = ids
            print(f"{n} tokens: logits {logits.shape}", file=sys.stderr)
        (OUT / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
