"""MTP rounds on a hybrid qwen3_5 on the CPU with an oracle draft: what a head that agrees with
probability p buys, and what replaying the recurrent layers (instead of a second forward after
a rejection) is worth. Random weights (no trained MTP head runs on this CPU), so the MTP head
runs as usual (its cost is in the figures) but its proposal is replaced by the plain stream's
own next tokens, each kept with probability p, else changed.

Model: qwen3_5 with 1024 hidden, 16 layers (12 Gated DeltaNet + 4 attention), vocab 8,000
(the head costs ~8% of a step, near the 27B's ~6%: one layer + LM head of 65 layers),
fp32, random. Greedy decode of `--tokens` after a 64-token prompt; plain and every (k, p,
rollback) setting interleaved run by run, medians of `--runs`; streams checked equal to plain.

    QWEN38_HOME=~/.cache/qwen38-test-home .venv/bin/python \\
        benchmarks/bench_speculative_oracle_cpu.py \\
        --out benchmarks/results/cpu/speculative_oracle_qwen3_5_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import common  # first: it loads the system OpenBLAS before MLX
import numpy as np

import qwen38_backend
from qwen38_backend import drafts, speculative
from qwen38_backend.testing import make_tiny_weights

DIMS = dict(
    vocab_size=8000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=16,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    mrope_section=[8, 4, 4],  # half of the 32 rotary dims (partial rotary 0.25 of 128)
)


def install_oracle(plain: list[int], prompt_len: int, p: float, seed: int) -> None:
    """MTPTrack.draft runs the head, then proposes the plain stream's tokens kept w.p. p."""
    rng = np.random.default_rng(seed)
    real = install_oracle.real

    def draft(self, net, next_token, k):
        _, keep = real(self, net, next_token, k)
        done = self.seen - prompt_len + 1
        out = list(plain[done : done + k])
        for i in range(len(out)):
            if rng.random() >= p:
                out[i] = (out[i] + 1) % DIMS["vocab_size"]
        return out, keep

    drafts.MTPTrack.draft = draft


install_oracle.real = drafts.MTPTrack.draft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--k", default="1,2,3")
    ap.add_argument("--p", default="0.5,0.65,0.8,0.9")
    ap.add_argument("--out")
    args = ap.parse_args()

    directory = make_tiny_weights("qwen3_5", tempfile.mkdtemp(), **DIMS)
    model = qwen38_backend.load(str(directory))
    prompt = np.random.default_rng(0).integers(10, DIMS["vocab_size"], 64).tolist()
    opts = {"max_tokens": args.tokens, "stop_token_ids": []}
    plain = list(model.generate_tokens(prompt, draft="off", **opts))  # also compiles
    settings = [("plain", None, None, None)]
    for k in [int(x) for x in args.k.split(",")]:
        for p in [float(x) for x in args.p.split(",")]:
            for rollback in ("replay", "refeed"):
                settings.append((f"k{k} p{p} {rollback}", k, p, rollback))
    can_replay = speculative._can_replay
    rates: dict[str, list[float]] = {name: [] for name, *_ in settings}
    figures: dict[str, dict] = {}
    identical = True
    for run in range(args.runs):
        for name, k, p, rollback in settings:
            if k is None:
                stream = model.generate_tokens(prompt, draft="off", **opts)
            else:
                install_oracle(plain, len(prompt), p, seed=run)
                speculative._can_replay = can_replay if rollback == "replay" else (lambda s: False)
                stream = model.generate_tokens(prompt, draft="mtp", draft_tokens=k, **opts)
            tokens = list(stream)
            identical &= tokens == plain
            rates[name].append(stream.stats.decode_tokens_per_second)
            figures[name] = stream.stats.draft_stats()
    speculative._can_replay = can_replay
    base = statistics.median(rates["plain"])
    rows = {}
    for name, *_ in settings:
        med = statistics.median(rates[name])
        rows[name] = {
            "decode_tok_s": {"median": med, "runs": rates[name]},
            "vs_plain": med / base,
            "draft": figures[name],
        }
        print(f"{name}: {med:.2f} tok/s (x{med / base:.2f})", flush=True)
    common.write_json(
        {
            "benchmark": "MTP rounds with an oracle draft, qwen3_5 (random, 1024 hidden, 16 "
            "layers, vocab 8000, fp32), greedy",
            "prompt_tokens": len(prompt),
            "tokens": args.tokens,
            "runs": args.runs,
            "identical_to_plain": identical,
            "environment": common.environment(),
            "settings": rows,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
