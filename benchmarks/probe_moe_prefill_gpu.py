"""Flash-Next's routed experts over a prefill chunk, 4-bit: the ways MLX can run them, timed.

    # H200 (real expert dims: 512 experts, hidden 2560, intermediate 640, top-10, group 64):
    python benchmarks/probe_moe_prefill_gpu.py --tokens 512,2048 --out moe_prefill.json
    # CPU smoke (fewer, narrower experts, fp32):
    python benchmarks/probe_moe_prefill_gpu.py --experts 16 --hidden 256 --intermediate 64 \
        --tokens 64,256 --dtype float32

One MoE layer's routed part (`QuantizedExperts`, random weights, routing drawn from a random
router's softmax top-k, so the groups are as uneven as random weights make them), for each
chunk of `--tokens` tokens, median of `--runs` timed calls after a warm one:
- `gather_qmm`: the engine's grouped path (pairs laid out [E, cap, H], zero padded to the
  largest group, `gather_qmm` with one batch entry per expert); on CUDA MLX runs gather_qmm
  as a gather_qmv (one matrix-vector product per row);
- `quantized_matmul`: the same [E, cap, H] layout through `mx.quantized_matmul` with the 3-D
  packed stacks (a batched quantized GEMM where the backend has one);
- `dequantize`: every expert stack dequantized to the model dtype, then the dense grouped
  GEMMs (`Experts._grouped_mm`); `dequantize_S`: the same S experts at a time (transient
  bounded to S experts' weights).
Each output's max |difference| against an fp32 reference (the dequantized weights in fp32) is
recorded beside the dtype's own rounding (the reference rounded to the dtype), and the
transient bytes of the dequantize variants.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--intermediate", type=int, default=640)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--tokens", default="512,2048")
    ap.add_argument("--slices", default="64,128", help="experts per dequantize slice")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import mlx.core as mx

    from qwen38_backend.models import moe

    dtype = getattr(mx, args.dtype)
    E, H, inter, k = args.experts, args.hidden, args.intermediate, args.top_k
    dense = moe.Experts(E, H, inter)
    dense.gate_up_proj = mx.random.normal((E, 2 * inter, H), dtype, scale=H**-0.5)
    dense.down_proj = mx.random.normal((E, H, inter), dtype, scale=inter**-0.5)
    quant = dense.to_quantized(64, 4)
    mx.eval(quant.parameters())
    del dense

    def stack(name: str, first: int = 0, last: int | None = None, to=dtype) -> mx.array:
        p = getattr(quant, name)
        sl = slice(first, last)
        return mx.dequantize(
            p["weight"][sl], p["scales"][sl], p["biases"][sl], group_size=64, bits=4
        ).astype(to)

    def grouped_dense(buf: mx.array, first: int = 0, last: int | None = None) -> mx.array:
        h = moe._swiglu(buf @ stack("gate_up_proj", first, last).swapaxes(-1, -2), inter)
        return h @ stack("down_proj", first, last).swapaxes(-1, -2)

    def sliced(size: int):
        def mm(buf: mx.array) -> mx.array:
            parts = [grouped_dense(buf[a : a + size], a, a + size) for a in range(0, E, size)]
            return mx.concatenate(parts, axis=0)

        return mm

    def qmm(buf: mx.array) -> mx.array:
        def one(x, name):
            p = getattr(quant, name)
            return mx.quantized_matmul(
                x, p["weight"], p["scales"], p["biases"], transpose=True, group_size=64, bits=4
            )

        return one(moe._swiglu(one(buf, "gate_up_proj"), inter), "down_proj")

    variants = {
        "gather_qmm": lambda x, inds: quant(x, inds),
        "quantized_matmul": lambda x, inds: moe._grouped(x, inds, E, qmm),
        "dequantize": lambda x, inds: moe._grouped(x, inds, E, grouped_dense),
    }
    for s in [int(v) for v in args.slices.split(",") if v]:
        if s < E:
            variants[f"dequantize_{s}"] = lambda x, inds, s=s: moe._grouped(x, inds, E, sliced(s))

    result = {
        "environment": environment(),
        "experts": E,
        "hidden": H,
        "intermediate": inter,
        "top_k": k,
        "dtype": args.dtype,
        "bits": 4,
        "group_size": 64,
        "runs": args.runs,
        "dequantized_bytes_per_expert": (3 * inter * H) * dtype.size,
        "tokens": {},
    }
    router = mx.random.normal((H, E), scale=H**-0.5)
    for T in [int(v) for v in args.tokens.split(",")]:
        x = mx.random.normal((T, H), dtype)
        inds, _ = moe.route(x.astype(mx.float32) @ router, k, True)
        mx.eval(x, inds)
        counts = mx.zeros((E,), mx.int32).at[inds.reshape(-1).astype(mx.int32)].add(1)
        ref = moe._grouped(
            x.astype(mx.float32),
            inds,
            E,
            lambda buf: (
                moe._swiglu(buf @ stack("gate_up_proj", to=mx.float32).swapaxes(-1, -2), inter)
                @ stack("down_proj", to=mx.float32).swapaxes(-1, -2)
            ),
        )
        mx.eval(ref)
        row = {
            "pairs": T * k,
            "largest_group": int(counts.max().item()),
            "mean_group": T * k / E,
            "dtype_rounding_of_reference": float(mx.abs(ref.astype(dtype) - ref).max().item()),
            "variants": {},
        }
        for name, fn in variants.items():
            try:
                out = fn(x, inds)
                mx.eval(out)
            except Exception as err:  # a backend without the primitive: record, go on
                row["variants"][name] = {"error": f"{type(err).__name__}: {err}"[:300]}
                continue
            times = []
            for _ in range(args.runs):
                mx.synchronize()
                t = time.perf_counter()
                mx.eval(fn(x, inds))
                mx.synchronize()
                times.append(time.perf_counter() - t)
            ms = 1e3 * statistics.median(times)
            row["variants"][name] = {
                "ms": ms,
                "ms_runs": [1e3 * v for v in times],
                "max_abs_vs_fp32": float(mx.abs(out.astype(mx.float32) - ref).max().item()),
            }
            print(f"T {T}: {name} {ms:.2f} ms", flush=True)
            del out
        result["tokens"][str(T)] = row
        write_json(result, args.out)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
