"""Decode at depth and where a Quest step's time goes (Qwen3.8-27B dims, random bf16, CUDA).

    python benchmarks/probe_quest_step_gpu.py --layers 64 \
        --lengths 4096,32768,131072,262144 --dense-max 262144 --out quest_step.json

Per length, in one process: prefill into a paged Quest state (kv_topk `--budget`) at the
engine's default chunk (tok/s, peak memory), then decode `--decode` greedy tokens `--runs`
times (medians; the modes take turns run by run) in each of these modes:
- `quest`: as users run it (each step scores every page and takes the top-k);
- `quest_op_topk`: the same with the top-k as compiled ops (kernels/top_select.py off);
- `fixed`: every attention layer reuses its first selection (no scoring, no top-k): the
  difference to `quest` is what selecting costs inside a real step;
- `dense` (lengths up to `--dense-max`): the budget covers the whole context;
- `dense_fma` (`--fma`): dense with the decode attention kernel's fp32-FMA form instead of
  its tensor-core one (kernels/decode_attention.TENSOR_CORES off).
Then, on one attention layer's metadata at that depth, the selection alone: `--chain` calls
queued and evaluated at once (as a step queues its layers), per call: the page-key kernel,
the top-k as ops and as one kernel, and the whole selection. Selection ms per token = 16
layers x the whole call.
Bytes a token reads per mode (dense: the whole KV; Quest: the selected rows and every page's
metadata) and tok/s as a fraction of the `--bound-gbps` bound.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_27b import bytes_per_token, prompt, random_model  # noqa: E402
from bench_gpu_depth import attention_layers, decode, timed_prefill  # noqa: E402
from common import eval_seconds, settings, write_json  # noqa: E402


class FixedSelection:
    """PagedKV.select replaced by each store's first selection (per selection size)."""

    def __init__(self) -> None:
        from qwen38_backend.kv.paged import PagedKV

        self.cls, self.original, self.cache = PagedKV, PagedKV.select, {}

    def __enter__(self) -> FixedSelection:
        import mlx.core as mx

        original, cache = self.original, self.cache

        def select(store, q, n_sel):
            key = (id(store), n_sel)
            if key not in cache:
                cache[key] = original(store, q, n_sel)
                mx.eval(cache[key])
            return cache[key]

        self.cls.select = select
        return self

    def __exit__(self, *exc) -> None:
        self.cls.select = self.original


def chained(fn, n: int, repeats: int) -> float:
    """Seconds per call of fn(i) for i < n queued and evaluated at once (median)."""
    return eval_seconds(lambda: [fn(i) for i in range(n)], repeats) / n


def fused_selection(select, n: int, repeats: int) -> dict:
    """ms per call of the selection with its two launches as one (QWEN38_FUSED_KERNEL=auto:
    kv/quest.py, kernels/fused.py), and whether its probe chose it (a fused launch traced)."""
    import os

    from qwen38_backend.kernels import fused

    previous, traced = os.environ.get("QWEN38_FUSED_KERNEL"), []
    launch = fused.launch
    os.environ["QWEN38_FUSED_KERNEL"] = "auto"
    fused.launch = lambda *a, **kw: traced.append(1) or launch(*a, **kw)
    try:
        ms = 1e3 * chained(select, n, repeats)
    finally:
        fused.launch = launch
        if previous is None:
            os.environ.pop("QWEN38_FUSED_KERNEL")
        else:
            os.environ["QWEN38_FUSED_KERNEL"] = previous
    return {"select_fused_ms": ms, "select_fused_chosen": bool(traced)}


def selection_parts(store, n: int, repeats: int) -> dict:
    """ms per call of one attention layer's selection pieces at its depth."""
    import mlx.core as mx

    from qwen38_backend.kv import quest

    n_pages, n_sel = store.selection_size()
    hkv, _, d = store.kmax.shape
    qs = [mx.random.normal((24, d), key=mx.random.key(i)).astype(mx.bfloat16) for i in range(n)]
    mx.eval(qs)
    count = mx.array(n_pages, dtype=mx.int32)
    run = quest.selector(n_sel, store.sink_pages, store.recent_pages, store.shared)
    out = {
        "pages": n_pages,
        "selected": n_sel,
        "metadata_bytes": 2 * store.kmax[:, :n_pages].nbytes,
        "kernel": quest.kernel_usable(qs[0], store.kmin, store.kmax),
        "select_ms": 1e3 * chained(lambda i: run(qs[i], store.kmin, store.kmax, count), n, repeats),
    }
    if out["kernel"]:
        out.update(fused_selection(lambda i: run(qs[i], store.kmin, store.kmax, count), n, repeats))
        from qwen38_backend.kernels import quest_select

        def keys(i):
            return quest_select.page_keys(
                qs[i], store.kmin, store.kmax, count, store.sink_pages, store.recent_pages, True
            )

        out["page_keys_ms"] = 1e3 * chained(keys, n, repeats)
        ready = [keys(i) for i in range(n)]
        mx.eval(ready)
        top = mx.compile(lambda k: quest.top_pages(k, n_sel))
        out["top_k_ms"] = 1e3 * chained(lambda i: top(ready[i]), n, repeats)
        if quest.top_kernel_usable(ready[0].shape[1], n_sel):
            from qwen38_backend.kernels import top_select

            top_kernel = lambda i: top_select.top_ids(ready[i], n_sel)  # noqa: E731
            out["top_k_kernel_ms"] = 1e3 * chained(top_kernel, n, repeats)
    return out


def measure(model, state, logits, args, length: int) -> dict:
    """The decode modes and the selection pieces at this state's depth."""
    state.save_point()
    stores = attention_layers(state)

    def quest():
        return decode(model, state, logits, args.decode)

    def fixed():
        with FixedSelection():
            return decode(model, state, logits, args.decode)

    def dense():
        budgets = [s.budget_pages for s in stores]
        for s in stores:
            s.budget_pages = 1 << 30
        try:
            return decode(model, state, logits, args.decode)
        finally:
            for s, b in zip(stores, budgets, strict=True):
                s.budget_pages = b

    def dense_fma():  # dense through the decode attention kernel's fp32-FMA form
        from qwen38_backend.kernels import decode_attention

        decode_attention.TENSOR_CORES = False
        try:
            return dense()
        finally:
            decode_attention.TENSOR_CORES = True

    def quest_op_topk():  # Quest with its top-k as compiled ops (kernels/top_select.py off)
        from qwen38_backend.kernel_import import kernel_module

        kernel = kernel_module("top_select")
        os.environ["QWEN38_QUEST_TOP_KERNEL"] = "off"
        if kernel is not None:
            kernel.top_available.cache_clear()
        try:
            return decode(model, state, logits, args.decode)
        finally:
            os.environ.pop("QWEN38_QUEST_TOP_KERNEL")
            if kernel is not None:
                kernel.top_available.cache_clear()

    modes = {"quest": quest, "quest_op_topk": quest_op_topk, "fixed": fixed}
    if length <= args.dense_max:
        modes["dense"] = dense
        if args.fma:
            modes["dense_fma"] = dense_fma
    row = {}
    rates = {name: [] for name in modes}
    for _ in range(args.runs):  # the modes take turns: a drift within the call spreads over all
        for name, fn in modes.items():
            rates[name].append(fn())
    for name in modes:
        row[f"{name}_tok_s"] = statistics.median(rates[name])
        row[f"{name}_runs"] = rates[name]
    row["select_cost_ms_per_token"] = 1e3 * (1 / row["quest_tok_s"] - 1 / row["fixed_tok_s"])
    row["selection"] = selection_parts(stores[0], args.chain, args.runs * 3)
    row["selection"]["all_layers_ms"] = len(stores) * row["selection"]["select_ms"]
    return row


def read_bytes(config: dict, weights_bytes: int, length: int, state, bound: float, row: dict):
    """Bytes a token reads in each mode and its tok/s as a fraction of the bandwidth bound:
    dense the whole KV; Quest the selected rows (`--budget`) and every page's metadata."""
    stores = attention_layers(state)
    selected = min(length, stores[0].budget_pages * stores[0].page_tokens)
    meta = sum(2 * s.kmax[:, : s.selection_size()[0]].nbytes for s in stores)
    sparse = bytes_per_token(config, weights_bytes, selected, 2)
    out = {
        "bytes_per_token": {
            "dense": bytes_per_token(config, weights_bytes, length, 2),
            "fixed": sparse,
            "quest": sparse + meta,
        }
    }
    out["bytes_per_token"]["dense_fma"] = out["bytes_per_token"]["dense"]
    for mode, nbytes in out["bytes_per_token"].items():
        if f"{mode}_tok_s" in row:
            out[f"{mode}_fraction_of_bound"] = row[f"{mode}_tok_s"] * nbytes / bound
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny"])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--lengths", default="4096,32768,131072")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--dense-max", type=int, default=131072)
    ap.add_argument("--chain", type=int, default=16, help="selection calls queued at once")
    ap.add_argument(
        "--fma", action="store_true", help="also dense with the attention kernel's FMA form"
    )
    ap.add_argument("--bound-gbps", type=float, default=4800.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import mlx.core as mx

    model, config, weights_bytes = random_model(args.dims, args.layers, "bfloat16")
    vocab = config["text_config"]["vocab_size"]
    result = {
        "device": str(mx.default_device()),
        "dims": args.dims,
        "layers": args.layers,
        "budget": args.budget,
        "weights_bytes": weights_bytes,
        "runs": args.runs,
        "decode_tokens": args.decode,
        "settings": settings(),
        "lengths": {},
    }
    warm = model.new_state(kv_paged="on", kv_topk=args.budget)
    mx.eval(model.prefill(prompt(2048, vocab), warm))
    del warm
    for length in (int(x) for x in args.lengths.split(",")):
        mx.clear_cache()
        mx.reset_peak_memory()
        state = model.new_state(kv_paged="on", kv_topk=args.budget)
        logits, seconds = timed_prefill(model, prompt(length, vocab), state)
        row = {
            "prefill_tok_s": length / seconds,
            "prefill_peak_bytes": mx.get_peak_memory(),
            "kv_bytes": state.nbytes(),
        }
        row.update(measure(model, state, logits, args, length))
        row.update(read_bytes(config, weights_bytes, length, state, args.bound_gbps * 1e9, row))
        # a length given twice (e.g. 32768 after 131072: its prefill without first traces)
        key = str(length) if str(length) not in result["lengths"] else f"{length}_again"
        result["lengths"][key] = row
        print(json.dumps({key: row}), flush=True)
        write_json(result, args.out)  # after each length: a call cut off keeps the rest
        del state, logits


if __name__ == "__main__":
    main()
