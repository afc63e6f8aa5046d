"""Where a decode step's host time goes, function by function (C++ frames of MLX included):
a 27B-dims decode (Flash-Next's with `--dims flash`: 4-bit experts) sampled by py-spy,
then summarised.

    py-spy record --native -r 200 -f raw -o raw.txt -- \
        python benchmarks/profile_host_gpu.py --layers 64 --tokens 500
    python benchmarks/profile_host_gpu.py --summarize raw.txt --out host_profile.json

The first command builds the model (random bf16 weights), prefills `--context` tokens,
decodes 16 untimed tokens, then `--tokens` more inside `profiled_decode` (greedy, as
generation decodes). The second keeps the samples taken inside `profiled_decode` and writes,
by frame: samples where it is the innermost frame (`self`), samples where it is on the
stack (`inclusive`), and the most frequent stacks (their last 12 frames). py-spy is not a
dependency of the project: on the H200 it travels as a wheel with MLX's (py-spy 0.4.3 ran
there as root, resolving libmlx.so's symbols). Sampling pauses the process, so the tok/s
printed is below a plain run's; the shares are what matter.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MARK = "profiled_decode"


def profiled_decode(model, state, logits, n: int) -> list[float]:
    """The stretch the summary keeps (its name marks the samples)."""
    from bench_gpu_27b import decode_times

    return decode_times(model, state, logits, n)


def run(args) -> None:
    import mlx.core as mx
    from bench_gpu_27b import decode_rate, decode_times, prompt, random_model

    if args.dims == "flash":
        from bench_qsa_depth import flash_model

        model, config = flash_model(args.layers, args.experts)
    else:
        model, config, _ = random_model(args.dims, args.layers, "bfloat16")
    state = model.new_state()
    logits = model.prefill(prompt(args.context, config["text_config"]["vocab_size"]), state)
    mx.eval(logits)
    decode_times(model, state, logits, 16)
    t = time.perf_counter()
    times = profiled_decode(model, state, logits, args.tokens)
    elapsed = time.perf_counter() - t
    print(f"decode {decode_rate(times):.1f} tok/s (sampled) over {elapsed:.1f} s", flush=True)


def summarize(raw: str, top: int = 250) -> dict:
    """py-spy's raw (collapsed) stacks -> the summary described in the module docstring."""
    own, inclusive, stacks = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    for line in Path(raw).read_text().splitlines():
        if MARK not in line:
            continue
        stack, count = line.rsplit(" ", 1)
        n = int(count)
        frames = [f[:160] for f in stack.split(";")]
        start = max(i for i, f in enumerate(frames) if MARK in f) + 1
        frames = frames[start:]
        total += n
        own[frames[-1] if frames else "(none)"] += n
        for frame in set(frames):
            inclusive[frame] += n
        stacks[";".join(frames[-12:])] += n
    return {
        "samples": total,
        "self": own.most_common(80),
        "inclusive": inclusive.most_common(top),
        "stacks": stacks.most_common(300),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny", "flash"])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--experts", type=int, default=512, help="--dims flash: experts per layer")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--summarize", default=None, help="a py-spy raw file of a run of this script")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.summarize is None:
        run(args)
        return
    result = summarize(args.summarize)
    print(f"{result['samples']} samples inside {MARK}", file=sys.stderr)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
