"""Where a prefill's time goes: Qwen3.8-27B dims (random bf16, generated on the device), per
block part at the engine's prefill chunk, against the same GEMMs alone and the device's peak.

    python benchmarks/profile_prefill_gpu.py --length 4096 --past 2048 --out profile_prefill.json

In one process: the whole model's prefill of `--length` tokens at `--chunk` (default
Model.prefill_chunk: 2048 on CUDA), median tok/s of `--runs` fresh states after a warm-up;
then one chunk through ONE Gated DeltaNet block and ONE full-attention block (the first of
each), every part called through the model's own functions on the inputs a real call gives
it, each evaluated and synchronised, median of `--reps` after a warm-up. Attention attends
over `--past` stored tokens through the real KV store (2048: the second chunk of a 4K
prompt). Parts the code does not expose as calls are derived (see "notes" in the output).
Then the same GEMM shapes alone (x[chunk, in] @ W.T), a square matmul (the practical peak),
and per layer type: ms, share per part, TFLOP/s and fraction of the peak of matmul parts,
and block times x layer counts x chunks against the measured whole-model time.
`--dims tiny --layers 4` smoke-tests the script on a CPU.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gpu_27b import prompt, random_model  # noqa: E402
from common import mx, write_json  # noqa: E402  (common: the system OpenBLAS before MLX)

from qwen38_backend.config import FULL, LINEAR  # noqa: E402

TARGET_TOK_S = 7000
KINDS = {"gated_deltanet": LINEAR, "full_attention": FULL}
NOTES = {
    "mixer_rest": "mixer minus its timed parts: what is no call of its own (gates g/beta, "
    "reshapes, state layout swaps); may be slightly negative (noise)",
    "block_rest": "block minus input_norm, mixer, post_norm, mlp: the residual adds",
    "in_proj": "GatedDeltaNet._project: the fused in_proj_all matmul and its split",
    "qk_norm_rope": "Attention.project_qkv minus qkv_proj (split, q/k norm, rope)",
    "gate": "Attention.output minus o_proj (sigmoid gate x attention output)",
    "attend": "the KV store's attend (append, attention over past + chunk), then rewound; "
    "flops 4 x heads x head_dim x chunk x (past + chunk / 2)",
    "share_of_model": "ms x layers of the type x chunks / whole-model ms (attention at --past)",
    "layer_type_totals_ms": "chunks x layers x block ms; attention per chunk linear in its "
    "past between block_first_chunk (past 0) and block (--past)",
}


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median ms of fn() evaluated and synchronised, after one warm-up call."""

    def once() -> float:
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        return (time.perf_counter() - t) * 1e3

    once()
    return statistics.median(once() for _ in range(reps))


KEYWORDS: dict[str, dict] = {}


@contextmanager
def captured(module, name: str, seen: dict):
    """Inside: `module.name` records the arguments of its last call in seen[name] (keyword
    arguments in KEYWORDS[name])."""
    real = getattr(module, name)

    def spy(*args, **kwargs):
        seen[name], KEYWORDS[name] = args, kwargs
        return real(*args, **kwargs)

    setattr(module, name, spy)
    try:
        yield
    finally:
        setattr(module, name, real)


def mlp_parts(block, h: mx.array, reps: int) -> dict:
    """Post-attention norm and the SwiGLU MLP (fused gate_up, swiglu, down) on h."""
    from qwen38_backend.models.layers import swiglu
    from qwen38_backend.rows import project

    mlp = block.mlp
    y = block.post_attention_layernorm(h)
    gate, up = mx.split(project(mlp.gate_up_proj, y), 2, axis=-1)
    act = swiglu(gate, up)
    mx.eval(y, gate, up, act)
    return {
        "post_norm": timed(lambda: block.post_attention_layernorm(h), reps),
        "mlp_gate_up_proj": timed(lambda: project(mlp.gate_up_proj, y), reps),
        "mlp_swiglu": timed(lambda: swiglu(gate, up), reps),
        "mlp_down_proj": timed(lambda: project(mlp.down_proj, act), reps),
        "mlp": timed(lambda: mlp(y), reps),
    }


def with_rests(parts: dict, mixer_parts: list[str]) -> dict:
    parts["mixer_rest"] = parts["mixer"] - sum(parts[k] for k in mixer_parts)
    whole = ("input_norm", "mixer", "post_norm", "mlp")
    parts["block_rest"] = parts["block"] - sum(parts[k] for k in whole)
    return parts


def gdn_parts(block, st, h: mx.array, offset: int, reps: int) -> dict:
    """Parts of GatedDeltaNet.__call__ (the prefill path) and of its block; `st` is the
    layer state after the past (a call advances a state: each runs on a copy)."""
    from qwen38_backend.models import gated_deltanet as gdn
    from qwen38_backend.models.gated_delta import scan_chunks, solve_chunks
    from qwen38_backend.rows import project

    def through(call: Callable) -> Callable:
        def run():
            new = gdn.GatedDeltaNetState()
            new.conv, new.recurrent, new.length = st.conv, st.recurrent, st.length
            return call(new), new.conv, new.recurrent

        return run

    mixer, T = block.linear_attn, h.shape[0]
    x = block.input_layernorm(h)
    qkv, z, _, _ = mixer._project(x)
    seen: dict = {}  # the core's real inputs (gates, prepared q/k, state), from a real call
    with captured(gdn, "chunked_gated_delta", seen):
        mixed = through(lambda s: mixer(x, s))()[0]
    # prepare_qk runs compiled (gdn.compiled_with): its inputs from the conv's output
    conv = through(lambda s: mixer._conv(qkv, s))()[0]
    q = conv[:, : mixer.key_dim].reshape(T, mixer.n_k_heads, mixer.k_head_dim)
    k = conv[:, mixer.key_dim : 2 * mixer.key_dim].reshape(T, mixer.n_k_heads, mixer.k_head_dim)
    prepare = gdn.compiled_with(gdn.prepare_qk, n_v_heads=mixer.n_v_heads)
    mx.eval(
        x, qkv, z, mixed, q, k, [a for c in seen.values() for a in c if isinstance(a, mx.array)]
    )
    core = functools.partial(gdn.chunked_gated_delta, *seen["chunked_gated_delta"])
    o = core(**KEYWORDS["chunked_gated_delta"])[0].astype(x.dtype)
    z = z.reshape(T, mixer.n_v_heads, mixer.v_head_dim)
    normed = mixer.norm(o, z).reshape(T, mixer.value_dim)
    mx.eval(o, normed)
    parts = {
        "input_norm": timed(lambda: block.input_layernorm(h), reps),
        "in_proj": timed(lambda: mixer._project(x), reps),
        "conv": timed(through(lambda s: mixer._conv(qkv, s)), reps),
        "prepare_qk": timed(lambda: prepare(q, k), reps),
        "chunked_gated_delta": timed(lambda: core(**KEYWORDS["chunked_gated_delta"]), reps),
        # the same on the op path (the engine's solve and scan on CUDA are one kernel
        # launch each, kernels/gdn_prefill.py, where their probes pass)
        "chunked_gated_delta_op_path": timed(
            lambda: core(solve=solve_chunks, scan=scan_chunks), reps
        ),
        "gated_norm": timed(lambda: mixer.norm(o, z), reps),
        "out_proj": timed(lambda: project(mixer.out_proj, normed), reps),
        "mixer": timed(through(lambda s: mixer(x, s)), reps),
    }
    parts |= mlp_parts(block, h + mixed, reps)
    parts["block"] = timed(through(lambda s: block(h, s, offset)), reps)
    inside = ["in_proj", "conv", "prepare_qk", "chunked_gated_delta", "gated_norm", "out_proj"]
    return with_rests(parts, inside)


def attention_parts(block, kv, new_kv: Callable, h: mx.array, past: int, reps: int) -> dict:
    """Parts of Attention.__call__ (project_qkv, kv.attend, output) and of its block; `kv`
    holds `past` tokens and is rewound to them after every call; `new_kv()` an empty store."""
    from qwen38_backend.rows import project

    def rewound(call: Callable) -> Callable:
        def run():
            out = call()
            kv.truncate(past)
            return out

        return run

    attn, T = block.self_attn, h.shape[0]
    x = block.input_layernorm(h)
    q, k, v, gate = attn.project_qkv(x, past)
    out = rewound(lambda: kv.attend(q, k, v, attn.scale))()
    gated = (out.transpose(0, 2, 1, 3).reshape(T, -1) * mx.sigmoid(gate)).astype(x.dtype)
    mixed = attn.output(out, gate)
    mx.eval(x, q, k, v, gate, out, gated, mixed)
    parts = {
        "input_norm": timed(lambda: block.input_layernorm(h), reps),
        "qkv_proj": timed(lambda: project(attn.qkv_proj, x), reps),
        "project_qkv": timed(lambda: attn.project_qkv(x, past), reps),
        "attend": timed(rewound(lambda: kv.attend(q, k, v, attn.scale)), reps),
        "o_proj": timed(lambda: project(attn.o_proj, gated), reps),
        "output": timed(lambda: attn.output(out, gate), reps),
        "mixer": timed(rewound(lambda: attn(x, kv, past)), reps),
    }
    parts["qk_norm_rope"] = parts["project_qkv"] - parts["qkv_proj"]
    parts["gate"] = parts["output"] - parts["o_proj"]
    parts |= mlp_parts(block, h + mixed, reps)
    parts["block"] = timed(rewound(lambda: block(h, kv, past)), reps)
    parts["block_first_chunk"] = timed(lambda: block(h, new_kv(), 0), reps)
    return with_rests(parts, ["project_qkv", "attend", "output"])


def gemm(rows: int, n_in: int, n_out: int, dtype, reps: int) -> dict:
    """x[rows, in] @ W.T alone: ms and TFLOP/s."""
    x = mx.random.normal((rows, n_in)).astype(dtype)
    w = mx.random.normal((n_out, n_in)).astype(dtype)
    mx.eval(x, w)
    ms = timed(lambda: x @ w.T, reps)
    return {"shape": [rows, n_in, n_out], "ms": ms, "tflops": 2 * rows * n_in * n_out / ms / 1e9}


def whole_model(model, ids: list[int], chunk: int, runs: int) -> list[float]:
    """tok/s of `runs` prefills into fresh states, after one warm-up (compiles kernels)."""
    rates = []
    for _ in range(runs + 1):
        state = model.new_state()
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(model.prefill(ids, state, chunk=chunk))
        mx.synchronize()
        rates.append(len(ids) / (time.perf_counter() - t))
        del state
        mx.clear_cache()
    return rates[1:]


def measure_blocks(model, tc: dict, chunk: int, past: int, reps: int) -> tuple[dict, dict]:
    """One chunk through the first block of each layer type, after `past` tokens through
    it: ({kind: parts ms}, {name: linear} of the projections timed)."""
    from qwen38_backend import rows
    from qwen38_backend.kv import make_kv_factory

    rows.prepare(model.dtype)  # as the model's forward does first
    net, types = model.net, tc["layer_types"]
    h_all = net.model.embed_tokens(mx.array(prompt(past + chunk, tc["vocab_size"])))
    h, state, blocks = h_all[past:], model.new_state(), {}
    for kind, layer_type in KINDS.items():
        if layer_type in types:
            i = types.index(layer_type)
            block, st = blocks[kind] = net.model.layers[i], state.layers[i]
            for start in range(0, past, chunk):
                mx.eval(block(h_all[start : min(start + chunk, past)], st, start))
    state.reserve(chunk)  # as a prefill does after its first chunk
    mlp = net.model.layers[0].mlp
    measured = {}
    linears = {"mlp_gate_up_proj": mlp.gate_up_proj, "mlp_down_proj": mlp.down_proj}
    if "gated_deltanet" in blocks:
        block, st = blocks["gated_deltanet"]
        measured["gated_deltanet"] = gdn_parts(block, st, h, past, reps)
        linears |= {
            "in_proj": block.linear_attn.in_proj_all,
            "out_proj": block.linear_attn.out_proj,
        }
    if "full_attention" in blocks:
        block, kv = blocks["full_attention"]
        measured["full_attention"] = attention_parts(block, kv, make_kv_factory(), h, past, reps)
        linears |= {"qkv_proj": block.self_attn.qkv_proj, "o_proj": block.self_attn.o_proj}
    return measured, linears


def derive(measured: dict, flops: dict, peak: float, counts: dict, chunks: int, args, model_ms):
    """Per part: share of the block and of the model, TFLOP/s and fraction of the peak of the
    matmul parts; per layer type: chunks x layers x block ms (NOTES)."""
    report, totals = {}, {}
    for kind, parts in measured.items():
        report[kind] = {}
        for name, ms in parts.items():
            row = {"ms": ms, "share_of_block": ms / parts["block"]}
            row["share_of_model"] = ms * counts[kind] * chunks / model_ms
            if name in flops:
                row["tflops"] = flops[name] / ms / 1e9
                row["fraction_of_peak"] = row["tflops"] / peak
            report[kind][name] = row
        per_chunk = [parts["block"]] * chunks
        if kind == "full_attention" and args.past:  # attention grows with the chunk's past
            first, grown = parts["block_first_chunk"], parts["block"] - parts["block_first_chunk"]
            per_chunk = [first + grown * c * args.chunk / args.past for c in range(chunks)]
        totals[kind] = counts[kind] * sum(per_chunk)
    return report, totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny"])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=0, help="0: Model.prefill_chunk")
    ap.add_argument("--past", type=int, default=2048, help="tokens before the timed chunk")
    ap.add_argument("--runs", type=int, default=3, help="whole-model prefills")
    ap.add_argument("--reps", type=int, default=10, help="repetitions per part")
    ap.add_argument("--peak-n", type=int, default=0, help="square matmul (0: 8192, tiny 512)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    model, config, nbytes = random_model(args.dims, args.layers, args.dtype)
    tc = config["text_config"]
    args.chunk = args.chunk or model.prefill_chunk
    chunks = math.ceil(args.length / args.chunk)
    counts = {kind: tc["layer_types"].count(t) for kind, t in KINDS.items()}
    rates = whole_model(model, prompt(args.length, tc["vocab_size"]), args.chunk, args.runs)
    model_ms = args.length / statistics.median(rates) * 1e3
    measured, linears = measure_blocks(model, tc, args.chunk, args.past, args.reps)

    # the same GEMMs alone, and the practical peak
    shapes = {name: linear.weight.shape for name, linear in linears.items()}
    dtype = model.dtype
    alone = {name: gemm(args.chunk, s[1], s[0], dtype, args.reps) for name, s in shapes.items()}
    n = args.peak_n or (8192 if args.dims == "27b" else 512)
    peak = gemm(n, n, n, dtype, args.reps)
    for row in alone.values():
        row["fraction_of_peak"] = row["tflops"] / peak["tflops"]

    flops = {name: 2 * args.chunk * s[0] * s[1] for name, s in shapes.items()}
    heads_x_dim = tc["num_attention_heads"] * tc["head_dim"]
    flops["attend"] = 4 * heads_x_dim * args.chunk * (args.past + args.chunk / 2)
    report, totals = derive(measured, flops, peak["tflops"], counts, chunks, args, model_ms)
    layers_ms = sum(totals.values())
    result = {
        "benchmark": "prefill profile per block part, random weights",
        **{k: getattr(args, k) for k in ("dims", "layers", "dtype", "length", "chunk", "past")},
        "chunks": chunks,
        "reps": args.reps,
        "layer_counts": counts,
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "weights_bytes": nbytes,
        "whole_model": {"tok_s": statistics.median(rates), "tok_s_runs": rates, "ms": model_ms},
        "peak_matmul": peak,
        "gemm_alone": alone,
        "blocks": report,
        "derived": {
            "ms_per_layer": {kind: parts["block"] for kind, parts in measured.items()},
            "layer_type_totals_ms": totals,
            "layers_total_ms": layers_ms,
            "measured_model_ms": model_ms,
            "layers_total_over_measured": layers_ms / model_ms,
            "rest_of_model_ms": model_ms - layers_ms,  # embedding, final norm, LM head, syncs
            "target_tok_s": TARGET_TOK_S,
            "model_ms_at_target": args.length / TARGET_TOK_S * 1e3,
        },
        "notes": NOTES,
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
