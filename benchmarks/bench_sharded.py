"""Qwen3.8-27B dims (random weights) split over the ranks of `mx.distributed` vs one device.

One GPU per rank (the NCCL backend gives rank r the GPU r):

    python benchmarks/bench_sharded.py --out x1.json                       # one GPU
    python -m mlx._distributed_utils.launch -n 2 --backend nccl -- \\
        python benchmarks/bench_sharded.py --out x2.json                  # two GPUs (= mlx.launch)
    python benchmarks/bench_sharded.py --combine x1.json x2.json --out sharded.json

Each run: (1) correctness at 27B per-layer dims with `--check-layers` layers: the split model's
logits over a prompt and its greedy tokens against the whole model built on rank 0 (same
random weights); (2) speed with `--layers` layers: prefill tok/s at each length (the engine's
default chunk), decode tok/s after it, peak memory per rank, the fraction of the aggregate
bandwidth bound (bytes a token reads / (ranks x bound)), and the time of one all-reduce of a
token's hidden state (a token makes 2 per layer). Only rank 0 writes. `--dims tiny --layers 4
--check-layers 4` smoke-tests it on a CPU (`--backend ring` under mlx.launch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench_gpu_27b import bytes_per_token, prefill_then_decode, prompt, random_model  # noqa: E402
from common import write_json  # noqa: E402


def median(values: list[float]) -> dict:
    return {"median": statistics.median(values), "runs": values}


def check(args, group, dtype: str) -> dict:
    """Split vs whole logits and greedy tokens at full per-layer dims, few layers."""
    import mlx.core as mx
    import numpy as np

    split, config, _ = random_model(args.dims, args.check_layers, dtype, group)
    ids = prompt(args.check_tokens, config["text_config"]["vocab_size"])
    got = np.array(split.logits(ids))
    tokens = list(split.generate_tokens(ids, max_tokens=16, temperature=0.0))
    del split
    mx.clear_cache()
    if group.rank() != 0:
        return {}
    whole, _, _ = random_model(args.dims, args.check_layers, dtype, None)
    want = np.array(whole.logits(ids))
    want_tokens = list(whole.generate_tokens(ids, max_tokens=16, temperature=0.0))
    del whole
    mx.clear_cache()
    return {
        "layers": args.check_layers,
        "prompt_tokens": len(ids),
        "max_abs_logit_diff": float(np.abs(got - want).max()),
        "max_abs_logit": float(np.abs(want).max()),
        "argmax_agreement": float((got.argmax(-1) == want.argmax(-1)).mean()),
        "greedy_identical": tokens == want_tokens,
        "greedy_split": tokens,
        "greedy_whole": want_tokens,
    }


def all_reduce_seconds(group, hidden: int, dtype, repeats: int = 200) -> float:
    """One all_sum of a [1, hidden] row, as a decode step does it (a chain of them, timed)."""
    import mlx.core as mx

    x = mx.ones((1, hidden), dtype=dtype)
    mx.eval(mx.distributed.all_sum(x, group=group))
    t = time.perf_counter()
    for _ in range(repeats):
        x = mx.distributed.all_sum(x, group=group) * 0.5
    mx.eval(x)
    return (time.perf_counter() - t) / repeats


def speed(args, group) -> dict:
    import mlx.core as mx

    mx.reset_peak_memory()
    model, config, nbytes = random_model(args.dims, args.layers, args.dtype, group)
    vocab = config["text_config"]["vocab_size"]
    warm = model.new_state()
    mx.eval(model.prefill(prompt(1024, vocab), warm))
    del warm
    out = {"weights_bytes_whole": nbytes, "lengths": {}}
    itemsize = 2 if args.dtype in ("bfloat16", "float16") else 4
    for length in args.lengths:
        ids = prompt(length, vocab)
        pre, dec = prefill_then_decode(model, ids, args.runs, args.decode)
        per_token = bytes_per_token(config, nbytes, length + args.decode // 2, itemsize)
        rate = statistics.median(dec)
        bound = group.size() * args.bound_gbps * 1e9
        out["lengths"][str(length)] = {
            "prefill_tok_s": median(pre),
            "decode_tok_s": median(dec),
            "bytes_per_token_all_ranks": per_token,
            "fraction_of_aggregate_bound": per_token * rate / bound,
            "peak_memory_bytes_rank0": mx.get_peak_memory(),
        }
    hidden = config["text_config"]["hidden_size"]
    if group.size() > 1:
        seconds = all_reduce_seconds(group, hidden, getattr(mx, args.dtype))
        out["all_reduce_seconds"] = seconds
        out["all_reduce_ms_per_token"] = seconds * 2 * args.layers * 1e3
    return out


def combine(paths: list[str]) -> dict:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    result = {"benchmark": "27b dims split over ranks", "runs": runs}
    one = next((r for r in runs if r["ranks"] == 1), None)
    for r in runs:
        if one is None or r is one:
            continue
        for key, entry in r["speed"]["lengths"].items():
            base = one["speed"]["lengths"].get(key)
            if base:
                entry["decode_ratio_vs_1"] = (
                    entry["decode_tok_s"]["median"] / base["decode_tok_s"]["median"]
                )
                entry["prefill_ratio_vs_1"] = (
                    entry["prefill_tok_s"]["median"] / base["prefill_tok_s"]["median"]
                )
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny"])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--check-layers", type=int, default=8)
    ap.add_argument("--check-tokens", type=int, default=256)
    ap.add_argument("--lengths", default="4096,32768")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bound-gbps", type=float, default=4800.0, help="per device; H200 4.8 TB/s")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--combine", nargs="+", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.combine:
        write_json(combine(args.combine), args.out)
        return
    import mlx.core as mx

    args.lengths = [int(x) for x in args.lengths.split(",")]
    group = mx.distributed.init()
    result = {
        "ranks": group.size(),
        "dims": args.dims,
        "dtype": args.dtype,
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
    }
    if not args.skip_check:
        # in the compute dtype, and in fp32 where rounding cannot hide a wrong cut
        result["check"] = check(args, group, args.dtype)
        result["check_float32"] = check(args, group, "float32")
    result["speed"] = speed(args, group)
    if group.rank() == 0:
        write_json(result, args.out)


if __name__ == "__main__":
    main()
