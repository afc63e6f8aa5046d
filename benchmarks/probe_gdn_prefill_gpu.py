"""The Gated DeltaNet prefill kernels (kernels/gdn_prefill.py) against the op path on the
device, at 27B's head dims over a 2048-token prefill chunk (48 value heads, 32 chunks of
64): each kernel's probe, and the median ms of each part both ways.

    python benchmarks/probe_gdn_prefill_gpu.py --out probe_gdn_prefill.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import mx, write_json  # noqa: E402


def median_ms(fn, args, reps: int) -> float:
    for _ in range(2):
        mx.eval(fn(*args))
    times = []
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn(*args))
        mx.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--heads", type=int, default=48)
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from qwen38_backend.kernels import gdn_prefill as kernel

    from qwen38_backend.models.gated_delta import scan_chunks, solve_chunks

    ops = kernel.probe_inputs(heads=args.heads, chunks=args.chunks, chunk=64, dk=128, dv=128)
    mx.eval(ops)
    out = {"device": str(mx.default_device()), "heads": args.heads, "chunks": args.chunks}
    for kind, fast, slow, operands in (
        ("solve", kernel.chunk_solve, solve_chunks, ops[:4]),
        ("scan", kernel.chunk_scan, scan_chunks, ops[4:]),
    ):
        row = {"available": kernel.available(kind, 128, 128, 64)}
        row["kernel_ms"] = median_ms(fast, operands, args.reps)
        row["op_path_ms"] = median_ms(slow, operands, args.reps)
        row["speedup"] = row["op_path_ms"] / row["kernel_ms"]
        out[kind] = row
        print(json.dumps({kind: row}), flush=True)
    write_json(out, args.out)


if __name__ == "__main__":
    main()
