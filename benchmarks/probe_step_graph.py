"""What one decode step hands MLX: its graph's nodes by primitive, and the host's time to
build it and to queue it (Qwen3.8-27B dims, random weights; any device).

    python benchmarks/probe_step_graph.py --layers 4 --out step_graph.json

A state of `--context` tokens (paged Quest with `--kv-topk`, else the default store), then
plain steps as decoding runs them (Model.forward of one token, last position): per step, ms
to build the graph in Python and ms for mx.async_eval to queue it (median of `--steps`), and
one step's graph (the logits and the state it writes) exported with mx.export_to_dot and
counted by primitive: a compiled graph is one node, views (reshape, slice, ...) are nodes
too. On a GPU the host's build + queue time per step bounds decode when it exceeds the
device's.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--kv-topk", type=int, default=0, help="paged Quest with this budget")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dot", default=None, help="keep the step's graph here (Graphviz)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import mlx.core as mx

    model, config, _ = random_model(args.dims, args.layers, args.dtype)
    kv = {"kv_paged": "on", "kv_topk": args.kv_topk} if args.kv_topk else {}
    state = model.new_state(**kv)
    mx.eval(model.prefill(prompt(args.context, config["text_config"]["vocab_size"]), state))
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
        "context": args.context,
        "kv": kv,
        "build_ms": 1e3 * statistics.median(builds),
        "queue_ms": 1e3 * statistics.median(queues),
        "nodes": sum(counts.values()),
        "nodes_per_layer": sum(counts.values()) / args.layers,
        "kernels": kernel_count(counts),
        "by_primitive": counts,
    }
    print(
        f"build {result['build_ms']:.2f} ms, queue {result['queue_ms']:.2f} ms, "
        f"{result['nodes']} nodes, {result['kernels']} of them kernels",
        file=sys.stderr,
    )
    write_json(result, args.out)


if __name__ == "__main__":
    main()
