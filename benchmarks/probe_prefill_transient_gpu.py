"""What a prefill chunk holds above weights + KV at depth, and which layer holds it.

    python benchmarks/probe_prefill_transient_gpu.py --layers 8 --depths 32768,131072,262144

Qwen3.8-27B dims (random bf16, bench_gpu_27b.random_model), paged KV, a few layers (the
transient of a chunk is per layer, not per model: the layers run one or two at a time). The
state is prefilled to each depth with the engine's prefill; then one more chunk is run for
every (chunk, layers ahead) pair and cut back (a save point), measuring the peak above what
was resident before it (after a reset) and the chunk's time. With `ahead` 0 each layer is
waited for, and the peak of every layer is recorded alone (`layers`): what one Gated
DeltaNet block and one attention block hold at that depth.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_27b import prompt, random_model  # noqa: E402
from common import write_json  # noqa: E402


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny"])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--depths", type=ints, default=[32768, 131072, 262144])
    ap.add_argument("--chunks", type=ints, default=[1024, 2048])
    ap.add_argument("--ahead", type=ints, default=[0, 1])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import mlx.core as mx

    from qwen38_backend import state as state_module
    from qwen38_backend.engine import state_arrays
    from qwen38_backend.kv.paged import prefilling

    model, config, weights_bytes = random_model(args.dims, args.layers, args.dtype)
    end = max(args.depths) + max(args.chunks)
    ids = prompt(end, config["text_config"]["vocab_size"])
    state = model.new_state(kv_paged="on")
    kinds = config["text_config"]["layer_types"]
    rows: list[dict] = []

    def run_chunk(depth: int, chunk: int, ahead: int) -> dict:
        per_layer: list[dict] = []
        built = state.layer_built

        def traced(index, out, n_rows, eager):
            built(index, out, n_rows, eager)
            if ahead == 0:  # layer_built waited for this layer: its peak is its own
                mx.synchronize()
                per_layer.append(
                    {"layer": index, "kind": kinds[index], "over": mx.get_peak_memory() - start}
                )
                mx.reset_peak_memory()

        state_module.PREFILL_LAYERS_AHEAD = ahead
        state.layer_built = traced
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        start = before = mx.get_active_memory()
        t = time.perf_counter()
        with prefilling():
            logits = model.forward(ids[depth : depth + chunk], state, last_only=True)
        mx.eval(logits, *state_arrays(state))
        mx.synchronize()
        seconds = time.perf_counter() - t
        del state.layer_built
        over = max([mx.get_peak_memory() - before] + [r["over"] for r in per_layer])
        state.truncate(depth)
        return {
            "depth": depth,
            "chunk": chunk,
            "ahead": ahead,
            "over_bytes": over,
            "over_per_chunk_token": over / chunk,
            "seconds": seconds,
            "tok_s": chunk / seconds,
            "layers": per_layer,
        }

    for depth in sorted(args.depths):
        if state.offset < depth:
            model.prefill(ids[state.offset : depth], state, then=end - depth)
        mx.eval(*state_arrays(state))
        state.save_point()
        for chunk in args.chunks:
            for ahead in args.ahead:
                run_chunk(depth, chunk, ahead)  # warm-up: compiles for this shape
                rows.append(run_chunk(depth, chunk, ahead))
                r = rows[-1]
                print(
                    f"depth {depth} chunk {chunk} ahead {ahead}: "
                    f"{r['over_bytes'] / 2**30:.2f} GiB over, {r['tok_s']:.0f} tok/s",
                    flush=True,
                )
    state_module.PREFILL_LAYERS_AHEAD = 1
    write_json(
        {
            "dims": args.dims,
            "layers": args.layers,
            "weights_bytes": weights_bytes,
            "state_bytes": state.nbytes(),
            "rows": rows,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
