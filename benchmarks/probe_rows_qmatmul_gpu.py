"""The row-invariant quantized product (kernels/rows_qmatmul.py) against MLX's own
quantized_matmul at the 27B's projection shapes, for 1..8 rows: microseconds and the weight
bytes per second each reaches (the weights are what a decode step reads).

    python benchmarks/probe_rows_qmatmul_gpu.py --bits 4 --out rows_qmatmul.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json  # noqa: E402

SHAPES = {"mlp_up": (34816, 5120), "mlp_down": (5120, 17408), "gdn_in": (12352, 5120)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--rows", default="1,2,3,5,8")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    os.environ.setdefault("QWEN38_ROWS_QKERNEL", "auto")  # off by default until measured
    import mlx.core as mx
    from qwen38_backend.kernels import rows_qmatmul as kernel

    def timed(fn) -> float:
        for _ in range(3):
            mx.eval(fn())
        mx.synchronize()
        runs = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            mx.eval(fn())
            mx.synchronize()
            runs.append(time.perf_counter() - t)
        return statistics.median(runs)

    gs, bits = args.group_size, args.bits
    out = {"bits": bits, "group_size": gs, "available": kernel.available(mx.bfloat16, bits, gs)}
    out["shapes"] = {}
    for name, (n, k) in SHAPES.items():
        dense = mx.random.normal((n, k)).astype(mx.bfloat16) * k**-0.5
        w, scales, biases = mx.quantize(dense, group_size=gs, bits=bits)
        nbytes = w.nbytes + scales.nbytes + biases.nbytes
        row = {}
        for rows in (int(r) for r in args.rows.split(",")):
            x = mx.random.normal((rows, k)).astype(mx.bfloat16)
            ops = (x, w, scales, biases)
            ours = timed(lambda ops=ops: kernel.rows_qmatmul(*ops, bits))
            mlx = timed(lambda ops=ops: mx.quantized_matmul(*ops, True, gs, bits))
            row[str(rows)] = {
                "ours_us": ours * 1e6,
                "mlx_us": mlx * 1e6,
                "ours_gbps": nbytes / ours / 1e9,
                "mlx_gbps": nbytes / mlx / 1e9,
            }
        out["shapes"][name] = {"n": n, "k": k, "weight_bytes": nbytes, "by_rows": row}
    write_json(out, args.out)


if __name__ == "__main__":
    main()
