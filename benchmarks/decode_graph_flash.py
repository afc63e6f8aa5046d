"""Flash-Next (qwen4_exp) decode step: its graph by layer part, and the host time to build it.

    python benchmarks/decode_graph_flash.py --layers 4 --depth 2112 --experts-bits 4 \
        --out benchmarks/results/cpu/decode_graph_flash.json

Builds a reduced-width Flash-Next (bench_qsa_depth.flash_config, random weights; 4 layers =
Gated DeltaNet, Gated DeltaNet + PLE, Gated DeltaNet, QSA), prefills --depth tokens (past the
QSA dense threshold of indexer_budget + ratio - 1 = 2,051 tokens, so decode takes the sparse
path) and, for each mode (the compiled decode steps; op by op), from the same state:

- host_build_ms: the time Model.forward takes to BUILD one decode step's graph (no
  evaluation; median over --steps steps, each evaluated untimed afterwards) plus the greedy
  argmax: on a GPU, roughly the host time per token that nothing overlaps; by layer kind:
  one layer's share (median over a second run of --steps steps, each layer call timed);
  BLAS runs on one thread here (OPENBLAS_NUM_THREADS, unless set): the spinning threads of
  the previous evaluation would otherwise be measured;
- the step's graph (mx.export_to_dot over the logits, the greedy token and every state array
  the step wrote; the mean over --count-steps steps, 4: one QSA block pooled) by part: each
  node is attributed to the first part whose output reaches it.
  Parts: embed; per layer ple, attn_hc / mlp_hc (the hyper-connection mixes around the mixer
  / the MoE), mixer (Gated DeltaNet, or what QSA runs besides qsa_index / qsa_qkv /
  qsa_select / qsa_gather), moe, state (state writes no output reads yet, e.g. QSA's raw
  indexer keys); head_hc (the final mixer read), lm_head, sampling (argmax). A compiled
  piece counts as a whole under its method's name (in this tree: _linear_step = a whole
  Gated DeltaNet layer; _attention_in / _attention_out = QSA's layer before its state writes
  and after its attention (MoE included); pool (QSA's block pooling); mix (PLE); read (the
  final mixer)), and "<name> inputs" is what its inputs needed that no part claimed yet.
  Per layer kind the figures are per layer.

"nodes" are primitives; "kernels" leaves out views (Reshape, Slice, Broadcast, ...), an
estimate of the launches on a GPU, where MLX launches one kernel per primitive and an
mx.compile'd elementwise chain is one "Compiled" node. On this CPU mx.fast.rms_norm, rope and
scaled_dot_product_attention are decomposed into their elementwise ops (on a GPU each is one
kernel), so the CPU counts run higher than a GPU's for the same step. The modes' greedy
tokens and last logits (sha256) are compared ("same_tokens", "same_logits").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

# One BLAS thread: on a small CPU the threads of the last evaluation spin on the cores for a
# while and triple the measured build time of the next step (a GPU host has no such threads).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_qsa_depth import flash_config, greedy, prompt, random_model, sha  # noqa: E402
from common import environment, write_json  # noqa: E402
from decode_graph_ops import split_ops, summary  # noqa: E402

_MISSING = object()


class Recorder:
    """Attributes graph nodes to parts: `mark(part, arrays)` claims every node the arrays
    reach that no earlier mark claimed (counted once the step is built: `parts()`)."""

    def __init__(self) -> None:
        self.marks: list[tuple[int | None, str, list]] = []
        self.layer: int | None = None
        self.active = False

    def mark(self, part: str, arrays) -> None:
        if self.active:  # off while timing, and while mx.compile traces a hooked method
            self.marks.append((self.layer, part, list(arrays)))

    def parts(self) -> dict[tuple[int | None, str], Counter]:
        out: dict[tuple[int | None, str], Counter] = defaultdict(Counter)
        for (layer, part, _), ops in zip(
            self.marks, split_ops([a for *_, a in self.marks]), strict=True
        ):
            out[(layer, part)].update(ops)
        return out


def layer_arrays(layer_state) -> list:
    from qwen38_backend.engine import state_arrays

    return state_arrays(SimpleNamespace(layers=[layer_state]))


@contextmanager
def hooks(net, rec: Recorder):
    """Wrap the decode path's pieces so each marks its outputs; undone on exit. Hooks inside
    a compiled step's trace never see real arrays: marks are only taken while `rec.active`,
    after the warm-up traced the steps (a compiled step is marked as a whole, by its name)."""
    from qwen38_backend.kv import PagedKV
    from qwen38_backend.kv.contiguous import ContiguousKV
    from qwen38_backend.models import qsa
    from qwen38_backend.models.hyper_connections import GatedResidual
    from qwen38_backend.models.ple import PLELayer
    from qwen38_backend.models.qsa import QSAAttention
    from qwen38_backend.models.qwen4_exp import Qwen4ExpBlock

    blocks = net.model.layers
    index = {id(b): i for i, b in enumerate(blocks)}
    roles = {}
    for b in blocks:
        roles[id(b.attn_hyper_connection)] = ("attn_hc", "mixer")
        roles[id(b.mlp_hyper_connection)] = ("mlp_hc", "moe")

    def block_call(real):
        def call(self, R, ids, st, offset, unclosed=()):
            rec.layer = None
            rec.mark("embed", [R])  # claims nodes only before the first layer
            rec.layer = index[id(self)]
            out = real(self, R, ids, st, offset, unclosed)
            rec.mark("state", layer_arrays(st))
            rec.layer = None
            return out

        return call

    def residual_call(real):
        def call(self, R, block):
            hc, part = roles[id(self)]

            def inner(x):
                rec.mark(hc, [x])
                return marked(rec, part, block(x))

            return marked(rec, hc, real(self, R, inner))

        return call

    def mark_as(part):
        return lambda real: lambda *a, **k: marked(rec, part, real(*a, **k))

    patches = [
        (Qwen4ExpBlock, "__call__", block_call),
        (PLELayer, "__call__", mark_as("ple")),
        (GatedResidual, "__call__", residual_call),
        (GatedResidual, "read", mark_as("head_hc")),
        # the QSA attention's steps, while they run op by op (mixer: what is left after them)
        (QSAAttention, "index", mark_as("qsa_index")),
        (QSAAttention, "project_qkv", mark_as("qsa_qkv")),
        (QSAAttention, "select", mark_as("qsa_select")),
        (qsa, "token_indices", mark_as("qsa_token_ids")),  # before decode_tokens
        (qsa, "decode_tokens_step", lambda real: lambda *a: mark_as("qsa_select")(real(*a))),
        (ContiguousKV, "gather", mark_as("qsa_gather")),
        (PagedKV, "gather", mark_as("qsa_gather")),
    ]
    patches = [p for p in patches if hasattr(p[0], p[1])]  # the code at hand's pieces
    saved = [(owner, name, vars(owner).get(name, _MISSING)) for owner, name, _ in patches]
    methods = [m.__dict__.get("_compiled_methods", {}) for _, m in net.named_modules()]
    saved_methods = [dict(m) for m in methods]
    for owner, name, wrap in patches:
        setattr(owner, name, wrap(getattr(owner, name)))
    for m in methods:
        for key, fn in list(m.items()):  # keyed (method, row padding)
            m[key] = hooked_compiled(fn, key[0], rec)
    try:
        yield
    finally:
        for owner, name, real in saved:
            if real is _MISSING:
                delattr(owner, name)  # an inherited method: the subclass's wrapper goes
            else:
                setattr(owner, name, real)
        for m, real in zip(methods, saved_methods, strict=True):
            m.update(real)


def marked(rec: Recorder, part: str, out):
    from mlx.utils import tree_flatten

    rec.mark(part, [a for _, a in tree_flatten(out) if a is not None])
    return out


def hooked_compiled(fn, name: str, rec: Recorder):
    def run(*args):
        rec.mark(f"{name} inputs", [a for a in args if a is not None])
        return marked(rec, name, fn(*args))

    return run


def layer_kind(block) -> str:
    if not block.is_linear:
        return "qsa"
    return "gdn+ple" if block.has_ple else "gdn"


def count_steps(model, state, tok: int, steps: int) -> dict:
    """`steps` decode steps with the hooks on: nodes per step, per (layer kind, part) and in
    all (a mean: QSA pools a block every `ratio` steps and its tail length cycles)."""
    import mlx.core as mx

    from qwen38_backend.engine import state_arrays

    net = model.net
    parts: dict[tuple[int | None, str], Counter] = defaultdict(Counter)
    for _ in range(steps):
        rec = Recorder()
        with hooks(net, rec):
            rec.active = True
            logits = model.forward([tok], state, last_only=True)
            rec.layer = None
            rec.mark("lm_head", [logits])
            nxt = mx.argmax(logits.reshape(-1, logits.shape[-1])[-1].astype(mx.float32))
            rec.mark("sampling", [nxt])
            rec.mark("state", state_arrays(state))
            rec.active = False
        for key, ops in rec.parts().items():  # before the evaluation detaches the graph
            parts[key].update(ops)
        mx.eval(logits, nxt, *state_arrays(state))
        tok = int(nxt.item())
    return aggregate(parts, net.model.layers, steps)


def aggregate(parts: dict, blocks, steps: int) -> dict:
    kinds = [layer_kind(b) for b in blocks]
    n_kind = Counter(kinds)
    per_kind: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
    total: Counter = Counter()
    for (layer, part), ops in parts.items():
        total.update(ops)
        kind = "model" if layer is None else kinds[layer]
        per_kind[kind][part].update(ops)
    s = summary(total.elements())
    out = {
        "step": {
            "nodes": s["nodes"] / steps,
            "kernels": s["kernels"] / steps,
            "by_primitive": {op: c / steps for op, c in s["by_primitive"].items()},
        },
        "per_layer": {},
    }
    for kind, kind_parts in per_kind.items():
        n = n_kind.get(kind, 1) * steps
        all_parts: Counter = Counter()
        rows = {}
        for part, ops in sorted(kind_parts.items()):
            all_parts.update(ops)
            s = summary(ops.elements())
            rows[part] = {
                "nodes": s["nodes"] / n,
                "kernels": s["kernels"] / n,
                "by_primitive": {op: c / n for op, c in s["by_primitive"].items()},
            }
        s = summary(all_parts.elements())
        out["per_layer"][kind] = {
            "layers": n_kind.get(kind, 0),
            "nodes": s["nodes"] / n,
            "kernels": s["kernels"] / n,
            "parts": rows,
        }
    return out


def timed_steps(model, state, tok: int, steps: int) -> tuple[list[float], list[int], str]:
    """(host build seconds per step, greedy tokens, sha256 of the last logits)."""
    import mlx.core as mx

    from qwen38_backend.engine import state_arrays

    builds, tokens, logits = [], [], None
    for _ in range(steps):
        t = time.perf_counter()
        logits = model.forward([tok], state, last_only=True)
        nxt = mx.argmax(logits.reshape(-1, logits.shape[-1])[-1].astype(mx.float32))
        builds.append(time.perf_counter() - t)
        mx.eval(logits, nxt, *state_arrays(state))
        tok = int(nxt.item())
        tokens.append(tok)
    return builds, tokens, sha(logits)


@contextmanager
def layer_timer(blocks, seconds: dict[str, list[float]]):
    """Time every block call into seconds[layer kind] (the build of its part of the step)."""
    from qwen38_backend.models.qwen4_exp import Qwen4ExpBlock

    real = Qwen4ExpBlock.__dict__["__call__"]
    kinds = {id(b): layer_kind(b) for b in blocks}

    def timed(self, *args):
        t = time.perf_counter()
        out = real(self, *args)
        seconds[kinds[id(self)]].append(time.perf_counter() - t)
        return out

    Qwen4ExpBlock.__call__ = timed
    try:
        yield
    finally:
        Qwen4ExpBlock.__call__ = real


def one_mode(model, state, depth: int, first: int, args) -> dict:
    # warm-up: traces the compiled steps at each tail length of the QSA selection (0..3)
    timed_steps(model, state, first, args.warmup)
    state.truncate(depth)
    builds, tokens, digest = timed_steps(model, state, first, args.steps)
    state.truncate(depth)
    layers: dict[str, list[float]] = defaultdict(list)
    with layer_timer(model.net.model.layers, layers):
        timed_steps(model, state, first, args.steps)
    state.truncate(depth)
    graph = count_steps(model, state, first, args.count_steps)
    state.truncate(depth)
    return {
        "host_build_ms": {
            "median": 1e3 * statistics.median(builds),
            "min": 1e3 * min(builds),
            "per_layer_median": 1e3 * statistics.median(builds) / len(model.net.model.layers),
            "by_layer_kind_median": {k: 1e3 * statistics.median(v) for k, v in layers.items()},
        },
        "tokens": tokens,
        "last_logits_sha256": digest,
        **graph,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="a multiple of 4 (every 4th is QSA)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--experts-bits", type=int, default=4, choices=[0, 2, 3, 4, 5, 6, 8])
    ap.add_argument("--depth", type=int, default=2112, help="prompt tokens before decoding")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per mode")
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps per mode first")
    ap.add_argument(
        "--count-steps", type=int, default=4, help="steps whose graphs are counted (mean)"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--modes", default="compiled,op_by_op")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.layers < 4 or args.layers % 4:
        ap.error(f"--layers {args.layers}: a multiple of 4 (every 4th layer is QSA)")

    import mlx.core as mx

    from qwen38_backend.engine import state_arrays
    from qwen38_backend.models.qwen4_exp import Qwen4ExpBlock

    config = flash_config("reduced", args.layers, args.experts, None)
    model, _ = random_model(config, args.dtype, args.seed, args.experts_bits or None)
    cfg = model.net.config
    dense_until = cfg.indexer_budget + cfg.indexer_compress_ratio - 1
    state = model.new_state()
    last = model.prefill(prompt(args.depth, cfg.vocab_size), state)
    mx.eval(last, *state_arrays(state))
    state.save_point()
    first = greedy(last)
    result = {
        "environment": environment(),
        "layers": args.layers,
        "layer_kinds": [layer_kind(b) for b in model.net.model.layers],
        "experts": args.experts,
        "experts_bits": args.experts_bits or None,
        "experts_module": type(model.net.model.layers[0].mlp.experts).__name__,
        "dtype": args.dtype,
        "depth": args.depth,
        "qsa_sparse": args.depth + 1 > dense_until,
        "modes": {},
    }
    for mode in args.modes.split(","):
        Qwen4ExpBlock.compile_decode = mode == "compiled"
        result["modes"][mode] = one_mode(model, state, args.depth, first, args)
        r = result["modes"][mode]
        print(
            f"{mode}: build {r['host_build_ms']['median']:.2f} ms/step, "
            f"{r['step']['nodes']} nodes, {r['step']['kernels']} kernels",
            file=sys.stderr,
        )
    Qwen4ExpBlock.compile_decode = True
    runs = list(result["modes"].values())
    result["same_tokens"] = all(r["tokens"] == runs[0]["tokens"] for r in runs)
    result["same_logits"] = all(
        r["last_logits_sha256"] == runs[0]["last_logits_sha256"] for r in runs
    )
    write_json(result, args.out)


if __name__ == "__main__":
    main()
