"""Qwen3.8-27B dimensions with random weights, generated on the device: ours vs mlx-lm.

    python benchmarks/bench_gpu_27b.py --layers 64 --lengths 4096,32768 --decode 32 \
        --runs 3 --out bench_gpu_27b.json

Weights are drawn on the device per tensor name (same seed, same weights in every process),
so no 54 GB of weights has to be written or shipped. Each engine runs in its own subprocess.
Reports prefill and decode tokens/s (medians), bytes a decoded token reads (weights + KV at
that depth + Gated DeltaNet state), achieved bandwidth and its fraction of the bound.
`--peer-fill synthetic` measures mlx-lm's decode at depth without its prefill (random K/V
rows in its cache; this CPU, tiny dims, 2,048 tokens: 347 tok/s vs 341 after a real prefill).
`--mlx-gemv-steps` also runs ours with a plain step's one-row products in MLX's own gemv
(the row-invariant kernel off, nothing padded): what decode would reach if a verify's rows
could match MLX's one-row order (they do not here, so speculative rounds would not be exact:
a measurement, not a mode the engine offers).
`--dims tiny --layers 4` smoke-tests the script on a CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import run_json_worker, settings  # noqa: E402


def config_and_shapes(dims: str, layers: int) -> tuple[dict, list]:
    from qwen38_backend.testing.tiny_qwen3_5 import tensor_shapes, text_config

    tc = text_config(dims, layers)
    tc["mtp_num_hidden_layers"] = 0
    config = {"model_type": "qwen3_5", "text_config": tc, "tie_word_embeddings": False}
    return config, tensor_shapes(tc, with_mtp=False)


def random_weights(shapes: list, dtype, seed: int = 0) -> dict:
    """Device-side random tensors with sane scales (no inf/NaN through 64 layers)."""
    import mlx.core as mx

    out = {}
    for name, shape in shapes:
        key = mx.random.key(seed * 1_000_003 + zlib.crc32(name.encode()))
        if name.endswith("A_log"):
            w = mx.log(mx.random.uniform(1.0, 16.0, shape, key=key))
        elif name.endswith("dt_bias"):
            w = mx.random.uniform(-0.5, 0.5, shape, key=key)
        elif "norm" in name:
            w = 0.05 * mx.random.normal(shape, key=key)
        else:
            fan_in = shape[-1] if len(shape) > 1 else 1
            w = mx.random.normal(shape, key=key) * (fan_in**-0.5)
        out[name] = w.astype(dtype)
        mx.eval(out[name])
    return out


def prompt(length: int, vocab: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(0).integers(vocab // 100, vocab // 2, size=length).tolist()


def bytes_per_token(
    config: dict, weights_bytes: int, depth: int, kv_itemsize: int, embed_bytes: int | None = None
) -> int:
    """Bytes one decode step reads at `depth`: the weights but the embedding (one row of it),
    the KV and the Gated DeltaNet states. embed_bytes: the embedding's stored bytes (None:
    unquantized, vocab x hidden x kv_itemsize)."""
    tc = config["text_config"]
    attn = sum(1 for t in tc["layer_types"] if t == "full_attention")
    gdn = len(tc["layer_types"]) - attn
    kv = attn * 2 * tc["num_key_value_heads"] * tc["head_dim"] * kv_itemsize * depth
    state = (
        gdn
        * tc["linear_num_value_heads"]
        * tc["linear_key_head_dim"]
        * tc["linear_value_head_dim"]
        * 4
        * 2
    )  # fp32 state read + written
    # the embedding is looked up one row per token, not read whole
    embed = (
        tc["vocab_size"] * tc["hidden_size"] * kv_itemsize if embed_bytes is None else embed_bytes
    )
    return weights_bytes - embed + embed // tc["vocab_size"] + kv + state


def _median(values: list[float]) -> dict:
    return {"median": statistics.median(values), "runs": values}


# ----- workers ---------------------------------------------------------------------------------
def quantize_random(net, bits: int, group_size: int = 64) -> None:
    """MLX affine quantization of every linear and embedding whose input width divides into
    groups (what an mlx-community 4-bit checkpoint of the model holds), in place."""
    import mlx.core as mx
    import mlx.nn as nn

    def predicate(_path: str, module) -> bool:
        weight = getattr(module, "weight", None)
        return (
            isinstance(module, (nn.Linear, nn.Embedding))
            and weight is not None
            and weight.shape[-1] % group_size == 0
        )

    nn.quantize(net, group_size=group_size, bits=bits, class_predicate=predicate)
    mx.eval(net.parameters())


def embed_bytes(net) -> int:
    """Stored bytes of the token embedding (quantized or not)."""
    from mlx.utils import tree_flatten

    for name, module in net.named_modules():
        if name.endswith("embed_tokens"):
            return sum(p.nbytes for _, p in tree_flatten(module.parameters()))
    raise ValueError("no embed_tokens module")


def random_model(
    dims: str, layers: int, dtype_name: str, group=None, bits: int = 0, group_size: int = 64
):
    """(Model, config, weight bytes): the family built with device-side random weights;
    split over `group`'s ranks when given (the same weights on every rank, then cut);
    `bits` > 0: then quantized (quantize_random)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    from qwen38_backend.engine import Model
    from qwen38_backend.loading import Weights
    from qwen38_backend.models import build_model
    from qwen38_backend.models.layers import fuse_projections

    dtype = getattr(mx, dtype_name)
    config, shapes = config_and_shapes(dims, layers)
    net = build_model(config)
    weights = net.sanitize(random_weights(shapes, dtype))
    nbytes = sum(w.nbytes for w in weights.values())
    net.update(tree_unflatten(list(weights.items())))
    del weights
    if bits:
        quantize_random(net, bits, group_size)
        nbytes = sum(p.nbytes for _, p in tree_flatten(net.parameters()))
    if group is not None and group.size() > 1:
        net.shard(group)
        mx.eval(net.parameters())
        mx.clear_cache()
    fuse_projections(net)
    read = Weights(
        config=config, tensors={}, quantization={}, generation_config={"eos_token_id": []}
    )
    return Model(net, read, dtype, name="27b-random", group=group), config, nbytes


def decode_times(model, state, logits, n: int, tokens: list[int] | None = None) -> list[float]:
    """Wall seconds to each of n greedy tokens decoded after the prefill's last `logits`, as
    generation decodes after a prompt (times[0]: sampling the first token; each later one a
    decode step); `tokens` gets the tokens. Feeding that first token through Model.run
    instead would prefill it: a prompt row attends densely, which reads every spilled page of
    a capped pool once."""
    from qwen38_backend.generation import GenerationStats
    from qwen38_backend.sampling import SamplingParams

    params = SamplingParams(max_tokens=n, stop_token_ids=[])
    times, t = [], time.perf_counter()
    for token in model.decode(logits, state, params, GenerationStats()):
        now = time.perf_counter()
        if tokens is not None:
            tokens.append(token)
        times.append(now - t)
        t = now
    return times


def decode_rate(times: list[float]) -> float:
    """Decode tok/s of decode_times' result: the steps after the first token."""
    return (len(times) - 1) / sum(times[1:])


def prefill_then_decode(
    model, ids: list[int], runs: int, decode: int, chunk: int | None = None
) -> tuple[list[float], list[float]]:
    """Per run: prefill `ids` into a fresh state (tok/s, synchronised), then decode `decode`
    greedy tokens after it (tok/s). Returns (prefill rates, decode rates)."""
    import mlx.core as mx

    pre, dec = [], []
    for _ in range(runs):
        state = model.new_state()
        mx.synchronize()
        t = time.perf_counter()
        logits = model.prefill(ids, state, chunk=chunk)
        mx.eval(logits)
        mx.synchronize()
        pre.append(len(ids) / (time.perf_counter() - t))
        dec.append(decode_rate(decode_times(model, state, logits, decode)))
        del state
        mx.clear_cache()
    return pre, dec


def worker_ours(args) -> dict:
    import os

    import mlx.core as mx

    if args.norm_prologue or args.fused:  # the products' norm prologue (rows.project)
        os.environ["QWEN38_ROWS_NORM"] = "auto"
    if args.fused:  # a Gated DeltaNet block's one-row step as one launch (kernels/fused.py)
        os.environ["QWEN38_FUSED_KERNEL"] = "auto"
    if args.op_by_op:
        from qwen38_backend.models.layers import PreNormBlock

        PreNormBlock.compile_decode = False
    if args.mlx_gemv_steps:  # one-row products: MLX's gemv (module docstring)
        from qwen38_backend import rows

        os.environ["QWEN38_ROWS_KERNEL"] = "off"
        unpadded = rows.unpadded
    else:
        from contextlib import nullcontext as unpadded
    if args.rows_chunk:
        from qwen38_backend.kernels import rows_matmul

        rows_matmul.CHUNK_BYTES = args.rows_chunk
    model, config, nbytes = random_model(
        args.dims, args.layers, args.dtype, bits=args.bits, group_size=args.group_size
    )
    args.chunk = args.chunk or model.prefill_chunk  # the engine's default unless given
    result = {
        "prefill_chunk": args.chunk,
        "weights_bytes": nbytes,
        "embed_bytes": embed_bytes(model.net),
        "lengths": {},
    }
    # warm-up: the first prefill compiles kernels (it ran at ~200 tok/s on the H200)
    warm = model.new_state()
    mx.eval(model.prefill(prompt(args.chunk, config["text_config"]["vocab_size"]), warm))
    del warm
    for length in args.lengths:
        ids = prompt(length, config["text_config"]["vocab_size"])
        with unpadded():
            pre, dec = prefill_then_decode(model, ids, args.runs, args.decode, args.chunk)
        result["lengths"][str(length)] = {
            "prefill_tok_s": _median(pre),
            "decode_tok_s": _median(dec),
            "peak_memory_bytes": mx.get_peak_memory(),
        }
    layers = model.net.model.layers
    result["fused_layers"] = sum(bool(getattr(b, "_fuse_linear_for", ())) for b in layers)
    return result


def worker_mlx_lm(args) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models import qwen3_5

    dtype = getattr(mx, args.dtype)
    config, shapes = config_and_shapes(args.dims, args.layers)
    model_args = qwen3_5.ModelArgs.from_dict(config)
    model = qwen3_5.Model(model_args)
    weights = model.sanitize(random_weights(shapes, dtype))
    model.load_weights(list(weights.items()), strict=False)
    del weights
    if args.bits:
        quantize_random(model, args.bits, args.group_size)
    mx.eval(model.parameters())
    result = {"lengths": {}}
    warm = generate_step(
        mx.array(prompt(2048, config["text_config"]["vocab_size"])), model, max_tokens=2
    )
    for _ in warm:
        pass
    if args.peer_fill == "synthetic":
        for length in args.lengths:
            dec = [synthetic_decode(model, length, args.decode, dtype) for _ in range(args.runs)]
            result["lengths"][str(length)] = {"prefill_tok_s": None, "decode_tok_s": _median(dec)}
        return result
    for length in args.lengths:
        ids = mx.array(prompt(length, config["text_config"]["vocab_size"]))
        pre, dec = [], []
        for _ in range(args.runs):
            t = time.perf_counter()
            gen = generate_step(ids, model, max_tokens=args.decode)
            next(gen)
            t1 = time.perf_counter()
            pre.append(length / (t1 - t))
            n = sum(1 for _ in gen)
            dec.append(n / (time.perf_counter() - t1))
            mx.clear_cache()
        result["lengths"][str(length)] = {
            "prefill_tok_s": _median(pre),
            "decode_tok_s": _median(dec),
        }
    return result


def synthetic_decode(model, length: int, decode: int, dtype) -> float:
    """mlx-lm's decode tok/s at `length` tokens of context without prefilling them (its
    CUDA prefill runs ~195 tok/s here: 131K would take 11 minutes): a 16-token prompt shapes
    its cache, then each attention layer's KVCache gets `length` random rows (what a decode
    step reads is the same bytes), and generate_step decodes from one more token."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(prompt(16, 1000))[None], cache=cache)
    for i, c in enumerate(cache):
        if isinstance(c, KVCache):
            _, hkv, _, d = c.keys.shape
            room = -(-(length + decode + 1) // c.step) * c.step
            keys = mx.random.split(mx.random.key(i))
            c.keys = mx.random.normal((1, hkv, room, d), key=keys[0]).astype(dtype)
            c.values = mx.random.normal((1, hkv, room, d), key=keys[1]).astype(dtype)
            c.offset = length
    mx.eval([c.state for c in cache])
    gen = generate_step(mx.array([5]), model, prompt_cache=cache, max_tokens=decode)
    next(gen)
    t = time.perf_counter()
    n = sum(1 for _ in gen)
    rate = n / (time.perf_counter() - t)
    del cache
    mx.clear_cache()
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dims", default="27b", choices=["27b", "tiny"])
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--lengths", default="4096,32768")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument(
        "--chunk",
        type=int,
        default=0,
        help="our prefill chunk (0: the engine's default, what users get; 4096 before session 27)",
    )
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--bits", type=int, default=0, choices=[0, 2, 3, 4, 5, 6, 8], help="0: none")
    ap.add_argument("--group-size", type=int, default=64, help="quantization group size")
    ap.add_argument("--peer", choices=["mlx-lm", "none"], default="mlx-lm")
    ap.add_argument("--peer-lengths", default=None, help="lengths for the peer (default: same)")
    ap.add_argument("--peer-runs", type=int, default=None)
    ap.add_argument(
        "--peer-fill",
        choices=["prefill", "synthetic"],
        default="prefill",
        help="mlx-lm's context: prefilled, or random K/V rows (decode only: synthetic_decode)",
    )
    ap.add_argument("--bound-gbps", type=float, default=4800.0, help="H200: 4.8 TB/s")
    ap.add_argument(
        "--op-by-op",
        action="store_true",
        help="also run ours with the compiled decode step off (what it buys, same run)",
    )
    ap.add_argument(
        "--mlx-gemv-steps",
        action="store_true",
        help="also run ours with one-row step products in MLX's gemv (module docstring)",
    )
    ap.add_argument(
        "--rows-chunk",
        type=int,
        default=0,
        choices=[0, 8, 16],
        help="the row-invariant kernel's chunk in bytes (kernels/rows_matmul.py; 0: its default)",
    )
    ap.add_argument(
        "--norm-prologue",
        action="store_true",
        help="also run ours with the products' norm prologue on (QWEN38_ROWS_NORM=auto)",
    )
    ap.add_argument(
        "--fused",
        action="store_true",
        help="also run ours with each Gated DeltaNet block's one-row step as one fused launch "
        "(QWEN38_FUSED_KERNEL=auto, with the norm prologue, which it needs)",
    )
    ap.add_argument("--worker", choices=["ours", "mlx-lm"], default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.lengths = [int(x) for x in str(args.lengths).split(",")]

    if args.worker:
        fn = worker_ours if args.worker == "ours" else worker_mlx_lm
        print(json.dumps(fn(args)))
        return

    def spawn(which: str, lengths: list[int], runs: int, variant: str = "") -> dict:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", which]
        cmd += [f"--{variant}"] if variant else []
        names = ("dims", "layers", "decode", "chunk", "dtype", "bits", "group_size", "peer_fill")
        for k in (*names, "rows_chunk"):
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
        cmd += ["--lengths", ",".join(map(str, lengths)), "--runs", str(runs)]
        return run_json_worker(cmd)

    import mlx.core as mx

    config, _ = config_and_shapes(args.dims, args.layers)
    result = {
        "benchmark": "27b-dims random weights",
        "dims": args.dims,
        "layers": args.layers,
        "dtype": args.dtype,
        "bits": args.bits or None,
        "settings": settings(),
        "group_size": args.group_size if args.bits else None,
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "bound_bytes_s": args.bound_gbps * 1e9,
        "rows_chunk": args.rows_chunk or None,
    }
    result["ours"] = spawn("ours", args.lengths, args.runs)
    if args.op_by_op:
        result["ours_op_by_op"] = spawn("ours", args.lengths, args.runs, "op-by-op")
    if args.mlx_gemv_steps:
        result["ours_mlx_gemv_steps"] = spawn("ours", args.lengths, args.runs, "mlx-gemv-steps")
    if args.norm_prologue:
        result["ours_norm_prologue"] = spawn("ours", args.lengths, args.runs, "norm-prologue")
    if args.fused:
        result["ours_fused"] = spawn("ours", args.lengths, args.runs, "fused")
    if args.peer == "mlx-lm":
        peer_lengths = [
            int(x) for x in (args.peer_lengths or ",".join(map(str, args.lengths))).split(",")
        ]
        result["mlx_lm"] = spawn("mlx-lm", peer_lengths, args.peer_runs or args.runs)
    itemsize = 2 if args.dtype in ("bfloat16", "float16") else 4
    for length in args.lengths:
        key = str(length)
        ours = result["ours"].get("lengths", {}).get(key)
        if not ours:
            continue
        per_token = bytes_per_token(
            config,
            result["ours"]["weights_bytes"],
            length + args.decode // 2,
            itemsize,
            result["ours"].get("embed_bytes"),
        )
        variants = ("op_by_op", "mlx_gemv_steps", "norm_prologue", "fused")
        for name in ("ours", *(f"ours_{v}" for v in variants), "mlx_lm"):
            entry = result.get(name, {}).get("lengths", {}).get(key)
            if entry:
                rate = entry["decode_tok_s"]["median"]
                entry["bytes_per_token"] = per_token
                entry["fraction_of_bound"] = per_token * rate / result["bound_bytes_s"]
        peer = result.get("mlx_lm", {}).get("lengths", {}).get(key)
        if peer and peer["prefill_tok_s"]:
            ours["prefill_ratio_vs_mlx_lm"] = (
                ours["prefill_tok_s"]["median"] / peer["prefill_tok_s"]["median"]
            )
        if peer:
            ours["decode_ratio_vs_mlx_lm"] = (
                ours["decode_tok_s"]["median"] / peer["decode_tok_s"]["median"]
            )
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
