"""Offline study of Quest selection variants: attention mass recalled and output error.

    python benchmarks/quest_recall.py --cache /tmp/quest_cache --budgets 256,512,1024,2048 \
        --out benchmarks/results/cpu/quest_recall_demo.json
    python benchmarks/quest_recall.py --variants base --budgets 768,1280,2304 \
        --out benchmarks/results/cpu/quest_recall_demo_base_plus256.json

Reads the dense references of quest_reference.py (each attention layer's query at every
teacher-forced decode step, and the K/V those steps saw) and, for each selection variant,
replays the selection of every layer, step and KV head with the same token budget: no model
runs, so a variant costs seconds instead of the minutes of a decode run. Per (layer, step,
query head) it measures the share of the dense attention mass in the selected pages
(recall) and |o_sparse - o_dense| / |o_dense| of the attention output (sparse = softmax over
the selected keys only, as the store computes it). The end-to-end check of the variants that
win here is quest_quality.py. "base" is the selection before issue 18 (32-token pages, per
KV head). The second command gives the base 256 more tokens of budget: the KV + metadata
bytes that 16-token pages read at budget B (their fp32 metadata is 2x, ~252 tokens of fp32
K/V per step on the demo at ~8K context) equal the base's at B + 256.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np
from bench_kv import environment, write_json

from qwen38_backend.kv import quest


@dataclass(frozen=True)
class Variant:
    name: str
    page_tokens: int = 32
    sinks: int = 32
    recent: int = 64
    summary: str = "minmax"  # page metadata and its score (quest.SUMMARIES)
    width: float = 1.0  # "meanstd": how many standard deviations a page's score reaches
    group: str = "sum"  # how a KV group's query heads combine (quest.GROUP_REDUCES)
    shared: bool = False  # one selection for every KV head (scores summed over heads)
    lag: int = 0  # score with the query of `lag` steps before (0: the current one)


VARIANTS = {
    v.name: v
    for v in [
        Variant("base"),
        Variant("lag_one", lag=1),
        Variant("shared_heads", shared=True),
        Variant("group_max", group="max"),
        Variant("group_softmax", group="softmax"),
        Variant("meanstd", summary="meanstd"),
        Variant("meanstd2", summary="meanstd", width=2.0),
        Variant("page16", page_tokens=16),
        Variant("page64", page_tokens=64),
        Variant("sinks0", sinks=0),
        Variant("sinks64", sinks=64),
        Variant("recent0", recent=0),
        Variant("recent256", recent=256),
        Variant("page8", page_tokens=8),
        Variant("page16_shared", page_tokens=16, shared=True),  # the default since issue 18
        Variant("page8_shared", page_tokens=8, shared=True),
        Variant("page16_sinks16", page_tokens=16, sinks=16),
        Variant("page16_recent128", page_tokens=16, recent=128),
    ]
}


def layer_pages(k: mx.array, v: mx.array, q: mx.array, prefix: int, P: int, scale: float):
    """Per step and query head, the dense attention mass and mass-weighted V of each page.

    k, v: [Hkv, L, D] (L = prefix + steps); q: [steps, Hq, D]. Returns mass
    [steps, Hq, n_pages] and pv [steps, Hq, n_pages, D] (pages past a step's keys are 0).
    """
    hkv, L, d = k.shape
    steps, hq, _ = q.shape
    g = hq // hkv
    n_pages = -(-L // P)
    pad = n_pages * P - L
    kp = mx.pad(k, [(0, 0), (0, pad), (0, 0)])
    vp = mx.pad(v, [(0, 0), (0, pad), (0, 0)])
    qg = q.reshape(steps, hkv, g, d).transpose(1, 0, 2, 3).reshape(hkv, steps * g, d)
    logits = (qg @ kp.swapaxes(1, 2)).reshape(hkv, steps, g, n_pages * P) * scale
    pos = mx.arange(n_pages * P)
    visible = pos[None, :] < (prefix + 1 + mx.arange(steps))[:, None]  # [steps, L']
    logits = mx.where(visible[None, :, None], logits, -mx.inf)
    p = mx.softmax(logits, axis=-1)  # [hkv, steps, g, L']
    pr = p.reshape(hkv, steps * g, n_pages, P)
    mass = pr.sum(axis=-1)  # [hkv, steps*g, n_pages]
    pv = mx.einsum("hsnp,hnpd->hsnd", pr, vp.reshape(hkv, n_pages, P, d))
    mass = mass.reshape(hkv, steps, g, n_pages).transpose(1, 0, 2, 3).reshape(steps, hq, -1)
    pv = pv.reshape(hkv, steps, g, n_pages, d).transpose(1, 0, 2, 3, 4)
    return mass, pv.reshape(steps, hq, n_pages, d)


def selection(var: Variant, q: mx.array, meta, n_pages: int, budget: int, scale: float):
    """Selected-page mask [steps, Hkv, n_pages] of steps with `n_pages` pages (the library's
    functions); q: [steps, Hq, D]; meta: the two summaries [Hkv, >= n_pages, D]."""
    P = var.page_tokens
    steps, hq, d = q.shape
    hkv = meta[0].shape[0]
    a, b = (mx.broadcast_to(m[None, :, :n_pages], (steps, hkv, n_pages, d)) for m in meta)
    a, b = a.reshape(steps * hkv, n_pages, d), b.reshape(steps * hkv, n_pages, d)
    scores = quest.page_scores(q.reshape(-1, d), a, b, var.summary, var.group, scale, var.width)
    scores = scores.reshape(steps, hkv, n_pages)
    if var.shared:
        scores = mx.stack([quest.shared_scores(s) for s in scores])
    forced, n_forced = quest.forced_pages(n_pages, -(-var.sinks // P), -(-var.recent // P))
    n_sel = min(n_pages, max(-(-budget // P), n_forced))
    pages = quest.select_pages(scores.reshape(steps * hkv, n_pages), forced, n_sel)
    mask = mx.zeros((steps * hkv, n_pages), dtype=mx.bool_)
    mask[mx.arange(steps * hkv)[:, None], pages] = True
    return mask.reshape(steps, hkv, n_pages)


def study(ref: dict, variants: list[Variant], budgets: list[int], scale: float) -> dict:
    """Recall and output error of each variant and budget over every layer and step (the
    dense attention of a layer is computed once per page size and shared by the variants)."""
    keys, values, queries = ref["keys"], ref["values"], ref["queries"]
    n_layers, steps, hq, d = queries.shape
    hkv = keys.shape[1]
    prefix = keys.shape[2] - steps
    out = {(v.name, b): {"recall": [], "err": []} for v in variants for b in budgets}
    for layer in range(n_layers):
        k, v = mx.array(keys[layer]), mx.array(values[layer])
        q = mx.array(queries[layer])
        for P in sorted({var.page_tokens for var in variants}):
            mass, pv = layer_pages(k, v, q, prefix, P, scale)
            mx.eval(mass, pv)
            dense_o = pv.sum(axis=2)  # [steps, hq, d]
            n_pages_of = [-(-(prefix + i + 1) // P) for i in range(steps)]
            runs = [
                (n, [i for i in range(steps) if n_pages_of[i] == n])
                for n in sorted(set(n_pages_of))
            ]
            full = (k.shape[1] // P) * P
            for var in [x for x in variants if x.page_tokens == P]:
                meta = quest.page_summary(k[:, :full].reshape(hkv, full // P, P, d), var.summary)
                pad = -(-k.shape[1] // P) - meta[0].shape[1]
                # The open page's summary is never scored (it is always selected).
                meta = tuple(mx.pad(m, [(0, 0), (0, pad), (0, 0)]) for m in meta)
                lagged = mx.array([max(i - var.lag, 0) for i in range(steps)])
                for b in budgets:
                    recalls, errs = [], []
                    for n, idx in runs:
                        ix = mx.array(idx)
                        mask = selection(var, q[lagged[ix]], meta, n, b, scale)
                        m = mx.repeat(mask, hq // hkv, axis=1)  # [s, hq, n]
                        sel_mass = (mass[ix, :, :n] * m).sum(axis=-1)
                        sel_pv = (pv[ix, :, :n] * m[..., None]).sum(axis=2)
                        o = sel_pv / sel_mass[..., None]
                        dense = dense_o[ix]
                        err = mx.linalg.norm(o - dense, axis=-1) / mx.linalg.norm(dense, axis=-1)
                        recalls.append(sel_mass)
                        errs.append(err)
                    r, e = mx.concatenate(recalls), mx.concatenate(errs)
                    mx.eval(r, e)
                    out[var.name, b]["recall"].append(np.array(r))
                    out[var.name, b]["err"].append(np.array(e))
    summary = {}
    for var in variants:
        summary[var.name] = {}
        for b in budgets:
            r = np.stack(out[var.name, b]["recall"])  # [layers, steps, hq]
            e = np.stack(out[var.name, b]["err"])
            summary[var.name][str(b)] = {
                "mean_recall": float(r.mean()),
                "p01_recall": float(np.quantile(r, 0.01)),
                "share_recall_below_0_9": float((r < 0.9).mean()),
                "mean_output_error": float(e.mean()),
                "p99_output_error": float(np.quantile(e, 0.99)),
                "meta_bytes_per_token_per_head": 2 * d * 4 / var.page_tokens,
            }
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default="/tmp/quest_cache", help="quest_reference.py output")
    ap.add_argument("--budgets", default="256,512,1024,2048")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--combine", action="append", default=[], help="name:field=value,...")
    ap.add_argument("--texts", default="", help="only these texts (default: every reference)")
    ap.add_argument("--out")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    variants = [VARIANTS[n] for n in args.variants.split(",") if n]
    for spec in args.combine:  # e.g. best:group=softmax,summary=meanstd
        name, _, fields = spec.partition(":")
        changes = {}
        for item in fields.split(","):
            key, _, value = item.partition("=")
            kind = type(getattr(Variant("x"), key))
            changes[key] = value == "True" if kind is bool else kind(value)
        variants.append(replace(Variant(name), **changes))
    refs = sorted(Path(args.cache).glob("ref_*.npz"))
    if args.texts:
        refs = [
            r for r in refs if any(r.name.startswith(f"ref_{t}_") for t in args.texts.split(","))
        ]
    if not refs:
        raise SystemExit(f"no references in {args.cache}: run quest_quality.py first")
    results = {}
    t0 = time.perf_counter()
    for path in refs:
        ref = dict(np.load(path))
        text = path.stem.split("_7936")[0].removeprefix("ref_")
        scale = 1 / math.sqrt(ref["queries"].shape[-1])
        t = time.perf_counter()
        res = study(ref, variants, budgets, scale)
        for var in variants:
            results.setdefault(var.name, {"variant": asdict(var)})[text] = res[var.name]
            line = " ".join(
                f"{b}: {res[var.name][str(b)]['mean_recall']:.4f}"
                f"/{res[var.name][str(b)]['mean_output_error']:.4f}"
                for b in budgets
            )
            print(f"{text:14s} {var.name:14s} {line}", flush=True)
        print(f"{text}: {time.perf_counter() - t:.0f}s", flush=True)
    write_json(
        args.out,
        {
            "benchmark": "quest_recall",
            "budgets": budgets,
            "results": results,
            "seconds": round(time.perf_counter() - t0, 1),
            "environment": environment(),
        },
    )


if __name__ == "__main__":
    main()
