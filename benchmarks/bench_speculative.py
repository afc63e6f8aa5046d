"""Speculative decoding with n-gram drafts vs plain decoding, demo model, CPU, same process.

Tasks where prompt lookup helps (fix a given code block and return it whole; answer from a
given passage, quoting it; repeat a given list) and one where it should not (open prose: the
throttle should keep it from being slower). For each task and mode: decode tok/s (median of
`--runs`, modes interleaved run by run so load from other processes falls on both alike),
the speedup against plain measured in the same run, acceptance rate, tokens per forward,
throttle pauses, MLX peak memory, and whether the token streams are identical.

    QWEN38_HOME=~/.cache/qwen38-test-home .venv/bin/python benchmarks/bench_speculative.py \\
        --out benchmarks/results/cpu/bench_speculative_demo.json

(benchmarks/common.py loads the system OpenBLAS before MLX: with MLX's bundled reference BLAS
a 5-row verify costs ~5 plain steps and drafting cannot win.)
"""

from __future__ import annotations

import argparse
import statistics

import common  # first: it loads the system OpenBLAS before MLX
import mlx.core as mx

import qwen38_backend
from qwen38_backend import speculative

BUGGY_CODE = """def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(value)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)


def stdev(values):
    return variance(values) ** 0.5
"""

PASSAGE = (
    "The Rhine is a river that begins in the Swiss Alps, in the canton of Graubunden, and "
    "flows north through Lake Constance. It then turns west along the border between "
    "Switzerland and Germany, passes Basel, and runs north between France and Germany. "
    "After Mainz it cuts through the Rhine Gorge, where the Lorelei rock stands, and it "
    "reaches the North Sea in the Netherlands near Rotterdam. The river is about 1,230 "
    "kilometres long and is one of the busiest inland waterways in Europe."
)

TASKS = {
    "fix_code": "This code has a bug (a misspelled name). Reply with the whole corrected code "
    "and nothing else:\n\n" + BUGGY_CODE,
    "answer_from_passage": "Passage:\n" + PASSAGE + "\n\nUsing only the passage, describe the "
    "route of the Rhine from its source to the sea, quoting the passage's words.",
    "repeat_list": "Repeat this list exactly, one item per line: apple, banana, cherry, date, "
    "elderberry, fig, grape, honeydew, kiwi, lemon, mango, nectarine, orange, papaya.",
    "open_prose": "Write a short paragraph about why the sea is blue.",
}
MODES = ("off", "ngram")


def one_run(model, ids: list[int], mode: str, max_tokens: int, k: int) -> dict:
    """One greedy decode; mode "off", "ngram", or "ngram_window<W>" (n-gram drafts with the
    throttle deciding every W rounds instead of speculative.WINDOW)."""
    mx.reset_peak_memory()
    window = speculative.Throttle.window
    if mode.startswith("ngram_window"):
        speculative.Throttle.window = int(mode.removeprefix("ngram_window"))
    try:
        draft = "off" if mode == "off" else "ngram"
        stream = model.generate_tokens(ids, max_tokens=max_tokens, draft=draft, draft_tokens=k)
        tokens = list(stream)
    finally:
        speculative.Throttle.window = window
    s = stream.stats
    return {
        "tokens": tokens,
        "decode_tok_s": s.decode_tokens_per_second,
        "draft": s.draft_stats(),
        "peak_memory_bytes": mx.get_peak_memory(),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen38-demo")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="draft_tokens")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument(
        "--compare-window",
        type=int,
        default=None,
        help="also n-gram drafts with the throttle deciding every this many rounds",
    )
    ap.add_argument("--out")
    args = ap.parse_args()

    model = qwen38_backend.load(args.model)
    session = model.session(cache=False)
    result = {
        "benchmark": "speculative decoding, n-gram drafts vs plain (greedy)",
        "model": args.model,
        "max_tokens": args.max_tokens,
        "draft_tokens": args.k,
        "runs": args.runs,
        "environment": common.environment(),
        "tasks": {},
    }
    modes = MODES if args.compare_window is None else (*MODES, f"ngram_window{args.compare_window}")
    list(model.generate_tokens([1, 2, 3], max_tokens=4))  # compile the decode graphs
    for name in args.tasks.split(","):
        text = TASKS[name]
        ids = session.request([{"role": "user", "content": text}], enable_thinking=False).ids
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(args.runs):
            for mode in modes:
                runs[mode].append(one_run(model, ids, mode, args.max_tokens, args.k))
        row: dict = {"prompt_tokens": len(ids)}
        for mode in modes:
            rates = [r["decode_tok_s"] for r in runs[mode]]
            row[mode] = {
                "decode_tok_s": {"median": statistics.median(rates), "runs": rates},
                "peak_memory_bytes": max(r["peak_memory_bytes"] for r in runs[mode]),
            }
        for mode in modes[1:]:
            row[mode]["draft"] = runs[mode][-1]["draft"]
            row[mode]["speedup"] = (
                row[mode]["decode_tok_s"]["median"] / row["off"]["decode_tok_s"]["median"]
            )
        streams = [r["tokens"] for mode in modes for r in runs[mode]]
        row["generated_tokens"] = len(streams[0])
        row["identical_tokens"] = all(s == streams[0] for s in streams)
        row["speedup"] = (
            row["ngram"]["decode_tok_s"]["median"] / row["off"]["decode_tok_s"]["median"]
        )
        row["text"] = model.tokenizer.decode(streams[0])[:500]
        result["tasks"][name] = row
        d = row["ngram"]["draft"]
        print(
            f"{name}: plain {row['off']['decode_tok_s']['median']:.2f} tok/s, ngram "
            f"{row['ngram']['decode_tok_s']['median']:.2f} tok/s (x{row['speedup']:.2f}), "
            f"acceptance {d['acceptance_rate']:.2f}, {d['tokens_per_forward']:.2f} tok/forward, "
            f"identical {row['identical_tokens']}",
            flush=True,
        )
    common.write_json(result, args.out)


if __name__ == "__main__":
    main()
