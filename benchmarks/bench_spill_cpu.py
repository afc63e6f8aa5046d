"""A long prompt with a KV pool smaller than the context (the SSD tier) vs all-resident.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
    python benchmarks/bench_spill_cpu.py --model qwen38-demo --prompt 7500 --decode 32 \
        --pool 1024 --topk 256 --out benchmarks/results/cpu/spill_demo.json

Each mode runs in its own process (peak RSS is per process): "resident" (paged KV, the
pool holds the whole context) and "spill" (kv_pool_tokens=POOL, pages spill to a file in a
temp dir). Same prompt, greedy, same kv_topk; reports whether the tokens are equal, prefill
and decode tok/s, peak RSS, MLX peak memory, and the KV counters (pages spilled, written,
fetched, bytes read).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import environment, run_json_worker, write_json


def worker(args: argparse.Namespace) -> None:
    import mlx.core as mx
    import numpy as np

    import qwen38_backend

    model = qwen38_backend.load(args.model)
    rng = np.random.default_rng(0)
    ids = rng.integers(100, min(model.config.vocab_size, 32000) - 100, args.prompt).tolist()
    kv = {"kv_paged": "on", "kv_topk": args.topk}
    spill_dir = None
    if args.worker == "spill":
        spill_dir = tempfile.mkdtemp(prefix="qwen38-spill-")
        kv.update(kv_pool_tokens=args.pool, kv_spill_dir=spill_dir)
    t = time.perf_counter()
    stream = model.generate_tokens(ids, args.decode, stop_token_ids=[], **kv)
    tokens = list(stream)
    seconds = time.perf_counter() - t
    stats = stream.stats
    files = list(Path(spill_dir).glob("kv-*.spill")) if spill_dir else []
    if spill_dir:
        shutil.rmtree(spill_dir, ignore_errors=True)
    print(
        json.dumps(
            {
                "tokens": tokens,
                "prefill_tok_s": stats.prefill_tokens_per_second,
                "decode_tok_s": stats.decode_tokens_per_second,
                "seconds": seconds,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "mlx_peak_memory_bytes": mx.get_peak_memory(),
                "spill_files_left_after_run": len(files),
                "kv": {k: v for k, v in stats.kv.items() if isinstance(v, (int, float))},
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen38-demo")
    ap.add_argument("--prompt", type=int, default=7500)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--pool", type=int, default=1024)
    ap.add_argument("--topk", type=int, default=256)
    ap.add_argument("--worker", choices=["resident", "spill"], default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    runs = {}
    for mode in ("resident", "spill"):
        cmd = [sys.executable, __file__, "--worker", mode]
        for name in ("model", "prompt", "decode", "pool", "topk"):
            cmd += [f"--{name}", str(getattr(args, name))]
        runs[mode] = run_json_worker(cmd)
    same = runs["resident"].get("tokens") == runs["spill"].get("tokens")
    write_json(
        {
            "benchmark": "KV pool smaller than the context (SSD tier) vs all-resident",
            "model": args.model,
            "prompt_tokens": args.prompt,
            "decode_tokens": args.decode,
            "kv_pool_tokens": args.pool,
            "kv_topk": args.topk,
            "environment": environment(),
            "tokens_equal": same,
            "runs": runs,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
