"""Count the operations in one decode step's graph (what the device has to encode per token).

    python benchmarks/decode_graph_ops.py --layers 8

Builds a 27B-dimension model (random weights), prefills a few tokens, builds one decode
step's graph for each mode (compiled step, op by op) and prints the node count by primitive
as JSON. Fast kernels that a backend lacks show up as their decomposition.
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
        dot = io.StringIO()
        mx.export_to_dot(dot, logits)
        ops = Counter(re.findall(r'label ="([A-Za-z_]+)', dot.getvalue()))
        out[label] = {"nodes": sum(ops.values()), "by_primitive": dict(ops.most_common())}
        mx.eval(logits)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
