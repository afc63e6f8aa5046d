"""Prefill with blocked attention (kv/blocked.py) vs one-shot attention, same process.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
    python benchmarks/bench_blocked_prefill.py --model qwen38-demo --lengths 128,1024,4096 \
        --runs 3 --out benchmarks/results/cpu/blocked_prefill_demo.json

"one_shot" sets the block size beyond the context (every chunk attends over the whole past
in one scaled_dot_product_attention: the path before blocking); "blocked" is the default.
Runs alternate between the two so machine load hits both alike. Reports prefill tok/s
(median of runs) and peak memory of one prefill per mode and length.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from bench import prompt_ids
from common import environment, write_json

import qwen38_backend
from qwen38_backend.kv import ContiguousKV, PagedKV, blocked
from qwen38_backend.kv.blocked import BLOCK_TOKENS, ONE_SHOT_BYTES


def set_block(tokens: int) -> None:
    ContiguousKV.block_tokens = tokens
    PagedKV.block_tokens = tokens
    blocked.ONE_SHOT_BYTES = ONE_SHOT_BYTES if tokens == BLOCK_TOKENS else 1 << 62


def one_prefill(model, ids: list[int], kv: dict) -> tuple[float, int]:
    state = model.new_state(**kv)
    mx.eval(mx.zeros(1))
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t = time.perf_counter()
    mx.eval(model.prefill(ids, state))
    seconds = time.perf_counter() - t
    return len(ids) / seconds, mx.get_peak_memory() - base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen38-demo")
    ap.add_argument("--lengths", default="128,1024,4096")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--paged", action="store_true", help="kv_paged=on instead of contiguous")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    model = qwen38_backend.load(args.model)
    kv = {"kv_paged": "on", "kv_topk": 10**6} if args.paged else {}
    modes = {"blocked": BLOCK_TOKENS, "one_shot": 1 << 40}
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        ids = prompt_ids(model.config.vocab_size, length)
        set_block(BLOCK_TOKENS)
        one_prefill(model, ids, kv)  # warm-up
        speed = {m: [] for m in modes}
        peak = {m: 0 for m in modes}
        for _ in range(args.runs):
            for mode, block in modes.items():
                set_block(block)
                tok_s, p = one_prefill(model, ids, kv)
                speed[mode].append(tok_s)
                peak[mode] = max(peak[mode], p)
        set_block(BLOCK_TOKENS)
        row = {"length": length, "chunk": model.prefill_chunk}
        for mode in modes:
            row[mode] = {
                "prefill_tok_s": statistics.median(speed[mode]),
                "runs": speed[mode],
                "peak_memory_bytes": peak[mode],
            }
        row["blocked_over_one_shot"] = (
            row["blocked"]["prefill_tok_s"] / row["one_shot"]["prefill_tok_s"]
        )
        rows.append(row)
    write_json(
        {
            "benchmark": "blocked prefill attention vs one-shot",
            "model": args.model,
            "kv": kv or "contiguous",
            "block_tokens": BLOCK_TOKENS,
            "one_shot_bytes": ONE_SHOT_BYTES,
            "environment": environment(),
            "results": rows,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
