"""Passkey retrieval: dense vs Quest at several token budgets, one prefill per depth.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
    python benchmarks/passkey.py --model qwen38-demo --haystack 7500 --depths 10 \
        --budgets 256,512,1024,2048 --out passkey.json

A five-digit key sits at `depths` evenly spaced depths of a filler haystack; the model
completes "The pass key is". Each depth is prefilled once (prefill attention is dense in every
store); the state is then restored into the contiguous store (dense) and into Quest stores of
each budget, and each decodes greedily. Prints a JSON accuracy table. `--variants old,new`
compares selection variants of quest_quality.py (their page size, sinks and recent window
replace the flags) at each budget.
"""

from __future__ import annotations

import argparse
import functools
import re
import time

import mlx.core as mx
import numpy as np
from bench_kv import environment, factory, greedy, prefill, state_from, write_json
from quest_quality import VARIANTS

import qwen38_backend
from qwen38_backend.kv import PagedKV

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n"
)


def build_prompt(tok, haystack: int, depth: float, key: str) -> list[int]:
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    question = "\nWhat is the pass key? The pass key is"
    filler_ids = tok.encode(FILLER * (haystack // 8 + 50))
    budget = haystack - len(tok.encode(INTRO + needle + question))
    filler_ids = filler_ids[:budget]
    cut = int(len(filler_ids) * depth)
    before, after = tok.decode(filler_ids[:cut]), tok.decode(filler_ids[cut:])
    return tok.encode(INTRO + before + needle + after + question)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen38-demo")
    ap.add_argument("--haystack", type=int, default=7500, help="prompt tokens")
    ap.add_argument("--depths", type=int, default=10)
    ap.add_argument("--budgets", default="256,512,1024,2048")
    ap.add_argument("--page-tokens", type=int, default=32)
    ap.add_argument("--sinks", type=int, default=32)
    ap.add_argument("--recent", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--variants", default="", help="selection variants of quest_quality.py")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="resume at this depth index")
    ap.add_argument("--depth-list", default="", help="explicit depths, e.g. 0.1,0.25 (else even)")
    ap.add_argument("--out")
    args = ap.parse_args()

    model = qwen38_backend.load(args.model)
    net, tok = model.net, model.tokenizer
    rng = np.random.default_rng(args.seed)
    budgets = [int(b) for b in args.budgets.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}: choose from {sorted(VARIANTS)}")
    modes = [("dense", None)] + [("quest", b) for b in budgets if not variants]
    modes += [(v, b) for b in budgets for v in variants]
    rows = []
    t_start = time.perf_counter()
    depths = [float(d) for d in args.depth_list.split(",") if d]
    depths = depths or [i / max(args.depths - 1, 1) for i in range(args.depths)]
    for i, depth in enumerate(depths):
        key = str(rng.integers(10000, 100000))
        if i < args.start:  # same keys as a full run: the rng still advances
            continue
        ids = build_prompt(tok, args.haystack, depth, key)
        paged = factory("paged", None, args.page_tokens, args.sinks, args.recent)
        state = net.make_state(kv_factory=paged)
        t0 = time.perf_counter()
        logits = prefill(net, ids, state)
        prefill_s = time.perf_counter() - t0
        snap = state.snapshot()
        row = {"depth": round(depth, 3), "key": key, "prompt_tokens": len(ids)}
        row["prefill_seconds"] = round(prefill_s, 2)
        for mode, budget in modes:
            if mode in VARIANTS:
                kv = functools.partial(PagedKV, budget=budget, **VARIANTS[mode])
                name = f"{mode}_{budget}"
            else:
                kv = factory(mode, budget, args.page_tokens, args.sinks, args.recent)
                name = "dense" if mode == "dense" else f"quest_{budget}"
            out = greedy(net, state_from(net, snap, kv), logits, args.new_tokens)
            text = tok.decode(out)
            found = re.findall(r"\d{5}", text)
            row[name] = {"text": text, "correct": bool(found) and found[0] == key}
        rows.append(row)
        print(
            f"depth {depth:.2f} key {key} ({len(ids)} tok, prefill {prefill_s:.1f}s): "
            + " ".join(f"{n}={r['correct']}" for n, r in row.items() if isinstance(r, dict)),
            flush=True,
        )
    names = ["dense"] + [f"quest_{b}" if m == "quest" else f"{m}_{b}" for m, b in modes[1:]]
    accuracy = {n: sum(r[n]["correct"] for r in rows) / len(rows) for n in names}
    agreement = {
        n: sum(r[n]["text"] == r["dense"]["text"] for r in rows) / len(rows) for n in names[1:]
    }
    write_json(
        args.out,
        {
            "benchmark": "passkey",
            "model": args.model,
            "haystack_tokens": args.haystack,
            "variants": {v: VARIANTS[v] for v in variants},
            "page_tokens": args.page_tokens,
            "sinks": args.sinks,
            "recent": args.recent,
            "accuracy": accuracy,
            "same_text_as_dense": agreement,
            "rows": rows,
            "seconds": round(time.perf_counter() - t_start, 1),
            "environment": environment(),
        },
    )
    mx.clear_cache()


if __name__ == "__main__":
    main()
