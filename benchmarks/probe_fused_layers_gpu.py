"""A chain of 27B Gated DeltaNet blocks' one-row steps, each block's launches apart or as one
fused launch (kernels/fused.py; issues 14 and 15):

    python benchmarks/probe_fused_layers_gpu.py --layers 8 --runs 5 --per-sm 1,2 \
        --out fused_layers.json

Real 27B shapes (hidden 5,120, Gated DeltaNet 16 / 48 heads of 128, intermediate 17,408),
random bf16 weights, the products on the row-invariant kernel with the norm kernel
(QWEN38_ROWS_NORM=auto, which the fusion needs), each block's step compiled as the engine
compiles it (`_linear_step`, fp32 block inputs: the layers after the first), --layers
blocks chained. Ways: "apart" (each step's five launches) and "fused_P" (one launch of P
persistent blocks an SM). Per way, in turns run by run: the chain's device ms behind a spin
(probe_step_graph.py's method) and a layer's share, the host's ms to build and queue a
chain (wall and CPU), the bytes a chain reads over its device time; a fused way's outputs
must equal the apart way's bit for bit (recorded; a way that differs is not timed). What it
decides: whether a persistent launch's phases cost the device less than their launches
apart at these shapes, and at how many blocks an SM (the full-model answer is
bench_gpu_27b.py --fused).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import environment, write_json  # noqa: E402
from probe_grid_sync_gpu import host_ms  # noqa: E402
from probe_step_graph import queued_device_s  # noqa: E402


def blocks_of(dims: str, layers: int, dtype) -> list:
    """`layers` random Gated DeltaNet blocks of these dims, fused as loaded."""
    from mlx.utils import tree_unflatten

    from qwen38_backend.config import LINEAR, Qwen35Config
    from qwen38_backend.models.layers import fuse_projections
    from qwen38_backend.models.qwen3_5 import Qwen35Block
    from qwen38_backend.testing.tiny_qwen3_5 import text_config

    config = text_config(dims, layers)
    if dims == "tiny":  # the Gated DeltaNet kernel's smallest heads
        config.update(linear_key_head_dim=32, linear_value_head_dim=32)
    cfg = Qwen35Config.from_dict(config)
    blocks = []
    for i in range(layers):
        mx.random.seed(i)
        block = Qwen35Block(cfg, LINEAR)
        for name, value in tree_flatten(block.parameters()):
            if "norm" in name:  # zero-centred norms off their zeros
                block.update(tree_unflatten([(name, 0.1 * mx.random.normal(value.shape))]))
        block.set_dtype(dtype)
        fuse_projections(block)
        mx.eval(block.parameters())
        blocks.append(block)
    return blocks


def states_of(blocks: list, dtype) -> list:
    """Each block's (conv history, recurrent state), random."""
    out = []
    for i, block in enumerate(blocks):
        mixer = block.linear_attn
        keys = mx.random.split(mx.random.key(100 + i), 2)
        conv = mx.random.normal((mixer.conv_kernel - 1, mixer.conv_dim), key=keys[0])
        shape = (mixer.n_v_heads, mixer.v_head_dim, mixer.k_head_dim)
        out.append((conv.astype(dtype), 0.1 * mx.random.normal(shape, key=keys[1])))
    mx.eval(out)
    return out


def main() -> None:
    os.environ.setdefault("QWEN38_ROWS_NORM", "auto")
    os.environ.setdefault("QWEN38_FUSED_KERNEL", "auto")
    from qwen38_backend.kernels import fused, grid_sync

    from qwen38_backend import rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=10, help="chains queued per device timing")
    ap.add_argument("--host-chains", type=int, default=20)
    ap.add_argument("--per-sm", default="1,2", help="persistent blocks an SM, a way each")
    ap.add_argument("--out")
    args = ap.parse_args()
    dtype = mx.bfloat16
    blocks = blocks_of(args.dims, args.layers, dtype)
    states = states_of(blocks, dtype)
    width = blocks[0].linear_attn.out_proj.weight.shape[0]
    h0 = mx.random.normal((1, width), key=mx.random.key(7))
    mx.eval(h0)
    with rows.unpadded():
        rows.prepare(dtype)
        for block in blocks:
            block.linear_attn.prepare_decode(dtype)
            block._decide_fusion(mx.float32)
        chosen = sum(str(mx.float32) in b._fuse_linear_for for b in blocks)

        def way(per_sm: int):
            """A make() whose chain starts from the last chain's output (queued chains run
            one after another, as a step's layers do); per_sm 0: the launches apart."""
            fused.BLOCKS_PER_SM, fused._PER_SM = max(per_sm, 1), {}
            steps = []
            for block in blocks:
                block._fuse_linear_for = frozenset({str(mx.float32)} if per_sm else ())
                steps.append(mx.compile(block._linear_step))  # traced for this way
            held = [h0]

            def make():
                h = held[0]
                for step, (conv, recurrent) in zip(steps, states, strict=True):
                    h = step(h, conv, recurrent)[0]
                held[0] = h
                return h

            return make

        ways = {"apart": 0, **{f"fused_{p}": int(p) for p in args.per_sm.split(",")}}
        makes, same = {}, {}
        want = None
        for name, per_sm in ways.items():
            if per_sm and not chosen:
                continue  # the probe refused the fusion here
            makes[name] = way(per_sm)
            got = makes[name]()
            mx.eval(got)
            want = got if want is None else want
            same[name] = bool(mx.array_equal(got, want).item())
            makes[name] = way(per_sm)  # start again from h0: the chains' values stay bounded
        timed = [name for name in makes if same[name]]
        device = {name: [] for name in timed}
        for _ in range(args.runs):
            for name in timed:
                device[name].append(1e3 * queued_device_s(makes[name], args.repeats))
        nbytes = sum(v.nbytes for b in blocks for _, v in tree_flatten(b.parameters()))
        result = {
            "benchmark": "27B Gated DeltaNet blocks' one-row steps, launches apart vs fused",
            "environment": environment(),
            "dims": args.dims,
            "layers": args.layers,
            "sms": grid_sync.sm_count(),
            "weights_bytes": nbytes,
            "probe_chose_fused_layers": chosen,
            "ways": {},
        }
        for name in makes:
            if name not in timed:
                result["ways"][name] = {"same_bits_as_apart": False, "timed": False}
                print(f"{name}: not the apart way's bits, not timed")
                continue
            ms = statistics.median(device[name])
            result["ways"][name] = {
                "device_ms": ms,
                "device_us_a_layer": 1e3 * ms / args.layers,
                "tb_s": nbytes / (ms / 1e3) / 1e12,
                "device_runs": device[name],
                "same_bits_as_apart": same[name],
                **host_ms(makes[name], args.host_chains),
            }
            r = result["ways"][name]
            print(
                f"{name}: device {ms:.3f} ms ({r['device_us_a_layer']:.1f} us a layer, "
                f"{r['tb_s']:.2f} TB/s), host {r['host_wall_ms']:.3f} ms "
                f"(cpu {r['host_cpu_ms']:.3f}), same bits {same[name]}"
            )
    write_json(result, args.out)


if __name__ == "__main__":
    main()
