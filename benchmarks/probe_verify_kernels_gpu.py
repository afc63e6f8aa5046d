"""Where a verify forward's device time goes, kernel by kernel: one forward of each row count
under Nsight Compute (`ncu`), each between two marker launches, summed by kernel name.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --log-file k.csv \
        python benchmarks/probe_verify_kernels_gpu.py --layers 4 --context 4096
    python benchmarks/probe_verify_kernels_gpu.py --parse k.csv --out verify_kernels.json

Qwen3.8-27B dims (random bf16 weights), `--layers` layers (the 27B's order: three Gated
DeltaNet layers, then full attention), or with `--model flash` Flash-Next's real per-layer
dims (every 4th layer QSA, `--experts` experts in 4-bit, the rest bf16; `--rows 1` is a plain
decode step), the engine's default state at `--context` tokens; per
row count in `--rows`, one forward of that many rows, rewound after. ncu runs kernels one at
a time, so each kernel's time is its own (no overlap, no launch gaps): the sum is the
device's work, not a step's wall time. `--parse` groups the kernels between each pair of
markers by name: per row count, ms per kernel family and in all (pass the same `--rows`).

`--kv-topk N` decodes from a paged Quest state (budget N tokens) instead; `--window` brackets
the marked forwards with the driver's profiler start / stop, for ncu run with
`--profile-from-start off`, so a deep context's prefill is not profiled:

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum \
        --csv --log-file q.csv python benchmarks/probe_verify_kernels_gpu.py --layers 64 \
        --context 131072 --rows 1 --kv-topk 2048 --window
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import write_json  # noqa: E402

MARKER = "qwen38_marker"


def run(args) -> None:
    import mlx.core as mx
    from bench_gpu_27b import prompt, random_model

    if args.model == "flash":
        from bench_qsa_depth import flash_model

        model, config = flash_model(args.layers, args.experts)
    else:
        model, config, _ = random_model("27b", args.layers, "bfloat16")
    vocab = config["text_config"]["vocab_size"]
    kv = {"kv_paged": "on", "kv_topk": args.kv_topk} if args.kv_topk else {}
    state = model.new_state(**kv)
    mx.eval(model.prefill(prompt(args.context, vocab), state))
    ids = prompt(max(args.rows), vocab)
    marker = mx.fast.cuda_kernel(
        name=MARKER, input_names=["a"], output_names=["b"], source="b[0] = a[0];"
    )
    one = mx.zeros((1,), mx.float32)

    def mark() -> None:
        mx.eval(
            marker(
                inputs=[one],
                grid=(1, 1, 1),
                threadgroup=(1, 1, 1),
                output_shapes=[(1,)],
                output_dtypes=[mx.float32],
            )[0]
        )
        mx.synchronize()

    def forward(rows: int) -> None:
        offset = state.offset
        state.save_point()
        mx.eval(model.forward(ids[:rows], state))
        mx.synchronize()
        state.truncate(offset)
        state.drop_save_points()

    for rows in args.rows:  # warm: compiled pieces and kernels for each width
        forward(rows)
    window = profiler_window() if args.window else None
    if window:
        window(True)
    for rows in args.rows:
        mark()
        forward(rows)
        mark()
    if window:
        window(False)


def profiler_window():
    """on(True) / off(False): the CUDA driver's profiler start / stop, so that ncu run with
    `--profile-from-start off` profiles the marked forwards only, not the prefill before
    them (at 131K, tens of thousands of kernels each replayed)."""
    import ctypes

    driver = ctypes.CDLL("libcuda.so.1")

    def window(on: bool) -> None:
        code = driver.cuProfilerStart() if on else driver.cuProfilerStop()
        if code != 0:
            raise RuntimeError(f"cuProfiler{'Start' if on else 'Stop'} returned {code}")

    return window


def family(name: str) -> str:
    """A kernel's family: the engine's own kernels by their name, MLX's by its kind."""
    for own in ("rows_matmul", "gdn_decode", "decode_attention", "quest", "gemv", "gemm"):
        if own in name:
            return own
    head = re.split(r"[<(]", name, maxsplit=1)[0]
    return head[:60]


def parse(path: str, rows: list[int]) -> dict:
    spans: list[list[tuple[str, float]]] = []
    current: list[tuple[str, float]] | None = None
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"]
        value = float(row["Metric Value"].replace(",", ""))
        ms = value * {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0}.get(
            row.get("Metric Unit", "nsecond"), 1e-6
        )
        if MARKER in name:
            if current is None:
                current = []
            else:
                spans.append(current)
                current = None
        elif current is not None:
            current.append((name, ms))
    spans = spans[-len(rows) :]  # the measured forwards (warm-up ones are not marked)
    if len(spans) < len(rows):  # e.g. ncu could not read the counters: its errors are here
        with open(path) as f:
            head = "".join(f.readlines()[:8])
        raise SystemExit(
            f"{path}: {len(spans)} marked forwards, expected {len(rows)}; the log begins:\n{head}"
        )
    out = {}
    for r, span in zip(rows, spans, strict=True):
        by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for name, ms in span:
            by[family(name)][0] += ms
            by[family(name)][1] += 1
        out[str(r)] = {
            "total_ms": sum(ms for _, ms in span),
            "kernels": len(span),
            "by_family": {
                k: {"ms": v[0], "launches": v[1]}
                for k, v in sorted(by.items(), key=lambda kv: -kv[1][0])
            },
            # launch order (name head, us): which layer part each kernel belongs to
            "sequence": [[name[:90], round(ms * 1000, 2)] for name, ms in span],
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="27b", choices=["27b", "flash"])
    ap.add_argument("--experts", type=int, default=512, help="--model flash: experts per layer")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rows", type=lambda v: [int(r) for r in v.split(",")], default=[1, 2, 5])
    ap.add_argument("--kv-topk", type=int, default=0, help="27b: paged Quest, this budget")
    ap.add_argument(
        "--window",
        action="store_true",
        help="profile only the marked forwards (run ncu with --profile-from-start off)",
    )
    ap.add_argument("--parse", default=None, help="an ncu CSV log of a run of this script")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.parse:  # pass the run's --model, --layers, --context: they label the JSON
        result = {"model": args.model, "layers": args.layers, "context": args.context}
        result["rows"] = parse(args.parse, args.rows)
        write_json(result, args.out)
        for r, v in result["rows"].items():
            print(
                r,
                round(v["total_ms"], 3),
                {k: round(f["ms"], 3) for k, f in list(v["by_family"].items())[:8]},
            )
    else:
        run(args)


if __name__ == "__main__":
    main()
