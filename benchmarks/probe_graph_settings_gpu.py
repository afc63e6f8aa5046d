"""How MLX's CUDA graph settings change a decode step: 27B dims (random weights), each
setting in its own process (MLX reads them once).

    python benchmarks/probe_graph_settings_gpu.py --layers 64 --out graph_settings.json

MLX's CUDA backend records kernels into CUDA graphs of `MLX_MAX_OPS_PER_BUFFER` nodes
(default 20), keeps up to `MLX_CUDA_GRAPH_CACHE_SIZE` instantiated graphs (default 100) and
drops all of them when the cache overflows (since session 33 the package sets 100 and 1,000
where the user has not: `default` is those, `mlx` MLX's own); `MLX_USE_CUDA_GRAPHS=0`
launches kernels one by one. A 64-layer step is ~700 kernels, so with MLX's defaults a step
may instantiate its graphs again every token. Per setting: pipelined plain decode tok/s
(median of --runs), and the latency of one synchronous forward of 1 and of 3 rows (what a
speculative round waits for), medians of --sync-runs. `--dims tiny` keeps the step's
kernels and makes them nearly free: its times are the host's.

`--flash-args "..."` runs `bench_flash_full.py` with those arguments per setting instead
(Flash-Next's step is bound by the host's launches, ~1,700 a token, so its graphs' split and
cache may matter where the 27B's did not, session 10) and records its decode and prefill:

    python benchmarks/probe_graph_settings_gpu.py --settings default,cache1000,cache1000_ops100 \
        --flash-args "--dims flash --layers 48 --experts 512 --experts-bits 4 --depth 4096 \
        --decode 32 --runs 3 --prefill 4096" --out graph_settings_flash.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SETTINGS = {
    "default": {},  # the package's own (qwen38_backend/cuda_graphs.py)
    "mlx": {"MLX_MAX_OPS_PER_BUFFER": "20", "MLX_CUDA_GRAPH_CACHE_SIZE": "100"},  # MLX's
    "cache1000": {"MLX_CUDA_GRAPH_CACHE_SIZE": "1000"},
    "cache1000_ops50": {"MLX_CUDA_GRAPH_CACHE_SIZE": "1000", "MLX_MAX_OPS_PER_BUFFER": "50"},
    "cache1000_ops100": {"MLX_CUDA_GRAPH_CACHE_SIZE": "1000", "MLX_MAX_OPS_PER_BUFFER": "100"},
    "cache1000_ops200": {"MLX_CUDA_GRAPH_CACHE_SIZE": "1000", "MLX_MAX_OPS_PER_BUFFER": "200"},
    "no_graphs": {"MLX_USE_CUDA_GRAPHS": "0"},
}


def worker(args) -> dict:
    import mlx.core as mx
    from bench_gpu_27b import prefill_then_decode, prompt, random_model

    model, config, nbytes = random_model(args.dims, args.layers, args.dtype)
    ids = prompt(args.context, config["text_config"]["vocab_size"])
    _, rates = prefill_then_decode(model, ids, args.runs, args.decode, chunk=2048)
    state = model.new_state()
    mx.eval(model.prefill(ids, state, chunk=2048))
    sync = {}
    for rows in (1, 3):
        times = []
        for _ in range(args.sync_runs):
            offset = state.offset
            state.save_point()
            mx.synchronize()
            t = time.perf_counter()
            mx.eval(model.forward(ids[:rows], state))
            times.append(time.perf_counter() - t)
            state.truncate(offset)
            state.drop_save_points()
        sync[str(rows)] = statistics.median(times[1:]) * 1e3
    return {
        "weights_bytes": nbytes,
        "decode_tok_s": statistics.median(rates),
        "decode_runs": rates,
        "sync_forward_ms": sync,
    }


def flash_bench(flash_args: str, env: dict) -> dict:
    """bench_flash_full.py with `flash_args` under `env`: its decode and prefill figures."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "flash.json"
        cmd = [sys.executable, str(HERE / "bench_flash_full.py"), *shlex.split(flash_args)]
        done = subprocess.run([*cmd, "--out", str(out)], env=env, capture_output=True, text=True)
        if done.returncode:
            return {"error": done.stderr[-2000:]}
        result = json.loads(out.read_text())
    decode = result["decode"]["tokens_per_second"]
    return {
        "decode_tok_s": decode["median"],
        "decode_runs": decode["runs"],
        "decode_percent_of_bound": result["decode_percent_of_bound"],
        "prefill_tok_s": result["prefill_tokens_per_second"],
        "runs_identical": result["decode"]["runs_identical"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny"])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sync-runs", type=int, default=9)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--flash-args", default=None, help="bench_flash_full.py's arguments")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    from common import write_json

    out = {k: v for k, v in vars(args).items() if k not in ("worker", "out")}
    out["results"] = {}
    for name in args.settings.split(","):
        env = {**os.environ, **SETTINGS[name]}
        if args.flash_args:
            out["results"][name] = {"env": SETTINGS[name], **flash_bench(args.flash_args, env)}
            print(name, json.dumps(out["results"][name])[:300], flush=True)
            continue
        cmd = [sys.executable, __file__, "--worker", *sys.argv[1:]]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            out["results"][name] = {"error": done.stderr[-2000:]}
        else:
            measured = json.loads(done.stdout.splitlines()[-1])
            out["results"][name] = {"env": SETTINGS[name], **measured}
        print(name, json.dumps(out["results"][name])[:300], flush=True)
    write_json(out, args.out)


if __name__ == "__main__":
    main()
