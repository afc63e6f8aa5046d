"""Qwen3.8-27B dimensions (random bf16, generated on the device) at depth: 32K to 262,144.

    python benchmarks/bench_gpu_depth.py --lengths 32768,131072,262144 --out depth.json

Per length, in one process: prefill at the engine's default chunk (Model.prefill_chunk) into a
paged state (identity-mapped pages: the same dense prefill math), peak memory of that prefill
(mx.get_peak_memory after a reset) against weights + KV, then decode `--decode` tokens with
Quest (kv_topk budget) and, after rewinding them, the same number dense (the budget widened to
the whole context). Reports tok/s, bytes a token reads and the fraction of the bandwidth bound.
`--dims tiny --layers 4` smoke-tests the script on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_27b import decode_rate, decode_times, prompt, random_model  # noqa: E402
from common import block_score_option, settings, use_block_score  # noqa: E402


def decode(model, state, logits, n: int) -> float:
    """Decode tok/s of n greedy tokens after the prompt, then back to its end (the state's
    save point). Four tokens first, untimed: a new depth compiles kernels for its shapes."""
    length = state.offset
    for steps in (4, n):
        times = decode_times(model, state, logits, steps)
        state.truncate(length)
    return decode_rate(times)


def timed_prefill(model, ids: list[int], state, **options) -> tuple:
    """(last logits, seconds) of prefilling `ids` into `state`, synchronised both ends."""
    import mlx.core as mx

    mx.synchronize()
    t = time.perf_counter()
    logits = model.prefill(ids, state, **options)
    mx.eval(logits)
    mx.synchronize()
    return logits, time.perf_counter() - t


def attention_layers(state) -> list:
    return [layer for layer in state.layers if hasattr(layer, "budget_pages")]


def spill_ios(state) -> list:
    ios = {}
    for layer in attention_layers(state):
        region = layer.table.spill
        if region is not None and region.io.fd >= 0:  # a file was created (pages spilled)
            ios[id(region.io)] = region.io
    return list(ios.values())


def read_totals(state) -> tuple[int, float]:
    ios = spill_ios(state)
    return sum(io.stats["read_bytes"] for io in ios), sum(io.read_seconds for io in ios)


def spill_reads(state, before: tuple[int, float]) -> dict:
    """What decode read from the spill file (bytes, seconds, GB/s; `before`: the totals
    before decode; its untimed warm-up tokens included), and a plain sequential read of the
    same file in the same run: with its page cache dropped first (cold) and again right
    after (warm)."""
    import os

    ios = spill_ios(state)
    if not ios:
        return {}
    total_bytes, total_seconds = read_totals(state)
    read_bytes, read_seconds = total_bytes - before[0], total_seconds - before[1]
    out = {"decode_read_bytes": read_bytes, "decode_read_seconds": read_seconds}
    out["decode_read_gb_s"] = read_bytes / read_seconds / 1e9 if read_seconds else None
    for io in ios:
        size = os.fstat(io.fd).st_size
        for label in ("cold", "warm"):
            if label == "cold":
                os.posix_fadvise(io.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t, done = time.perf_counter(), 0
            while done < size:
                done += len(os.pread(io.fd, min(64 << 20, size - done), done))
            out[f"sequential_{label}_gb_s"] = size / (time.perf_counter() - t) / 1e9
        out["spill_file_bytes"] = size
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny"])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--lengths", default="32768,131072,262144")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--budget", type=int, default=2048, help="Quest kv_topk")
    ap.add_argument(
        "--pool-tokens", type=int, default=None, help="kv_pool_tokens: cap the pool (spills)"
    )
    ap.add_argument("--spill-dir", default=None, help="kv_spill_dir")
    ap.add_argument("--page-tokens", type=int, default=None, help="kv_page_tokens")
    ap.add_argument(
        "--no-dense",
        action="store_true",
        help="skip the dense decode (with spilled pages it streams the whole past from disk)",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="prefill chunk (default: the engine's); with a capped pool each chunk reads the "
        "spilled past back, so a wider one reads less",
    )
    ap.add_argument(
        "--layers-ahead",
        type=int,
        default=None,
        help="state.PREFILL_LAYERS_AHEAD: prefill layers queued ahead of the one waited for",
    )
    ap.add_argument(
        "--quest-ops",
        action="store_true",
        help="Quest decode without its kernels: page keys by MLX ops "
        "(QWEN38_QUEST_KERNEL=off) and the selected rows gathered before attention",
    )
    ap.add_argument(
        "--churn",
        type=float,
        default=None,
        help="Quest decode: pages of a selection replaced per step (profile_spill_gpu."
        "WanderingSelection; default: Quest's own selection)",
    )
    ap.add_argument(
        "--settle-layers",
        action="store_true",
        help="a settled prefill: every layer and walk block waited for and released before "
        "the next (qwen38_backend/settle.py)",
    )
    ap.add_argument(
        "--settle-every",
        type=int,
        default=None,
        help="state.PREFILL_SETTLE_EVERY: settle the prefill every N layers (0: never)",
    )
    block_score_option(ap)
    ap.add_argument("--bound-gbps", type=float, default=4800.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    use_block_score(args)

    import mlx.core as mx

    from qwen38_backend import state as state_module
    from qwen38_backend.kv import blocked, collect_kv_stats, one_token

    if args.layers_ahead is not None:
        state_module.PREFILL_LAYERS_AHEAD = args.layers_ahead
    if args.settle_every is not None:
        state_module.PREFILL_SETTLE_EVERY = args.settle_every
    if args.churn is not None:
        from profile_spill_gpu import WanderingSelection

        WanderingSelection(args.churn).install()
    if args.quest_ops:
        os.environ["QWEN38_QUEST_KERNEL"] = "off"
        one_token.READ_PAGES_IN_PLACE = False

    model, config, weights_bytes = random_model(args.dims, args.layers, args.dtype)
    if args.chunk:
        model.prefill_chunk = args.chunk
    vocab = config["text_config"]["vocab_size"]
    result = {
        "device": str(mx.default_device()),
        "dims": args.dims,
        "layers": args.layers,
        "dtype": args.dtype,
        "prefill_chunk": model.prefill_chunk,
        "weights_bytes": weights_bytes,
        "budget": args.budget,
        "prefill_layers_ahead": state_module.PREFILL_LAYERS_AHEAD,
        "quest_kernels": not args.quest_ops,
        "churn": args.churn,
        "settle_layers": args.settle_layers,
        "settle_every": state_module.PREFILL_SETTLE_EVERY,
        "block_score_mib": blocked.BLOCK_SCORE_BYTES >> 20,
        "settings": settings(),
        "lengths": {},
    }
    kv = {"kv_paged": "on", "kv_topk": args.budget}
    if args.page_tokens:
        kv["kv_page_tokens"] = args.page_tokens
    if args.pool_tokens:
        kv.update(kv_pool_tokens=args.pool_tokens, kv_spill_dir=args.spill_dir)
    result["kv_options"] = kv
    warm = model.new_state(kv_paged="on", kv_topk=args.budget)
    mx.eval(model.prefill(prompt(2048, vocab), warm))  # compiles kernels
    del warm
    for length in (int(x) for x in args.lengths.split(",")):
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        state = model.new_state(**kv)
        ids = prompt(length, vocab)
        logits, seconds = timed_prefill(model, ids, state, settle_layers=args.settle_layers)
        kv_bytes = state.nbytes()
        peak = mx.get_peak_memory()
        state.save_point()  # the Gated DeltaNet state to rewind the decoded tokens to
        before = read_totals(state)
        quest = decode(model, state, logits, args.decode)
        quest_kv = collect_kv_stats(state)
        spill = spill_reads(state, before)
        for layer in attention_layers(state):
            layer.budget_pages = 1 << 30  # covers everything: dense attention through pages
        dense = None if args.no_dense else decode(model, state, logits, args.decode)
        row = {
            "prefill_tok_s": length / seconds,
            "prefill_seconds": seconds,
            "peak_memory_bytes": peak,
            "resident_before_bytes": base,
            "kv_bytes": kv_bytes,
            "peak_over_weights_plus_kv": peak / (weights_bytes + kv_bytes),
            "decode_tokens": args.decode,  # the rates below time decode - 1 steps
            "decode_quest_tok_s": quest,
            "decode_dense_tok_s": dense,
            "quest_kv_stats": {k: v for k, v in quest_kv.items() if "spill" in k or "fetch" in k},
            "spill_reads": spill,
        }
        dense_bytes = weights_bytes + kv_bytes
        if dense is not None:
            row["dense_fraction_of_bound"] = dense * dense_bytes / (args.bound_gbps * 1e9)
        result["lengths"][str(length)] = row
        print(json.dumps({str(length): row}), flush=True)
        del state, logits
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
