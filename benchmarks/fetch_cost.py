"""What bringing one spilled KV page back costs the host, part by part, on this machine.

    python benchmarks/fetch_cost.py --out fetch_cost.json                # 27B page shape
    python benchmarks/fetch_cost.py --page-tokens 16 --head-dim 64       # the demo's

A spilled Quest decode step fetches the pages its selection misses, one wait per attention
layer (kv/paged.py `_resident_selection`); on the H200 that host work, not the disk, decides
the spilled/resident ratio (bench_gpu_depth.py: 262K with a 64K pool read 5.3 GB/s but decoded
4.9x slower than resident). This measures it without a model, in seconds, so a GPU session
can see where the time goes on its own host: one PagedKV store (a layer of `--kv-heads` x
`--head-dim`, bf16, `--page-tokens` per page) filled with `--context` random tokens, a pool of
`--pool-pages` (the rest spilled), then selections of `--select` pages of which `--churn` are
new each step (drawn at random from the whole context, as random weights do). Reported in
microseconds per fetched page (medians over `--steps` steps), first right after the fill
(`after_fill`: the resident pages are not on disk yet, so fetches also write older ones
behind, as after a prefill) and then with every resident page written (`steady`):
- `step`: `_resident_selection` (pin, fetch the misses, write behind) and waiting for the pool
  writes it queues on the device: what a layer-step pays for its misses;
- its parts, on the same pages: `read` (SpillRegion.read: pread + CRC-32 check + views),
  `crc` (the checksums alone), `pread` (the reads alone), `upload` (one host buffer, one
  host-to-device copy, `PagedKV._upload`, waited for), `scatter` (the uploaded rows written
  into the pool's slots, waited for), `alloc` (pool slots, evictions included).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import numpy as np  # noqa: E402
from common import environment, mx, write_json  # noqa: E402 (BLAS chosen before MLX loads)

from qwen38_backend.kv.paged import PagedKV  # noqa: E402
from qwen38_backend.kv.spill import SpillFile, read_all  # noqa: E402
from qwen38_backend.kv.table import SPILLED  # noqa: E402


def filled_store(args, spill: SpillFile) -> PagedKV:
    kv = PagedKV(
        args.page_tokens, args.select * args.page_tokens, pool_pages=args.pool_pages, spill=spill
    )
    mx.random.seed(0)
    chunk = 2048
    for _ in range(0, args.context, chunk):
        shape = (1, args.kv_heads, chunk, args.head_dim)
        k = mx.random.normal(shape).astype(mx.bfloat16)
        v = mx.random.normal(shape).astype(mx.bfloat16)
        kv.store(k, v)
        mx.eval(kv.pool.k, kv.pool.v)
    return kv


class Selections:
    """Selections of `size` pages, `churn` of them new each step (random weights: the
    selection wanders over the whole context)."""

    def __init__(self, n_pages: int, size: int, churn: int, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.n_pages, self.size, self.churn = n_pages, size, churn
        self.current = self.rng.choice(n_pages, size, replace=False)

    def next(self) -> np.ndarray:
        keep = self.rng.choice(self.current, self.size - self.churn, replace=False)
        rest = np.setdiff1d(np.arange(self.n_pages), keep)
        new = self.rng.choice(rest, self.churn, replace=False)
        self.current = np.sort(np.concatenate([keep, new]))
        return self.current


class Stopwatch:
    """Seconds per page of named parts: `with watch("read", pages=n): ...`."""

    def __init__(self) -> None:
        self.parts: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str, pages: int):
        t = time.perf_counter()
        yield
        self.parts.setdefault(name, []).append((time.perf_counter() - t) / pages)


def flush(kv: PagedKV) -> int:
    """Write every resident sealed page to the spill file and wait: the steady state, where
    evictions find pages already on disk (after a prefill the resident ones are not)."""
    region, slots = kv.table.spill, kv.table.slots
    pages = [p for p in range(kv.table.n_sealed) if slots[p] != SPILLED]
    pages = region.unqueued(pages)
    if pages:
        kv.table.write_behind(pages)
        region.io.wait(lambda: all(region._clean(p) for p in pages))
    return len(pages)


def steps(kv: PagedKV, selections: Selections, n: int) -> tuple[list[float], list[int]]:
    """Per step: seconds of the misses' host work (and the pool writes it queued), pages
    fetched."""
    seconds, fetched = [], []
    for _ in range(n):
        pages = mx.array(selections.next()[None].astype(np.int32))
        mx.eval(pages)
        before = kv.stats["pages_fetched"]
        t = time.perf_counter()
        pinned, _, _ = kv._resident_selection(pages)
        mx.eval(kv.pool.k, kv.pool.v)
        seconds.append(time.perf_counter() - t)
        fetched.append(kv.stats["pages_fetched"] - before)
        if pinned:
            kv.pool.unpin(pinned)
            kv.pool.touch(pinned)
    return seconds, fetched


def parts(kv: PagedKV, n: int, batch: int, rng) -> dict[str, list[float]]:
    """Seconds per page of each part of a fetch of `batch` spilled pages, `n` times."""
    region = kv.table.spill
    P = kv.page_tokens
    watch = Stopwatch()
    for _ in range(n):
        spilled = [p for p in range(len(kv.table)) if kv.table.slots[p] == SPILLED]
        pages = sorted(rng.choice(spilled, batch, replace=False).tolist())
        with watch("read", batch):
            data = region.read(pages)
        offsets = [region._offset(p) for p in pages]
        with watch("pread", batch):
            raw = [read_all(region.io.fd, region.page_bytes, at) for at in offsets]
        with watch("crc", batch):
            for b in raw:
                zlib.crc32(b)
        with watch("upload", batch):
            up = kv._upload(pages, data)
            mx.eval(*up)
        with watch("alloc", batch):
            slots = kv.pool.alloc(len(pages), kv.pool.k, kv.pool.v)
        rows = (mx.array(slots, dtype=mx.int32)[:, None] * P + mx.arange(P)).reshape(-1)
        mx.eval(rows)
        with watch("scatter", batch):
            kv.pool.k[:, rows], kv.pool.v[:, rows] = up
            mx.eval(kv.pool.k, kv.pool.v)
        kv.table.place(pages, slots)
    return watch.parts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=65536, help="tokens in the store")
    ap.add_argument("--pool-pages", type=int, default=1024, help="resident pages")
    ap.add_argument("--page-tokens", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--select", type=int, default=64, help="pages a step selects")
    ap.add_argument("--churn", default="2,16", help="new pages per step (comma list)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--spill-dir", default=None, help="default: a temporary directory")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="qwen38-fetch-", dir=args.spill_dir) as where:
        kv = filled_store(args, SpillFile(where))
        result: dict = {
            "environment": environment(),
            "args": vars(args),
            "page_bytes": kv.table.spill.page_bytes,
            "pages": len(kv.table),
            "spilled": kv.table.n_spilled,
            "by_churn": {},
        }
        # first as after a prefill (the resident pages not yet on disk: each fetch also
        # writes older ones behind), then with every resident page on disk
        for seed, when in enumerate(("after_fill", "steady")):
            if when == "steady":
                result["flushed_pages"] = flush(kv)
            rows = result["by_churn"].setdefault(when, {})
            for churn in (int(c) for c in args.churn.split(",")):
                selections = Selections(len(kv.table), args.select, churn, seed)
                seconds, fetched = steps(kv, selections, args.steps)
                per_page = [s / f for s, f in zip(seconds, fetched, strict=True) if f]
                rows[str(churn)] = {
                    "fetched_per_step": statistics.median(fetched),
                    "step_us": 1e6 * statistics.median(seconds),
                    "step_us_per_fetched_page": (
                        1e6 * statistics.median(per_page) if per_page else None
                    ),
                }
        batch = max(int(rows[str(churn)]["fetched_per_step"]), 1)
        split = parts(kv, args.steps, batch, np.random.default_rng(1))
        result["parts_batch_pages"] = batch
        result["parts_us_per_page"] = {k: 1e6 * statistics.median(v) for k, v in split.items()}
        kv.close()
    write_json(result, args.out)


if __name__ == "__main__":
    main()
