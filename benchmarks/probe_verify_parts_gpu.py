"""What the parts of a verify forward that are not weight products cost per row count, on
a GPU, at Qwen3.8-27B shapes: one decode-attention call (kernels/decode_attention.py) over
`--length` stored tokens, one Gated DeltaNet decode launch (kernels/gdn_decode.py), and the
embedding lookup.

    python benchmarks/probe_verify_parts_gpu.py --length 4096 --out verify_parts.json

Each part runs back to back on as many distinct inputs as the model has layers of its kind
(16 KV caches, 48 recurrent states), so nothing stays in L2 that a real step would find cold;
ms per call, median of `--runs`. The calls of one `mx.eval` do not depend on each other, so
the device may overlap them: a launch of few blocks looks cheaper here than in a step, where
each waits on the one before (probe_verify_kernels_gpu.py times kernels one at a time).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import environment, write_json  # noqa: E402


def per_call_ms(calls, runs: int) -> float:
    import mlx.core as mx

    mx.eval([c() for c in calls])  # warm: compile
    times = []
    for _ in range(runs):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval([c() for c in calls])
        mx.synchronize()
        times.append((time.perf_counter() - t) / len(calls) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument(
        "--rows", type=lambda v: [int(r) for r in v.split(",")], default=[1, 2, 3, 4, 5]
    )
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import mlx.core as mx
    from qwen38_backend.kernels import decode_attention, gdn_decode

    dt = mx.bfloat16
    hkv, hq, d = 4, 24, 256
    hk, hv, dk, dv, kw = 16, 48, 128, 128, 4
    conv_dim = 2 * hk * dk + hv * dv
    spec = (hk, hv, dk, dv, 1e-6, "silu")
    key = iter(mx.random.split(mx.random.key(0), 256))

    def normal(shape, dtype=dt, s=1.0):
        return (s * mx.random.normal(shape, key=next(key))).astype(dtype)

    caches = [
        (normal((1, hkv, args.length, d)), normal((1, hkv, args.length, d))) for _ in range(16)
    ]
    states = [normal((hv, dv, dk), mx.float32, 0.1) for _ in range(48)]
    conv_w, hist = normal((conv_dim, kw), s=0.5), normal((kw - 1, conv_dim))
    A_log, dt_bias, norm_w = normal((hv,)), normal((hv,)), mx.ones((dv,), dt)
    table = normal((248320, 5120), s=0.02)
    mx.eval(caches, states, conv_w, hist, table)
    ok = {
        "attention": decode_attention.available(dt, dt, d, hq // hkv),
        "gdn": gdn_decode.available(spec, dt),
    }
    result = {"environment": environment(), "length": args.length, "kernels": ok, "rows": {}}

    def measure(rows: int) -> dict:
        q = normal((1, hq, rows, d))
        qkv, z, b, a = (
            normal((rows, conv_dim)),
            normal((rows, hv * dv)),
            normal((rows, hv)),
            normal((rows, hv)),
        )
        ids = mx.array(list(range(1000, 1000 + 37 * rows, 37)), dtype=mx.int32)
        scale = d**-0.5
        return {
            "attention_ms": per_call_ms(
                [lambda c=c: decode_attention.decode_attention(q, *c, scale) for c in caches],
                args.runs,
            ),
            "gdn_ms": per_call_ms(
                [
                    lambda s=s: gdn_decode.gdn_decode_rows(
                        qkv, z, b, a, hist, conv_w, A_log, dt_bias, s, norm_w, spec=spec
                    )[0]
                    for s in states
                ],
                args.runs,
            ),
            "embedding_ms": per_call_ms([lambda: table[ids]] * 8, args.runs),
        }

    for rows in args.rows:
        row = measure(rows)
        result["rows"][str(rows)] = row
        print(rows, {k: round(v, 4) for k, v in row.items()}, flush=True)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
