"""The row-invariant step product (kernels/rows_matmul.py) against MLX's products, on a GPU.

    python benchmarks/probe_rows_kernel_gpu.py --out rows_kernel.json

For each distinct projection shape of Qwen3.8-27B (random bf16 weights, a set of distinct
weight matrices cycled so that none stays in L2): the median time of one product and the
weight bytes it reads per second, for MLX's one-row product (gemv: what unpadded plain
decoding ran), MLX's product padded to 8 rows (what row-exact decoding ran), and the kernel
with 1, 2, 3, 4, 5 and 8 rows. Identity: every kernel row equals the one-row kernel call bit
for bit; error against an fp32 product, next to MLX's own. `--sweep-rows 1,2,3,4,5`: for
those row counts, the kernel at every (outputs per warp, loads in flight) of
`--shapes-grid` (rows_matmul._shape; loads in flight apply to the register walk, which
launches below rows_matmul.STAGED_FROM rows take), and the fastest per row count. The
products here do not wait on each other (a real step's do): a narrow launch looks cheaper
than in a step (benchmarks/results/h200/rows_kernel_sweep.json ran before the staged walk).
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

# (name, outputs N, inputs K) of the 27B's projections (fused where the engine fuses them)
SHAPES = [
    ("attn_qkv", 12288 + 2 * 1024, 5120),
    ("attn_o", 5120, 6144),
    ("gdn_in", 10240 + 6144 + 2 * 48, 5120),
    ("gdn_out", 5120, 6144),
    ("mlp_gate_up", 2 * 17408, 5120),
    ("mlp_down", 5120, 17408),
    ("lm_head", 248320, 5120),
]


def median_ms(fn, weights, runs: int, inner: int) -> float:
    """Median over runs of the mean time of `inner` products, each on the next weight."""
    import mlx.core as mx

    times = []
    for _ in range(runs):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval([fn(weights[i % len(weights)]) for i in range(inner)])
        mx.synchronize()
        times.append((time.perf_counter() - t) / inner * 1e3)
    return statistics.median(times)


def measure(n: int, k: int, args) -> dict:
    import mlx.core as mx
    from qwen38_backend.kernels import rows_matmul as kernel

    dtype = mx.bfloat16
    nbytes = n * k * dtype.size
    copies = max(1, min(8, int(args.l2_bytes // nbytes) + 1))
    keys = mx.random.split(mx.random.key(0), copies + 1)
    weights = [(mx.random.normal((n, k), key=kk) * k**-0.5).astype(dtype) for kk in keys[1:]]
    x = mx.random.normal((8, k), key=keys[0]).astype(dtype)
    mx.eval(weights, x)

    def product(w, rows: int, shape: tuple[int, int] | None):
        chosen = kernel._shape
        if shape is not None:
            kernel._shape = lambda r: shape  # read when the launch is built
        try:
            return kernel.rows_matmul(x[:rows], w)
        finally:
            kernel._shape = chosen

    variants = {"mlx_1row": lambda w: x[:1] @ w.T, "mlx_8rows": lambda w: x @ w.T}
    for rows in (1, 2, 3, 4, 5, 8):
        variants[f"kernel_{rows}rows"] = lambda w, r=rows: product(w, r, None)
    for rows in args.sweep_rows:
        for nw, u in args.shapes_grid:
            name = f"kernel_{rows}rows_nw{nw}_u{u}"
            variants[name] = lambda w, r=rows, s=(nw, u): product(w, r, s)
    ms = {v: median_ms(f, weights, args.runs, args.inner) for v, f in variants.items()}
    best = {}
    for rows in args.sweep_rows:
        tried = {v: t for v, t in ms.items() if v.startswith(f"kernel_{rows}rows_nw")}
        if tried:
            name = min(tried, key=tried.get)
            best[str(rows)] = {"variant": name, "ms": tried[name]}
    w = weights[0]
    ref = x.astype(mx.float32) @ w.astype(mx.float32).T
    together = kernel.rows_matmul(x, w)
    alone = mx.concatenate([kernel.rows_matmul(x[i : i + 1], w) for i in range(8)])

    def err(y):
        return (mx.abs(y.astype(mx.float32) - ref).max() / mx.abs(ref).max()).item()

    return {
        "n": n,
        "k": k,
        "weight_bytes": nbytes,
        "weight_copies": copies,
        "ms": ms,
        "weight_gb_s": {v: nbytes / (t * 1e-3) / 1e9 for v, t in ms.items()},
        "kernel_1row_over_mlx_1row": ms["kernel_1rows"] / ms["mlx_1row"],
        "kernel_5rows_over_mlx_8rows": ms["kernel_5rows"] / ms["mlx_8rows"],
        "rows_equal_one_row_calls": mx.array_equal(together, alone).item(),
        "max_rel_err_vs_fp32": {"kernel": err(together), "mlx": err(x @ w.T)},
        "best_shape_by_rows": best,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--inner", type=int, default=24)
    ap.add_argument("--l2-bytes", type=float, default=4 * 50e6, help="weights cycled past this")
    ap.add_argument("--sweep-rows", type=lambda v: [int(r) for r in v.split(",")], default=[])
    ap.add_argument(
        "--shapes-grid",
        type=lambda v: [tuple(int(a) for a in s.split("x")) for s in v.split(",")],
        default=[(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2)],
        help="(outputs per warp)x(loads in flight) pairs tried for --sweep-rows",
    )
    ap.add_argument("--shapes", default=",".join(n for n, _, _ in SHAPES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import mlx.core as mx
    from qwen38_backend.kernels import rows_matmul as kernel

    result = {
        "environment": environment(),
        "available": kernel.available(mx.bfloat16),
        "shapes": {
            name: measure(n, k, args) for name, n, k in SHAPES if name in args.shapes.split(",")
        },
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
