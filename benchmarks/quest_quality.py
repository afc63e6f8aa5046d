"""Quest quality: teacher-forced sparse decode against dense, at budget-to-context ratios.

    python benchmarks/quest_quality.py --model qwen38-demo --budgets 2048,1024,512,256 \
        --variants old,new,page16_shared --full-check \
        --out benchmarks/results/cpu/quest_quality_demo.json

Each text (quest_reference.py: real English from installed packages) is prefilled densely
once, and cached with a dense teacher-forced decode of the next `--steps` tokens and a dense
greedy run of `--greedy` tokens. Each variant and budget then restores the prefix's K/V into
a paged store with that selection and decodes the same way: teacher-forced (the true next
token is fed, whatever the sparse step predicted) and greedily. Reported per text, variant
and budget: top-1 agreement with dense, mean and max |log p_sparse - log p_dense| of the
dense top-1 token, the identical-prefix length of the greedy runs, and the KV bytes read per
token (K and V rows of the selected pages, all layers) next to the metadata bytes scored.
With a ~8K context, budgets 2048 / 1024 / 512 / 256 are ratios ~4x / 8x / 16x / 32x.
Each disagreement is listed with dense's own top-1 minus top-2 log-prob at that step.

Study variants (not engine options; same K/V bytes read as Quest at the budget): "oracle*"
rank pages by the true attention mass of the step's query (OracleKV; the ceiling of page
selection), "gauss" by an estimate from a per-page key mean and variance (GaussKV).
    python benchmarks/quest_quality.py --budgets 2048,256 \
        --variants new,oracle,oracle_head,oracle_page8,gauss \
        --out benchmarks/results/cpu/quest_quality_oracle_demo.json
On the demo (numpy_license / pydantic_docs) the shared 32-token oracle gets 96.9 / 97.7%
top-1 at 4x and 77.3 / 89.1% at 32x; its misses at 4x are near-ties of dense (margin
<= 0.17 nats); 8-token pages lift 32x to 83.6 / 93.0%.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from bench_kv import environment, write_json
from quest_reference import TEXTS, log_softmax, reference, text_path

import qwen38_backend
from qwen38_backend.kv import PagedKV, collect_kv_stats
from qwen38_backend.kv.quest import forced_pages, select_pages
from qwen38_backend.state import StateSnapshot

# The selection of each variant: PagedKV keyword arguments besides the budget.
VARIANTS = {
    # Before issue 18: 32-token pages, each KV head selecting its own pages.
    "old": {"page_tokens": 32, "sinks": 32, "recent": 64, "shared": False},
    # The default since: 32-token pages, one selection shared by the KV heads (same bytes).
    "new": {"page_tokens": 32, "sinks": 32, "recent": 64, "shared": True},
    # 16-token pages, shared: more recall per K/V byte, 2x the metadata (kv_page_tokens=16).
    "page16_shared": {"page_tokens": 16, "sinks": 32, "recent": 64, "shared": True},
    "page16": {"page_tokens": 16, "sinks": 32, "recent": 64, "shared": False},
    # Metadata in bf16 rounded outward (still a bound): 16-token pages at the default's bytes.
    "new_bf16": {
        "page_tokens": 32,
        "sinks": 32,
        "recent": 64,
        "shared": True,
        "meta_dtype": "bfloat16",
    },
    "page16_bf16": {
        "page_tokens": 16,
        "sinks": 32,
        "recent": 64,
        "shared": True,
        "meta_dtype": "bfloat16",
    },
    # Study only (not engine options): the same pages, forcing and bytes as "new"/"old", but
    # chosen by the true attention mass of the step's query (OracleKV): the ceiling of any
    # page selection at these KV bytes.
    "oracle": {"page_tokens": 32, "sinks": 32, "recent": 64, "shared": True, "select": "oracle"},
    "oracle_head": {
        "page_tokens": 32,
        "sinks": 32,
        "recent": 64,
        "shared": False,
        "select": "oracle",
    },
    # The oracle without sinks or recent window (only the open page forced): what the forced
    # pages (128 of a 256-token budget) cost at the same bytes.
    "oracle_free": {"page_tokens": 32, "sinks": 0, "recent": 0, "shared": True, "select": "oracle"},
    "oracle_page8_free": {
        "page_tokens": 8,
        "sinks": 0,
        "recent": 0,
        "shared": True,
        "select": "oracle",
    },
    # Cheap metadata at the default's bytes (GaussKV): per-page mean and variance of the keys
    # in bf16 instead of min/max, scored as an estimate of each page's attention mass.
    "gauss": {"page_tokens": 32, "sinks": 32, "recent": 64, "shared": True, "select": "gauss"},
    # The oracle with smaller pages (same token budget, so the same K/V bytes): how much of
    # the gap to dense is page granularity.
    "oracle_page8": {
        "page_tokens": 8,
        "sinks": 32,
        "recent": 64,
        "shared": True,
        "select": "oracle",
    },
}


class OracleKV(PagedKV):
    """PagedKV selecting by the true attention mass of the current query (study only).

    The same n_sel pages and sink/recent forcing as Quest, so attention reads the same K/V
    rows; only the ranking differs: softmax(scale * q . k) over the whole context (the full
    keys, which a real selector cannot read), summed per page over the tokens and the KV
    group's query heads, and over the KV heads when shared.
    """

    state_kind = "PagedKV"  # the prefix snapshot is restored as into the engine's store

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        self._scale = scale  # select() is not given it
        return super().attend(q, k, v, scale)

    def page_mass(self, q: mx.array) -> mx.array:
        """Attention mass [Hkv, n_pages] of q [Hq, D] per KV head (summed over its group)."""
        keys = self._dense_kv()[0][0].astype(mx.float32)  # [Hkv, L, D]
        hkv, length, d = keys.shape
        qg = q.astype(mx.float32).reshape(hkv, -1, d)
        probs = mx.softmax((qg @ keys.swapaxes(1, 2)) * self._scale, axis=-1)
        n_pages, P = len(self.table), self.page_tokens
        probs = mx.pad(probs, [(0, 0), (0, 0), (0, n_pages * P - length)])
        return probs.reshape(hkv, qg.shape[1], n_pages, P).sum(axis=(1, 3))

    def select(self, q: mx.array, n_sel: int) -> mx.array:
        scores = self.page_mass(q)
        if self.shared:
            scores = scores.sum(axis=0, keepdims=True)
        forced, _ = forced_pages(len(self.table), self.sink_pages, self.recent_pages)
        pages = select_pages(scores, forced, n_sel)
        return mx.broadcast_to(pages, (self.pool.k.shape[0], n_sel))


class GaussKV(OracleKV):
    """Quest's bytes spent on a per-page mean and per-dimension variance of the keys (bf16).

    If a page's keys were Gaussian, sum_k exp(s q.k) = P exp(s q.mu + s^2/2 q^2 . var): each
    query head's estimated log-mass per page, softmaxed over pages (so every head counts the
    same, as in the oracle) and summed over the group (and the KV heads when shared). The
    statistics come from the stored rows of sealed pages, cached as they seal; the open
    (last) page is always forced.
    """

    def _page_stats(self) -> tuple[mx.array, mx.array]:
        n_sealed, P = self.length // self.page_tokens, self.page_tokens
        have = 0 if getattr(self, "_mu", None) is None else self._mu.shape[1]
        if have > n_sealed:  # rewound: recompute
            have, self._mu, self._var = 0, None, None
        if have < n_sealed:
            rows = self._span(have * P, n_sealed * P)[0].astype(mx.float32)
            hkv, _, d = rows.shape
            rows = rows.reshape(hkv, n_sealed - have, P, d)
            mu, var = rows.mean(axis=2), rows.var(axis=2)
            mu, var = (x.astype(mx.bfloat16).astype(mx.float32) for x in (mu, var))
            if have:
                mu = mx.concatenate([self._mu, mu], axis=1)
                var = mx.concatenate([self._var, var], axis=1)
            self._mu, self._var = mu, var
        return self._mu, self._var

    def page_mass(self, q: mx.array) -> mx.array:
        mu, var = self._page_stats()  # [Hkv, n_sealed, D]
        hkv, n_sealed, d = mu.shape
        s = self._scale
        qg = q.astype(mx.float32).reshape(hkv, -1, d)
        log_mass = s * (qg @ mu.swapaxes(1, 2)) + 0.5 * s * s * ((qg * qg) @ var.swapaxes(1, 2))
        mass = mx.softmax(log_mass, axis=-1).sum(axis=1)  # [Hkv, n_sealed]
        return mx.pad(mass, [(0, 0), (0, len(self.table) - n_sealed)])  # open page: forced


SELECTORS = {"quest": PagedKV, "oracle": OracleKV, "gauss": GaussKV}


def paged_state(net, ref: dict, prefix: int, budget: int, options: dict):
    """A paged state holding the prefix's K/V (metadata recomputed from the rows)."""
    options = dict(options)
    store = SELECTORS[options.pop("select", "quest")]
    if "meta_dtype" in options:  # named in VARIANTS (JSON-friendly)
        options["meta_dtype"] = getattr(mx, options["meta_dtype"])
    else:  # the variants before bf16 metadata: fp32 page min/max
        options["meta_dtype"] = mx.float32
    state = net.make_state(kv_factory=functools.partial(store, budget=budget, **options))
    layers = [
        # page_tokens 0 never matches: the store recomputes its page metadata from the rows.
        {"keys": mx.array(k), "values": mx.array(v), "page_tokens": mx.array(0)}
        for k, v in zip(ref["prefix_keys"], ref["prefix_values"], strict=True)
    ]
    ids = ref["ids"].tolist()
    state.restore(StateSnapshot(tokens=ids[:prefix], layers=layers, extras={}))
    return state


def run_variant(net, ref: dict, budget: int, options: dict) -> dict:
    ids = ref["ids"].tolist()
    steps = ref["logprobs"].shape[0]
    prefix = len(ids) - steps - 1
    state = paged_state(net, ref, prefix, budget, options)
    agree, diffs, misses = [], [], []
    t0 = time.perf_counter()
    for i in range(steps):
        token = ids[prefix + i]
        lp = log_softmax(net(mx.array([token], dtype=mx.int32), state, last_only=True)[-1])
        state.advance([token])
        lp = np.array(lp)
        dense = ref["logprobs"][i]
        top = int(dense.argmax())
        agree.append(int(lp.argmax()) == top)
        diffs.append(abs(float(lp[top]) - float(dense[top])))
        if not agree[-1]:  # how close dense's own top two were where the sparse top-1 differs
            second = float(np.partition(dense, -2)[-2])
            misses.append([i, round(float(dense[top]) - second, 4)])
    forced_s = time.perf_counter() - t0
    stats = collect_kv_stats(state)
    # Greedy from the prefix: the first token comes from the (dense) prefill's logits.
    state = paged_state(net, ref, prefix, budget, options)
    logits, same = mx.array(ref["last_logits"]), 0
    for want in ref["greedy"].tolist():
        token = int(mx.argmax(logits).item())
        if token != want:
            break
        same += 1
        logits = net(mx.array([token], dtype=mx.int32), state, last_only=True)[-1]
        state.advance([token])
    return {
        "top1_agreement": float(np.mean(agree)),
        "mean_abs_logprob_diff": float(np.mean(diffs)),
        "max_abs_logprob_diff": float(np.max(diffs)),
        "greedy_identical_prefix": same,
        "disagreements_step_dense_margin": misses,
        "greedy_tokens": len(ref["greedy"]),
        "sparse_steps": stats.get("sparse_steps", 0),
        "kv_read_bytes_per_token": stats.get("kv_read_bytes_per_token", 0),
        "meta_read_bytes_per_token": stats.get("meta_read_bytes", 0) / max(steps, 1),
        "teacher_forced_seconds": round(forced_s, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen38-demo")
    ap.add_argument("--texts", default=",".join(TEXTS))
    ap.add_argument("--prefix", type=int, default=7936, help="prompt tokens before decoding")
    ap.add_argument("--steps", type=int, default=128, help="teacher-forced decode steps")
    ap.add_argument("--greedy", type=int, default=32, help="greedy tokens compared")
    ap.add_argument("--budgets", default="2048,1024,512,256")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--full-check", action="store_true", help="also a budget covering all")
    ap.add_argument("--cache", default="/tmp/quest_cache", help="dense references")
    ap.add_argument("--out")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}: choose from {sorted(VARIANTS)}")
    model = qwen38_backend.load(args.model)
    net, tok = model.net, model.tokenizer
    t_start = time.perf_counter()
    results = {}
    for text in args.texts.split(","):
        path = reference(net, tok, text, args.prefix, args.steps, args.greedy, Path(args.cache))
        ref = dict(np.load(path))
        context = args.prefix + args.steps
        entry = {
            "source": str(text_path(text)),
            "tokens_sha256_16": path.stem.rsplit("_", 1)[-1],
            "prefix_tokens": args.prefix,
            "dense_prefill_seconds": float(ref["seconds"][0]),
            "runs": {},
        }
        plan = [(n, b) for b in budgets for n in names]  # variants interleaved per budget
        if args.full_check:
            plan.append((names[0], 1 << 20))
        for name, budget in plan:
            res = run_variant(net, ref, budget, VARIANTS[name])
            res["ratio"] = round(context / budget, 2)
            entry["runs"].setdefault(name, {})[str(budget)] = res
            print(
                f"{text} {name} budget {budget} (x{res['ratio']}): top1 "
                f"{res['top1_agreement']:.3f} mean|dlp| {res['mean_abs_logprob_diff']:.3f} "
                f"max {res['max_abs_logprob_diff']:.2f} greedy {res['greedy_identical_prefix']}"
                f"/{res['greedy_tokens']} ({res['teacher_forced_seconds']}s)",
                flush=True,
            )
        results[text] = entry
    write_json(
        args.out,
        {
            "benchmark": "quest_quality",
            "model": args.model,
            "steps": args.steps,
            "budgets": budgets,
            "variants": {n: VARIANTS[n] for n in names},
            "texts": results,
            "seconds": round(time.perf_counter() - t_start, 1),
            "environment": environment(),
        },
    )


if __name__ == "__main__":
    main()
