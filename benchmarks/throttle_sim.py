"""The drafting throttle on a simulated stream (issue 13): which windowing loses least.

    python benchmarks/throttle_sim.py --out benchmarks/results/cpu/throttle_sim.json

A stream of `--tokens` tokens where each draft token agrees with probability p (independent,
as the H200 oracle benchmark draws them: bench_verify_gpu.py), k drafts per round, a round of
T rows costing speculative.verify_cost(T, gpu=True) plain steps and a paused step one.
Decoded tokens per step spent, relative to plain decoding, for the throttle as it is
(speculative.Throttle: windows of WINDOW rounds apart), its earlier forms (windows of 4
rounds; a sliding window deciding after every round; no cap or no reset of the pause) and
no throttle at all: per rule the best fixed k per p and k chosen each round by
speculative.DraftLength (`draft_length_speedup`), mean over `--seeds` streams.
No model runs: this measures the rule, not the engine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from qwen38_backend import speculative  # noqa: E402
from qwen38_backend.speculative import (  # noqa: E402
    FIRST_PAUSE,
    WINDOW,
    DraftLength,
    Throttle,
    verify_cost,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json  # noqa: E402


class SlidingThrottle(Throttle):
    """The previous rule: after every round, pause when the last WINDOW rounds gained
    nothing."""

    def record(self, n: int, gain: float) -> None:
        self.gains = (self.gains + [gain])[-self.window :]
        if len(self.gains) == self.window and sum(self.gains) <= 0:
            self.resume_at = n + self.pause
            self.pause *= 2
            self.pauses += 1
            self.gains = []


class FourRoundThrottle(Throttle):
    """The rule before session 16: a decision every 4 rounds."""

    window = 4


class NeverThrottle(Throttle):
    """No throttle: drafting never pauses (the ceiling for a stream that wins on average)."""

    def record(self, n: int, gain: float) -> None:
        pass


class UncappedThrottle(Throttle):
    """Reset after a winning window, but no cap on the doubling."""

    max_pause = None


class NoResetThrottle(Throttle):
    """The rule before session 10: the pause doubles for the rest of the stream, whatever
    the windows in between gained."""

    max_pause = None
    reset_after_gain = False


def agreement(spec: str, phase: int) -> Callable[[int], float]:
    """p at token n: "0.65" everywhere, or "0.2/0.9" alternating every `phase` tokens (prose
    between copied spans)."""
    values = [float(v) for v in spec.split("/")]
    return lambda n: values[(n // phase) % len(values)]


def speedup(
    rule: type[Throttle],
    p: Callable[[int], float],
    k: int,
    tokens: int,
    seed: int,
    adaptive: bool = False,
) -> float:
    """Tokens per step spent; `adaptive`: each round drafts DraftLength's k (at most k)."""
    rng, throttle, n, spent = random.Random(seed), rule(), 0, 0.0
    length = DraftLength(k, lambda j: verify_cost(j + 1, gpu=True))
    while n < tokens:
        if not throttle.allows(n):
            n, spent = n + 1, spent + 1.0
            continue
        drafted = length.next() if adaptive else k
        cost = verify_cost(drafted + 1, gpu=True)
        accepted = 0
        while accepted < drafted and rng.random() < p(n + accepted):
            accepted += 1
        throttle.record(n, accepted + 1 - cost)
        length.record(drafted, accepted)
        n, spent = n + accepted + 1, spent + cost
    return tokens / spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument(
        "--p",
        default="0.2,0.35,0.5,0.65,0.8,0.9,0.2/0.9,0.35/0.8",
        help="agreement per stream: p, or a/b alternating every --phase tokens",
    )
    ap.add_argument("--phase", type=int, default=64)
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--seeds", type=int, default=400)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rules = {
        "windows_apart": Throttle,
        "windows_of_4": FourRoundThrottle,
        "never": NeverThrottle,
        "uncapped": UncappedThrottle,
        "no_reset": NoResetThrottle,
        "sliding": SlidingThrottle,
    }
    out: dict = {
        "window": WINDOW,
        "first_pause": FIRST_PAUSE,
        "round_cost": {str(r): verify_cost(r, gpu=True) for r in range(2, args.max_k + 2)},
        "tokens": args.tokens,
        "phase": args.phase,
        "seeds": args.seeds,
        "by_p": {},
    }
    for spec in args.p.split(","):
        p = agreement(spec, args.phase)
        row = {}
        for name, rule in rules.items():
            by_k = {
                k: statistics.mean(speedup(rule, p, k, args.tokens, s) for s in range(args.seeds))
                for k in range(1, args.max_k + 1)
            }
            best = max(by_k, key=by_k.get)
            adaptive = statistics.mean(
                speedup(rule, p, args.max_k, args.tokens, s, adaptive=True)
                for s in range(args.seeds)
            )
            row[name] = {
                "best_k": best,
                "speedup": by_k[best],
                "by_k": by_k,
                "draft_length_speedup": adaptive,  # k chosen by DraftLength, at most max_k
            }
        out["by_p"][spec] = row
    out["module"] = speculative.__file__
    write_json(out, args.out)


if __name__ == "__main__":
    main()
