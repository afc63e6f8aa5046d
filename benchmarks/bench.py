"""Prefill and decode speed of a model at given prompt lengths, with mlx-lm beside it.

    python benchmarks/bench.py --model qwen38-demo --lengths 128,1024 --decode 64 --runs 3 \
        --peer mlx-lm --out bench.json

Reports tokens/s (median of runs), peak memory, bytes a decoded token must read (weights it
touches + the KV at that depth) and the achieved bandwidth as a fraction of the bound.
For speed on CPU preload OpenBLAS:
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from common import (
    environment,
    median_of,
    mlx_lm_decode_tok_s,
    mlx_lm_prefill_tok_s,
    peak_bandwidth,
    write_json,
)
from mlx.utils import tree_flatten

import qwen38_backend


def prompt_ids(vocab: int, length: int, seed: int = 0) -> list[int]:
    # ids from the lower vocabulary: ordinary tokens, never the special ones at the top
    rng = np.random.default_rng(seed)
    return rng.integers(100, min(vocab, 32000) - 100, size=length).tolist()


def decode_bytes(model, depth: int) -> int:
    """Bytes one decode step reads: every weight except the embedding rows not looked up,
    plus K and V of every attention layer at `depth` tokens."""
    total = 0
    for name, w in tree_flatten(model.net.parameters()):
        if "embed_tokens" in name and not getattr(model.config, "tie_word_embeddings", False):
            total += w.nbytes // w.shape[0]  # one row
        else:
            total += w.nbytes
    state = model.new_state()
    kv_layers = sum(1 for layer in state.layers if hasattr(layer, "attend"))
    cfg = model.config
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * mx.float32.size
    if model.dtype != mx.float32:
        per_token = per_token // 2
    return total + kv_layers * per_token * depth


def bench_ours(model, length: int, decode: int, runs: int) -> dict:
    ids = prompt_ids(model.config.vocab_size, length)

    def prefill() -> float:
        state = model.new_state()
        t = time.perf_counter()
        logits = model.prefill(ids, state)
        mx.eval(logits)
        return length / (time.perf_counter() - t)

    def dec() -> float:
        stream = model.generate_tokens(ids, max_tokens=decode, stop_token_ids=[])
        for _ in stream:
            pass
        return stream.stats.decode_tokens_per_second

    mx.reset_peak_memory()
    result = {"prefill_tok_s": median_of(runs, prefill), "decode_tok_s": median_of(runs, dec)}
    result["peak_memory_bytes"] = mx.get_peak_memory()
    return result


def export_for_mlx_lm(model, directory: Path) -> Path:
    """Write the weights in the MLX/HF layout mlx-lm reads, with the same numerics as ours:
    dequantized fp32 when our model runs dequantized (CPU), else as stored."""
    import json

    from qwen38_backend.loading import read_weights
    from qwen38_backend.models.assign import dequantize_all

    # the loaded model consumed its weights' tensors: read them again (lazily)
    read = read_weights(model.weights.source, tokenizer=False)
    weights, quantization = read.tensors, read.quantization
    packed = any("Quantized" in type(m).__name__ for _, m in model.net.named_modules())
    if quantization and not packed:
        weights, quantization = dequantize_all(weights, quantization, model.dtype), {}
    weights = {
        k: (v.astype(model.dtype) if v.dtype in (mx.float16, mx.bfloat16, mx.float32) else v)
        for k, v in weights.items()
    }
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    config = dict(read.config)
    if quantization:
        gs = {g for g, _ in quantization.values()}
        quant: dict = {"group_size": gs.pop(), "bits": 4}
        for module, (g, b) in quantization.items():
            quant[module] = {"group_size": g, "bits": b}
        config["quantization"] = quant
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def bench_mlx_lm(model_dir: Path, vocab: int, length: int, decode: int, runs: int) -> dict:
    from mlx_lm.utils import load_model

    peer, _ = load_model(model_dir)
    ids = prompt_ids(vocab, length)
    return {
        "prefill_tok_s": median_of(runs, lambda: mlx_lm_prefill_tok_s(peer, ids)),
        "decode_tok_s": median_of(runs, lambda: mlx_lm_decode_tok_s(peer, ids, decode)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="qwen38-demo")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--lengths", default="128,1024")
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--peer", choices=["mlx-lm", "none"], default="mlx-lm")
    ap.add_argument("--peak-gbps", type=float, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    model = qwen38_backend.load(args.model, dtype=args.dtype)
    bound, bound_source = peak_bandwidth(args.peak_gbps)
    result = {
        "benchmark": "prefill/decode",
        "model": args.model,
        "dtype": str(model.dtype),
        "environment": environment(),
        "bandwidth_bound_bytes_s": bound,
        "bandwidth_bound_source": bound_source,
        "lengths": {},
    }
    peer_dir = None
    if args.peer == "mlx-lm":
        peer_dir = Path(tempfile.mkdtemp(prefix="qwen38-peer-"))
        export_for_mlx_lm(model, peer_dir)
    for length in [int(x) for x in args.lengths.split(",")]:
        ours = bench_ours(model, length, args.decode, args.runs)
        per_token = decode_bytes(model, length + args.decode // 2)
        achieved = per_token * ours["decode_tok_s"]["median"]
        ours["bytes_per_decoded_token"] = per_token
        ours["achieved_bandwidth_bytes_s"] = achieved
        ours["fraction_of_bound"] = achieved / bound
        entry = {"ours": ours}
        if peer_dir is not None:
            peer = bench_mlx_lm(peer_dir, model.config.vocab_size, length, args.decode, args.runs)
            entry["mlx_lm"] = peer
            entry["decode_ratio_vs_mlx_lm"] = (
                ours["decode_tok_s"]["median"] / peer["decode_tok_s"]["median"]
            )
            entry["prefill_ratio_vs_mlx_lm"] = (
                ours["prefill_tok_s"]["median"] / peer["prefill_tok_s"]["median"]
            )
        result["lengths"][str(length)] = entry
    write_json(result, args.out)


if __name__ == "__main__":
    main()
