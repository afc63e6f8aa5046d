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
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import numpy as np  # noqa: E402
from bench_gpu_27b import prompt, random_model  # noqa: E402
from common import WaitClock, write_json  # noqa: E402


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


@contextlib.contextmanager
def one_row_products():
    """Inside: MLX's own few-row products, unpadded (not row-exact on a GPU)."""
    from qwen38_backend.kernels import rows_matmul

    saved = {k: os.environ.get(k) for k in ("QWEN38_PAD_ROWS", "QWEN38_ROWS_KERNEL")}
    os.environ.update(QWEN38_PAD_ROWS="1", QWEN38_ROWS_KERNEL="off")
    rows_matmul.available.cache_clear()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        rows_matmul.available.cache_clear()


def clocked(decode, **options) -> dict:
    """One decode with a WaitClock from its first token on (the prompt's prefill is not
    counted): per forward, the waits in mx.eval (a round's read-back; a plain step waits in
    .item(), counted in other_ms), hand-overs and the rest."""
    clock = WaitClock()
    tokens, stats, speed = decode(clock=clock, **options)
    forwards = stats.forwards or len(tokens) - 1  # plain decoding counts no forwards
    return {"forwards": forwards, **clock.split((len(tokens) - 1) / speed, forwards)}


def end_to_end(model, ids: list[int], args, vocab: int) -> dict:
    """Real rounds through the engine (sampler, rollback, throttle included): greedy decode of
    --e2e tokens after the prompt, plain vs n-gram rounds whose drafts are the plain stream
    with each token kept with probability p (an oracle draft), for k = 1..--max-k. Decode
    tok/s from the first token on, median of --e2e-runs; tokens must equal plain. Per p the
    plain runs are interleaved with the drafted ones and `speedup` is against their median
    (`speedup_vs_first_plain`: against the plain runs made first, as before session 16).
    --profile-out: cProfile of one more drafted run at the first p and the last k."""
    from qwen38_backend import drafts

    def decode(clock=None, **options) -> tuple[list[int], object, float]:
        """Tokens, stats, and tok/s from the first token to the last (the prefill's tail and
        the first token's latency are not decode; nor are they in `clock`'s times)."""
        stream = model.generate_tokens(ids, max_tokens=args.e2e, stop_token_ids=[], **options)
        tokens = [next(stream)]
        with clock or contextlib.nullcontext():
            t = time.perf_counter()
            tokens += list(stream)
            seconds = time.perf_counter() - t
        return tokens, stream.stats, (len(tokens) - 1) / seconds

    def rate(**options) -> tuple[float, object, list[int]]:
        runs = [decode(**options) for _ in range(args.e2e_runs)]
        return statistics.median(r[2] for r in runs), runs[-1][1], runs[-1][0]

    if args.eager_layers:  # the same runs per hand-over stride (state.eager_layers)
        out = {}
        strides, args.eager_layers = args.eager_layers, None
        for stride in strides:
            os.environ["QWEN38_EAGER_LAYERS"] = str(stride)
            out[str(stride)] = end_to_end(model, ids, args, vocab)
        del os.environ["QWEN38_EAGER_LAYERS"]
        return {"by_eager_layers": out}
    plain_rate, _, plain = rate(draft="off")
    with one_row_products():
        one_row_rate = rate(draft="off")[0]
    out: dict = {
        "tokens": args.e2e,
        "plain_tok_s": plain_rate,
        "plain_one_row_products_tok_s": one_row_rate,
        "by_p": {},
    }
    real = drafts.NgramIndex.match
    try:
        for p in (float(x) for x in args.p.split(",")):
            rng = np.random.default_rng(0)

            def oracle(index, k, p=p, rng=rng):
                done = len(index.tokens) - len(ids)
                want = plain[done : done + k]
                return [t if rng.random() < p else (t + 1) % vocab for t in want], 3

            drafts.NgramIndex.match = oracle
            # plain runs interleaved with the drafted ones (a plain run, then one per k,
            # --e2e-runs times): drift of the device's speed over the run falls on both
            ks = range(1, args.max_k + 1)
            runs: dict = {"plain": [], **{k: [] for k in ks}}
            for _ in range(args.e2e_runs):
                runs["plain"].append(decode(draft="off"))
                for k in ks:
                    runs[k].append(decode(draft="ngram", draft_tokens=k))
            paired_plain = statistics.median(r[2] for r in runs["plain"])
            by_k = {}
            for k in ks:
                speed = statistics.median(r[2] for r in runs[k])
                tokens, stats, _ = runs[k][-1]
                by_k[str(k)] = {
                    "tok_s": speed,
                    "speedup": speed / paired_plain,
                    "speedup_vs_first_plain": speed / plain_rate,
                    "speedup_vs_one_row_products": speed / one_row_rate,
                    "acceptance": stats.accepted / max(stats.drafted, 1),
                    "forwards": stats.forwards,
                    # a forward's wall time (rounds and any plain steps between them): at
                    # p 1.0 every forward is a round of k + 1 rows
                    "ms_per_forward": 1e3 * (len(tokens) - 1) / speed / max(stats.forwards, 1),
                    "identical_to_plain": tokens == plain,
                }
            best = max(by_k, key=lambda k: by_k[k]["tok_s"])
            out["by_p"][str(p)] = {
                "plain_tok_s": paired_plain,
                "by_k": by_k,
                "best_k": int(best),
                **by_k[best],
            }
            if args.clock:
                row = out["by_p"][str(p)]
                row["clocked"] = clocked(decode, draft="ngram", draft_tokens=int(best))
        if args.clock:
            out["plain_clocked"] = clocked(decode, draft="off")
        if args.profile_out:
            import cProfile
            import pstats

            profile = cProfile.Profile()
            profile.enable()
            decode(draft="ngram", draft_tokens=args.max_k)
            profile.disable()
            with open(args.profile_out, "w") as f:
                pstats.Stats(profile, stream=f).sort_stats("tottime").print_stats(40)
    finally:
        drafts.NgramIndex.match = real
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny"])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--p", default="0.5,0.65,0.8,0.9")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bits", type=int, default=0, help="quantize the weights (0: none)")
    ap.add_argument("--e2e", type=int, default=0, help="tokens decoded end to end (0: skip)")
    ap.add_argument("--e2e-runs", type=int, default=3)
    ap.add_argument("--profile-out", default=None)
    ap.add_argument("--clock", action="store_true", help="per forward: waits, hand-overs, the rest")
    ap.add_argument(
        "--eager-layers",
        type=lambda v: [int(x) for x in v.split(",")],
        default=None,
        help="end to end once per verify hand-over stride (QWEN38_EAGER_LAYERS)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import mlx.core as mx

    from qwen38_backend.rows import kernel_dtype, pad_rows

    model, config, nbytes = random_model(args.dims, args.layers, args.dtype, bits=args.bits)
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
    kernel = kernel_dtype()  # before the comparison below switches it off
    # the plain step with MLX's one-row products (gemv, no row-invariant kernel, no padding):
    # a row-exact verify is not possible then; it is what plain decoding ran before rows.py
    with one_row_products():
        timed_forward(model, state, draft[:1])
        unpadded = statistics.median(
            timed_forward(model, state, draft[:1])[0] for _ in range(args.runs)
        )
    result = {
        "dims": args.dims,
        "layers": args.layers,
        "dtype": args.dtype,
        "bits": args.bits,
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "context": args.context,
        "weights_bytes": nbytes,
        "pad_rows": pad_rows(),
        "rows_kernel": str(kernel),
        "plain_step_ms": plain * 1e3,
        "plain_step_unpadded_ms": unpadded * 1e3,
        "verify_ms": {str(k + 1): costs[k] * 1e3 for k in range(1, args.max_k + 1)},
        "verify_over_plain": {str(k + 1): costs[k] / plain for k in range(1, args.max_k + 1)},
        "oracle": {},
    }
    for p in (float(x) for x in args.p.split(",")):
        rates = {}
        for k in range(1, args.max_k + 1):
            tokens = k + 1 if p == 1 else (1 - p ** (k + 1)) / (1 - p)
            rates[str(k)] = tokens / costs[k] * plain  # as a ratio to plain decoding
        best = max(rates, key=rates.get)
        result["oracle"][str(p)] = {
            "speedup_by_k": rates,
            "best_k": int(best),
            "best_speedup": rates[best],
            "best_speedup_vs_unpadded": rates[best] * unpadded / plain,
            "best_tok_s": rates[best] / plain,
        }
    if args.e2e:
        result["end_to_end"] = end_to_end(model, prompt(args.context, vocab), args, vocab)
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
