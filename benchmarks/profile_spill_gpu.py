"""Where a Quest decode step with a spilling page pool spends its time (host side).

    python benchmarks/profile_spill_gpu.py --layers 16 --length 32768 --pool-tokens 8192
    python benchmarks/profile_spill_gpu.py --layers 64 --length 262144 --pool-tokens 65536 \
        --churn 0.25 --runs 2 --wait-first --restore    # one prefill: fits a 10-minute call

Prefills one paged state fully resident and one with a capped pool (pages spilled), then
decodes `--runs` x `--decode` tokens on each after the prompt (rewinding to its end after
each): per-step wall times (median, first step apart: it fetches most of the first
selection), pages fetched per attention layer-step, one more decode per --eager-layers
stride under a WaitClock, then one more under cProfile (top functions by own time and by
cumulative time).
`host_ms_per_layer_step` is the spilled step's extra time over the resident one per
attention layer. Spilled steps attend on a guess (PagedKV.attend_on_guess, the GPU's default,
forced on here also on a CPU; `--wait-only`: off); `--wait-first` adds, after each spilled
run, the same run with each attention layer waiting for its selection before attending. On a
CPU (the same shape of host work, small dims):

    nice -n 10 python benchmarks/profile_spill_gpu.py --dims tiny --layers 64 --length 8192 \
        --pool-tokens 4096 --page-tokens 16 --budget 1024 --chunk 2048 --runs 3
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_27b import decode_times, prompt, random_model  # noqa: E402
from common import WaitClock, environment, write_json  # noqa: E402


def step_times(model, state, logits, n: int) -> list[float]:
    """Wall seconds to each token of a greedy decode after the prompt (times[0]: the first
    token, sampled from the prefill's logits), then back to the prompt's end."""
    length = state.offset
    times = decode_times(model, state, logits, n)
    state.truncate(length)
    return times


def clocked_runs(model, state, logits, args, n_attn: int) -> dict:
    """One more decode under a WaitClock (per step: waits in mx.eval, hand-overs, the rest)
    per QWEN38_EAGER_LAYERS stride in --eager-layers (the default alone without it)."""
    import os

    strides = args.eager_layers.split(",") if args.eager_layers else [None]
    out = {}
    for stride in strides:
        if stride is not None:
            os.environ["QWEN38_EAGER_LAYERS"] = stride
        before = fetched(state)
        with WaitClock() as clock:
            times = step_times(model, state, logits, args.decode)
        steps = len(times) - 1  # forwards: the first token is sampled from the prefill's
        row = clock.split(sum(times), steps)
        row["pages_fetched_per_layer_step"] = (fetched(state) - before) / (steps * n_attn)
        row["median_step_ms"] = 1e3 * statistics.median(times[1:])
        out[stride or "default"] = row
        os.environ.pop("QWEN38_EAGER_LAYERS", None)
    return out


class WanderingSelection:
    """--churn: each Quest decode step's selection replaced by one of the same size that
    keeps all but `churn` of its pages (a fraction: that many on average), the new ones drawn
    from the whole context, with the sinks and the recent window always in (Quest forces
    them). Random weights change most of a selection every step (~28% of it per step at
    262K), real text far less (the demo: 1.5%, benchmarks/spill_fetch_rate.py); this sets
    the churn, the same for the resident and the spilled state. The real selection is still
    computed (the device does the same work) and its result dropped."""

    def __init__(self, churn: float, seed: int = 0):
        self.churn = churn
        self.rng = np.random.default_rng(seed)
        self.kept: dict[int, set[int]] = {}

    def install(self) -> None:
        import mlx.core as mx

        from qwen38_backend.kv.paged import PagedKV

        real, wander = PagedKV.select, self

        def select(store, q, n_sel):
            pages = real(store, q, n_sel)
            chosen = mx.array(wander.pages(store, n_sel), dtype=mx.int32)
            return mx.broadcast_to(chosen[None], pages.shape) + pages[:, :1] * 0

        PagedKV.select = select

    def pages(self, store, n_sel: int) -> list[int]:
        n_pages = len(store.table)
        forced = set(range(min(store.sink_pages, n_pages)))
        forced |= set(range(max(n_pages - 1 - store.recent_pages, 0), n_pages))
        free = n_sel - len(forced)
        kept = {p for p in self.kept.get(id(store), ()) if p < n_pages and p not in forced}
        drop = int(self.churn) + (self.rng.random() < self.churn % 1)
        if drop and kept:
            kept -= set(self.rng.choice(sorted(kept), min(drop, len(kept)), replace=False))
        while len(kept) < free:
            p = int(self.rng.integers(n_pages))
            if p not in forced:
                kept.add(p)
        self.kept[id(store)] = kept
        return sorted(forced | kept)


def attention_layers(state) -> list:
    return [layer for layer in state.layers if hasattr(layer, "budget_pages")]


def fetched(state) -> int:
    return sum(layer.stats["pages_fetched"] for layer in attention_layers(state))


def reattended(state) -> int:
    return sum(layer.stats["reattended"] for layer in attention_layers(state))


def top(profile: cProfile.Profile, key: str, n: int) -> list[str]:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats(key).print_stats(n)
    return [line for line in out.getvalue().splitlines() if line.strip()][-n:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny"])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--page-tokens", type=int, default=None)
    ap.add_argument("--pool-tokens", type=int, default=8192)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (model default)")
    ap.add_argument("--runs", type=int, default=1, help="timed decodes (medians over them)")
    ap.add_argument(
        "--eager-layers",
        default=None,
        help="comma list of QWEN38_EAGER_LAYERS strides: one more clocked spilled run each",
    )
    ap.add_argument(
        "--churn",
        type=float,
        default=None,
        help="pages of a selection replaced per step (WanderingSelection; default: Quest's "
        "own selection, which random weights change every step)",
    )
    ap.add_argument(
        "--wait-first",
        action="store_true",
        help="after each spilled run, one more waiting for each selection before attending "
        "(PagedKV.attend_on_guess off: the path before issue 12's session 13)",
    )
    ap.add_argument(
        "--restore",
        action="store_true",
        help="fill the spilled state by restoring the resident one's snapshot instead of a "
        "second prefill (same tokens: a 64-layer pair at 262K fits one 10-minute call)",
    )
    ap.add_argument(
        "--wait-only", action="store_true", help="every spilled run waits for its selection"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import mlx.core as mx

    from qwen38_backend.kv.paged import PagedKV

    # the guess as on a GPU, also on a CPU (where it is off by default)
    guess = PagedKV.attend_on_guess = not args.wait_only

    if args.churn is not None:
        WanderingSelection(args.churn).install()

    model, config, _ = random_model(args.dims, args.layers, args.dtype)
    vocab = config["text_config"]["vocab_size"]
    kv = {"kv_paged": "on", "kv_topk": args.budget}
    if args.page_tokens:
        kv["kv_page_tokens"] = args.page_tokens
    spill_dir = tempfile.mkdtemp(prefix="qwen38-spill-")
    result: dict = {"environment": environment(), "args": vars(args)}
    snapshot = None
    for label, extra in (
        ("resident", {}),
        ("spilled", {"kv_pool_tokens": args.pool_tokens, "kv_spill_dir": spill_dir}),
    ):
        state = model.new_state(**kv, **extra)
        t = time.perf_counter()
        if snapshot is not None:  # --restore: the resident prompt's state, spilled on the way
            state.restore(snapshot)
            snapshot = None
            prefill_seconds = None
        else:
            logits = model.prefill(prompt(args.length, vocab), state, chunk=args.chunk)
            mx.eval(logits)
            prefill_seconds = time.perf_counter() - t
        state.save_point()  # each run rewinds to the prompt's end
        step_times(model, state, logits, 4)  # warm: compiles the decode graph
        restore_seconds = time.perf_counter() - t if prefill_seconds is None else None
        n_attn = len(attention_layers(state))
        medians, rates, per_layer_step, redone = [], [], [], []
        waiting: list[float] = []  # --wait-first: the same runs, waiting for each selection
        for _ in range(args.runs):
            before, again = fetched(state), reattended(state)
            times = step_times(model, state, logits, args.decode)
            medians.append(statistics.median(times[1:]))
            rates.append((len(times) - 1) / sum(times[1:]))
            per_layer_step.append((fetched(state) - before) / ((len(times) - 1) * n_attn))
            redone.append((reattended(state) - again) / ((len(times) - 1) * n_attn))
            if args.wait_first and label == "spilled":
                PagedKV.attend_on_guess = False
                times = step_times(model, state, logits, args.decode)
                PagedKV.attend_on_guess = guess
                waiting.append(statistics.median(times[1:]))
        clocked = clocked_runs(model, state, logits, args, n_attn)
        profile = cProfile.Profile()
        profile.enable()
        step_times(model, state, logits, args.decode)
        profile.disable()
        row = {
            "prefill_seconds": prefill_seconds,
            "restore_and_warm_seconds": restore_seconds,
            "prefill_chunk": args.chunk or model.prefill_chunk,
            "attention_layers": n_attn,
            "median_step_s": statistics.median(medians),
            "median_step_s_runs": medians,
            "tok_s_after_first": statistics.median(rates),
            "tok_s_runs": rates,
            "pages_fetched_per_layer_step": statistics.median(per_layer_step),
            "pages_fetched_total": fetched(state),
            "reattended_per_layer_step": statistics.median(redone),
            "wait_first_median_step_s_runs": waiting,
            "wait_first_median_step_s": statistics.median(waiting) if waiting else None,
            "clocked": clocked,
            "top_tottime": top(profile, "tottime", 25),
            "top_cumtime": top(profile, "cumulative", 40),
        }
        result[label] = row
        print(json.dumps({label: {k: v for k, v in row.items() if "top" not in k}}), flush=True)
        if args.restore and label == "resident":
            snapshot = state.snapshot()  # shares the pool's buffers: no copy of the KV
        state.close()
        del state
        mx.clear_cache()
    shutil.rmtree(spill_dir, ignore_errors=True)
    extra_s = result["spilled"]["median_step_s"] - result["resident"]["median_step_s"]
    result["host_ms_per_layer_step"] = 1e3 * extra_s / result["spilled"]["attention_layers"]
    print(json.dumps({"host_ms_per_layer_step": result["host_ms_per_layer_step"]}), flush=True)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
