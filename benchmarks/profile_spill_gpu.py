"""Where a Quest decode step with a spilling page pool spends its time (host side).

    python benchmarks/profile_spill_gpu.py --layers 16 --length 32768 --pool-tokens 8192

Prefills one paged state fully resident and one with a capped pool (pages spilled), then
decodes `--decode` tokens on each: per-step wall times (median, first step apart: it fetches
most of the first selection) and a cProfile of the spilled decode (top functions by own time
and by cumulative time). `--dims tiny --layers 4` smoke-tests the script on a CPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_27b import prompt, random_model  # noqa: E402
from common import environment, write_json  # noqa: E402


def step_times(model, state, first: int, n: int) -> list[float]:
    """Wall seconds between consecutive tokens of a greedy decode."""
    from qwen38_backend.sampling import SamplingParams

    stream = model.run([first], state, SamplingParams(max_tokens=n, stop_token_ids=[]))
    times, t = [], time.perf_counter()
    for _ in stream:
        now = time.perf_counter()
        times.append(now - t)
        t = now
    return times


def top(profile: cProfile.Profile, key: str, n: int) -> list[str]:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats(key).print_stats(n)
    return [line for line in out.getvalue().splitlines() if line.strip()][-n:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny"])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--page-tokens", type=int, default=None)
    ap.add_argument("--pool-tokens", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import mlx.core as mx

    model, config, _ = random_model(args.dims, args.layers, args.dtype)
    vocab = config["text_config"]["vocab_size"]
    kv = {"kv_paged": "on", "kv_topk": args.budget}
    if args.page_tokens:
        kv["kv_page_tokens"] = args.page_tokens
    spill_dir = tempfile.mkdtemp(prefix="qwen38-spill-")
    result: dict = {"environment": environment(), "args": vars(args)}
    for label, extra in (
        ("resident", {}),
        ("spilled", {"kv_pool_tokens": args.pool_tokens, "kv_spill_dir": spill_dir}),
    ):
        state = model.new_state(**kv, **extra)
        t = time.perf_counter()
        logits = model.prefill(prompt(args.length, vocab), state)
        first = int(mx.argmax(logits).item())
        prefill_seconds = time.perf_counter() - t
        step_times(model, state, first, 4)  # warm: compiles the decode graph
        profile = cProfile.Profile() if label == "spilled" else None
        if profile:
            profile.enable()
        times = step_times(model, state, first, args.decode)
        if profile:
            profile.disable()
        fetched = sum(
            layer.stats.get("pages_fetched", 0)
            for layer in state.layers
            if hasattr(layer, "budget_pages")
        )
        row = {
            "prefill_seconds": prefill_seconds,
            "prefill_chunk": model.prefill_chunk,
            "first_step_s": times[0],
            "median_step_s": statistics.median(times[1:]),
            "tok_s_after_first": (len(times) - 1) / sum(times[1:]),
            "pages_fetched": fetched,
        }
        if profile:
            row["top_tottime"] = top(profile, "tottime", 25)
            row["top_cumtime"] = top(profile, "cumulative", 40)
        result[label] = row
        print(json.dumps({label: {k: v for k, v in row.items() if "top" not in k}}), flush=True)
        state.close()
        del state, logits
        mx.clear_cache()
    write_json(result, args.out)


if __name__ == "__main__":
    main()
