"""Which row counts compute a row the same way: the facts a speculative verify on a GPU rests on.

    python benchmarks/probe_rows_gpu.py --out rows.json

For every distinct projection of a Qwen3.8-27B-dims model (random weights, bf16, and the same
projections quantized to 4 bits): row i of x[:M] @ W for M = 1..--max-rows, compared bit for
bit with the same row computed with other row counts and with other contents in the rows
around it; and the median time of one product per M (is a padded few-row product as fast as
a one-row one?). Then the row-wise ops a decode step also runs (rms_norm, rope at an offset).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_27b import random_model  # noqa: E402
from common import write_json  # noqa: E402


def median_ms(fn, runs: int, inner: int = 20) -> float:
    import mlx.core as mx

    times = []
    for _ in range(runs):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval([fn() for _ in range(inner)])
        mx.synchronize()
        times.append((time.perf_counter() - t) / inner * 1e3)
    return statistics.median(times)


def rows_table(layer, x, other, max_rows: int, runs: int) -> dict:
    """Row identity and timing of `layer` (a linear) over row counts 1..max_rows."""
    import mlx.core as mx

    out = {m: layer(x[:m]) for m in range(1, max_rows + 1)}
    mixed = {m: layer(mx.concatenate([x[:1], other[1:m]])) for m in range(1, max_rows + 1)}
    mx.eval(list(out.values()) + list(mixed.values()))
    # equal[m][n]: the rows both products share (first min(m, n)) are bit-identical
    equal = {
        m: [
            n
            for n in range(1, max_rows + 1)
            if mx.array_equal(out[m][: min(m, n)], out[n][: min(m, n)]).item()
        ]
        for m in out
    }
    neighbours = {m: mx.array_equal(out[m][:1], mixed[m][:1]).item() for m in out}
    ms = {m: median_ms(lambda m=m: layer(x[:m]), runs) for m in (1, 2, 3, 4, 5, 8) if m <= max_rows}
    return {"same_rows_as": equal, "row0_ignores_other_rows": neighbours, "ms": ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--max-rows", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import mlx.core as mx
    import mlx.nn as nn

    model, config, _ = random_model("27b", 4, "bfloat16")
    net = model.net
    linears = {}
    for name, module in net.named_modules():
        if isinstance(module, nn.Linear) and not name.startswith("mtp"):
            shape = tuple(module.weight.shape)
            linears.setdefault(shape, (name, module))
    lm = net.lm_head if "lm_head" in net else None
    if lm is not None:
        linears.setdefault(tuple(lm.weight.shape), ("lm_head", lm))
    result: dict = {"mlx": mx.__version__, "device": str(mx.default_device()), "linears": {}}
    for shape, (name, lin) in sorted(linears.items()):
        K = shape[1]
        x = mx.random.normal((args.max_rows, K), key=mx.random.key(1)).astype(mx.bfloat16)
        other = mx.random.normal((args.max_rows, K), key=mx.random.key(2)).astype(mx.bfloat16)
        entry = {"name": name, "bf16": rows_table(lin, x, other, args.max_rows, args.runs)}
        q = nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4)
        mx.eval(q.parameters())
        entry["q4"] = rows_table(q, x, other, args.max_rows, args.runs)
        result["linears"][f"{shape[0]}x{shape[1]}"] = entry
        print(shape, entry, flush=True)

    # row-wise ops: rms_norm over M rows, rope of row t at offset p vs one row at offset p + t
    H = config["hidden_size"]
    x = mx.random.normal((args.max_rows, H), key=mx.random.key(3)).astype(mx.bfloat16)
    w = mx.ones((H,), dtype=mx.float32)
    norm_rows = {
        m: mx.array_equal(
            mx.fast.rms_norm(x[:m], w, 1e-6)[:1], mx.fast.rms_norm(x[:1], w, 1e-6)
        ).item()
        for m in range(1, args.max_rows + 1)
    }
    q = mx.random.normal((1, 24, args.max_rows, 256), key=mx.random.key(4)).astype(mx.bfloat16)
    p = 4093

    def rope(a, offset):
        return mx.fast.rope(a, 64, traditional=False, base=1e7, scale=1.0, offset=offset)

    many = rope(q, p)
    rope_rows = [
        mx.array_equal(many[:, :, t : t + 1], rope(q[:, :, t : t + 1], p + t)).item()
        for t in range(args.max_rows)
    ]
    result["rms_norm_row0_equal_by_rows"] = norm_rows
    result["rope_row_equal_single"] = rope_rows
    print(result["rms_norm_row0_equal_by_rows"], rope_rows, flush=True)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
