"""The full Flash-Next (qwen4_exp) on one H200: 48 layers, 512 experts in 4-bit, the rest bf16.

    # H200, one call (~8 min budget; weights ~78 GB = 68.0 GB 4-bit experts + 9.9 GB bf16
    # rest, peak ~85-90 GB of the 139 GiB; host RAM stays small: weights are drawn on device):
    python benchmarks/bench_flash_full.py --dims flash --layers 48 --experts 512 \
        --experts-bits 4 --depth 4096 --decode 32 --runs 3 --prefill 4096,32768 \
        --out benchmarks/results/h200/flash_full_4bit.json
    # CPU smoke (reduced widths, 4 layers = 3 Gated DeltaNet + 1 QSA, 8 experts, fp32):
    python benchmarks/bench_flash_full.py --dims reduced --layers 4 --experts 8 \
        --experts-bits 4 --depth 256 --decode 8 --runs 2 --prefill 256,512

The model is built in-process with random weights (bench_qsa_depth.random_model: device-side,
a seed per tensor name, the real layout): every expert stack is drawn and MLX-affine quantized
one at a time (group 64), and the triplets go through the loader's assign_weights as a
quantized checkpoint's would, so the experts are QuantizedExperts (gather_qmm) and everything
else stays in --dtype. The n-gram table is the scaled-down one of flash_config
(--ngram-base 20000: 0.1 GB; the real 20M-base table is 102 GB in bf16, memory-mapped on the
host by the loader, and a decoded token reads 16 of its rows either way).

Measured, in this order, greedy, decoded as Engine.decode decodes (--decode-loop engine: the
next step queued before this token is read back; `sync`, this bench's loop before session 35:
each token read back before the next step is built) (the JSON is rewritten to --out after
each phase, so a call cut off at its time limit still leaves a record):
- a --depth prompt prefilled and 2 tokens decoded untimed (compiles both QSA regimes and the
  decode steps);
- prefill tok/s of the --depth prompt into a fresh state at the engine's default chunk
  (Model.prefill, Model.prefill_chunk unless --chunk), then decode tok/s over --decode tokens
  from it, median of --runs (each run rewinds to the prompt through a save point; every run
  must decode the same tokens), with the host's CPU ms a token (this thread's CPU time: a
  run slower in wall time but not in CPU time was held up, e.g. by the machine);
- with --step-kernels, decode tok/s again for each set of Flash-Next's step kernels switched
  on (routing, stream mixes, routed experts, QSA's selection: kernels/moe_route.py,
  stream_mix.py, expert_qmv.py, top_select.py; "qk": QSA's q/k norms and RoPE,
  qk_norm_rope.py; "gates" / "mix": the gated residuals' gates / block-input mix in their
  products' epilogues, rows_matmul.py; "fused": a step's close with the next gated
  residual's norm and both its products as one persistent launch, and a Gated DeltaNet
  layer's close, mixer open and Gated DeltaNet as one, fused.py (off by default until
  measured); "inplace": QSA steps reading their chosen
  blocks in place through kernels/decode_attention.py; the rest off), the sets taking turns run by
  run, the layers that chose them, whether the tokens are the default's and the first that
  is not (against the default's gap between its two largest logits at each step,
  "margins");
- with --loops / --eager-layers, decode tok/s again per decode loop / hand-over stride, in
  turns the same way;
- the bytes a decoded token reads (formula in the JSON, "bytes_per_token") and its bound at
  --bandwidth-gbps (default: 4.8 TB/s on an H200, measured on the CPU), decode as % of bound;
- prefill tok/s at the other --prefill lengths, a fresh state each; a length whose projected
  time (1.5 x length / the slowest rate so far) would pass --time-budget (540 s from start)
  is skipped and says so;
- weight bytes (routed experts / embedding / the rest / n-gram table), peak memory of the
  build and of the runs (mx.get_peak_memory), peak RSS, and the seconds of each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_27b import decode_rate, decode_times  # noqa: E402
from bench_qsa_depth import (  # noqa: E402
    attention_bytes,
    flash_config,
    greedy,
    prompt,
    random_model,
)
from bench_qsa_depth import decode as sync_decode  # noqa: E402
from common import environment, peak_bandwidth, write_json  # noqa: E402

START = time.perf_counter()

FORMULA = (
    "dense (every parameter but embed_tokens and the routed expert stacks, at their stored "
    "size: attention / Gated DeltaNet / QSA indexer projections, norms, hyper-connections, "
    "router, shared expert and its gate, PLE projections, lm_head) + embed_row (hidden x "
    "itemsize) + ngram_rows (PLE layers x heads x head_dim x table itemsize) + routed_experts "
    "(layers x top_k x (gate_up_proj + down_proj bytes incl. scales and biases) / num_experts) "
    "+ state (linear layers: Gated DeltaNet conv + recurrent and PLE conv state, read and "
    "written: 2 x their bytes; QSA layers: the selected K/V rows + the pooled index keys the "
    "indexer scores, bench_qsa_depth.attention_bytes, + the new K/V row written); "
    "bound tok/s = bandwidth / bytes"
)


def save(result: dict, out: str | None) -> None:
    """The record so far (a run cut off at the call's time limit still leaves one)."""
    if out:
        Path(out).write_text(json.dumps(result, indent=2, default=str) + "\n")


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f}s] {msg}", file=sys.stderr, flush=True)


def weight_parts(model) -> dict:
    """Bytes of the routed expert stacks, the embedding, the rest, and the n-gram tables."""
    from mlx.utils import tree_flatten

    parts = {"routed_experts": 0, "embed_tokens": 0, "dense": 0}
    for name, w in tree_flatten(model.net.parameters()):
        if ".mlp.experts." in name:
            parts["routed_experts"] += w.nbytes
        elif name.startswith("model.embed_tokens."):
            parts["embed_tokens"] += w.nbytes
        else:
            parts["dense"] += w.nbytes
    parts["ngram_table"] = sum(
        s.nbytes for _, ple in model.net.ple_layers() for s in ple.ple_embedding.table.shards
    )
    return parts


def bytes_per_token(model, state, depth: int, parts: dict) -> dict:
    """What one decoded token at position `depth` reads (FORMULA), term by term."""
    cfg = model.net.config
    item = model.dtype.size
    ples = [ple.ple_embedding for _, ple in model.net.ple_layers()]
    ngram = sum(e.sizes.size * e.head_dim * e.table.shards[0].dtype.size for e in ples)
    layers = len(cfg.layer_types)
    routed = cfg.num_experts_per_tok * parts["routed_experts"] // cfg.num_experts
    linear = sum(
        s.nbytes()
        for s, t in zip(state.layers, cfg.layer_types, strict=True)
        if t == "linear_attention"
    )
    n_qsa = layers - sum(1 for t in cfg.layer_types if t == "linear_attention")
    new_row = n_qsa * (2 * cfg.num_key_value_heads * cfg.head_dim + cfg.indexer_head_dim) * item
    terms = {
        "dense": parts["dense"],
        "embed_row": cfg.hidden_size * item,
        "ngram_rows": ngram,
        "routed_experts": routed,
        "state": 2 * linear + attention_bytes(model, depth, item) + new_row,
    }
    terms["total"] = sum(terms.values())
    return terms


def timed_prefill(model, ids: list[int], chunk: int, kv: dict) -> tuple[float, object, object]:
    """(tok/s, state, last logits): ids into a fresh state with the engine's chunked prefill."""
    import mlx.core as mx

    state = model.new_state(**kv)
    t = time.perf_counter()
    last = model.prefill(ids, state, chunk=chunk)
    mx.eval(last)
    return len(ids) / (time.perf_counter() - t), state, last


def engine_decode(model, state, first: int, n: int) -> tuple[float, list[int], None]:
    """(tok/s, tokens, None): `first` fed, then n greedy tokens as users get them
    (Engine.decode: the next step queued before this token is read back, which for
    Flash-Next overlaps the next step's layers before its PLE layer with this one's tail);
    tok/s over the n - 1 steps after the first token (n forwards, as sync_decode's)."""
    import mlx.core as mx

    logits = model.forward([first], state, last_only=True)
    mx.eval(logits)
    tokens: list[int] = []
    times = decode_times(model, state, logits, n, tokens)
    return decode_rate(times), tokens, None


# How the bench decodes (--decode-loop): as the engine does, or each step read back before
# the next is built (this bench's loop until session 35: its figures before then are that)
LOOPS = {"engine": engine_decode, "sync": sync_decode}


def decode(args, model, state, first: int, n: int | None = None) -> tuple[float, list, float]:
    """(tok/s, tokens, the host's CPU ms a token) of n (default --decode) greedy tokens after
    `first`, decoded by the --decode-loop. The CPU time is this thread's (Python and MLX's
    encoding of the launches, which run on the caller) over the whole decode / n: where
    tok/s varies from run to run and it does not, the host was held up, not busier."""
    n = n or args.decode
    cpu = time.thread_time()
    tps, tokens, _ = LOOPS[args.decode_loop](model, state, first, n)
    return tps, tokens, 1e3 * (time.thread_time() - cpu) / n


def spread(values: list[float]) -> dict:
    """{"median", "runs"} of per-run figures."""
    return {"median": statistics.median(values), "runs": values}


def decode_runs(args, model, state, first: int) -> tuple[list[float], list[list[int]], list]:
    """--runs timed decodes of --decode tokens from the --depth prompt (each rewinds to it):
    (tok/s of each, tokens of each, host CPU ms a token of each)."""
    runs, tokens, cpus = [], [], []
    for _ in range(args.runs):
        tps, toks, cpu = decode(args, model, state, first)
        runs.append(tps)
        tokens.append(toks)
        cpus.append(cpu)
        state.truncate(args.depth)
    return runs, tokens, cpus


def in_turns(args, names: list[str], choose, model, state, first: int, want, bound) -> dict:
    """Decode tok/s (median of --runs) for each of `names`, choose(name) setting it up: the
    names take turns, one run each per round, as the step-kernel sets do (within one call
    the machine's speed drifts by more than a setting changes it: session 30)."""
    runs = {name: [] for name in names}
    tokens = {name: [] for name in names}
    cpus = {name: [] for name in names}
    for _ in range(args.runs):
        for name in names:
            choose(name)
            tps, toks, cpu = decode(args, model, state, first)
            state.truncate(args.depth)
            runs[name].append(tps)
            tokens[name].append(toks)
            cpus[name].append(cpu)
    return {
        name: {
            "tokens_per_second": spread(runs[name]),
            "host_cpu_ms_per_token": spread(cpus[name]),
            "percent_of_bound": 100 * statistics.median(runs[name]) / bound,
            "identical_to_default": all(t == want for t in tokens[name]),
        }
        for name in names
    }


def by_stride(args, model, state, first: int, want: list[int], bound: float) -> dict:
    """Decode tok/s per hand-over stride: how often a step gives the layers built so far to
    the device (SequenceState.eager_layers; PLE's read-back of the token ids makes a step
    wait for the previous one, so the rest is built after it), in turns."""
    strides = args.eager_layers.split(",")
    out = in_turns(
        args,
        strides,
        lambda stride: os.environ.__setitem__("QWEN38_EAGER_LAYERS", stride),
        model,
        state,
        first,
        want,
        bound,
    )
    os.environ.pop("QWEN38_EAGER_LAYERS", None)
    for stride, v in out.items():
        log(f"decode, hand-over stride {stride}: {v['tokens_per_second']['median']:.2f} tok/s")
    return out


def by_loop(args, loops: list[str], model, state, first: int, want, bound: float) -> dict:
    """Decode tok/s per decode loop (LOOPS: the engine's pipelined one, or each token read
    back before the next step is built), in turns."""
    default = args.decode_loop
    choose = lambda loop: setattr(args, "decode_loop", loop)  # noqa: E731
    out = in_turns(args, loops, choose, model, state, first, want, bound)
    args.decode_loop = default
    for loop, v in out.items():
        log(f"decode, {loop} loop: {v['tokens_per_second']['median']:.2f} tok/s")
    return out


STEP_KERNELS = {
    "route": "ROUTE",
    "stream": "STREAM",
    "expert": "EXPERT",
    "select": "QSA_SELECT",
    "qk": "QK",
    "gates": "GATES",
    "mix": "MIX",
    "fused": "FUSED",
}
IN_PLACE = "inplace"  # a set's name for QSA's in-place block reads (no environment switch)
# each step kernel's module and its cached probes (cleared when the switches change)
STEP_PROBES = {
    "moe_route": ("available",),
    "stream_mix": ("available",),
    "expert_qmv": ("available",),
    "top_select": ("qsa_available",),
    "qk_norm_rope": ("available",),
    "rows_matmul": ("gates_available", "mix_available"),
    "fused": ("agrees",),
}


def greedy_margins(model, state, first: int, n: int) -> list[float]:
    """Per greedy step from `first` (untimed): the gap between its two largest logits in
    fp32, how near the step is to a tie that another order of sums could flip."""
    import mlx.core as mx

    gaps, tok = [], first
    for _ in range(n):
        last = model.forward([tok], state, last_only=True)
        row = last.reshape(-1, last.shape[-1])[-1].astype(mx.float32)
        top = mx.sort(row)[-2:]
        gaps.append((top[1] - top[0]).item())
        tok = int(mx.argmax(row).item())
    return gaps


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The index of the first token where `got` leaves `want` (None: the same tokens)."""
    return next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)


def switch_step_kernels(model, chosen: set[str]) -> None:
    """Switch Flash-Next's step kernels (QWEN38_<STEP_KERNELS value>_KERNEL) to auto for
    `chosen`, off for the rest, and make the model decide and trace its steps again: each
    layer decides once per dtype and a trace holds what it chose."""
    import mlx.nn as nn

    from qwen38_backend.kernel_import import kernel_module
    from qwen38_backend.kv import one_token
    from qwen38_backend.models.hyper_connections import GatedResidual
    from qwen38_backend.models.layers import Attention
    from qwen38_backend.models.moe import SparseMoE
    from qwen38_backend.models.qwen4_exp import Qwen4ExpBlock

    for name, env in STEP_KERNELS.items():
        os.environ[f"QWEN38_{env}_KERNEL"] = "auto" if name in chosen else "off"
    # "inplace": QSA steps read their chosen blocks in place (the split-KV kernel's page
    # lists) rather than gathering them for MLX's attention
    one_token.READ_PAGES_IN_PLACE = IN_PLACE in chosen
    for module_name, probes in STEP_PROBES.items():
        kernels = kernel_module(module_name)
        for probe in probes if kernels is not None else ():
            getattr(kernels, probe).cache_clear()

    def reset(_, module: nn.Module) -> None:
        module.__dict__.pop("_compiled_methods", None)
        if isinstance(module, (SparseMoE, GatedResidual)):
            module._checked = ""
        if isinstance(module, Attention):
            module._qk_checked = ""
        if isinstance(module, Qwen4ExpBlock):
            module._prepared = None

    model.net.apply_to_modules(reset)


def qsa_selects(layer) -> bool:
    """Whether a QSA layer's decode steps choose through kernels/top_select.py (its probe's
    answer, which the steps ask too: qsa.select_kernel)."""
    from qwen38_backend.kernel_import import kernel_module

    kernel = kernel_module("top_select")
    if layer.is_linear or kernel is None:
        return False
    return kernel.qsa_available(layer.self_attn.n_blocks, layer.self_attn.ratio)


def by_step_kernels(args, model, state, first: int, want: list[int], bound: float) -> dict:
    """Decode tok/s (median of --runs) with each set of step kernels on (--step-kernels),
    what each layer chose, and whether the tokens are the default run's. The sets take
    turns, one run each per round (each switch traces the steps again, untimed), so a drift
    of the machine over the call spreads over every set rather than landing on one."""
    variants = {}
    for variant in args.step_kernels.split(","):
        chosen = set() if variant == "off" else set(variant.split("+"))
        unknown = chosen - set(STEP_KERNELS) - {IN_PLACE}
        if unknown:
            raise SystemExit(
                f"--step-kernels: unknown {sorted(unknown)}; use {[*STEP_KERNELS, IN_PLACE]}"
            )
        variants[variant] = chosen
    runs = {v: [] for v in variants}
    tokens = {v: [] for v in variants}
    cpus = {v: [] for v in variants}
    chose = {}
    layers = model.net.model.layers
    for _ in range(args.runs):
        for variant, chosen in variants.items():
            switch_step_kernels(model, chosen)
            decode(args, model, state, first, 2)  # decides and traces the steps again
            state.truncate(args.depth)
            tps, toks, cpu = decode(args, model, state, first)
            state.truncate(args.depth)
            runs[variant].append(tps)
            tokens[variant].append(toks)
            cpus[variant].append(cpu)
            chose[variant] = {
                "route": sum(bool(layer.mlp._route_for) for layer in layers),
                "expert": sum(bool(layer.mlp._kernel_for) for layer in layers),
                "stream": sum(
                    bool(m._kernel_for)
                    for layer in layers
                    for m in (layer.attn_hyper_connection, layer.mlp_hyper_connection)
                ),
                "select": sum(qsa_selects(layer) for layer in layers),
                "fused": sum(
                    bool(m._fuse_for)
                    for layer in layers
                    for m in (layer.attn_hyper_connection, layer.mlp_hyper_connection)
                ),
                "fused_linear": sum(bool(layer._fuse_linear_for) for layer in layers),
                "qk": sum(
                    bool(layer.self_attn._qk_kernel_for) for layer in layers if not layer.is_linear
                ),
            }
    out = {}
    for variant in variants:
        median = statistics.median(runs[variant])
        out[variant] = {
            "tokens_per_second": {"median": median, "runs": runs[variant]},
            "host_cpu_ms_per_token": spread(cpus[variant]),
            "percent_of_bound": 100 * median / bound,
            "runs_identical": all(t == tokens[variant][0] for t in tokens[variant]),
            "same_tokens_as_default": tokens[variant][0] == want,
            "first_difference": first_difference(tokens[variant][0], want),
            "decoded": tokens[variant][0],
            "layers_choosing": chose[variant],
            "layers": len(layers),
        }
        log(f"decode, step kernels {variant}: {median:.2f} tok/s, {chose[variant]}")
    switch_step_kernels(model, set())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="reduced", choices=["reduced", "flash"])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=None, help="default: 512 flash, 8 reduced")
    ap.add_argument("--experts-bits", type=int, default=4, choices=[0, 2, 3, 4, 5, 6, 8])
    ap.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128])
    ap.add_argument("--ngram-base", type=int, default=None)
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prefill", default="4096,32768", help="prefill lengths (comma list)")
    ap.add_argument("--chunk", type=int, default=None, help="default: Model.prefill_chunk")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--kv-paged", default="off", choices=["on", "off"], help="engine default")
    ap.add_argument("--bandwidth-gbps", type=float, default=None)
    ap.add_argument("--time-budget", type=float, default=540.0, help="seconds for the run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--eager-layers",
        default=None,
        help="comma list of QWEN38_EAGER_LAYERS strides (0: the whole step at once): decode "
        "tok/s for each, after the default",
    )
    ap.add_argument(
        "--step-kernels",
        default=None,
        help="comma list of step-kernel sets (off, or +-joined route / stream / expert / select "
        "/ inplace, e.g. "
        "off,route+stream,route+stream+expert): decode tok/s with each switched on (auto), "
        "the same weights and prompt, after the default",
    )
    ap.add_argument(
        "--decode-loop",
        default="engine",
        choices=sorted(LOOPS),
        help="engine: as Engine.decode (pipelined); sync: each token read back first",
    )
    ap.add_argument(
        "--loops",
        default=None,
        help="comma list of decode loops (engine, sync): decode tok/s with each, after the "
        "default, taking turns",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.prefill.split(",") if x]
    if args.layers < 2:
        ap.error("--layers: at least 2 (the PLE layer is the 2nd)")
    if min([args.depth, args.runs, *lengths]) < 1 or args.decode < 2:
        ap.error("--depth, --runs and --prefill must be positive, --decode at least 2")
    loops = args.loops.split(",") if args.loops else []
    if set(loops) - set(LOOPS):
        ap.error(f"--loops: unknown {sorted(set(loops) - set(LOOPS))}; choose from {sorted(LOOPS)}")

    import mlx.core as mx

    dtype = args.dtype or ("float32" if mx.default_device() == mx.cpu else "bfloat16")
    experts = args.experts or (512 if args.dims == "flash" else 8)
    config = flash_config(args.dims, args.layers, experts, args.ngram_base)
    log(f"building {args.dims} x {args.layers} layers, {experts} experts, {dtype}")
    t = time.perf_counter()
    model, weights_bytes = random_model(
        config, dtype, args.seed, args.experts_bits or None, args.group_size, log=log
    )
    build_s = time.perf_counter() - t
    parts = weight_parts(model)
    build_peak = mx.get_peak_memory()
    log(f"built in {build_s:.1f}s: {weights_bytes / 1e9:.2f} GB, peak {build_peak / 1e9:.2f} GB")
    mx.reset_peak_memory()
    kv = {"kv_paged": "on"} if args.kv_paged == "on" else {}
    chunk = args.chunk or model.prefill_chunk
    vocab = config["text_config"]["vocab_size"]
    bandwidth, bandwidth_source = peak_bandwidth(args.bandwidth_gbps)

    result = {
        "environment": environment(),
        "dims": args.dims,
        "layers": args.layers,
        "experts": experts,
        "top_k": config["text_config"]["num_experts_per_tok"],
        "ngram_vocab_size_base": config["text_config"]["ngram_vocab_size_base"],
        "dtype": dtype,
        "experts_quantization": (
            {"bits": args.experts_bits, "group_size": args.group_size, "mode": "affine"}
            if args.experts_bits
            else None
        ),
        "experts_module": type(model.net.model.layers[0].mlp.experts).__name__,
        "kv_options": kv,
        "prefill_chunk": chunk,
        "weights_bytes": weights_bytes,
        "weights_bytes_parts": parts,
        "build_seconds": build_s,
        "build_peak_memory_bytes": build_peak,
        "bytes_per_token_formula": FORMULA,
        "bandwidth_bytes_per_second": bandwidth,
        "bandwidth_source": bandwidth_source,
    }
    save(result, args.out)

    # the depth prompt once untimed: compiles prefill (both QSA regimes) and the decode steps
    t = time.perf_counter()
    _, warm, last = timed_prefill(model, prompt(args.depth, vocab), chunk, kv)
    decode(args, model, warm, greedy(last), 2)
    del warm
    result["warmup_seconds"] = time.perf_counter() - t
    log(f"warm-up {result['warmup_seconds']:.1f}s")

    tps, state, last = timed_prefill(model, prompt(args.depth, vocab), chunk, kv)
    prefill = result["prefill_tokens_per_second"] = {str(args.depth): tps}
    log(f"prefill {args.depth}: {tps:.1f} tok/s")
    first = greedy(last)
    state.save_point()
    runs, outs, cpus = decode_runs(args, model, state, first)
    reads = bytes_per_token(model, state, args.depth, parts)
    median = statistics.median(runs)
    bound = bandwidth / reads["total"]
    log(f"decode at {args.depth}: {median:.2f} tok/s, bound {bound:.1f} ({median / bound:.1%})")
    result["decode"] = {
        "depth": args.depth,
        "tokens": args.decode,
        "tokens_per_second": {"median": median, "runs": runs},
        "host_cpu_ms_per_token": spread(cpus),
        "runs_identical": all(o == outs[0] for o in outs),
        "decoded": outs[0],
        "margins": greedy_margins(model, state, first, args.decode),
        "state_bytes": state.nbytes(),
    }
    state.truncate(args.depth)
    result["bytes_per_token"] = reads
    result["decode_bound_tokens_per_second"] = bound
    result["decode_percent_of_bound"] = 100 * median / bound
    result["decode"]["loop"] = args.decode_loop
    if loops:
        result["decode_by_loop"] = by_loop(args, loops, model, state, first, outs[0], bound)
    if args.eager_layers:
        result["decode_by_eager_layers"] = by_stride(args, model, state, first, outs[0], bound)
    if args.step_kernels:
        kernels = by_step_kernels(args, model, state, first, outs[0], bound)
        result["decode_by_step_kernels"] = kernels
    del state
    mx.clear_cache()
    save(result, args.out)

    for n in sorted(x for x in lengths if x != args.depth):
        rate = min(v for v in prefill.values() if isinstance(v, float))
        projected = 1.5 * n / rate  # longer prompts prefill slower: QSA selection grows
        if time.perf_counter() - START + projected > args.time_budget:
            prefill[str(n)] = f"skipped: ~{projected:.0f}s projected past --time-budget"
            log(f"prefill {n}: {prefill[str(n)]}")
            continue
        tps, state, _ = timed_prefill(model, prompt(n, vocab), chunk, kv)
        prefill[str(n)] = tps
        log(f"prefill {n}: {tps:.1f} tok/s")
        del state
        mx.clear_cache()
        save(result, args.out)
    result["run_peak_memory_bytes"] = mx.get_peak_memory()
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["total_seconds"] = time.perf_counter() - START
    write_json(result, args.out)


if __name__ == "__main__":
    main()
