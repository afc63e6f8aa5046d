"""Time to first token of a follow-up turn: from a state file vs full recompute.

For each history length (tokens of chat history before the follow-up), one setup turn runs
the history and stores its state file in a fresh prefix-store directory. Then, several times
each, the follow-up turn (history + the reply + a new question) is timed from `generate()`
to its first event:
  recompute  Session(cache=False): prefill everything
  disk       a new PrefixStore on the same directory (empty memory tier, as a new process
             would have): lookup + read + verify checksums + restore + prefill the new tokens
  memory     the store that ran the setup turn: restore from the in-memory tier
Medians and all runs are printed as JSON.

  python benchmarks/bench_resume.py [--model qwen38-demo] [--history 2048 4096 7168] [--runs 3]
On x86 Linux, LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 speeds
up MLX's CPU matmuls.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

FILLER = (
    "The committee reviewed the quarterly figures for each region, noting that shipping "
    "delays in the northern warehouses had eased while costs in the south kept rising. "
)


def history_messages(session, target: int) -> list[dict]:
    """User/assistant turns whose rendered prompt is about `target` tokens."""
    msgs: list[dict] = []
    i = 0
    while True:
        msgs.append({"role": "user", "content": f"Part {i}. " + FILLER * 6})
        ids, _ = session.render(msgs)
        if len(ids) >= target:
            return msgs
        msgs.append({"role": "assistant", "content": f"Noted part {i}. " + FILLER * 4})
        i += 1


def first_event_seconds(session, msgs) -> tuple[float, dict]:
    t0 = time.perf_counter()
    events = session.generate(msgs, max_tokens=2, stop_token_ids=[])
    next(events)
    elapsed = time.perf_counter() - t0
    events.close()  # do not run the turn's end (it would store state files: not timed here)
    return elapsed, session.last_stats.usage()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen38-demo")
    ap.add_argument("--history", type=int, nargs="+", default=[2048, 4096, 7168])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = ap.parse_args(argv)

    import mlx.core as mx

    import qwen38_backend
    from qwen38_backend.prefix_store import PrefixStore

    model = qwen38_backend.load(args.model)
    results = []
    for target in args.history:
        probe = model.session(cache=False)
        history = history_messages(probe, target)
        directory = Path(tempfile.mkdtemp(prefix="bench_resume_"))
        store = PrefixStore(directory, memory_bytes=4 * 1024**3)
        setup = model.session(cache=store)
        t0 = time.perf_counter()
        reply = "".join(
            e.text
            for e in setup.generate(history, max_tokens=16)
            if e.type in ("text", "reasoning")
        )
        setup_s = time.perf_counter() - t0
        follow = history + [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "Summarize the regional trends in one sentence."},
        ]
        prompt_tokens = len(probe.render(follow)[0])
        state_file_bytes = sum(e.nbytes for e in store.entries() if e.tier == "disk")
        runs: dict[str, list[float]] = {"recompute": [], "disk": [], "memory": []}
        usage: dict[str, dict] = {}
        for _ in range(args.runs):
            s, usage["recompute"] = first_event_seconds(model.session(cache=False), follow)
            runs["recompute"].append(s)
            s, usage["disk"] = first_event_seconds(
                model.session(cache=PrefixStore(directory, memory_bytes=0)), follow
            )
            runs["disk"].append(s)
            s, usage["memory"] = first_event_seconds(model.session(cache=store), follow)
            runs["memory"].append(s)
        medians = {k: statistics.median(v) for k, v in runs.items()}
        row = {
            "history_tokens": len(probe.render(history)[0]),
            "follow_up_prompt_tokens": prompt_tokens,
            "cached_tokens": usage["disk"]["cached"],
            "state_file_bytes_on_disk": state_file_bytes,
            "setup_turn_seconds": setup_s,
            "ttft_median_seconds": medians,
            "speedup_disk_vs_recompute": medians["recompute"] / medians["disk"],
            "speedup_memory_vs_recompute": medians["recompute"] / medians["memory"],
            "runs_seconds": runs,
            "usage": usage,
        }
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        store.clear()
    report = {
        "benchmark": "bench_resume",
        "model": args.model,
        "dtype": str(model.dtype),
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "runs": args.runs,
        "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
