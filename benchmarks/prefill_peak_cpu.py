"""Peak memory of a prefill above weights + state, per chunk token (issue #12), on the CPU.

    nice -n 10 python benchmarks/prefill_peak_cpu.py --layers 8 --chunks 512,1024 --n 2 \
        --out benchmarks/results/cpu/prefill_peak_8layers.json

Qwen3.8-27B layer dims (hidden 5120, MLP 17408, Gated DeltaNet 16/48 heads of 128, attention
24/4 heads of 256) with `--layers` layers (3 Gated DeltaNet then 1 full attention, repeated) and
a small vocabulary (the embedding and head are not what a chunk's activations depend on),
random fp32 weights generated here. Per chunk size: prefill `--n` chunks into a fresh state
(after a warm-up), mx.get_peak_memory() after a reset, less what was resident before (the
weights) and the state's bytes after (KV at its allocated capacity, Gated DeltaNet state):
the transient a chunk needs, reported in bytes per chunk token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402,F401  (the system OpenBLAS before MLX: fp32 matmuls)
from bench_gpu_27b import random_weights  # noqa: E402


def build(layers: int, dtype_name: str, vocab: int):
    import mlx.core as mx
    from mlx.utils import tree_unflatten

    from qwen38_backend.engine import Model
    from qwen38_backend.loading import Weights
    from qwen38_backend.models import build_model
    from qwen38_backend.models.layers import fuse_projections
    from qwen38_backend.testing.tiny_qwen3_5 import tensor_shapes, text_config

    tc = text_config("27b", layers, vocab_size=vocab, mtp_num_hidden_layers=0)
    config = {"model_type": "qwen3_5", "text_config": tc, "tie_word_embeddings": False}
    net = build_model(config)
    weights = net.sanitize(
        random_weights(tensor_shapes(tc, with_mtp=False), getattr(mx, dtype_name))
    )
    nbytes = sum(w.nbytes for w in weights.values())
    net.update(tree_unflatten(list(weights.items())))
    del weights
    fuse_projections(net)
    read = Weights(config=config, tensors={}, quantization={}, generation_config={})
    return Model(net, read, getattr(mx, dtype_name), name="27b-dims"), nbytes


def state_capacity_bytes(state) -> int:
    """Bytes the state's arrays hold (KV at its allocated capacity, not just its length)."""
    from qwen38_backend.engine import state_arrays

    seen, total = set(), 0
    for a in state_arrays(state):
        if id(a) not in seen:
            seen.add(id(a))
            total += a.nbytes
    return total


def measure(model, chunk: int, n: int, vocab: int, kv: dict) -> dict:
    import mlx.core as mx
    import numpy as np

    ids = np.random.default_rng(0).integers(1, vocab, size=chunk * n).tolist()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    state = model.new_state(**kv)
    t = time.perf_counter()
    logits = model.prefill(ids, state, chunk=chunk)
    mx.eval(logits)
    seconds = time.perf_counter() - t
    peak = mx.get_peak_memory()
    held = state_capacity_bytes(state)
    extra = peak - base - held
    return {
        "tokens": chunk * n,
        "prefill_seconds": seconds,
        "peak_bytes": peak,
        "resident_before_bytes": base,
        "state_nbytes": state.nbytes(),
        "state_capacity_bytes": held,
        "extra_bytes": extra,
        "extra_bytes_per_chunk_token": extra / chunk,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--chunks", default="512,1024")
    ap.add_argument("--n", type=int, default=2, help="chunks per prefill")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--paged", action="store_true", help="kv_paged=on (the GPU benchmark's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import mlx.core as mx

    model, weights_bytes = build(args.layers, args.dtype, args.vocab)
    kv = {"kv_paged": "on"} if args.paged else {}
    warm = model.new_state(**kv)
    mx.eval(model.prefill(list(range(1, 65)), warm, chunk=64))
    del warm
    import qwen38_backend

    result = {
        "package": str(Path(qwen38_backend.__file__).parent),
        "device": str(mx.default_device()),
        "layers": args.layers,
        "dtype": args.dtype,
        "vocab": args.vocab,
        "weights_bytes": weights_bytes,
        "kv_options": kv,
        "chunks": {},
    }
    for chunk in (int(c) for c in args.chunks.split(",")):
        row = measure(model, chunk, args.n, args.vocab, kv)
        result["chunks"][str(chunk)] = row
        print(json.dumps({chunk: row}), flush=True)
    result["command"] = "python " + " ".join(sys.argv)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
