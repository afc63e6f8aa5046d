"""What one decode step hands MLX: its graph's nodes by primitive, and the host's time to
build it and to queue it (Qwen3.8-27B dims, or Flash-Next's with `--dims flash`: 4-bit
experts; random weights; any device).

    python benchmarks/probe_step_graph.py --layers 4 --out step_graph.json

A state of `--context` tokens (paged Quest with `--kv-topk`, else the default store), then
plain steps as decoding runs them (Model.forward of one token, last position): per step, ms
to build the graph in Python and ms for mx.async_eval to queue it (median of `--steps`), and
one step's graph (the logits and the state it writes) exported with mx.export_to_dot and
counted by primitive: a compiled graph is one node, views (reshape, slice, ...) are nodes
too. On a GPU the host's build + queue time per step bounds decode when it exceeds the
device's.

`--pipelined N` also decodes N greedy tokens as Engine.decode does (the next step built and
queued before this token is read back) and splits each token's wall time into build, queue
and the wait in `item()`: a wait near zero means the host bounds the token.
`--device N` (a GPU) measures a step's device time with the host out of the way: a spin
kernel of fixed length is queued first, the whole step is built and queued while the device
spins, then the step's wall time past the spin alone is its device time (median of N).
With `--dims flash` every step also reads the previous token back to the host (the PLE
layer's n-gram rows are looked up there), so a pipelined token's build includes that wait:
a token near build (ids already on the host, `build_ms`) + device time says the two do not
overlap.
`--rows-kernel off` runs one-row products in MLX's gemv instead (bench_gpu_27b.py's
`--mlx-gemv-steps`: a measurement, not an engine mode).
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_27b import prompt, random_model  # noqa: E402
from common import environment, write_json  # noqa: E402


def node_counts(outputs: list, keep: str | None = None) -> dict[str, int]:
    """Primitives of the graph behind `outputs`, counted by name (numbers stripped); `keep`:
    a path to keep the graph at (Graphviz dot)."""
    import mlx.core as mx

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(keep) if keep else Path(tmp) / "step.dot"
        mx.export_to_dot(str(path), *outputs)
        text = path.read_text()
    # one declaration per application of a primitive (a compiled function's replays share
    # its primitives' ids, so ids undercount); arrays the step leaves unevaluated, such as
    # Quest's open-page bounds, carry their chain since the last evaluation
    names = re.findall(r'label\s*=\s*"([^"]+)", shape=rectangle', text)
    counts = collections.Counter(name.split()[0] for name in names)
    return dict(counts.most_common())


# Primitives MLX runs without a kernel of their own (views of their input's buffer).
VIEWS = {"Reshape", "Split", "Transpose", "Squeeze", "Slice", "Broadcast", "ExpandDims"}
VIEWS |= {"Flatten", "Unflatten", "AsStrided"}


def kernel_count(counts: dict[str, int]) -> int:
    """Nodes of `counts` that launch work (every primitive but the views)."""
    return sum(n for name, n in counts.items() if name not in VIEWS)


def state_arrays(state) -> list:
    """The arrays the step leaves in the state (what it writes)."""
    import mlx.core as mx

    out = []
    for layer in state.layers:
        for value in vars(layer).values():
            if isinstance(value, mx.array):
                out.append(value)
        pool = getattr(layer, "pool", None)
        if pool is not None and pool.k is not None:
            out += [pool.k, pool.v]
    return out


SPIN_SOURCE = """
    long long start = clock64();
    while (clock64() - start < cycles[0]) {}
    out[0] = 0;
"""


def spin_kernel():
    """A one-thread kernel that keeps the device busy for `cycles` clock cycles."""
    import mlx.core as mx

    kernel = mx.fast.cuda_kernel(
        name="spin", input_names=["cycles"], output_names=["out"], source=SPIN_SOURCE
    )

    def spin(cycles: int) -> mx.array:
        return kernel(
            inputs=[mx.array([cycles], dtype=mx.int64)],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.int32],
        )[0]

    return spin


def behind_spin(make, repeats: int, spin_ms: float = 40.0, warm: bool = True) -> tuple:
    """Median seconds of a spin of about spin_ms alone, and of the spin with the work make()
    returns (lazy arrays) queued behind it, `repeats` of each in turns: the spin outlasts
    the host's build and queue of the work, so the difference is the work's device time.
    `warm`: run the work once first (compiling its kernels; not for work that advances a
    state)."""
    import mlx.core as mx

    spin = spin_kernel()

    def timed(cycles: int, with_work: bool) -> float:
        mx.synchronize()
        t0 = time.perf_counter()
        out = [spin(cycles)]
        mx.async_eval(out[0])
        if with_work:
            out.append(make())
            mx.async_eval(out[-1])
        mx.eval(out)
        mx.synchronize()
        return time.perf_counter() - t0

    cycles = 1_000_000
    timed(cycles, warm)  # the first launch compiles the spin kernel
    while timed(cycles, False) < spin_ms / 1e3:  # calibrate: about spin_ms of spinning
        cycles *= 2
    alone, both = [], []
    for _ in range(repeats):
        alone.append(timed(cycles, False))
        both.append(timed(cycles, True))
    return statistics.median(alone), statistics.median(both)


def queued_device_s(make, repeats: int, spin_ms: float = 40.0) -> float:
    """Device seconds of the work make() returns, with the host out of the way (behind_spin)."""
    alone, both = behind_spin(make, repeats, spin_ms)
    return both - alone


def device_ms(model, state, token, steps: int, spin_ms: float = 40.0) -> dict:
    """A step's device time: queued behind a spin of fixed length, so its whole graph is
    queued before the device reaches it (module docstring). Median ms of `steps`."""
    step = lambda: model.forward(token, state, last_only=True)  # noqa: E731
    spin_s, step_s = behind_spin(step, steps, spin_ms, warm=False)
    return {"spin_ms": 1e3 * spin_s, "step_ms": 1e3 * (step_s - spin_s), "steps": steps}


def pipelined_split(model, state, logits, n: int) -> dict:
    """Median ms of build, queue and wait per greedy token decoded as Engine.decode does
    without logits processors (the next step queued before this token is read)."""
    import mlx.core as mx

    y = mx.argmax(logits.reshape(-1, logits.shape[-1])[-1], axis=-1)
    mx.async_eval(y)
    parts = {"build": [], "queue": [], "wait": [], "token": []}
    for _ in range(n):
        t0 = time.perf_counter()
        next_y = mx.argmax(model.forward(y.reshape(1), state, last_only=True)[-1], axis=-1)
        t1 = time.perf_counter()
        mx.async_eval(next_y)
        t2 = time.perf_counter()
        y.item()
        t3 = time.perf_counter()
        for name, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
            parts[name].append(dt)
        y = next_y
    mx.eval(y)
    skip = min(3, n // 2)  # the first tokens trace the compiled graphs
    return {name: 1e3 * statistics.median(v[skip:]) for name, v in parts.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny", "flash"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=512, help="--dims flash: experts per layer")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--kv-topk", type=int, default=0, help="paged Quest with this budget")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dot", default=None, help="keep the step's graph here (Graphviz)")
    ap.add_argument("--pipelined", type=int, default=0, help="tokens decoded as Engine does")
    ap.add_argument("--device", type=int, default=0, help="steps timed behind a spin (GPU)")
    ap.add_argument("--rows-kernel", default="auto", choices=["auto", "off"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import os
    from contextlib import nullcontext

    from qwen38_backend import rows

    os.environ["QWEN38_ROWS_KERNEL"] = args.rows_kernel
    if args.dims == "flash":
        from bench_qsa_depth import flash_model

        model, config = flash_model(args.layers, args.experts, args.dtype)
    else:
        model, config, _ = random_model(args.dims, args.layers, args.dtype)
    kv = {"kv_paged": "on", "kv_topk": args.kv_topk} if args.kv_topk else {}
    state = model.new_state(**kv)
    with rows.unpadded() if args.rows_kernel == "off" else nullcontext():
        result = measure(args, model, config, state, kv)
    write_json(result, args.out)


def measure(args, model, config, state, kv: dict) -> dict:
    import mlx.core as mx

    prefill_logits = model.prefill(prompt(args.context, config["text_config"]["vocab_size"]), state)
    mx.eval(prefill_logits)
    token = mx.array([7])
    builds, queues = [], []
    for i in range(args.steps + 3):
        mx.synchronize()
        t0 = time.perf_counter()
        logits = model.forward(token, state, last_only=True)
        t1 = time.perf_counter()
        mx.async_eval(logits)
        t2 = time.perf_counter()
        mx.eval(logits)
        if i >= 3:  # the first steps trace the compiled graphs
            builds.append(t1 - t0)
            queues.append(t2 - t1)
    logits = model.forward(token, state, last_only=True)
    counts = node_counts([logits, *state_arrays(state)], args.dot)
    mx.eval(logits)
    result = {
        "environment": environment(),
        "dims": args.dims,
        "layers": args.layers,
        "experts": args.experts if args.dims == "flash" else None,
        "context": args.context,
        "kv": kv,
        "build_ms": 1e3 * statistics.median(builds),
        "queue_ms": 1e3 * statistics.median(queues),
        "nodes": sum(counts.values()),
        "nodes_per_layer": sum(counts.values()) / args.layers,
        "kernels": kernel_count(counts),
        "rows_kernel": args.rows_kernel,
        "by_primitive": counts,
    }
    print(
        f"build {result['build_ms']:.2f} ms, queue {result['queue_ms']:.2f} ms, "
        f"{result['nodes']} nodes, {result['kernels']} of them kernels",
        file=sys.stderr,
    )
    if args.pipelined:
        result["pipelined_ms"] = pipelined_split(model, state, prefill_logits, args.pipelined)
        print(f"pipelined: {result['pipelined_ms']}", file=sys.stderr)
    if args.device:
        # the spin must outlast the host's build of a whole step (~25 ms for Flash-Next)
        spin_ms = 100.0 if args.dims == "flash" else 40.0
        result["device"] = device_ms(model, state, token, args.device, spin_ms)
        print(f"device: {result['device']}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
