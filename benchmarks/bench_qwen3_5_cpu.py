"""qwen3_5 on CPU: ours vs mlx-lm 0.32.2's qwen3_5, on the SAME weights directory.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
    python benchmarks/bench_qwen3_5_cpu.py --out bench_qwen3_5_cpu.json

Models: the tiny random qwen3_5 (fp32) and the real 27B widths with 4 layers (3 Gated DeltaNet
+ 1 attention, vocab 248320, bf16 on disk; `--real-dir` reuses one, else it is generated).
Both engines compute in fp32 (MLX's x86 half kernels are slow). mlx-lm's model is loaded lazily
and cast to float32 tensor by tensor (a whole-model set_dtype holds bf16 + fp32 at once: 24 GB
for the real shape). mlx-lm's prefill is its generate_step up to the first token (its own
chunking; only the last position goes through the LM head, as in ours). Each (engine, model)
runs in its own subprocess so memory is returned between them. Reports medians of --runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    cast_in_place,
    measure_engine,
    mlx_lm_decode_tok_s,
    mlx_lm_prefill_tok_s,
    run_json_worker,
)

HERE = Path(__file__).resolve().parent


def prompt(length: int, vocab: int) -> list[int]:
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(10, min(vocab, 500), size=length).tolist()


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "runs": values}


# ----- workers (run in a subprocess) ---------------------------------------------------------
def worker_ours(path: str, lengths: list[int], decode: int, runs: int) -> dict:
    import qwen38_backend

    # the product loader: per-tensor fp32 cast (peak ~ fp32 size), fused projections
    model = qwen38_backend.load(path, dtype="float32")
    return measure_engine(model, prompt, lengths, decode, runs)


def worker_mlx_lm(path: str, lengths: list[int], decode: int, runs: int) -> dict:
    import mlx.core as mx
    import mlx_lm

    model, _ = mlx_lm.load(path, lazy=True)
    cast_in_place(model, mx.float32)  # like ours: fp32 compute, never source + copy at once
    vocab = model.args.text_config["vocab_size"]
    mlx_lm_decode_tok_s(model, prompt(80, vocab), 2)  # warm-up
    out: dict = {"prefill": {}}
    for n in lengths:
        vals = [mlx_lm_prefill_tok_s(model, prompt(n, vocab)) for _ in range(runs)]
        out["prefill"][str(n)] = _stats(vals)
    vals = [mlx_lm_decode_tok_s(model, prompt(16, vocab), decode) for _ in range(runs)]
    out["decode"] = _stats(vals)
    return out


# ----- driver ---------------------------------------------------------------------------------
def run_worker(engine: str, path: Path, lengths, decode, runs) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        engine,
        "--model-dir",
        str(path),
        "--lengths",
        ",".join(map(str, lengths)),
        "--decode",
        str(decode),
        "--runs",
        str(runs),
    ]
    return run_json_worker(cmd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiny-lengths", default="512,4096")
    p.add_argument("--real-lengths", default="512,4096")
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--real-runs", type=int, default=2)
    p.add_argument("--real-decode", type=int, default=8, help="decode tokens (real shape)")
    p.add_argument("--real-dir", default=None, help="existing 27B-shape weights to reuse")
    p.add_argument("--skip-real", action="store_true")
    p.add_argument("--skip-mlx-lm", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", choices=["ours", "mlx-lm"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--lengths", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker:
        fn = worker_ours if args.worker == "ours" else worker_mlx_lm
        lengths = [int(x) for x in args.lengths.split(",") if x]
        print(json.dumps(fn(args.model_dir, lengths, args.decode, args.runs)))
        return

    sys.path.insert(0, str(HERE))
    from common import environment, write_json

    from qwen38_backend.testing import make_tiny_weights

    engines = ["ours"] + ([] if args.skip_mlx_lm else ["mlx-lm"])
    result: dict = {"environment": environment(), "compute_dtype": "float32", "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_tiny_weights("qwen3_5", Path(tmp) / "tiny", seed=0)
        tiny_lengths = [int(x) for x in args.tiny_lengths.split(",")]
        todo = [("tiny", tiny, tiny_lengths, args.runs, args.decode)]
        if not args.skip_real:
            real = Path(args.real_dir) if args.real_dir else None
            if real is None or not (real / "model.safetensors").exists():
                real = real or Path(tmp) / "real"
                make_tiny_weights(
                    "qwen3_5",
                    real,
                    seed=0,
                    dims="27b",
                    num_layers=4,
                    dtype="bfloat16",
                    with_mtp=False,
                )
            lengths = [int(x) for x in args.real_lengths.split(",")]
            todo.append(("27b_4layers_bf16_ckpt", real, lengths, args.real_runs, args.real_decode))
        for label, path, lengths, runs, decode in todo:
            result["models"][label] = {
                engine: run_worker(engine, path, lengths, decode, runs) for engine in engines
            }
            print(f"{label}: done", file=sys.stderr)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
