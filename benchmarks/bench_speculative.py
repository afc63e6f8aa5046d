"""n-gram speculative decoding vs plain greedy decoding on the demo model (CPU).

Tasks where prompt lookup helps (repeat a list, rewrite a given code block) and one where it
should not (open prose). For each: decode tok/s plain and with speculative="ngram" (median of
`--runs`), the acceptance rate, tokens per forward, and whether the token streams are equal.

    QWEN38_HOME=~/.cache/qwen38-test-home .venv/bin/python benchmarks/bench_speculative.py \
        --out benchmarks/results/cpu/bench_speculative_demo.json
"""

from __future__ import annotations

import argparse
import statistics

from common import environment, write_json

import qwen38_backend

CODE = """def mean(values):
    total = 0
    for v in values:
        total += v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total += (v - m) ** 2
    return total / len(values)
"""

TASKS = {
    "repeat_list": "Repeat this list exactly, one item per line: apple, banana, cherry, date, "
    "elderberry, fig, grape, honeydew, kiwi, lemon, mango, nectarine, orange, papaya.",
    "rewrite_code": "Rewrite this Python code with type hints, otherwise unchanged:\n\n" + CODE,
    "prose": "Write a short paragraph about why the sea is blue.",
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen38-demo")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()

    model = qwen38_backend.load(args.model)
    session = model.session(cache=False)
    result = {
        "benchmark": "speculative (n-gram drafts, greedy)",
        "model": args.model,
        "max_tokens": args.max_tokens,
        "speculative_tokens": args.k,
        "runs": args.runs,
        "environment": environment(),
        "tasks": {},
    }
    for name, text in TASKS.items():
        ids = session.request([{"role": "user", "content": text}], enable_thinking=False).ids
        row: dict = {"prompt_tokens": len(ids)}
        streams: dict = {}
        rates: dict = {"off": [], "ngram": []}
        specs: dict = {}
        # modes alternate run by run, so load from other processes on this shared CPU
        # falls on both alike
        for _ in range(args.runs):
            for mode in ("off", "ngram"):
                stream = model.generate_tokens(
                    ids, max_tokens=args.max_tokens, speculative=mode, speculative_tokens=args.k
                )
                streams[mode] = list(stream)
                rates[mode].append(stream.stats.decode_tokens_per_second)
                specs[mode] = stream.stats.speculative
        for mode in ("off", "ngram"):
            spec = specs[mode]
            runs = rates[mode]
            row[mode] = {"decode_tok_s": {"median": statistics.median(runs), "runs": runs}}
            if spec:
                gen = len(streams[mode])
                row[mode]["speculative"] = spec
                # forwards after the first token (which comes from the prefill logits)
                row[mode]["tokens_per_forward"] = (gen - 1) / max(spec["forwards"], 1)
        row["generated_tokens"] = len(streams["off"])
        row["identical_tokens"] = streams["off"] == streams["ngram"]
        row["speedup"] = (
            row["ngram"]["decode_tok_s"]["median"] / row["off"]["decode_tok_s"]["median"]
        )
        row["text"] = model.tokenizer.decode(streams["ngram"])[:400]
        result["tasks"][name] = row
        print(
            f"{name}: plain {row['off']['decode_tok_s']['median']:.2f} tok/s, ngram "
            f"{row['ngram']['decode_tok_s']['median']:.2f} tok/s (x{row['speedup']:.2f}), "
            f"accept {row['ngram']['speculative']['acceptance_rate']:.2f}, "
            f"identical {row['identical_tokens']}",
            flush=True,
        )
    write_json(result, args.out)


if __name__ == "__main__":
    main()
