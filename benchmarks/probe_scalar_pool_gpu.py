"""Does a fresh small array cost the device time? A chain of one-thread kernels, each reading
an int32 from a different source, timed on the device behind a spin (CUDA only).

    python benchmarks/probe_scalar_pool_gpu.py --kernels 64 --out scalar_pool.json

MLX's CUDA allocator keeps arrays of 8 bytes or less in one managed-memory pool advised
read-mostly, and larger ones in managed buffers too: a value the host writes into either is
read by the device through the unified-memory driver (a page fault on first touch after the
write). A decode step makes a few such arrays per layer from Python ints (positions, page
counts; `qwen38_backend/scalars.py` now makes each value once). Modes, each a chain of
--kernels launches (kernel i reads its int and the previous kernel's output):
- `cached`: one array made before timing, read by every kernel;
- `fresh_scalar`: a new 4-byte array per kernel (the small pool);
- `fresh_16b`: a new 16-byte array per kernel (a managed buffer of its own).
Per mode: device us per kernel (median of --repeats, behind_spin), and the same without
the spin (host and device together).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx.core as mx  # noqa: E402
from common import environment, write_json  # noqa: E402
from probe_step_graph import behind_spin  # noqa: E402

SOURCE = "out[0] = prev[0] + (float)value[0];"


def chain(kernel, n: int, source) -> mx.array:
    """n kernels in a row, kernel i reading source(i)."""
    x = mx.zeros((1,), dtype=mx.float32)
    for i in range(n):
        (x,) = kernel(
            inputs=[x, source(i)],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.float32],
        )
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not mx.cuda.is_available():
        sys.exit("probe_scalar_pool_gpu.py needs MLX with the CUDA backend")
    kernel = mx.fast.cuda_kernel(
        name="read_one_int", input_names=["prev", "value"], output_names=["out"], source=SOURCE
    )
    cached = mx.array(3, dtype=mx.int32)
    mx.eval(cached)
    modes = {
        "cached": lambda i: cached,
        "fresh_scalar": lambda i: mx.array(i, dtype=mx.int32),
        "fresh_16b": lambda i: mx.array([i, 0, 0, 0], dtype=mx.int32),
    }
    rows = {}
    for name, source in modes.items():
        make = lambda source=source: chain(kernel, args.kernels, source)  # noqa: E731
        alone, both = behind_spin(make, args.repeats)
        walls = []
        for _ in range(args.repeats):
            mx.synchronize()
            t = time.perf_counter()
            mx.eval(make())
            walls.append(time.perf_counter() - t)
        rows[name] = {
            "device_us_per_kernel": 1e6 * (both - alone) / args.kernels,
            "wall_us_per_kernel": 1e6 * statistics.median(walls) / args.kernels,
        }
        print(name, rows[name], file=sys.stderr)
    write_json({"environment": environment(), "kernels": args.kernels, "modes": rows}, args.out)


if __name__ == "__main__":
    main()
