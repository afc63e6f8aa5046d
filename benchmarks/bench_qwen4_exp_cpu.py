"""qwen4_exp (Flash-Next) on CPU: prefill and decode tokens/s of our engine.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
    python benchmarks/bench_qwen4_exp_cpu.py --out bench_qwen4_exp_cpu.json

Models: the tiny random qwen4_exp (fp32; QSA sparse from position 11) and the real Flash-Next
widths with 4 layers (3 Gated DeltaNet + 1 QSA, vocab 248320, 16 experts instead of 512, a
small n-gram table; bf16 on disk, fp32 compute; `--flash-dir` reuses one, else it is
generated, which takes minutes). mlx-lm has no qwen4_exp, so there is no peer. Each model runs
in its own subprocess so memory is returned between them. Reports medians of --runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import measure_engine, run_json_worker  # noqa: E402

HERE = Path(__file__).resolve().parent


def prompt(length: int, vocab: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(length).integers(10, min(vocab, 30000), size=length).tolist()


def _stats(values: list[float]) -> dict:
    return {"median": statistics.median(values), "runs": values}


def worker(path: str, lengths: list[int], decode: int, runs: int) -> dict:

    from qwen38_backend.loader import load_model

    t = time.perf_counter()
    model = load_model(path)
    load_s = time.perf_counter() - t
    attached = model.net.attach_ngram_tables(path)  # memory-map the n-gram table
    measured = measure_engine(model, prompt, lengths, decode, runs)
    return {
        "load_seconds": load_s,
        "ngram_table_memory_mapped": attached,
        "prefill": measured["prefill"],
        "decode_tokens_per_second": measured["decode"],
    }


def run_worker(path: Path, lengths, decode, runs) -> dict:
    cmd = [sys.executable, __file__, "--worker", str(path), "--lengths"]
    cmd += [",".join(map(str, lengths)), "--decode", str(decode), "--runs", str(runs)]
    return run_json_worker(cmd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiny-lengths", default="512,2048")
    p.add_argument("--flash-lengths", default="256")
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--flash-runs", type=int, default=1)
    p.add_argument("--flash-dir", default=None, help="existing real-shape weights to reuse")
    p.add_argument("--skip-flash", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--lengths", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker:
        lengths = [int(x) for x in args.lengths.split(",") if x]
        print(json.dumps(worker(args.worker, lengths, args.decode, args.runs)))
        return

    sys.path.insert(0, str(HERE))
    from common import environment, write_json

    from qwen38_backend.testing.tiny_qwen4_exp import write_tiny_qwen4_exp

    result: dict = {"environment": environment(), "compute_dtype": "float32", "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = write_tiny_qwen4_exp(Path(tmp) / "tiny", seed=0)
        todo = [("tiny", tiny, [int(x) for x in args.tiny_lengths.split(",")], args.runs)]
        if not args.skip_flash:
            flash = Path(args.flash_dir) if args.flash_dir else Path(tmp) / "flash"
            if not (flash / "model.safetensors").exists():
                write_tiny_qwen4_exp(flash, seed=0, dims="flash", dtype="bfloat16")
            lengths = [int(x) for x in args.flash_lengths.split(",")]
            todo.append(("flash_next_4layers_16experts_bf16_ckpt", flash, lengths, args.flash_runs))
        for label, path, lengths, runs in todo:
            result["models"][label] = run_worker(path, lengths, args.decode, runs)
            print(f"{label}: done", file=sys.stderr)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
