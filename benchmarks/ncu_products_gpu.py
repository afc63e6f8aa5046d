"""One-row products at a 27B decode step's widest shapes, ours (kernels/rows_matmul.py) and
MLX's gemv, each launched twice (the first compiles; read the second), for Nsight Compute
to compare side by side:

    ncu --clock-control none --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats -k regex:"rows_matmul|gemv" \
        python benchmarks/ncu_products_gpu.py > ncu_products.txt

Why: a 64-layer step's 257 one-row products take ~15 ms in our row-invariant kernel and
12.5 ms in MLX's gemv (benchmarks/probe_gemv_gpu.py), and since session 25 the step's device
time (16.4 ms) bounds decode as much as the host does (docs/INTERNALS.md). Shapes: the fused
gate/up product (34816 x 5120: with bf16 rows, with a norm's fp32 rows, with the swiglu
epilogue) and the down product (5120 x 17408: plain and with the residual epilogue).
"""

from __future__ import annotations

import mlx.core as mx


def main() -> None:
    from qwen38_backend.kernels import rows_matmul as kernel

    cases = []
    for n, k in ((2 * 17408, 5120), (5120, 17408)):
        w = (mx.random.normal((n, k)) * k**-0.5).astype(mx.bfloat16)
        x = mx.random.normal((1, k)).astype(mx.bfloat16)
        res = mx.random.normal((1, n)).astype(mx.float32)
        cases += [lambda x=x, w=w: kernel.rows_matmul(x, w), lambda x=x, w=w: x @ w.T]
        if k == 5120:  # gate/up: a norm's fp32 rows; silu(gate) * up stored by the product
            cases += [
                lambda x=x, w=w: kernel.rows_matmul(x.astype(mx.float32), w),
                lambda x=x, w=w: kernel.rows_matmul(x, w, swiglu=True),
            ]
        else:  # down: the block's sum stored by the product, as fp32
            cases.append(
                lambda x=x, w=w, r=res: kernel.rows_matmul(x, w, residual=r, dtype=mx.float32)
            )
        mx.eval(w, x, res)
    for case in cases:  # the first launches compile the kernels
        mx.eval(case())
    mx.synchronize()
    for case in cases:
        mx.eval(case())
    mx.synchronize()


if __name__ == "__main__":
    main()
