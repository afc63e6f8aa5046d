"""What a software grid barrier costs against a launch boundary, on the device and on the
host (kernels/grid_sync.py; issue 14):

    python benchmarks/probe_grid_sync_gpu.py --shapes 10240x320,2560x2560 --phases 16 \
        --runs 5 --out grid_sync.json

For each shape KxN a chain of --phases one-row bf16 products alternates a [N, K] and a
[K, N] weight (10240x320: a Flash-Next gated residual's low-rank down and up; 2560x2560: a
hidden-to-hidden product), run three ways in turns, run by run:
- "launches": a launch a phase (what a step does today);
- "persistent_B": one launch of B blocks (--per-sm times the SMs), grid barriers between
  phases;
- "barriers_B": that launch without the products (what the barriers alone cost).
Per way: the device ms of a chain (queued behind a spin: probe_step_graph.py's method), the
weights' TB/s, the host's ms to build and queue a chain (wall and CPU time; --host-chains
chains queued back to back, then waited for) and the wall ms a chain takes that way. The
persistent chain's phases must equal the launches' bit for bit with no wait giving up
(checked, recorded). What it decides: whether a step's launches can become phases of one
launch (a Flash-Next layer's ~14) at a device cost below what the host saves (~10-15 us a
launch, INTERNALS session 35).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import environment, write_json  # noqa: E402
from probe_step_graph import queued_device_s  # noqa: E402


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        k, n = part.lower().split("x")
        shapes.append((int(k), int(n)))
    return shapes


def chain_ways(grid_sync, x, wa, wb, phases: int, blocks: list[int]) -> tuple[dict, dict]:
    """({blocks: the persistent chain's bits against the launches', its barrier}, {way: a
    function making that way's next chain}). Each chain a way makes reads the one before's
    last output of K values: queued chains run one after another, as a step's launches do
    (two persistent launches at once would not all be resident)."""
    k = x.shape[0]
    last = phases - 1 if phases % 2 == 0 else phases - 2  # odd phases write K values

    def threaded(step):
        held = [x]

        def make():
            held[0] = step(held[0])
            return held[0]

        return make

    launches = grid_sync.chain_launches(x, wa, wb, phases)
    checks = {}
    makes = {"launches": threaded(lambda v: grid_sync.chain_launches(v, wa, wb, phases)[last])}
    for b in blocks:
        ys, barrier = grid_sync.chain(x, wa, wb, phases, b)
        mx.eval(ys, barrier, launches)
        checks[b] = {
            "same_bits": grid_sync.same_as_launches(ys, launches),
            "barrier": barrier.tolist(),
        }
        if checks[b]["barrier"][1] or not checks[b]["same_bits"]:
            continue  # not all resident (a wait gave up): each launch would wait ~0.3 s
        makes[f"persistent_{b}"] = threaded(
            lambda v, n=b: grid_sync.chain(v, wa, wb, phases, n)[0][last, :k]
        )
        # the barriers alone: ys is not written, the next chain reads it all the same
        makes[f"barriers_{b}"] = threaded(
            lambda v, n=b: grid_sync.chain(v, wa, wb, phases, n, False)[0][last, :k]
        )
    return checks, makes


def host_ms(make, chains: int) -> dict:
    """Per chain: the host's wall and CPU ms to build and queue `chains` chains back to back,
    and the wall ms until all of them are done."""
    mx.eval(make())
    t0, c0 = time.perf_counter(), time.thread_time()
    outs = []
    for _ in range(chains):
        out = make()
        mx.async_eval(out)
        outs.append(out)
    t1, c1 = time.perf_counter(), time.thread_time()
    mx.eval(outs)
    t2 = time.perf_counter()
    return {
        "host_wall_ms": 1e3 * (t1 - t0) / chains,
        "host_cpu_ms": 1e3 * (c1 - c0) / chains,
        "chain_wall_ms": 1e3 * (t2 - t0) / chains,
    }


def main() -> None:
    from qwen38_backend.kernels import grid_sync

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="10240x320,2560x2560")
    ap.add_argument("--phases", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20, help="chains queued per device timing")
    ap.add_argument("--host-chains", type=int, default=200)
    ap.add_argument(
        "--per-sm", default="1,2,4", help="persistent blocks an SM, each a way of its own"
    )
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.phases < 2:
        ap.error("--phases must be at least 2 (a barrier needs two phases)")
    sms = grid_sync.sm_count()
    per_sm = [int(p) for p in args.per_sm.split(",")]
    result = {
        "benchmark": "grid barrier vs launch boundary, chains of one-row bf16 products",
        "environment": environment(),
        "sms": sms,
        "per_sm": per_sm,
        "phases": args.phases,
        "shapes": {},
    }
    for k, n in parse_shapes(args.shapes):
        keys = mx.random.split(mx.random.key(k + n), 3)
        wa = (mx.random.normal((n, k), key=keys[0]) / k**0.5).astype(mx.bfloat16)
        wb = (mx.random.normal((k, n), key=keys[1]) / n**0.5).astype(mx.bfloat16)
        x = mx.random.normal((k,), key=keys[2]).astype(mx.bfloat16)
        mx.eval(wa, wb, x)
        checks, makes = chain_ways(grid_sync, x, wa, wb, args.phases, [sms * p for p in per_sm])
        ways_run = list(makes)
        device = {way: [] for way in ways_run}
        for _ in range(args.runs):
            for way in ways_run:
                device[way].append(1e3 * queued_device_s(makes[way], args.repeats))
        nbytes = (args.phases + 1) // 2 * wa.nbytes + args.phases // 2 * wb.nbytes
        ways = {}
        for way in ways_run:
            ms = statistics.median(device[way])
            ways[way] = {
                "device_ms": ms,
                "device_runs": device[way],
                **host_ms(makes[way], args.host_chains),
            }
            if way.startswith("barriers"):
                ways[way]["device_us_a_barrier"] = 1e3 * ms / (args.phases - 1)
            else:
                ways[way]["tb_s"] = nbytes / (ms / 1e3) / 1e12
        result["shapes"][f"{k}x{n}"] = {"weights_bytes": nbytes, "checks": checks, "ways": ways}
        print(f"{k}x{n}: {checks}")
        for way, r in ways.items():
            print(
                f"  {way}: device {r['device_ms']:.4f} ms, host {r['host_wall_ms']:.4f} ms "
                f"(cpu {r['host_cpu_ms']:.4f}), chain {r['chain_wall_ms']:.4f} ms"
            )
    write_json(result, args.out)


if __name__ == "__main__":
    main()
