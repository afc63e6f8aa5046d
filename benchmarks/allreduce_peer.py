"""Peer for bench_sharded's all-reduce time: PyTorch + NCCL, the same [1, hidden] bf16 row
all-reduced in a dependent chain, one process per GPU.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/allreduce_peer.py --out peer.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    x = torch.ones(1, args.hidden, dtype=torch.bfloat16, device="cuda")
    for _ in range(10):
        dist.all_reduce(x)
        x.mul_(0.5)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.repeats):
        dist.all_reduce(x)
        x.mul_(0.5)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - t) / args.repeats
    if rank == 0:
        text = json.dumps(
            {"peer": f"torch {torch.__version__} nccl", "all_reduce_seconds": seconds}
        )
        print(text)
        if args.out:
            open(args.out, "w").write(text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
