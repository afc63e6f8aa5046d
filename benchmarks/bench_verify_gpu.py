"""What a speculative round costs on the device: one verify forward of k+1 positions vs one
plain decode step, Qwen3.8-27B dims (random weights), and whether verify rows equal plain steps.

    python benchmarks/bench_verify_gpu.py --layers 64 --context 4096 --out verify.json

At `--context` tokens of prefilled state: the median time of a plain step (1 position) and
of a verify forward of k+1 positions for k = 1..--max-k (each forward rewound through a save
point and repeated `--runs` times). From those measured costs, the tokens per second a round
of k drafts gives when each draft token agrees with probability p (an oracle draft: no
drafting cost; expected tokens per round (1 - p^(k+1)) / (1 - p)), for p in --p, and the
best k per p, as a ratio to plain decoding.
Identity: the logits of each row of a k+1-position forward against the plain steps through
the same tokens (max |difference|, argmax agreement): on CUDA a matmul row is not computed
the same way for 1 row and for several, which is what keeps drafting off there unless
rows are identical. `--dims tiny --layers 4` smoke-tests it on a CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_27b import prompt, random_model  # noqa: E402
from common import write_json  # noqa: E402


def timed_forward(model, state, ids: list[int]) -> tuple[float, object]:
    import mlx.core as mx

    offset = state.offset
    state.save_point()
    mx.synchronize()
    t = time.perf_counter()
    logits = model.forward(ids, state)
    mx.eval(logits)
    mx.synchronize()
    seconds = time.perf_counter() - t
    state.truncate(offset)
    state.drop_save_points()
    return seconds, logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny"])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--p", default="0.5,0.65,0.8,0.9")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import mlx.core as mx
    import numpy as np

    model, config, nbytes = random_model(args.dims, args.layers, args.dtype)
    vocab = config["text_config"]["vocab_size"]
    state = model.new_state()
    mx.eval(model.prefill(prompt(args.context, vocab), state))
    draft = prompt(args.max_k + 1, vocab)
    costs: dict[int, float] = {}
    for k in range(0, args.max_k + 1):
        timed_forward(model, state, draft[: k + 1])  # warm (compiles this width)
        runs = [timed_forward(model, state, draft[: k + 1])[0] for _ in range(args.runs)]
        costs[k] = statistics.median(runs)
    plain = costs[0]
    result = {
        "dims": args.dims,
        "layers": args.layers,
        "dtype": args.dtype,
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "context": args.context,
        "weights_bytes": nbytes,
        "plain_step_ms": plain * 1e3,
        "verify_ms": {str(k + 1): costs[k] * 1e3 for k in range(1, args.max_k + 1)},
        "verify_over_plain": {str(k + 1): costs[k] / plain for k in range(1, args.max_k + 1)},
        "oracle": {},
    }
    for p in (float(x) for x in args.p.split(",")):
        rates = {}
        for k in range(1, args.max_k + 1):
            tokens = (1 - p ** (k + 1)) / (1 - p)
            rates[str(k)] = tokens / costs[k] * plain  # as a ratio to plain decoding
        best = max(rates, key=rates.get)
        result["oracle"][str(p)] = {
            "speedup_by_k": rates,
            "best_k": int(best),
            "best_speedup": rates[best],
            "best_tok_s": rates[best] / plain,
        }
    # identity: rows of one (k+1)-position forward vs k+1 plain steps through the same tokens
    _, rows = timed_forward(model, state, draft)
    steps = []
    offset = state.offset
    state.save_point()
    for t in draft:
        steps.append(model.forward([t], state))
    mx.eval(steps)
    state.truncate(offset)
    a = np.array(rows.astype(mx.float32))
    b = np.concatenate([np.array(s.astype(mx.float32)) for s in steps])
    result["identity"] = {
        "rows": len(draft),
        "max_abs_logit_diff": float(np.abs(a - b).max()),
        "max_abs_logit": float(np.abs(b).max()),
        "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).mean()),
        "identical": bool(np.array_equal(a, b)),
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
