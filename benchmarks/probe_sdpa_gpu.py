"""Is MLX's fused SDPA memory-bounded for a long prefill chunk on this backend?

    python benchmarks/probe_sdpa_gpu.py --chunk 4096 --past 32768

One prefill chunk of 27B attention shapes (24 query heads, 4 KV heads, head_dim 256, bf16)
over `--past` stored tokens plus itself: `mx.fast.scaled_dot_product_attention` with the
causal mask against the blocked walk (kv/blocked.py). Reports seconds (median of runs),
peak memory above the inputs, and the largest difference. A fused kernel's peak stays near
its output; a fallback materialises the [heads, chunk, past] scores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--past", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    import mlx.core as mx

    from qwen38_backend.kv.blocked import BLOCK_TOKENS, blocked_attention, spans

    dtype = getattr(mx, args.dtype)
    T, L, d = args.chunk, args.past, args.head_dim
    key = mx.random.key(0)
    kq, kk, kv = mx.random.split(key, 3)
    q = mx.random.normal((1, args.heads, T, d), key=kq).astype(dtype)
    k = mx.random.normal((1, args.kv_heads, L + T, d), key=kk).astype(dtype)
    v = mx.random.normal((1, args.kv_heads, L + T, d), key=kv).astype(dtype)
    mx.eval(q, k, v)
    scale = d**-0.5

    def fused():
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")

    def blocked():
        blocks = ((k[:, :, a:b], v[:, :, a:b]) for a, b in spans(L, BLOCK_TOKENS))
        return blocked_attention(q, blocks, k[:, :, L:], v[:, :, L:], scale)

    out = {"args": vars(args), "device": str(mx.default_device())}
    results = {}
    for name, fn in (("blocked", blocked), ("fused", fused)):
        try:
            mx.synchronize()
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            times = []
            for _ in range(args.runs):
                t = time.perf_counter()
                r = fn()
                mx.eval(r)
                mx.synchronize()
                times.append(time.perf_counter() - t)
            results[name] = r
            out[name] = {
                "seconds": statistics.median(times),
                "runs": times,
                "peak_above_inputs_bytes": mx.get_peak_memory() - base,
                "tflops": 4 * args.heads * d * T * (L + T / 2) / statistics.median(times) / 1e12,
            }
        except Exception as e:  # a fallback that does not fit is an answer too
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps({name: out[name]}), flush=True)
    if len(results) == 2:
        a = results["fused"].astype(mx.float32)
        b = results["blocked"].astype(mx.float32)
        out["max_abs_diff"] = mx.abs(a - b).max().item()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
