"""Count the operations in one decode step's graph (what the device has to encode per token).

    python benchmarks/decode_graph_ops.py --layers 8

Builds a 27B-dimension model (random weights), prefills a few tokens, builds one decode
step's graph for each mode (compiled step, op by op) and prints the node count by primitive
as JSON. Fast kernels that a backend lacks show up as their decomposition. The graph helpers
here (`graph_nodes`, `summary`) are shared with decode_graph_flash.py.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Primitives that make a view (no kernel) unless the layout forces a copy; a Reshape of a
# non-contiguous array does copy, so "kernels" is an estimate from below.
VIEWS = frozenset(
    {
        "Reshape",
        "Slice",
        "Broadcast",
        "BroadcastAxes",
        "Transpose",
        "ExpandDims",
        "Squeeze",
        "Flatten",
        "Unflatten",
        "AsStrided",
        "StopGradient",
        "Split",
        "Depends",
    }
)
_NODE = re.compile(r'\{ \d+ \[label ="([A-Za-z_0-9]+)')
# A primitive the decode graphs do not use: one marks where a group's nodes end.
_SENTINEL = "ErfInv"


def graph_ops(*arrays) -> list[str]:
    """The primitive of every unevaluated node the arrays depend on (a multi-output
    primitive is one node; an mx.compile'd fused chain is one "Compiled" node)."""
    return split_ops([list(arrays)])[0]


def split_ops(groups: list[list]) -> list[list[str]]:
    """graph_ops per group of arrays, each node counted in the first group that reaches it.

    One export over all groups, a sentinel node after each: the export walks the outputs in
    order, depth first, and writes a node when it is first reached. Nodes are told apart by
    array, not by primitive: replays of one compiled function share their primitives."""
    import mlx.core as mx

    outputs = []
    for group in groups:
        sentinel = mx.array(0.0)
        mx.eval(sentinel)
        outputs += [*group, mx.erfinv(sentinel)]
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    out: list[list[str]] = [[]]
    for name in _NODE.findall(dot.getvalue()):
        if name == _SENTINEL:
            out.append([])
        else:
            out[-1].append("Compiled" if name.startswith("Compiled") else name)
    if any(name == _SENTINEL for group in out for name in group) or len(out) != len(groups) + 1:
        raise RuntimeError("the graph uses the sentinel primitive: node groups unreliable")
    return out[:-1]


def summary(names) -> dict:
    """Node count, kernels (nodes that are not views) and the count by primitive."""
    ops = Counter(names)
    kernels = sum(n for op, n in ops.items() if op not in VIEWS)
    return {"nodes": sum(ops.values()), "kernels": kernels, "by_primitive": dict(ops.most_common())}


def main() -> None:
    import mlx.core as mx
    from bench_gpu_27b import config_and_shapes, random_weights
    from mlx.utils import tree_unflatten

    from qwen38_backend.models import build_model
    from qwen38_backend.models.layers import PreNormBlock, fuse_projections

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dims", default="27b")
    args = ap.parse_args()
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    config, shapes = config_and_shapes(args.dims, args.layers)
    net = build_model(config)
    net.update(tree_unflatten(list(net.sanitize(random_weights(shapes, dtype)).items())))
    fuse_projections(net)
    state = net.make_state()
    ids = list(range(10, 74))
    mx.eval(net(mx.array(ids), state, last_only=True))
    state.advance(ids)
    out = {"device": str(mx.default_device()), "layers": args.layers}
    for label, flag in (("compiled", True), ("op_by_op", False)):
        PreNormBlock.compile_decode = flag
        logits = net(mx.array([5]), state, last_only=True)
        state.advance([5])
        out[label] = summary(graph_ops(logits))
        mx.eval(logits)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
