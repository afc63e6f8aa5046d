"""KV decode-cost benchmark (see DOC below) and helpers shared with passkey.py."""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from qwen38_backend.kv import ContiguousKV, PagedKV
from qwen38_backend.state import SequenceState, StateSnapshot

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def factory(mode: str, budget: int | None, page_tokens: int, sinks: int, recent: int):
    """'dense' = the contiguous store; 'paged' = paged, everything selected; 'quest' = budget."""
    if mode == "dense":
        return ContiguousKV
    tokens = 1 << 40 if mode == "paged" else int(budget)
    return functools.partial(
        PagedKV, page_tokens=page_tokens, budget=tokens, sinks=sinks, recent=recent
    )


def convert_snapshot(snap: StateSnapshot, state: SequenceState) -> StateSnapshot:
    """A paged snapshot re-shaped for the layers of `state` (contiguous stores take [1,H,L,D])."""
    layers = []
    for tensors, layer in zip(snap.layers, state.layers, strict=True):
        if isinstance(layer, ContiguousKV) and "page_table" in tensors:
            tensors = {"keys": tensors["keys"][None], "values": tensors["values"][None]}
        layers.append(tensors)
    return StateSnapshot(tokens=snap.tokens, layers=layers, extras=dict(snap.extras))


def state_from(net, snap: StateSnapshot, kv_factory) -> SequenceState:
    state = net.make_state(kv_factory=kv_factory)
    state.restore(convert_snapshot(snap, state))
    return state


def prefill(net, ids: list[int], state: SequenceState, chunk: int = 512) -> mx.array:
    logits = None
    for s in range(0, len(ids), chunk):
        part = ids[s : s + chunk]
        logits = net(mx.array(part, dtype=mx.int32), state, last_only=True)
        state.advance(part)
        mx.eval(logits, *[a for layer in state.layers for a in _arrays(layer)])
    return logits[-1]


def _arrays(layer) -> list[mx.array]:
    out = []
    for value in vars(layer).values():
        if isinstance(value, mx.array):
            out.append(value)
        elif hasattr(value, "k") and isinstance(getattr(value, "k", None), mx.array):
            out += [value.k, value.v]
    return out


def greedy(net, state: SequenceState, logits: mx.array, n: int) -> list[int]:
    out = []
    for _ in range(n):
        token = int(mx.argmax(logits).item())
        out.append(token)
        logits = net(mx.array([token], dtype=mx.int32), state, last_only=True)[-1]
        state.advance([token])
    return out


def environment() -> dict:
    return {
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor(),
    }


def write_json(path: str | None, data: dict) -> None:
    text = json.dumps(data, indent=2)
    if path:
        Path(path).write_text(text + "\n")
    print(text)


# ----- the decode-cost benchmark -----------------------------------------------------------
DOC = """Decode ms/token vs context: contiguous (dense), paged-dense and Quest at a token budget.

CPU, demo model, real prefill:
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
    python benchmarks/bench_kv.py --model qwen38-demo --contexts 1024,4096,8192 --budget 1024 \\
        --out bench_kv_cpu.json
GPU, 27B dimensions, random weights, a few layers, synthetic KV (no prefill):
    python benchmarks/bench_kv.py --random qwen3_5-27b --layers 8 --dtype bfloat16 \\
        --synthetic --contexts 4096,32768,131072 --budget 1024 --out bench_kv_gpu.json
"""


def random_net(kind: str, layers: int, vocab: int | None, dtype: mx.Dtype):
    """A randomly initialised model with 27B attention dims ('qwen3_5-27b' or 'dense-27b')."""
    from qwen38_backend.models import build_model

    if kind == "qwen3_5-27b":
        from qwen38_backend.testing.tiny_qwen3_5 import text_config

        tc = text_config("27b", layers)
        tc["mtp_num_hidden_layers"] = 0
        if vocab:
            tc["vocab_size"] = vocab
        config = {"model_type": "qwen3_5", "text_config": tc, "tie_word_embeddings": False}
    elif kind == "dense-27b":
        config = {
            "model_type": "qwen3",
            "vocab_size": vocab or 248320,
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": layers,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1e7,
            "max_position_embeddings": 262144,
            "tie_word_embeddings": False,
        }
    else:
        raise SystemExit(f"--random {kind!r}: choose qwen3_5-27b or dense-27b")
    net = build_model(config)
    net.set_dtype(dtype)
    mx.eval(net.parameters())
    return net


def fill_synthetic(net, length: int, kv_factory, dtype: mx.Dtype, seed: int = 0):
    """A state whose attention layers hold `length` random K/V rows (written in chunks)."""
    state = net.make_state(kv_factory=kv_factory)
    key = mx.random.key(seed)
    for layer in state.layers:
        if not hasattr(layer, "attend"):
            continue
        for start in range(0, length, 8192):
            n = min(8192, length - start)
            key, k1, k2 = mx.random.split(key, 3)
            hkv, d = _kv_dims(net)
            k = mx.random.normal((hkv, n, d), key=k1).astype(dtype)
            v = mx.random.normal((hkv, n, d), key=k2).astype(dtype)
            if isinstance(layer, PagedKV):
                layer.append(k, v)
            else:
                layer.append(k[None], v[None])
            mx.eval(*_arrays(layer))
    state.advance([0] * length)
    return state


def _kv_dims(net) -> tuple[int, int]:
    cfg = net.config
    return cfg.num_key_value_heads, cfg.head_dim


def time_decode(net, state, steps: int, warmup: int) -> tuple[float, dict]:
    from qwen38_backend.kv import collect_kv_stats

    token = mx.array([1], dtype=mx.int32)
    for _ in range(warmup):
        mx.eval(net(token, state, last_only=True))
        state.advance([1])
    for layer in state.layers:  # count only the timed steps
        if isinstance(layer, PagedKV):
            layer.stats = dict.fromkeys(layer.stats, 0)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = net(token, state, last_only=True)
        state.advance([1])
        mx.async_eval(logits)
    mx.eval(logits)
    ms = (time.perf_counter() - t0) * 1000 / steps
    kv = collect_kv_stats(state)
    kv["peak_memory_bytes"] = mx.get_peak_memory()
    return ms, kv


def bench_main() -> None:
    ap = argparse.ArgumentParser(description=DOC, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen38-demo", help="registry name or path")
    ap.add_argument("--random", help="qwen3_5-27b or dense-27b: random weights, 27B dims")
    ap.add_argument("--layers", type=int, default=8, help="layers of the random model")
    ap.add_argument("--vocab", type=int, help="vocab of the random model (default 248320)")
    ap.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--modes", default="dense,paged,quest")
    ap.add_argument("--page-tokens", type=int, default=32)
    ap.add_argument("--sinks", type=int, default=32)
    ap.add_argument("--recent", type=int, default=64)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per mode; the median counts")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--synthetic", action="store_true", help="random KV instead of a prefill")
    ap.add_argument("--profile-steps", type=int, default=8, help="steps timing the selection")
    ap.add_argument("--out")
    args = ap.parse_args()

    from qwen38_backend.models.assign import parse_dtype

    if args.random:
        dtype = parse_dtype(args.dtype or "float32", {})
        net, name = random_net(args.random, args.layers, args.vocab, dtype), args.random
    else:
        import qwen38_backend

        model = qwen38_backend.load(args.model, args.dtype)
        net, dtype, name = model.net, model.dtype, args.model
    modes = args.modes.split(",")
    kv = {m: factory(m, args.budget, args.page_tokens, args.sinks, args.recent) for m in modes}
    results = []
    for context in [int(c) for c in args.contexts.split(",")]:
        snap = None
        if not args.synthetic:  # one real prefill, restored into every store
            ids = np.random.default_rng(0).integers(100, 20000, size=context).tolist()
            state = net.make_state(kv_factory=kv.get("paged") or factory("paged", 0, 32, 0, 0))
            t0 = time.perf_counter()
            prefill(net, ids, state)
            prefill_s = time.perf_counter() - t0
            snap = state.snapshot()
            del state
        for mode in modes:
            if snap is None:
                state = fill_synthetic(net, context, kv[mode], dtype)
            else:
                state = state_from(net, snap, kv[mode])
            runs = [time_decode(net, state, args.steps, args.warmup) for _ in range(args.runs)]
            ms, stats = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
            row = {
                "context": context,
                "mode": mode,
                "ms_per_token": round(ms, 3),
                "ms_per_token_runs": [round(r[0], 3) for r in runs],
                "kv": stats,
            }
            if snap is not None:
                row["prefill_seconds"] = round(prefill_s, 2)
            if mode == "quest" and args.profile_steps:
                PagedKV.profile = True
                for layer in state.layers:
                    if isinstance(layer, PagedKV):
                        layer.profile = True
                _, prof = time_decode(net, state, args.profile_steps, 1)
                PagedKV.profile = False
                row["selection_time_share"] = prof.get("selection_time_share", 0.0)
                row["select_ms_per_token"] = round(
                    prof.get("select_seconds", 0) * 1000 / args.profile_steps, 3
                )
            results.append(row)
            print(f"context {context} {mode}: {ms:.2f} ms/token", flush=True)
            del state
            mx.clear_cache()
    write_json(
        args.out,
        {
            "benchmark": "bench_kv",
            "model": name,
            "dtype": str(dtype),
            "budget": args.budget,
            "page_tokens": args.page_tokens,
            "synthetic": args.synthetic,
            "steps": args.steps,
            "runs": args.runs,
            "results": results,
            "environment": environment(),
        },
    )


if __name__ == "__main__":
    bench_main()
