"""A token's worth of Flash-Next gated-residual opens as separate launches and fused
(kernels/fused.py; issue 14):

    python benchmarks/probe_fused_open_gpu.py --opens 95 --runs 5 --out fused_open.json

Each open is what a Flash-Next step runs between a block and the next (GatedResidual.
close_then_open): the close of the streams with the block's output and the next residual's
norm (the stream kernels' closed norm), its down / inject product with the gates and its up
product with the block-input mix (rows_matmul's epilogues): three launches, or one fused
launch of persistent blocks (--per-sm times the SMs) with grid barriers between them. Real
per-layer dims (4 streams of 2560, low rank 320), random bf16 weights, --opens chained (a
48-layer token has 95 of them; the step's other launches are left out). Per way, in turns
run by run: the device ms of the chain (behind a spin, probe_step_graph.py's method), the
host's ms to build and queue it (wall and CPU) and the wall ms a chain takes; the fused
ways' outputs must equal the separate launches' bit for bit (recorded). What it decides:
whether QWEN38_FUSED_KERNEL (off by default) should be on, and at how many blocks an SM.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import mlx.core as mx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import environment, write_json  # noqa: E402
from probe_grid_sync_gpu import host_ms  # noqa: E402
from probe_step_graph import queued_device_s  # noqa: E402

HIDDEN, STREAMS, LOW_RANK, EPS = 2560, 4, 320, 1e-6


def residual(seed: int):
    """A GatedResidual with random bf16 weights scaled by their fan-in, fused as loaded."""
    from qwen38_backend.models.hyper_connections import GatedResidual

    hc = GatedResidual(HIDDEN, STREAMS, LOW_RANK, EPS)
    width = HIDDEN * STREAMS
    keys = mx.random.split(mx.random.key(seed), 4)
    hc.hc_norm.weight = 0.2 * mx.random.normal((width,), key=keys[0])
    hc.input_mix_weight_down.weight = width**-0.5 * mx.random.normal((LOW_RANK, width), key=keys[1])
    hc.input_mix_weight_up.weight = LOW_RANK**-0.5 * mx.random.normal(
        (width, LOW_RANK), key=keys[2]
    )
    hc.block_inject_weight.weight = width**-0.5 * mx.random.normal((STREAMS, width), key=keys[3])
    hc.fuse()
    hc.set_dtype(mx.bfloat16)
    mx.eval(hc.parameters())
    return hc


def main() -> None:
    os.environ.setdefault("QWEN38_FUSED_KERNEL", "auto")
    from qwen38_backend.kernels import fused, grid_sync

    from qwen38_backend import rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--opens", type=int, default=95)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=10, help="chains queued per device timing")
    ap.add_argument("--host-chains", type=int, default=20)
    ap.add_argument("--per-sm", default="1,2,4", help="persistent blocks an SM, a way each")
    ap.add_argument("--out")
    args = ap.parse_args()
    dtype = mx.bfloat16
    rows.prepare(dtype)
    hc, then = residual(1), residual(2)
    hc.prepare_decode(dtype)
    then.prepare_decode(dtype)
    chosen = then._fuse_for
    keys = mx.random.split(mx.random.key(3), 3)
    R0 = mx.random.normal((1, STREAMS * HIDDEN), key=keys[0]).astype(dtype)
    inj0 = mx.random.normal((1, STREAMS), key=keys[1]).astype(dtype)
    out0 = mx.random.normal((1, HIDDEN), key=keys[2]).astype(dtype)
    mx.eval(R0, inj0, out0)

    def chain(per_sm: int, start=(R0, inj0, out0)) -> list[mx.array]:
        """--opens opens chained (each block output: the last block input) from `start`;
        per_sm 0: the separate launches."""
        then._fuse_for = str(dtype) if per_sm else ""
        fused.BLOCKS_PER_SM = per_sm or fused.BLOCKS_PER_SM
        R, inj, out = start
        for _ in range(args.opens):
            R, x, inj = hc.close_then_open(R, inj, out, then)
            out = x
        return [R, inj, x]

    def threaded(per_sm: int):
        """A make() whose chain starts from the last one's outputs: queued chains run one
        after another, as a step's do (two persistent launches at once would not all be
        resident)."""
        held = [(R0, inj0, out0)]

        def make():
            held[0] = chain(per_sm, held[0])
            return held[0]

        return make

    sms = grid_sync.sm_count()
    ways = {"separate": 0, **{f"fused_{p}_per_sm": int(p) for p in args.per_sm.split(",")}}
    want = chain(0)
    mx.eval(want)
    same = {}
    for way, per_sm in ways.items():
        got = chain(per_sm)
        mx.eval(got)
        same[way] = all(mx.array_equal(g, w).item() for g, w in zip(got, want, strict=True))
    # a way whose bits differ (a barrier wait gave up: its blocks were not all resident) is
    # not timed: each of its launches would wait ~0.3 s
    timed = {way: per_sm for way, per_sm in ways.items() if same[way]}
    device = {way: [] for way in timed}
    for _ in range(args.runs):
        for way, per_sm in timed.items():
            device[way].append(1e3 * queued_device_s(threaded(per_sm), args.repeats))
    result = {
        "benchmark": "Flash-Next gated-residual opens, separate launches vs fused, bf16",
        "environment": environment(),
        "sms": sms,
        "opens": args.opens,
        "probe_chose_fused": bool(chosen),
        "ways": {},
    }
    for way, per_sm in ways.items():
        if way not in timed:
            result["ways"][way] = {"same_bits_as_separate": False, "timed": False}
            print(f"{way}: not the separate launches' bits, not timed")
            continue
        ms = statistics.median(device[way])
        result["ways"][way] = {
            "device_ms": ms,
            "device_us_an_open": 1e3 * ms / args.opens,
            "device_runs": device[way],
            "same_bits_as_separate": same[way],
            **host_ms(threaded(per_sm), args.host_chains),
        }
        r = result["ways"][way]
        print(
            f"{way}: device {ms:.3f} ms ({r['device_us_an_open']:.1f} us an open), host "
            f"{r['host_wall_ms']:.3f} ms (cpu {r['host_cpu_ms']:.3f}), same bits {same[way]}"
        )
    write_json(result, args.out)


if __name__ == "__main__":
    main()
