"""Where a speculative round's time goes on the host: building the forward's graph, handing it
to the device, and waiting for it, for one plain step and verifies of 2..--max-rows rows.

    python benchmarks/probe_round_host_gpu.py --layers 64 --context 4096 --out round_host.json

Qwen3.8-27B dims (random weights), the engine's default state, at `--context` tokens. Per
row count, medians of `--runs` forwards, each rewound through a save point:
- `build_ms`: the forward built with no hand-over (QWEN38_EAGER_LAYERS=0), nothing evaluated:
  Python and the compiled pieces' replay;
- `eval_prebuilt_ms`: mx.eval of that built graph: encoding every kernel, then the device;
- `eager_ms`: the forward as a round runs it (built and handed over layer by layer, then
  waited for): what a round pays;
- `pipelined_ms` (1 row): a plain step's share when steps are queued back to back (the next
  built while the device runs this one): close to the device's time for one step.
`eager_ms - pipelined_ms` is what a round pays above the device (host work not overlapped).
`--outputs-per-warp`, `--staged-from`, `--stages` and `--split-k` set the row-invariant
product's launch shape (kernels/rows_matmul.py; the probe checks rows stay invariant).
`--dims tiny --layers 4` smoke-tests it on a CPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_27b import prompt, random_model  # noqa: E402
from common import write_json  # noqa: E402


def median_ms(fn, runs: int) -> float:
    fn()  # warm: traces and compiles this width
    return 1e3 * statistics.median(fn() for _ in range(runs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny"])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--max-rows", type=int, default=5)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--outputs-per-warp",
        default=None,
        help="rows_matmul.OUTPUTS_PER_WARP entries, e.g. 4:2,5:2",
    )
    ap.add_argument("--staged-from", type=int, default=None, help="rows_matmul.STAGED_FROM")
    ap.add_argument("--stages", type=int, default=None, help="rows_matmul.STAGES")
    ap.add_argument("--split-k", type=int, default=None, help="rows_matmul.SPLIT_K")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    launch = {"STAGED_FROM": args.staged_from, "STAGES": args.stages, "SPLIT_K": args.split_k}
    if args.outputs_per_warp or any(v is not None for v in launch.values()):
        from qwen38_backend.kernels import rows_matmul

        for name, value in launch.items():
            if value is not None:
                setattr(rows_matmul, name, value)
        for entry in (args.outputs_per_warp or "").split(","):
            if entry:
                rows, nw = (int(v) for v in entry.split(":"))
                rows_matmul.OUTPUTS_PER_WARP[rows] = nw

    import mlx.core as mx

    model, config, nbytes = random_model(args.dims, args.layers, args.dtype)
    vocab = config["text_config"]["vocab_size"]
    state = model.new_state()
    mx.eval(model.prefill(prompt(args.context, vocab), state))
    ids = prompt(args.max_rows, vocab)

    def rewound(fn):
        """fn run at the current position, then the state cut back to it."""

        def run():
            offset = state.offset
            state.save_point()
            mx.synchronize()
            value = fn()
            mx.synchronize()
            state.truncate(offset)
            state.drop_save_points()
            return value

        return run

    def split(rows: int) -> tuple[float, float]:
        os.environ["QWEN38_EAGER_LAYERS"] = "0"
        try:
            t = time.perf_counter()
            logits = model.forward(ids[:rows], state)
            built = time.perf_counter()
            mx.eval(logits)
            return built - t, time.perf_counter() - built
        finally:
            del os.environ["QWEN38_EAGER_LAYERS"]

    def eager(rows: int) -> float:
        t = time.perf_counter()
        mx.eval(model.forward(ids[:rows], state))
        return time.perf_counter() - t

    def pipelined(steps: int = 16) -> float:
        # plain steps fed their own greedy tokens, each queued before the last is read
        t = time.perf_counter()
        y = mx.array([ids[0]], dtype=mx.int32)
        for _ in range(steps):
            y = mx.argmax(model.forward(y, state, last_only=True)[-1:], axis=-1).astype(mx.int32)
            mx.async_eval(y)
        mx.eval(y)
        return (time.perf_counter() - t) / steps

    result = {
        "dims": args.dims,
        "layers": args.layers,
        "context": args.context,
        "device": str(mx.default_device()),
        "weights_bytes": nbytes,
        "outputs_per_warp": args.outputs_per_warp,
        "staged_from": args.staged_from,
        "stages": args.stages,
        "split_k": args.split_k,
        "rows": {},
    }
    for rows in range(1, args.max_rows + 1):
        split(rows)  # warm
        parts = [rewound(lambda r=rows: split(r))() for _ in range(args.runs)]
        builds, evals = [b for b, _ in parts], [e for _, e in parts]
        row = {
            "build_ms": 1e3 * statistics.median(builds),
            "eval_prebuilt_ms": 1e3 * statistics.median(evals),
            "eager_ms": median_ms(rewound(lambda r=rows: eager(r)), args.runs),
        }
        if rows == 1:
            row["pipelined_ms"] = median_ms(rewound(pipelined), args.runs)
        result["rows"][str(rows)] = row
        print(rows, row, flush=True)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
