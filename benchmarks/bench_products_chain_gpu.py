"""The device time of a decode step's chain of one-row products, ours (kernels/rows_matmul.py)
and MLX's gemv, in one process:

    python benchmarks/bench_products_chain_gpu.py --layers 16 --runs 5 --out chain.json

The chain is a Gated DeltaNet layer's products at the 27B's shapes, --layers times (random
bf16 weights, each layer its own): in_proj (16480 x 5120), out_proj (5120 x 6144) plus the
residual, the fused gate/up (34816 x 5120) with the swiglu epilogue, down (5120 x 17408) plus
the residual; each takes the previous one's output, so they run one after another as a
step's do, with an RMS norm of the residual after each layer (values stay in range). The
device's time only: `--inner` chains are queued behind a spin kernel long enough for the host
to queue them all (benchmarks/probe_step_graph.py's method; the host encodes our launches
slower than MLX's gemv, so a chain timed from the host measures the host), minus the spin
alone; per mode the median ms of a chain over `--runs` and the weights' TB/s.

Session 27 used it (then with modes where each product prefetched the next one's weights
into L2, since removed: commit 70e6775) to find that such a chain already reads its weights
at ~4.0 TB/s (results/h200/products_chain_ahead_s27.json).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import environment, median_of, write_json  # noqa: E402
from probe_step_graph import spin_kernel  # noqa: E402

# (in_proj, out_proj, gate/up, down) of a 27B Gated DeltaNet layer: (N, K)
SHAPES = ((16480, 5120), (5120, 6144), (2 * 17408, 5120), (5120, 17408))


def weights(layers: int) -> list[list[mx.array]]:
    out = []
    for i in range(layers):
        layer = []
        for j, (n, k) in enumerate(SHAPES):
            key = mx.random.key(4 * i + j)
            layer.append((mx.random.normal((n, k), key=key) * k**-0.5).astype(mx.bfloat16))
        mx.eval(layer)
        out.append(layer)
    return out


def chain(ws: list[list[mx.array]], x: mx.array) -> mx.array:
    """The layers' products one after another (kernels/rows_matmul.py)."""
    from qwen38_backend.kernels.rows_matmul import rows_matmul

    for w_in, w_out, w_up, w_down in ws:
        a = rows_matmul(x, w_in)
        h = rows_matmul(a[:, : w_out.shape[1]], w_out, residual=x)
        g = rows_matmul(h, w_up, swiglu=True)
        x = mx.fast.rms_norm(rows_matmul(g, w_down, residual=h), None, 1e-6)
    return x


def gemv_chain(ws: list[list[mx.array]], x: mx.array) -> mx.array:
    """The same chain as MLX's own products (its gemv) and elementwise ops."""
    for w_in, w_out, w_up, w_down in ws:
        a = x @ w_in.T
        h = x + a[:, : w_out.shape[1]] @ w_out.T
        gate, up = mx.split(h @ w_up.T, 2, axis=-1)
        x = mx.fast.rms_norm(h + (gate * mx.sigmoid(gate) * up) @ w_down.T, None, 1e-6)
    return x


def chain_arguments(doc: str) -> argparse.ArgumentParser:
    """The options of a chain's timing (this bench's, and its variants' probe)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--inner", type=int, default=4, help="chains queued per evaluation")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5, help="evaluations per run (median)")
    ap.add_argument("--out", default=None)
    return ap


def main() -> None:
    args = chain_arguments(__doc__).parse_args()

    ws = weights(args.layers)
    nbytes = sum(w.nbytes for layer in ws for w in layer)
    x0 = (mx.random.normal((1, SHAPES[0][1]), key=mx.random.key(99))).astype(mx.bfloat16)

    spin = spin_kernel()

    def spun(cycles: int, fn=None) -> float:
        mx.synchronize()
        t0 = time.perf_counter()
        out = [spin(cycles)]
        mx.async_eval(out[0])
        if fn is not None:
            x = x0
            for _ in range(args.inner):
                x = fn(x)
            out.append(x)
            mx.async_eval(x)
        mx.eval(out)
        mx.synchronize()
        return time.perf_counter() - t0

    cycles = 1_000_000
    spun(cycles)  # compiles the spin kernel
    while spun(cycles) < 0.06:  # about 60 ms of spin: the host queues every chain behind it
        cycles *= 2

    def timed(fn) -> float:
        spun(cycles, fn)  # compiles, allocates
        alone = [spun(cycles) for _ in range(args.repeats)]
        both = [spun(cycles, fn) for _ in range(args.repeats)]
        return 1e3 * (statistics.median(both) - statistics.median(alone)) / args.inner

    modes = {
        "rows_matmul": lambda x: chain(ws, x),
        "mlx_gemv": lambda x: gemv_chain(ws, x),
    }
    finite = {name: bool(mx.isfinite(fn(x0)).all().item()) for name, fn in modes.items()}
    times = {name: [] for name in modes}
    for _ in range(args.runs):  # modes alternate within each run
        for name, fn in modes.items():
            times[name].append(timed(fn))
    result = {
        "benchmark": "one-row product chain, 27B Gated DeltaNet layer shapes, bf16",
        "environment": environment(),
        "layers": args.layers,
        "inner": args.inner,
        "weights_bytes": nbytes,
        "finite": finite,
        "modes": {},
    }
    for name, values in times.items():
        stats = median_of(len(values), iter(values).__next__)
        stats["tb_s"] = nbytes / (stats["median"] / 1e3) / 1e12
        result["modes"][name] = stats
    base = result["modes"]["mlx_gemv"]["median"]
    for stats in result["modes"].values():
        stats["vs_mlx_gemv"] = stats["median"] / base
    write_json(result, args.out)


if __name__ == "__main__":
    main()
