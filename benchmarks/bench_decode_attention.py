"""One layer's decode attention at depth on CUDA: the split-KV kernel vs MLX's SDPA.

    python benchmarks/bench_decode_attention.py --out decode_attention.json

Qwen3.8-27B full-attention shapes (24 query heads, 4 KV heads, head_dim 256, bf16), one
query token over L stored rows laid out as the stores pass them: a prefix view of a larger
buffer (ContiguousKV; the paged pool's dense view is the same kind of strided prefix) and a
fresh gather of 2,048 rows (a Quest selection at the default budget). Per case: seconds per
call (median of --runs runs of --inner calls queued and evaluated at once, mx.synchronize
around each run; also each call evaluated alone),
achieved GB/s (K + V bytes / seconds) against the 4.8 TB/s bound, the ratios to
mx.fast.scaled_dot_product_attention and to the kernel's fp32-FMA form (TENSOR_CORES off)
measured in the same run, peak memory of each, and the
kernel's error against the MLX op. --sweep-splits also times other split counts at the
longest length, --sweep-paged at a paged call over the --gathered rows (Quest's in-place
read: at 2,048 rows its blocks are latency-bound, session 32); an entry `SxW` runs S splits
with W warps a block. CUDA only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mlx.core as mx  # noqa: E402
from common import environment, peak_bandwidth, write_json  # noqa: E402
from probe_step_graph import queued_device_s  # noqa: E402

HQ, HKV, D = 24, 4, 256


def timed(fn, runs: int, inner: int) -> dict:
    """Seconds per call: median over runs of (inner calls queued, then evaluated at once, as
    a decode step queues its layers) / inner; `each_eval_s`: the median with every call
    evaluated alone (what one call costs with the host's round trip)."""
    for _ in range(3):
        mx.eval(fn())
    mx.synchronize()
    values, alone = [], []
    for _ in range(runs):
        t = time.perf_counter()
        mx.eval([fn() for _ in range(inner)])
        mx.synchronize()
        values.append((time.perf_counter() - t) / inner)
        t = time.perf_counter()
        for _ in range(inner):
            mx.eval(fn())
        mx.synchronize()
        alone.append((time.perf_counter() - t) / inner)
    return {
        "median_s": statistics.median(values),
        "min_s": min(values),
        "runs_s": values,
        "each_eval_s": statistics.median(alone),
    }


def peak_of(fn) -> int:
    mx.synchronize()
    mx.reset_peak_memory()
    mx.eval(fn())
    mx.synchronize()
    return mx.get_peak_memory()


def case(kernel, name: str, q, k, v, args, bound: float) -> dict:
    scale = D**-0.5
    mx.eval(q, k, v)
    length = k.shape[2]
    kv_bytes = 2 * HKV * length * D * k.dtype.size
    ours = lambda: kernel.decode_attention(q, k, v, scale)  # noqa: E731
    sdpa = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)  # noqa: E731

    def fma():  # the fp32-FMA kernel (what runs without tensor cores)
        kernel.TENSOR_CORES = False
        try:
            return kernel.decode_attention(q, k, v, scale)
        finally:
            kernel.TENSOR_CORES = True

    base = mx.get_active_memory()
    mma = kernel.uses_tensor_cores(q, k)
    row = {"case": name, "L": length, "kv_bytes": kv_bytes, "tensor_cores": mma}
    row["splits"] = kernel.n_splits(length, HKV, mma)
    row["mismatch_x_tolerance"] = kernel.mismatch(ours(), sdpa())
    row["fma_mismatch_x_tolerance"] = kernel.mismatch(fma(), sdpa())
    for label, fn in (("kernel", ours), ("fma_kernel", fma), ("sdpa", sdpa)):
        t = timed(fn, args.runs, args.inner)
        t["GBps"] = kv_bytes / t["median_s"] / 1e9
        t["fraction_of_bound"] = kv_bytes / t["median_s"] / bound
        t["peak_bytes_above_inputs"] = peak_of(fn) - base
        row[label] = t
    row["speedup_vs_sdpa"] = row["sdpa"]["median_s"] / row["kernel"]["median_s"]
    row["speedup_vs_fma"] = row["fma_kernel"]["median_s"] / row["kernel"]["median_s"]
    print(
        f"{name:>10} L={length:>7}: kernel {row['kernel']['median_s'] * 1e6:8.1f} us "
        f"{row['kernel']['GBps']:7.0f} GB/s | fma {row['fma_kernel']['GBps']:7.0f} GB/s "
        f"| sdpa {row['sdpa']['median_s'] * 1e6:8.1f} us "
        f"{row['sdpa']['GBps']:7.0f} GB/s | x{row['speedup_vs_sdpa']:.2f}",
        file=sys.stderr,
    )
    return row


def shapes(text: str) -> list[tuple[int, int | None]]:
    """'16,32x8' -> [(16, None), (32, 8)]: split counts, each with the tensor-core kernel's
    warps a block (None: its default)."""
    out = []
    for item in text.split(","):
        splits, _, warps = item.partition("x")
        out.append((int(splits), int(warps) if warps else None))
    return out


def sweep_splits(kernel, q, k, v, counts: list[tuple[int, int | None]], args, **paged) -> dict:
    """The kernel at other split counts (blocks per KV head) and warps a block on the same
    K/V (`paged`: the pages, page_tokens and length of a paged call over k / v as a pool)."""
    length, rows = paged.get("length", k.shape[2]), []
    for s, w in counts:
        call = lambda s=s, w=w: kernel.decode_attention(  # noqa: E731
            q, k, v, D**-0.5, splits=s, warps=w, **paged
        )
        t = timed(call, args.runs, args.inner)
        t["splits"], t["warps"] = s, w or kernel.MMA_WARPS
        t["GBps"] = 2 * HKV * length * D * k.dtype.size / t["median_s"] / 1e9

        # the device's time alone: --inner calls queued behind a spin (the host's time per
        # call is as long as a short call's device time, and the median above mixes both),
        # each call's query the previous call's output, so they run one after another as a
        # step's layers do (independent calls overlap on the device)
        def chain(s=s, w=w):
            x = q
            for _ in range(args.inner):
                x = kernel.decode_attention(x, k, v, D**-0.5, splits=s, warps=w, **paged)
            return x

        t["device_s"] = queued_device_s(chain, args.runs) / args.inner
        rows.append(t)
        print(
            f"  splits {s:>4} x {t['warps']} warps: {t['median_s'] * 1e6:7.1f} us, "
            f"device {t['device_s'] * 1e6:6.1f} us, {t['GBps']:7.0f} GB/s",
            file=sys.stderr,
        )
    return {"L": length, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="4096,32768,131072,262144")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--gathered", type=int, default=2048, help="rows of the Quest-like case")
    ap.add_argument("--sweep-splits", default="16,33,66,132,264")
    ap.add_argument(
        "--sweep-paged",
        default="4,8,16,32",
        help="split counts (each optionally x warps a block: 32x8) for a paged Quest-like "
        "call (--gathered rows in 32-row pages)",
    )
    ap.add_argument("--bandwidth-gbps", type=float, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if mx.default_device() != mx.gpu or not mx.cuda.is_available():
        sys.exit("bench_decode_attention.py needs MLX with the CUDA backend (a CUDA kernel)")
    from qwen38_backend.kernels import decode_attention as kernel

    lengths = [int(x) for x in args.lengths.split(",")]
    bound, bound_from = peak_bandwidth(args.bandwidth_gbps)
    dtype = mx.bfloat16
    result = {
        "environment": environment(),
        "shapes": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": "bfloat16"},
        "bound_bytes_per_s": bound,
        "bound_from": bound_from,
        "probe_passed": kernel.available(dtype, dtype, D, HQ // HKV),
        "runs": args.runs,
        "inner": args.inner,
        "rows": [],
    }
    q = mx.random.normal((1, HQ, 1, D), key=mx.random.key(0)).astype(dtype)
    for length in lengths:
        cap = -(-length // 256) * 256 + 256  # a store's buffer grows in steps of 256
        keys = mx.random.split(mx.random.key(length), 2)
        big_k = mx.random.normal((1, HKV, cap, D), key=keys[0]).astype(dtype)
        big_v = mx.random.normal((1, HKV, cap, D), key=keys[1]).astype(dtype)
        k, v = big_k[:, :, :length], big_v[:, :, :length]
        result["rows"].append(case(kernel, "store", q, k, v, args, bound))
        if length == max(lengths) and args.sweep_splits:
            counts = shapes(args.sweep_splits)
            result["splits_sweep"] = sweep_splits(kernel, q, k, v, counts, args)
        del big_k, big_v, k, v
        mx.clear_cache()
    n = args.gathered
    keys = mx.random.split(mx.random.key(1), 3)
    pool_k = mx.random.normal((HKV, 4 * n, D), key=keys[0]).astype(dtype)
    pool_v = mx.random.normal((HKV, 4 * n, D), key=keys[1]).astype(dtype)
    rows = mx.sort(mx.random.permutation(4 * n, key=keys[2])[:n])
    k, v = mx.take(pool_k, rows, axis=1)[None], mx.take(pool_v, rows, axis=1)[None]
    result["rows"].append(case(kernel, "gathered", q, k, v, args, bound))
    if args.sweep_paged:
        # the same rows read in place, as a Quest step does: whole 32-row pages of the pool
        P = 32
        pages = mx.sort(mx.random.permutation(4 * n // P, key=keys[2])[: n // P])
        pages = mx.broadcast_to(pages.astype(mx.int32)[None], (HKV, n // P))
        counts = shapes(args.sweep_paged)
        paged = {"pages": pages, "page_tokens": P, "length": n}
        result["paged_sweep"] = sweep_splits(
            kernel, q, pool_k[None], pool_v[None], counts, args, **paged
        )
        result["paged_sweep"]["default_splits"] = kernel.n_splits(n, HKV, True)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
