"""Per-token cost of n-gram (prompt-lookup) drafting on the host: before (each decided token
scanned the last 8192 tokens with numpy: `old_ngram_match`, the code as it was at 3f05bf9)
vs after (`drafts.NgramIndex`: append the token, look the suffix up), at context lengths
8K, 64K and 262K. Host code only, so synthetic token lists stand in for text: ids drawn
Zipf-like over a 151,936-id vocabulary (frequent ids recur, as in text).

Scenarios, `--steps` tokens decided one by one after a context of L tokens:
- prose: fresh tokens from the same distribution (few long matches: the lookup's worst case,
  every candidate of every n checked);
- copy: the tokens copy a span from the middle of the context, L/2 back ("answer from a given
  passage"): past 8192 tokens back the old scan finds no 3-token match, the index does.

Per scenario and length: microseconds per token (median of `--runs`, each over all steps),
the index's one-off build from the context (ms) and its size (tracemalloc: its dicts
and its own token list), the old cost of
the context copy a round made (`state.tokens + [last]`), and how many steps found a 3-token
match before and after.

    .venv/bin/python benchmarks/bench_ngram_lookup.py --out benchmarks/results/cpu/ngram_lookup.json
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import common
import numpy as np

from qwen38_backend.drafts import MAX_NGRAM, NgramIndex

VOCAB = 151_936
OLD_LOOKBACK = 8192


def old_ngram_match(tokens: list[int], k: int, max_n: int = MAX_NGRAM) -> tuple[list[int], int]:
    """drafts.ngram_match before the index (3f05bf9), kept here as the baseline."""
    if k <= 0 or len(tokens) < 2:
        return [], 0
    start = max(len(tokens) - OLD_LOOKBACK, 0)
    arr = np.asarray(tokens[start:], dtype=np.int64)
    size = len(arr)
    for n in range(min(max_n, size - 1), 0, -1):
        suffix = arr[size - n :]
        cands = np.nonzero(arr[: size - n] == suffix[0])[0][::-1]
        for j in cands:
            if np.array_equal(arr[j : j + n], suffix):
                follow = arr[j + n : j + n + (k if n > 1 else 1)]
                if len(follow):
                    return [int(t) for t in follow], n
    return [], 0


def zipf_tokens(rng: np.random.Generator, count: int) -> list[int]:
    """Ids with text-like frequencies: rank r drawn with probability ~ 1/r^1.1."""
    ranks = np.arange(1, VOCAB + 1, dtype=np.float64)
    p = ranks**-1.1
    ids = rng.permutation(VOCAB)[rng.choice(VOCAB, size=count, p=p / p.sum())]
    return ids.tolist()


def scenario(kind: str, length: int, steps: int, seed: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    context = zipf_tokens(rng, length)
    if kind == "copy":
        return context, context[length // 2 : length // 2 + steps]
    return context, zipf_tokens(rng, steps)


def per_token_old(context: list[int], stream: list[int], k: int) -> tuple[float, int]:
    tokens, found = list(context), 0
    t = time.perf_counter()
    for token in stream:
        tokens.append(token)
        found += old_ngram_match(tokens, k)[1] == MAX_NGRAM
    return (time.perf_counter() - t) / len(stream) * 1e6, found


def per_token_new(context: list[int], stream: list[int], k: int) -> tuple[float, int]:
    index, found = NgramIndex(context), 0
    t = time.perf_counter()
    for token in stream:
        index.append(token)
        found += index.match(k)[1] == MAX_NGRAM
    return (time.perf_counter() - t) / len(stream) * 1e6, found


def context_copy_us(context: list[int], repeats: int = 20) -> float:
    """What a round's `state.tokens + [last]` cost before (state.tokens copies the list)."""
    t = time.perf_counter()
    for _ in range(repeats):
        _ = list(context) + [0]
    return (time.perf_counter() - t) / repeats * 1e6


def index_build(context: list[int]) -> tuple[float, float]:
    t = time.perf_counter()
    NgramIndex(context)
    ms = (time.perf_counter() - t) * 1e3
    tracemalloc.start()
    index = NgramIndex(context)
    mib = tracemalloc.get_traced_memory()[0] / 2**20  # its dicts and its own token list
    tracemalloc.stop()
    del index
    return ms, mib


def measure(kind: str, length: int, args) -> dict:
    context, stream = scenario(kind, length, args.steps, seed=length)
    old = [per_token_old(context, stream, args.k) for _ in range(args.runs)]
    new = [per_token_new(context, stream, args.k) for _ in range(args.runs)]
    builds = [index_build(context) for _ in range(args.runs)]
    before = summary([us for us, _ in old])
    after = summary([us for us, _ in new])
    return {
        "old_us_per_token": before,
        "new_us_per_token": after,
        "speedup": before["median"] / after["median"],
        "old_round_context_copy_us": context_copy_us(context),
        "index_build_ms": summary([ms for ms, _ in builds]),
        "index_mib": builds[0][1],
        "steps": args.steps,
        "steps_with_3gram_match": {"old": old[0][1], "new": new[0][1]},
    }


def summary(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": values,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="8192,65536,262144")
    ap.add_argument("--steps", type=int, default=256, help="tokens decided per run")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--k", type=int, default=4, help="draft tokens asked for")
    ap.add_argument("--out")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    result = {
        "benchmark": "n-gram lookup per decided token: 8192-token numpy scan vs NgramIndex",
        "environment": common.environment(),
        "runs": args.runs,
        "by_scenario": {
            kind: {str(n): measure(kind, n, args) for n in lengths} for kind in ("prose", "copy")
        },
    }
    common.write_json(result, args.out)


if __name__ == "__main__":
    main()
