"""The device time of the 27B's chain of one-row products (bench_products_chain_gpu.py's
chain: a Gated DeltaNet layer's in_proj, out_proj + residual, gate/up + swiglu, down +
residual, --layers times) under variants of kernels/rows_matmul.py's launch shape, in one
process, the variants taking turns run by run:

    python benchmarks/probe_products_variants_gpu.py --layers 16 --runs 5 --out v.json

Variants (each a patch of the module's constants, its kernels compiled anew):
- "base": as the engine runs it;
- "ks2" / "ks8": SPLIT_K warps per output of the narrow products (out_proj, down) instead
  of 4 (changes the order of a row's sums: other bits, checked only for being close);
- "loads8": 8 x 16 bytes of weights in flight per lane instead of 4;
- "interleaved": the gate/up weight's rows interleaved (gate_i, up_i side by side) and the
  swiglu walk reading a warp's pair as adjacent rows, where it reads rows N / 2 apart: the
  same arithmetic, so the chain's output must be base's bit for bit (checked).
Why: under ncu (ncu_products_s26.json) the gate/up product with the swiglu epilogue read
85% of DRAM's peak where the plain one read 90%, and the down product 80-83%; a 27B step's
products are ~13 ms of its ~14 ms.
Per variant: the median ms of a chain (behind a spin kernel, probe_step_graph.py's method),
the weights' TB/s, and the output's largest difference from base's.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from pathlib import Path

import mlx.core as mx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_products_chain_gpu import SHAPES, chain, chain_arguments, weights  # noqa: E402
from common import environment, write_json  # noqa: E402
from probe_step_graph import queued_device_s  # noqa: E402

VARIANTS = ("base", "ks2", "ks8", "loads8", "interleaved")


def interleave(w: mx.array) -> mx.array:
    """A fused [gate; up] weight [N, K] as rows gate_0, up_0, gate_1, up_1, ..."""
    n, k = w.shape
    return mx.stack([w[: n // 2], w[n // 2 :]], axis=1).reshape(n, k)


@contextlib.contextmanager
def variant(name: str):
    """The rows_matmul module patched for `name`; its kernels named apart (MLX keeps a
    compiled kernel by name) and its caches cleared before and after."""
    from qwen38_backend.kernels import jit
    from qwen38_backend.kernels import rows_matmul as rm

    saved = {k: getattr(rm, k) for k in ("SPLIT_K", "LOADS", "cuda_kernel")}
    saved_rows = dict(rm.ROWS)
    if name == "ks2":
        rm.SPLIT_K = 2
    elif name == "ks8":
        rm.SPLIT_K = 8
    elif name == "loads8":
        rm.LOADS = 8
    elif name == "interleaved":
        rm.ROWS[""] = "n0 + j"  # a swiglu pair: adjacent rows
        rm.cuda_kernel = lambda *, name, **kw: jit.cuda_kernel(name=name + "_il", **kw)
    rm._kernel.cache_clear()
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(rm, k, v)
        rm.ROWS.clear()
        rm.ROWS.update(saved_rows)
        rm._kernel.cache_clear()


def main() -> None:
    ap = chain_arguments(__doc__)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = set(names) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")

    ws = weights(args.layers)
    mixed = [[w_in, w_out, interleave(w_up), w_down] for w_in, w_out, w_up, w_down in ws]
    mx.eval(mixed)
    nbytes = sum(w.nbytes for layer in ws for w in layer)
    x0 = mx.random.normal((1, SHAPES[0][1]), key=mx.random.key(99)).astype(mx.bfloat16)

    def make(name: str):
        layers = mixed if name == "interleaved" else ws

        def chains() -> mx.array:
            x = x0
            for _ in range(args.inner):
                x = chain(layers, x)
            return x

        return chains

    outputs, times = {}, {name: [] for name in names}
    for name in names:
        with variant(name):
            outputs[name] = make(name)().astype(mx.float32)
            mx.eval(outputs[name])
    for _ in range(args.runs):
        for name in names:
            with variant(name):
                times[name].append(1e3 * queued_device_s(make(name), args.repeats) / args.inner)
    base = outputs.get("base")
    result = {
        "benchmark": "one-row product chain, 27B Gated DeltaNet layer shapes, bf16, variants",
        "environment": environment(),
        "layers": args.layers,
        "inner": args.inner,
        "weights_bytes": nbytes,
        "variants": {},
    }
    for name in names:
        median = statistics.median(times[name])
        diff = None if base is None else mx.abs(outputs[name] - base).max().item()
        result["variants"][name] = {
            "ms": median,
            "runs": times[name],
            "tb_s": nbytes / (median / 1e3) / 1e12,
            "max_abs_diff_from_base": diff,
            "finite": bool(mx.isfinite(outputs[name]).all().item()),
        }
        print(f"{name}: {median:.3f} ms, {nbytes / median / 1e9:.2f} TB/s, diff {diff}")
    write_json(result, args.out)


if __name__ == "__main__":
    main()
