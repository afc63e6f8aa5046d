"""What filling one layer's paged store in one write costs with a capped pool (pages spilled on
the way) against the same write into an unbounded pool, on this machine.

    python benchmarks/restore_cost.py --out restore_cost.json

A state-file restore (`llm -c` continuing a long conversation) appends each layer's whole KV
at once (PagedKV.restore); with `kv_pool_tokens` below the context the write goes in pieces
that evict the pool each time. Reported per layer (medians over --runs, alternating the two):
seconds for the capped and the unbounded write, their ratio, the pages spilled, and how many
pages an eviction had to copy to the host and write by itself (`single_page_copies`: 0 when
each piece's evictions were written behind in one batch first). Shapes: --kv-heads x
--head-dim, --page-tokens per page, --dtype (bfloat16 on a GPU; the CPU is slow in it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import environment, mx, write_json  # noqa: E402 (BLAS chosen before MLX loads)

from qwen38_backend.kv.paged import PagedKV  # noqa: E402
from qwen38_backend.kv.spill import SpillFile  # noqa: E402
from qwen38_backend.kv.table import PageTable  # noqa: E402


def write_once(k, v, args, pool_pages, where) -> tuple[float, int, int]:
    """Seconds to append k/v into a fresh store (pool and Quest metadata evaluated, its spill
    writes finished), pages spilled, single-page host copies."""
    singles = 0
    page_rows = PageTable.page_rows

    def counting(self, slots, gathered=None):
        nonlocal singles
        singles += len(slots) == 1 and gathered is None
        return page_rows(self, slots, gathered)

    PageTable.page_rows = counting
    spill = SpillFile(where) if pool_pages else None
    store = PagedKV(args.page_tokens, pool_pages=pool_pages, spill=spill)
    try:
        t = time.perf_counter()
        store.append(k, v)
        mx.eval(store.pool.k, store.pool.v, store.kmin, store.kmax)
        if spill is not None:
            region = store.table.spill
            region.io.wait(lambda: not region.io.jobs)
        return time.perf_counter() - t, store.table.n_spilled, singles
    finally:
        PageTable.page_rows = page_rows
        store.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768, help="rows written at once")
    ap.add_argument("--pool-tokens", type=int, default=8192)
    ap.add_argument("--page-tokens", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--spill-dir", default=None, help="default: a temporary directory")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    gpu = mx.default_device().type == mx.DeviceType.gpu
    dtype = getattr(mx, args.dtype or ("bfloat16" if gpu else "float32"))
    shape = (args.kv_heads, args.tokens, args.head_dim)
    k = mx.random.normal(shape).astype(dtype)
    v = mx.random.normal(shape).astype(dtype)
    mx.eval(k, v)
    pool_pages = -(-args.pool_tokens // args.page_tokens)
    capped, unbounded, spilled, singles = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="qwen38-restore-", dir=args.spill_dir) as where:
        for _ in range(args.runs):
            seconds, n_spilled, n_single = write_once(k, v, args, pool_pages, where)
            capped.append(seconds)
            spilled.append(n_spilled)
            singles.append(n_single)
            unbounded.append(write_once(k, v, args, None, where)[0])
    result = {
        "environment": environment(),
        "args": vars(args),
        "dtype": str(dtype),
        "capped_seconds": statistics.median(capped),
        "unbounded_seconds": statistics.median(unbounded),
        "ratio": statistics.median(capped) / statistics.median(unbounded),
        "capped_runs": capped,
        "unbounded_runs": unbounded,
        "pages_spilled": statistics.median(spilled),
        "single_page_copies": statistics.median(singles),
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
