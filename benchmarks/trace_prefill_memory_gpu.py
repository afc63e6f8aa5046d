"""Where a long prefill's peak memory happens: per prefill chunk, the peak (after a reset)
above what was resident when the chunk began, and what stays resident after it.

    python benchmarks/trace_prefill_memory_gpu.py --length 131072 --out trace.json

Qwen3.8-27B dims (random bf16, bench_gpu_27b.random_model), paged KV (the engine's default
on CUDA), the engine's prefill loop (Model.prefill: chunk by chunk, the stores sized for the
whole prompt after the first chunk), timed and traced chunk by chunk. A transient that grows
with the depth shows as a rising `over_start` column; the reserve after the first chunk shows
at chunk 1. `--settle-layers` runs a settled prefill (settle.py: every layer and walk
block waited for and released before the next), to compare peaks and `prefill_tok_s`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_27b import prompt, random_model  # noqa: E402
from common import block_score_option, use_block_score, write_json  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny"])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--length", type=int, default=131072)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--settle-layers",
        action="store_true",
        help="a settled prefill: every layer and walk block waited for and released before "
        "the next (qwen38_backend/settle.py)",
    )
    block_score_option(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    use_block_score(args)

    import time

    import mlx.core as mx

    from qwen38_backend import state as state_module
    from qwen38_backend.engine import state_arrays
    from qwen38_backend.kv import blocked
    from qwen38_backend.settle import settled

    model, config, weights_bytes = random_model(args.dims, args.layers, args.dtype)
    ids = prompt(args.length, config["text_config"]["vocab_size"])
    state = model.new_state(kv_paged="on")
    chunk = model.prefill_chunk
    rows = []
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        t = time.perf_counter()
        with settled(args.settle_layers):
            logits = model.forward(part, state, last_only=True)
            mx.eval(logits, *state_arrays(state))
        mx.synchronize()
        seconds = time.perf_counter() - t
        peak = mx.get_peak_memory()
        after = mx.get_active_memory()
        rows.append(
            {
                "start": start,
                "over_start": peak - before,
                "over_end": peak - after,
                "grew": after - before,
                "seconds": seconds,
            }
        )
        if start == 0:
            state.reserve(len(ids) - len(part))
    worst = max(rows, key=lambda r: r["over_end"])
    result = {
        "dims": args.dims,
        "layers": args.layers,
        "length": args.length,
        "chunk": chunk,
        "weights_bytes": weights_bytes,
        "state_bytes": state.nbytes(),
        "settle_layers": args.settle_layers,
        "block_score_mib": blocked.BLOCK_SCORE_BYTES >> 20,
        "settle_every": state_module.PREFILL_SETTLE_EVERY,
        "prefill_tok_s": len(ids) / sum(r["seconds"] for r in rows),
        "over_start_gb": [round(r["over_start"] / 1e9, 2) for r in rows],
        "worst_chunk": worst,
        "chunks": rows,
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
