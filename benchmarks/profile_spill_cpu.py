"""Host time of Quest decode steps over paged KV with spilled pages, without a model.

    nice -n 10 python benchmarks/profile_spill_cpu.py --layers 16 --length 65536 \
        --page-tokens 32 --pool-tokens 32768 --budget 2048 --runs 5

The shape of benchmarks/profile_spill_gpu.py's spilled decode (64 layers at 64K with a 50%
pool on the H200: 16 attention layers, 2048 pages of 32 tokens, a 1024-page pool, a 64-page
selection) with small heads, on a CPU, in a minute: `--layers` PagedKV stores (one per
attention layer, sharing a sequence's spill file) are filled with random keys, then each
decode step feeds every layer a random query (chained through the previous layer's output,
as a model's layers are) and evaluates the last output. Random keys and queries change the
selection every step, so pages miss every step: the worst case. Reports per-step wall time
resident vs spilled (medians of `--runs` runs), host time per layer-step (wall less the
waits in mx.eval), pages fetched per layer-step, the spilled step's extra wall time per
layer-step, and a cProfile top list of one more spilled run.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import environment, mx, write_json  # noqa: E402 (BLAS chosen before MLX loads)

from qwen38_backend.kv.paged import PagedKV  # noqa: E402
from qwen38_backend.kv.spill import SpillFile  # noqa: E402


class EvalClock:
    """mx.eval timed: a step's host time is its wall time less the time spent waiting in
    mx.eval for the device (computing, on a CPU). Installed over mx.eval, so the stores'
    own calls are timed too and cProfile shows the waits as `wait` instead of folding
    them into the caller's own time."""

    def __init__(self):
        self.seconds = 0.0
        self._eval = mx.eval
        mx.eval = self.wait

    def wait(self, *arrays) -> None:
        t = time.perf_counter()
        self._eval(*arrays)
        self.seconds += time.perf_counter() - t


CLOCK: EvalClock | None = None


def build(args, pool_tokens: int | None, spill_dir: str | None) -> list[PagedKV]:
    """One filled store per attention layer (written in prefill-sized pieces)."""
    dtype = getattr(mx, args.dtype)
    spill = SpillFile(spill_dir) if spill_dir else None
    pool_pages = pool_tokens // args.page_tokens if pool_tokens else None
    layers = [
        PagedKV(args.page_tokens, args.budget, pool_pages=pool_pages, spill=spill)
        for _ in range(args.layers)
    ]
    mx.random.seed(0)
    shape = (1, args.kv_heads, args.chunk, args.head_dim)
    for layer in layers:
        for _ in range(0, args.length, args.chunk):
            k = mx.random.normal(shape).astype(dtype)
            v = mx.random.normal(shape).astype(dtype)
            layer.store(k, v)
            mx.eval(layer.pool.k, layer.pool.v, layer.kmin, layer.kmax)
    return layers


def decode(args, layers: list[PagedKV], steps: int) -> tuple[list[float], list[float]]:
    """Wall seconds of each decode step (every layer attends once, then the output is read),
    and host seconds of each (wall less the waits in mx.eval)."""
    dtype = getattr(mx, args.dtype)
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    scale = d**-0.5
    times, host = [], []
    for _ in range(steps):
        t, waited = time.perf_counter(), CLOCK.seconds
        h = mx.zeros((1, hq, 1, d), dtype)
        for layer in layers:
            q = mx.random.normal((1, hq, 1, d)).astype(dtype) + h
            k = mx.random.normal((1, hkv, 1, d)).astype(dtype)
            v = mx.random.normal((1, hkv, 1, d)).astype(dtype)
            h = layer.attend(q, k, v, scale)
        mx.eval(h)
        times.append(time.perf_counter() - t)
        host.append(times[-1] - (CLOCK.seconds - waited))
    return times, host


def fetched(layers: list[PagedKV]) -> int:
    return sum(layer.stats["pages_fetched"] for layer in layers)


def top(profile: cProfile.Profile, key: str, n: int) -> list[str]:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats(key).print_stats(n)
    return [line for line in out.getvalue().splitlines() if line.strip()][-n:]


def measure(args, label: str, layers: list[PagedKV]) -> dict:
    decode(args, layers, 4)  # warm: compiles the selection graph, first misses
    medians, host, per_layer_step = [], [], []
    for _ in range(args.runs):
        before = fetched(layers)
        times, host_times = decode(args, layers, args.decode)
        medians.append(statistics.median(times))
        host.append(statistics.median(host_times))
        per_layer_step.append((fetched(layers) - before) / (args.decode * len(layers)))
    row = {
        "median_step_s": statistics.median(medians),
        "median_step_s_runs": medians,
        "tok_s": 1 / statistics.median(medians),
        "host_ms_per_layer_step": 1e3 * statistics.median(host) / len(layers),
        "host_ms_per_layer_step_runs": [1e3 * h / len(layers) for h in host],
        "pages_fetched_per_layer_step": statistics.median(per_layer_step),
    }
    if label == "spilled":
        profile = cProfile.Profile()
        profile.enable()
        decode(args, layers, args.decode)
        profile.disable()
        row["top_tottime"] = top(profile, "tottime", 25)
        row["top_cumtime"] = top(profile, "cumulative", 30)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16, help="attention layers")
    ap.add_argument("--length", type=int, default=65536)
    ap.add_argument("--page-tokens", type=int, default=32)
    ap.add_argument("--pool-tokens", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--q-heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk", type=int, default=2048, help="rows per write when filling")
    ap.add_argument("--decode", type=int, default=16, help="steps per run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    global CLOCK
    CLOCK = EvalClock()
    result: dict = {"environment": environment(), "args": vars(args)}
    spill_dir = tempfile.mkdtemp(prefix="qwen38-spill-")
    for label, pool_tokens, where in (
        ("resident", None, None),
        ("spilled", args.pool_tokens, spill_dir),
    ):
        t = time.perf_counter()
        layers = build(args, pool_tokens, where)
        row = {"fill_seconds": time.perf_counter() - t, **measure(args, label, layers)}
        result[label] = row
        print(json.dumps({label: {k: v for k, v in row.items() if "top" not in k}}), flush=True)
        for layer in layers:
            layer.close()
        del layers
        mx.clear_cache()
    shutil.rmtree(spill_dir, ignore_errors=True)
    extra = result["spilled"]["median_step_s"] - result["resident"]["median_step_s"]
    result["extra_ms_per_layer_step"] = 1e3 * extra / args.layers
    print(json.dumps({"extra_ms_per_layer_step": result["extra_ms_per_layer_step"]}), flush=True)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
