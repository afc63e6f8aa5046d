"""What a decode step's one-row weight products reach on CUDA, against a plain read of the
same bytes (Qwen3.8-27B dims, random bf16).

    python benchmarks/probe_gemv_gpu.py --layers 64 --out gemv.json

Every 2-D weight a decode step multiplies (the fused projections of `--layers` layers and
the LM head), one row each, queued in layer order and evaluated at once, as a step runs
them (median of `--repeats`): MLX's product (`x @ w.T`), kernels/rows_matmul.py as a plain
step runs them and a verify's `--rows` rows, and a read-only kernel that touches every
weight byte once. GB/s = weight bytes / time (a k-row product reads the weights once).
`--orders`: the kernel's orders of sums (its chunk and split-K) and where it reads x, at
every row count, rows as a step hands them (fp32 from a norm where K is the hidden size).
Session 20 also timed the kernel summing in MLX's one-row order (commit 4361012,
results/h200/gemv_orders_64l.json).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_27b import random_model  # noqa: E402
from common import environment, eval_seconds, write_json  # noqa: E402

# Each thread sums its 16-byte vectors (grid-stride) so the loads cannot be dropped; one
# float per block.
_READ = """
    const uint4* w4 = reinterpret_cast<const uint4*>(w);
    const long long n = w_shape[0] * (long long)w_shape[1] * sizeof(T) / 16;
    unsigned acc = 0u;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const uint4 u = w4[i];
        acc ^= u.x ^ u.y ^ u.z ^ u.w;
    }
    if (acc == 0x12345678u) out[blockIdx.x] = 1.0f;  // practically never: keeps the loads
"""


def one_row_variants(rk, mats: list, xs: dict, record) -> None:
    """One-row launches with the kernel's template constants changed (each a kernel of its
    own: the constants are template arguments)."""
    variants = {
        "split_k_off": {"SPLIT_K_MAX_N": 0},
        "split_k_2": {"SPLIT_K": 2},
        "split_k_8": {"SPLIT_K": 8},
        "split_k_all": {"SPLIT_K_MAX_N": 1 << 30},
        "loads_8": {"LOADS": 8},
        "loads_2": {"LOADS": 2},
        "outputs_2": {"OUTPUTS_PER_WARP": {**rk.OUTPUTS_PER_WARP, 1: 2}},
    }

    def run():
        return [rk.rows_matmul(xs[w.shape[1]], w) for w in mats]

    for label, changes in variants.items():
        with constants(rk, changes):
            record(f"kernel_1row_{label}", run)


# Orders of a row's sums (a lane's chunk of 16 or 8 bytes, as MLX's gemv loads; split-K on
# for narrow products or off) and where lanes read x (X_SHARED), each timed at every --rows.
ORDERS = {
    "chunk16_split": {"CHUNK_BYTES": 16},
    "chunk16_split_xl1": {"CHUNK_BYTES": 16, "X_SHARED": "none"},
    "chunk16_split_xall": {"CHUNK_BYTES": 16, "X_SHARED": "all"},
    "chunk16_nosplit": {"CHUNK_BYTES": 16, "SPLIT_K_MAX_N": 0},
    "chunk8_split": {"CHUNK_BYTES": 8},
    "chunk8_split_xall": {"CHUNK_BYTES": 8, "X_SHARED": "all"},
    "chunk8_nosplit": {"CHUNK_BYTES": 8, "SPLIT_K_MAX_N": 0},
}


def order_grid(rk, mats: list, xs_rows: dict, rows: list, record) -> None:
    """Every ORDERS entry at every row count (rows as `xs_rows` holds them by (K, rows))."""
    for label, changes in ORDERS.items():
        with constants(rk, changes):
            for r in rows:
                record(
                    f"{label}_{r}rows",
                    lambda r=r: [rk.rows_matmul(xs_rows[w.shape[1], r], w) for w in mats],
                )


@contextlib.contextmanager
def constants(module, changes: dict):
    """The module's constants changed for the block, restored after."""
    saved = {name: getattr(module, name) for name in changes}
    for name, value in changes.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny"])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument(
        "--rows", type=lambda v: [int(r) for r in v.split(",")], default=[1, 2, 4, 5, 8]
    )
    ap.add_argument(
        "--variants",
        action="store_true",
        help="also one-row launches with other split-K, loads and outputs per warp",
    )
    ap.add_argument(
        "--orders",
        action="store_true",
        help="also every order of sums (chunk 16 / 8 bytes, split-K on / off) and x's place at"
        " every --rows",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from qwen38_backend.kernels import rows_matmul as rk

    model, config, _ = random_model(args.dims, args.layers, "bfloat16")
    # every product of a step, LM head included (untied); the embedding is a gather
    mats = [
        w
        for name, w in tree_flatten(model.net.parameters())
        if w.ndim == 2
        and w.dtype == mx.bfloat16
        and min(w.shape) >= 64
        and "embed" not in name
        and "mtp" not in name
    ]
    nbytes = sum(w.nbytes for w in mats)
    xs = {k: mx.random.normal((1, k)).astype(mx.bfloat16) for k in {w.shape[1] for w in mats}}
    mx.eval(list(xs.values()))
    result = {
        "environment": environment(),
        "dims": args.dims,
        "layers": args.layers,
        "products": len(mats),
        "weight_bytes": nbytes,
        "ms": {},
        "GBps": {},
    }

    def record(label: str, fn) -> None:
        t = eval_seconds(fn, args.repeats)
        result["ms"][label] = t * 1e3
        result["GBps"][label] = nbytes / t / 1e9
        print(f"{label:>16}: {t * 1e3:7.2f} ms {nbytes / t / 1e9:7.0f} GB/s", file=sys.stderr)

    xs_rows = {(k, r): mx.random.normal((r, k)).astype(mx.bfloat16) for k in xs for r in args.rows}
    mx.eval(list(xs_rows.values()))
    record("mlx", lambda: [xs[w.shape[1]] @ w.T for w in mats])
    result["kernel_available"] = rk.available(mx.bfloat16)
    for r in args.rows:
        record(
            f"kernel_{r}rows", lambda r=r: [rk.rows_matmul(xs_rows[w.shape[1], r], w) for w in mats]
        )
    if args.variants:
        one_row_variants(rk, mats, xs, record)
    if args.orders:  # as a step: fp32 rows from a norm (K = hidden), the others bf16
        hidden = config["text_config"]["hidden_size"]
        step = {(k, r): x.astype(mx.float32) if k == hidden else x for (k, r), x in xs_rows.items()}
        mx.eval(list(step.values()))
        result["fp32_rows_width"] = hidden
        order_grid(rk, mats, step, args.rows, record)
    read = mx.fast.cuda_kernel(
        name="qwen38_probe_read", input_names=["w"], output_names=["out"], source=_READ
    )
    blocks = 132 * 8

    def reads():
        return [
            read(
                inputs=[w],
                template=[("T", w.dtype)],
                grid=(blocks * 256, 1, 1),
                threadgroup=(256, 1, 1),
                output_shapes=[(blocks,)],
                output_dtypes=[mx.float32],
            )[0]
            for w in mats
        ]

    record("read_only", reads)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
