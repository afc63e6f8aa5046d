"""Where a 27B-dims decode step spends its time (device-side), piece by piece.

    python benchmarks/profile_decode_gpu.py --layers 64

Times, per token: all the weight matmuls alone (the bandwidth floor as MLX runs it), one
Gated DeltaNet layer, one attention layer, one MLP, and the whole step, each as the median of
repeated evals. JSON to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def timeit(fn, repeats: int = 20) -> float:
    import mlx.core as mx

    for _ in range(3):
        mx.eval(fn())
    mx.synchronize()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def host_costs(net, state, steps: int = 12) -> dict:
    """Host-side cost of a step: building the graph in Python, encoding it (async_eval
    returns once the kernels are queued) and then waiting for the device."""
    import mlx.core as mx

    build, encode, wait = [], [], []
    for _ in range(steps):
        mx.synchronize()
        t0 = time.perf_counter()
        logits = net(mx.array([5]), state, last_only=True)
        state.advance([5])
        t1 = time.perf_counter()
        mx.async_eval(logits)
        t2 = time.perf_counter()
        mx.eval(logits)
        t3 = time.perf_counter()
        build.append(t1 - t0)
        encode.append(t2 - t1)
        wait.append(t3 - t2)
    med = statistics.median
    return {"build": med(build) * 1e3, "encode": med(encode) * 1e3, "wait": med(wait) * 1e3}


def main() -> None:
    import mlx.core as mx
    from bench_gpu_27b import config_and_shapes, random_weights
    from mlx.utils import tree_flatten, tree_unflatten

    from qwen38_backend.models import build_model
    from qwen38_backend.models.layers import fuse_projections

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--dims", default="27b")
    ap.add_argument("--depth", type=int, default=4096)
    args = ap.parse_args()
    dtype = mx.bfloat16
    config, shapes = config_and_shapes(args.dims, args.layers)
    net = build_model(config)
    net.update(tree_unflatten(list(net.sanitize(random_weights(shapes, dtype)).items())))
    mats = [w for n, w in tree_flatten(net.parameters()) if w.ndim == 2 and "embed" not in n]
    fuse_projections(net)
    H = config["text_config"]["hidden_size"]
    x = mx.random.normal((1, H)).astype(dtype)
    out = {}
    nbytes = sum(w.nbytes for w in mats)

    def matmuls():
        return [
            x[:, : w.shape[1]] @ w.T if w.shape[1] <= H else mx.zeros((1, w.shape[1]), dtype) @ w.T
            for w in mats
        ]

    t = timeit(matmuls, 10)
    out["all_matmuls_ms"] = t * 1e3
    out["all_matmuls_bytes"] = nbytes
    out["all_matmuls_gbps"] = nbytes / t / 1e9
    big = mats[0]
    out["one_matmul"] = {"shape": list(big.shape), "us": timeit(lambda: x @ big.T) * 1e6}

    # state at some depth: prefill a few tokens then time single-token steps of parts
    state = net.make_state()
    ids = mx.array(list(range(1000, 1000 + args.depth)))
    for s in range(0, args.depth, 2048):
        logits = net(ids[s : s + 2048], state, last_only=True)
        state.advance(ids[s : s + 2048].tolist())
        mx.eval(logits)
    layers = net.model.layers
    gdn_i = next(i for i, layer in enumerate(layers) if hasattr(layer, "linear_attn"))
    att_i = next(i for i, layer in enumerate(layers) if hasattr(layer, "self_attn"))
    gdn = layers[gdn_i]
    out["gdn_mixer_us"] = timeit(lambda: gdn.linear_attn(x, state.layers[gdn_i].__class__())) * 1e6
    out["mlp_us"] = timeit(lambda: gdn.mlp(x)) * 1e6
    out["norm_us"] = timeit(lambda: gdn.input_layernorm(x)) * 1e6

    def step():
        logits = net(mx.array([5]), state, last_only=True)
        state.advance([5])
        return logits

    out["full_step_ms"] = timeit(step, 10) * 1e3

    # whole blocks, one token, as decode runs them (compiled step) and op by op
    from qwen38_backend.models.layers import PreNormBlock

    h = mx.random.normal((1, H)).astype(dtype)
    att = layers[att_i]
    for label, flag in (("compiled", True), ("op_by_op", False)):
        PreNormBlock.compile_decode = flag
        out[f"gdn_block_us_{label}"] = timeit(lambda: gdn(h, state.layers[gdn_i], 0)) * 1e6
        out[f"attention_block_us_{label}"] = (
            timeit(lambda: att(h, state.layers[att_i], args.depth)) * 1e6
        )
        out[f"full_step_ms_{label}"] = timeit(step, 10) * 1e3
        out[f"host_ms_{label}"] = host_costs(net, state)
    PreNormBlock.compile_decode = True
    n_att = sum(1 for layer in layers if not layer.is_linear)
    out["lm_head_us"] = timeit(lambda: net.logits_from_hidden(h)) * 1e6
    out["sum_of_parts_ms"] = (
        (len(layers) - n_att) * out["gdn_block_us_compiled"]
        + n_att * out["attention_block_us_compiled"]
        + out["lm_head_us"]
    ) / 1e3

    def build_only():
        t0 = time.perf_counter()
        logits = net(mx.array([5]), state, last_only=True)
        state.advance([5])
        out.setdefault("graph_build_ms", []).append((time.perf_counter() - t0) * 1e3)
        return logits

    timeit(build_only, 5)
    out["graph_build_ms"] = statistics.median(out["graph_build_ms"])
    out["attention_layer_index"] = att_i
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
