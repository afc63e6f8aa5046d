"""Helpers shared by the benchmarks: timing, medians, bandwidth, JSON output, peers."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from qwen38_backend import blas

# The system OpenBLAS before MLX loads (qwen38_backend/blas.py; importing the package did it
# already). With MLX imported first its reference BLAS stays, where a k-row matmul costs ~k
# one-row ones (bench_speculative.py measured no gain from 3.3 tokens per forward that way).
blas.use_system_openblas()

import mlx.core as mx  # noqa: E402


class WaitClock:
    """Host time split by what it waits on: while installed (a context manager), mx.eval
    and mx.async_eval are timed (seconds and calls each), so a decode's wall time splits into
    waits for the device (`eval`: also the device's compute on a CPU), hand-overs
    (`async_eval`: host cost of queueing work) and the rest (building graphs, Python).
    Installed over the module functions, so the engine's own calls are timed."""

    names = ("eval", "async_eval")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.names, 0.0)
        self.calls = dict.fromkeys(self.names, 0)
        self._saved: dict[str, Callable] = {}

    def _timed(self, name: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t
                self.calls[name] += 1

        return timed

    def __enter__(self) -> WaitClock:
        for name in self.names:
            self._saved[name] = getattr(mx, name)
            setattr(mx, name, self._timed(name, self._saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(mx, name, fn)

    def split(self, wall: float, per: int) -> dict:
        """ms per unit (`per`: steps, rounds) of the wall time `wall` spent in each part."""
        waits = sum(self.seconds.values())
        out = {f"{n}_ms": 1e3 * self.seconds[n] / per for n in self.names}
        out.update({f"{n}_calls": self.calls[n] / per for n in self.names})
        out["other_ms"] = 1e3 * (wall - waits) / per
        out["wall_ms"] = 1e3 * wall / per
        return out


def median_of(runs: int, fn: Callable[[], float]) -> dict:
    """Run fn (which returns a measurement) `runs` times; report median, min, max, all."""
    values = [fn() for _ in range(runs)]
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": values,
    }


def eval_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall seconds of mx.eval(fn()), synchronised before and after (one untimed
    call first: compiles, allocates)."""
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measured_read_bandwidth(nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes/s of a large on-device reduction: the practical read-bandwidth ceiling here."""
    x = mx.ones((nbytes // 4,), dtype=mx.float32)
    mx.eval(x)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(mx.sum(x))
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def peak_bandwidth(override_gbps: float | None) -> tuple[float, str]:
    """The bandwidth bound to compare against (bytes/s) and where the figure came from."""
    if override_gbps:
        return override_gbps * 1e9, "given"
    if mx.default_device() != mx.cpu:
        info = mx.device_info() if hasattr(mx, "device_info") else {}
        name = str(info.get("device_name", ""))
        if "H200" in name:
            return 4.8e12, "H200 spec sheet"
    return measured_read_bandwidth(), "measured (mx.sum over 256 MiB)"


def environment() -> dict:
    return {
        "python": sys.version.split()[0],
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "blas": blas.loaded or "MLX's bundled BLAS",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "settings": settings(),
    }


def settings() -> dict:
    """The MLX_* and QWEN38_* environment variables set for this run (MLX's CUDA graph
    cache and ops per graph, the engine's kernel switches)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("MLX_", "QWEN38_"))}


def write_json(result: dict, out: str | None) -> None:
    text = json.dumps(result, indent=2, default=str)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def run_json_worker(cmd: list[str]) -> dict:
    """Run a benchmark worker in its own process (memory is returned between engines) and
    parse the JSON object on its last stdout line; an error dict when it fails."""
    import subprocess

    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-5:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_engine(model, prompt, lengths: list[int], decode: int, runs: int) -> dict:
    """Our engine's prefill tok/s at each length and decode tok/s, medians of `runs`.

    prompt(n, vocab) -> token ids. A short generation first compiles the kernels."""
    vocab = model.config.vocab_size
    for _ in model.generate_tokens(prompt(24, vocab), max_tokens=3):
        pass
    prefill = {}
    for n in lengths:
        ids, vals = prompt(n, vocab), []
        for _ in range(runs):
            state = model.new_state()
            t = time.perf_counter()
            mx.eval(model.prefill(ids, state, chunk=4096))
            vals.append(n / (time.perf_counter() - t))
        prefill[str(n)] = {"median": statistics.median(vals), "runs": vals}
    vals = []
    for _ in range(runs):
        stream = model.generate_tokens(prompt(16, vocab), max_tokens=decode + 1)
        for _ in stream:
            pass
        vals.append(stream.stats.decode_tokens_per_second)
    return {"prefill": prefill, "decode": {"median": statistics.median(vals), "runs": vals}}


def mlx_lm_prefill_tok_s(model, ids: list[int]) -> float:
    """mlx-lm's prefill as its users get it: generate_step's own chunked prefill up to the first
    token (only the last position goes through the LM head, as in ours)."""
    from mlx_lm.generate import generate_step

    t = time.perf_counter()
    next(generate_step(mx.array(ids), model, max_tokens=1))
    return len(ids) / (time.perf_counter() - t)


def mlx_lm_decode_tok_s(model, ids: list[int], decode: int) -> float:
    """mlx-lm's decode tokens/s after `ids`, timed from the first token to the last."""
    from mlx_lm.generate import generate_step

    gen = generate_step(mx.array(ids), model, max_tokens=decode + 1)
    next(gen)  # the first token comes from the prefill
    t = time.perf_counter()
    n = sum(1 for _ in gen)
    return n / (time.perf_counter() - t)


def cast_in_place(model, dtype: mx.Dtype) -> None:
    """Cast a (lazily loaded) model's parameters one tensor at a time, so the source copy of a
    tensor is freed before the next is read: peak memory ~ the cast size, not source + cast."""
    from mlx.utils import tree_flatten, tree_unflatten

    for name, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating) and value.dtype != dtype:
            value = value.astype(dtype)
        mx.eval(value)
        model.update(tree_unflatten([(name, value)]), strict=False)


def block_score_option(ap) -> None:
    """--block-score-mib: one prefill walk block's fp32 scores (kv/blocked.BLOCK_SCORE_BYTES)."""
    ap.add_argument(
        "--block-score-mib",
        type=int,
        default=None,
        help="kv/blocked.BLOCK_SCORE_BYTES in MiB: one prefill walk block's fp32 scores",
    )


def use_block_score(args) -> None:
    """Apply --block-score-mib where it was given."""
    if args.block_score_mib is not None:
        from qwen38_backend.kv import blocked

        blocked.BLOCK_SCORE_BYTES = args.block_score_mib << 20
