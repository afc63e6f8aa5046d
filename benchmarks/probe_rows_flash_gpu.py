"""Which parts of a Flash-Next (qwen4_exp) verify row differ from the plain step on a GPU.

    python benchmarks/probe_rows_flash_gpu.py --out rows_flash.json

Before session 18 Flash-Next did not draft on a GPU: its experts, QSA selection and
hyper-connection mixes took a verify's rows together, and its plain steps ran compiled
graphs a verify did not. This probe measures what
a verify of --rows positions computes against the plain steps at the same positions (random
weights, bf16; the tiny test config, or real per-layer dims with --dims flash), bit for bit,
for each way the few-row products could run:
- as_is: what the device runs now (rows.py's plan there; before session 18 every product
  took the rows together);
- split: the CPU's plan (rows.py): the products outside `project` (router, stream mixes,
  indexer, PLE, shared-expert gate) row by row, `project` row by row where its probe found
  rows that differ;
- split_all: every product row by row (only attention, QSA scoring and the experts take the
  rows together);
- split_all_op_by_op: split_all with the plain steps built op by op, as a verify is
  (Qwen4ExpBlock.compile_decode off: no fused elementwise graphs in either).
For each: contiguous and paged stores, a history inside QSA's budget and one past it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import environment, write_json  # noqa: E402

STORES = {"contiguous": {}, "paged": {"kv_paged": "on", "kv_page_tokens": 16}}
MODES = ("as_is", "split", "split_all", "split_all_op_by_op")


@contextmanager
def rows_mode(mode: str):
    """rows.py's plan on this device as `mode` says (module docstring)."""
    from qwen38_backend import rows
    from qwen38_backend.models.qwen4_exp import Qwen4ExpBlock

    saved = rows._splits, rows._split_plan
    if mode != "as_is":
        rows._splits = lambda: True
    if mode.startswith("split_all"):
        rows._split_plan = lambda dtype, net, n: "all" if 1 < n <= rows.STEP_MAX_ROWS else None
    Qwen4ExpBlock.compile_decode = not mode.endswith("op_by_op")
    try:
        yield
    finally:
        rows._splits, rows._split_plan = saved
        Qwen4ExpBlock.compile_decode = True


def compare(model, prefix: list[int], tail: list[int], store: dict) -> dict:
    """Verify rows of `tail` after `prefix` against plain steps: identical, max |diff|."""
    import mlx.core as mx
    import numpy as np

    one, many = model.new_state(**store), model.new_state(**store)
    model.prefill(prefix, one)
    model.prefill(prefix, many)
    t0 = time.perf_counter()
    steps = [np.array(model.forward([t], one)[-1].astype(mx.float32)) for t in tail]
    t1 = time.perf_counter()
    feats = model.forward_features(tail, many)
    got = np.array(model.net.logits_from_features(feats).astype(mx.float32))
    t2 = time.perf_counter()
    diffs = [float(np.abs(got[i] - s).max()) for i, s in enumerate(steps)]
    return {
        "identical": all(d == 0.0 for d in diffs),
        "max_abs_diff_per_row": diffs,
        "argmax_agree": [int(got[i].argmax()) == int(s.argmax()) for i, s in enumerate(steps)],
        "plain_steps_s": t1 - t0,
        "verify_s": t2 - t1,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", choices=["tiny", "flash"], default="tiny")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--rows", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", help="float32 on the CPU (its gather_mm)")
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of the modes to run")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import qwen38_backend
    from qwen38_backend.testing import make_tiny_weights

    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_weights(
            "qwen4_exp", Path(tmp) / "m", dims=args.dims, num_layers=args.layers, dtype="bfloat16"
        )
        model = qwen38_backend.load(str(path), dtype=args.dtype)
    cfg = model.net.config
    budget = cfg.indexer_budget
    vocab = min(cfg.vocab_size, 500) - 2
    histories = {"within_budget": max(budget // 2, 3), "past_budget": 3 * budget + 5}
    tail = [(13 * i + 11) % vocab + 2 for i in range(args.rows)]
    result = {
        "environment": environment(),
        "dims": args.dims,
        "layers": cfg.num_hidden_layers,
        "rows": args.rows,
        "dtype": args.dtype,
        "indexer_budget": budget,
        "histories": histories,
        "modes": {},
    }
    for mode in args.modes.split(","):
        with rows_mode(mode):
            table = {}
            for store_name, store in STORES.items():
                for name, length in histories.items():
                    prefix = [(5 * i + 3) % vocab + 2 for i in range(length)]
                    table[f"{store_name}/{name}"] = compare(model, prefix, tail, store)
        result["modes"][mode] = table
        print(mode, {k: v["identical"] for k, v in table.items()}, flush=True)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
