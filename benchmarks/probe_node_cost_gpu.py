"""What one graph node costs the host and the device, by kind (any device; meant for CUDA).

    python benchmarks/probe_node_cost_gpu.py --nodes 500 --out node_cost.json

A decode step is ~2,000 nodes (benchmarks/probe_step_graph.py), and on the H200 the host's
work per step was as long as the device's. Here each kind of node runs as a chain of
`--nodes` dependent steps on a 5120-wide row (a 27B hidden state): per step, us to build the
chain in Python, us for mx.async_eval to queue it (MLX's encode) and us until the device is
done (median of `--repeats`). A step is one node, except `cast_pair` (a cast up and one back)
and `reshape` (there and back): two. Kinds: a cast pair, an add, MLX's RMSNorm, a reshape
pair (no kernel),
a compiled elementwise graph, a trivial custom kernel with 1 and with 5 template constants,
and one-row products (MLX's gemv and kernels/rows_matmul.py) on a 512 x 512 weight.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import environment, write_json  # noqa: E402

_ADD_ONE = """
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < x_shape[1]) y[i] = T(static_cast<float>(x[i]) + 1.0f);
"""


@functools.cache
def _add_one():
    import mlx.core as mx

    return mx.fast.cuda_kernel(
        name="probe_add_one", input_names=["x"], output_names=["y"], source=_ADD_ONE
    )


def chains(width: int) -> dict:
    """kind -> (start value, one node applied to a value)."""
    import mlx.core as mx

    bf16 = mx.bfloat16
    row = mx.random.normal((1, width)).astype(bf16)
    w = mx.ones((width,), dtype=bf16)

    def custom(x, extra: int):
        kernel = _add_one()
        template = [("T", bf16)] + [(f"C{i}", i + 1) for i in range(extra)]
        return kernel(
            inputs=[x],
            template=template,
            grid=(width, 1, 1),
            threadgroup=(256, 1, 1),
            output_shapes=[x.shape],
            output_dtypes=[bf16],
        )[0]

    fused = mx.compile(lambda x: (x.astype(mx.float32) * 0.5 + 1.0).astype(bf16))
    kinds = {
        "cast_pair": (row, lambda x: x.astype(mx.float32).astype(bf16)),
        "add": (row, lambda x: x + 1),
        "rms_norm": (row, lambda x: mx.fast.rms_norm(x, w, 1e-6)),
        "reshape": (row, lambda x: x.reshape(width, 1).reshape(1, width)),
        "compiled_elementwise": (row, fused),
    }
    if mx.cuda.is_available():
        kinds["custom_1_constant"] = (row, lambda x: custom(x, 0))
        kinds["custom_5_constants"] = (row, lambda x: custom(x, 4))
    small = mx.random.normal((512, 512)).astype(bf16) / 32
    vec = mx.random.normal((1, 512)).astype(bf16)
    kinds["gemv_512"] = (vec, lambda x: x @ small.T)
    if mx.cuda.is_available():
        from qwen38_backend.kernels.rows_matmul import rows_matmul

        kinds["rows_matmul_512"] = (vec, lambda x: rows_matmul(x, small))
    return kinds


def measure(start, node, n: int, repeats: int) -> dict:
    import mlx.core as mx

    per = {"build": [], "queue": [], "done": []}
    for i in range(repeats + 2):
        mx.synchronize()
        t0 = time.perf_counter()
        x = start
        for _ in range(n):
            x = node(x)
        t1 = time.perf_counter()
        mx.async_eval(x)
        t2 = time.perf_counter()
        mx.synchronize()
        t3 = time.perf_counter()
        if i >= 2:  # the first two warm traces and kernels
            per["build"].append((t1 - t0) / n * 1e6)
            per["queue"].append((t2 - t1) / n * 1e6)
            per["done"].append((t3 - t1) / n * 1e6)
    return {k: round(statistics.median(v), 2) for k, v in per.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--width", type=int, default=5120)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result = {"environment": environment(), "nodes": args.nodes, "width": args.width}
    result["us_per_node"] = {}
    for kind, (start, node) in chains(args.width).items():
        result["us_per_node"][kind] = measure(start, node, args.nodes, args.repeats)
        print(kind, result["us_per_node"][kind], flush=True)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
