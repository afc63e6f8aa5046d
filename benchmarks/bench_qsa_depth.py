"""Flash-Next (qwen4_exp) at depth: per-depth records of bounded QSA attention.

    # CPU (reduced widths, 4 layers = 3 Gated DeltaNet + 1 QSA, fp32):
    python benchmarks/bench_qsa_depth.py --lengths 2048,4096,8192,16384 --decode 16 \
        --out benchmarks/results/cpu/qsa_depth_reduced.json
    # H200 (real per-layer widths, 8 layers = 2 QSA, 512 experts, bf16):
    python benchmarks/bench_qsa_depth.py --dims flash --layers 8 --experts 512 \
        --dtype bfloat16 --lengths 2048,16384,65536,131072,262144 --decode 64 --peer-max 0

The model is built in-process with random weights (device-side, a seed per tensor name), in
the real weight layout, so nothing is written or shipped. The QSA budget (indexer_budget 2048,
compress ratio 4) is the real one in both dims, so past 2,051 tokens every QSA query attends
2,048 selected tokens plus a 0..3-token causal tail.

Per depth, in one process (greedy decoding, logits read back every token):
- prefill tok/s (`--chunk` tokens per forward), the last position's logits sha256 (fp32
  bytes) and greedy token;
- decode tok/s over `--decode` tokens, median of `--runs` (each run rewinds to the prompt
  boundary through a save point and replays); every replay must give the same tokens and
  logits sha256 ("rewind_replay_identical");
- live attention bytes per decoded token (QSA layers: the gathered K/V rows plus the pooled
  block keys the indexer scores), the sequence state's resident bytes, peak memory of the
  depth (mx.get_peak_memory after a reset) and process peak RSS;
- a state file written at the prompt boundary, its bytes, then restored into a fresh state and
  decoded again: same tokens and logits sha256 ("state_file_identical");
- peer, measured in the same process: the [T, context] masked attention that bounded QSA
  replaced (prefill tok/s and logits sha vs ours), at depths <= `--peer-max` (its scores are
  O(chunk x context); 0 turns it off).
The summary gives decode tok/s at each depth as a ratio of decode at the first depth (the
goal: >= 0.95 at 262,144 vs 2,048).

Flags:
  --dims reduced|flash   reduced: hidden 256, 8/2 heads x 64, GDN 4/12 x 32, 8 experts top-2,
                         vocab 4096 (a CPU-sized Flash-Next); flash: the real per-layer widths
                         (hidden 2560, 24/2 heads x 256, GDN 16/48 x 128, hc 4 x 320, vocab
                         248,320, top-10 of --experts, indexer 4 x 128)
  --layers N             layers (a multiple of 4: every 4th is QSA); default 4
  --experts N            experts per MoE layer (flash default 16; real Flash-Next: 512)
  --ngram-base N         PLE n-gram vocab base (default 1000 reduced / 20000 flash; real 2e7)
  --lengths a,b,...      prompt depths (tokens)
  --decode N             decoded tokens per run; --runs N: decode runs per depth (median)
  --chunk N              prefill tokens per forward (default: the engine's prefill chunk)
  --dtype                float32 (CPU default) or bfloat16 (GPU default)
  --kv-paged on|off      QSA K/V in the paged store (default on) or the contiguous one
  --page-tokens N        kv_page_tokens (a multiple of 4; default 32)
  --pool-tokens N        kv_pool_tokens (bounded pool, spills to --spill-dir)
  --peer-max N           largest depth at which the masked peer runs (default 8192)
  --experts-bits N       MLX-affine quantize the expert stacks (4 or 8, group --group-size
                         64), kept packed as a quantized checkpoint's (gather_qmm); default off
  --seed N               weights seed; --out FILE: write the JSON there too
  --op-by-op             decode with the block steps built op by op (the compiled steps off)
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import environment, write_json  # noqa: E402

REDUCED = dict(
    vocab_size=4096,
    hidden_size=256,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=12,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=128,
    hc_lowrank=32,
    ple_embed_dim=256,
    ngram_vocab_size_base=1000,
    split_ngram_parts=4,
    indexer_head_dim=32,
    eos_token_id=7,
    bos_token_id=7,
    mrope_section=[3, 3, 2],  # 16 rotary dims of 64
)


def flash_config(dims: str, layers: int, experts: int | None, ngram_base: int | None) -> dict:
    from qwen38_backend.testing.tiny_qwen4_exp import FLASH, full_config, text_config

    c = text_config("flash", layers)
    if dims == "reduced":
        c.update({k: v for k, v in REDUCED.items() if k != "mrope_section"})
        rope = dict(c["rope_parameters"], mrope_section=REDUCED["mrope_section"])
        c["rope_parameters"] = rope
    c["mtp_num_hidden_layers"] = 0
    c["max_position_embeddings"] = FLASH["max_position_embeddings"]
    if experts:
        c["num_experts"] = experts
    if ngram_base:
        c["ngram_vocab_size_base"] = ngram_base
    return full_config(c)


EXPERT_STACKS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
LAYER = "model.language_model.layers."


def random_model(
    config: dict,
    dtype_name: str,
    seed: int,
    experts_bits: int | None = None,
    group_size: int = 64,
    log=None,
):
    """(Model, weight bytes) with device-side random weights in the real layout.

    experts_bits: every fused expert stack is drawn (in the model dtype) and MLX-affine
    quantized at once, its float copy freed before the next, so peak memory stays near the
    packed size; the triplets then go through the loader's `assign_weights` as a quantized
    checkpoint's would (QuantizedExperts, gather_qmm). Weight bytes exclude the n-gram table
    (the loader memory-maps it; `ngram_table_bytes` counts it). log(msg): progress per layer.
    """
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten

    from qwen38_backend.engine import Model
    from qwen38_backend.loading import Weights
    from qwen38_backend.models import build_model
    from qwen38_backend.models.assign import assign_weights
    from qwen38_backend.models.layers import fuse_projections
    from qwen38_backend.testing import tiny_qwen4_exp as tq

    dtype = getattr(mx, dtype_name)
    tc = config["text_config"]
    net = build_model(config)
    weights, quantization, layer = {}, {}, None
    for name, (shape, kind) in tq.tensor_shapes(tc).items():
        if log is not None and name.startswith(LAYER) and name.split(".")[3] != layer:
            layer = name.split(".")[3]
            done = sum(w.nbytes for w in weights.values())
            log(f"weights: layer {layer}/{tc['num_hidden_layers']}, {done / 1e9:.2f} GB so far")
        if kind.startswith("buffer:"):  # the n-gram hash buffers: exact int64 values
            weights[name] = mx.array(np.concatenate(list(tq._values(name, shape, kind, 0, tc))))
            continue
        key = mx.random.key(seed * 1_000_003 + zlib.crc32(name.encode()))
        if experts_bits and name.endswith(EXPERT_STACKS):
            w = mx.random.normal(shape, dtype, scale=shape[-1] ** -0.5, key=key)
            packed = mx.quantize(w, group_size, experts_bits)
            mx.eval(*packed)
            del w
            mx.clear_cache()  # the float stack's buffer: not kept for the packed ones
            for part, value in zip(("weight", "scales", "biases"), packed, strict=True):
                weights[f"{name}.{part}"] = value
            quantization[name] = (group_size, experts_bits)
            continue
        n = mx.random.normal(shape, key=key)
        if kind == "A_log":
            w = mx.log(mx.random.uniform(0.5, 4.0, shape, key=key))
        elif kind in ("linear", "router"):
            w = n * (shape[-1] ** -0.5)
        elif kind in ("zc_norm", "conv", "dt_bias"):
            w = n * 0.2
        elif kind == "plain_norm":
            w = 1.0 + n * 0.2
        else:  # embed, table
            w = n
        weights[name] = w.astype(dtype)
        mx.eval(weights[name])
    assign_weights(net, weights, quantization, dtype, dequantize=False)
    nbytes = sum(w.nbytes for _, w in tree_flatten(net.parameters()))
    fuse_projections(net)
    read = Weights(
        config=config,
        tensors={},
        quantization=quantization,
        generation_config={"eos_token_id": []},
    )
    return Model(net, read, dtype, name="flash-next-random"), nbytes


def flash_model(layers: int, experts: int = 512, dtype_name: str = "bfloat16"):
    """(Model, config): Flash-Next's real per-layer dims over `layers` layers, `experts`
    experts a layer in 4-bit, the rest in `dtype_name`, random weights (the probes' model)."""
    config = flash_config("flash", layers, experts, None)
    model, _ = random_model(config, dtype_name, 0, experts_bits=4)
    return model, config


def prompt(length: int, vocab: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(length).integers(10, vocab - 1, size=length).tolist()


def sha(logits) -> str:
    import mlx.core as mx
    import numpy as np

    return hashlib.sha256(np.array(logits.astype(mx.float32)).tobytes()).hexdigest()


def greedy(logits) -> int:
    import mlx.core as mx

    return int(mx.argmax(logits.reshape(-1, logits.shape[-1])[-1].astype(mx.float32)).item())


def decode(model, state, first: int, n: int) -> tuple[float, list[int], str]:
    """(tok/s, tokens, sha256 of the last step's logits): n greedy steps from `first`."""
    tokens, tok, last = [], first, None
    t = time.perf_counter()
    for _ in range(n):
        last = model.forward([tok], state, last_only=True)
        tok = greedy(last)
        tokens.append(tok)
    return n / (time.perf_counter() - t), tokens, sha(last)


def prefill(model, ids: list[int], state, chunk: int):
    """(tok/s, last logits)."""
    import mlx.core as mx

    t = time.perf_counter()
    last = None
    for a in range(0, len(ids), chunk):
        last = model.forward(ids[a : a + chunk], state, last_only=True)
        mx.eval(last)
    return len(ids) / (time.perf_counter() - t), last


def attention_bytes(model, depth: int, item: int) -> int:
    """Bytes one decoded token's QSA layers read: gathered K/V rows + pooled block keys."""
    cfg = model.net.config
    ratio, n_blocks = cfg.indexer_compress_ratio, cfg.indexer_budget // cfg.indexer_compress_ratio
    p = depth  # the decoded token's position
    nvis = (p + 1) // ratio
    rows = p + 1 if nvis <= n_blocks else n_blocks * ratio + (p + 1) - nvis * ratio
    kv = rows * cfg.num_key_value_heads * cfg.head_dim * 2 * item
    scored = nvis * cfg.indexer_head_dim * item if nvis > n_blocks else 0
    n_qsa = sum(1 for t in cfg.layer_types if t != "linear_attention")
    return n_qsa * (kv + scored)


def masked_attend(self, q, qi, positions, st, offset):
    """The peer: the [T, context] masked attention bounded QSA replaced (contiguous KV)."""
    import mlx.core as mx

    from qwen38_backend.models import qsa

    blocks = self.select(qi, positions, st)
    n = st.kv.length
    mask = qsa.token_mask(blocks, positions, self.ratio, n)
    keys, values = st.kv.keys[..., :n, :], st.kv.values[..., :n, :]
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)


def one_depth(model, depth: int, args, kv: dict, vocab: int) -> dict:
    import mlx.core as mx

    from qwen38_backend.models import qsa
    from qwen38_backend.state_files import restore_state_file, save_state_file

    ids = prompt(depth, vocab)
    chunk = args.chunk or model.prefill_chunk
    mx.clear_cache()
    mx.reset_peak_memory()
    state = model.new_state(**kv)
    pre_tps, last = prefill(model, ids, state, chunk)
    first = greedy(last)
    rec = {"prefill_tokens_per_second": pre_tps, "logits_sha256": sha(last), "greedy": first}
    state.save_point()
    runs, outs = [], []
    for _ in range(args.runs):
        tps, toks, digest = decode(model, state, first, args.decode)
        runs.append(tps)
        outs.append((toks, digest))
        state.truncate(depth)
    rec["decode_tokens_per_second"] = {"median": statistics.median(runs), "runs": runs}
    rec["decoded"] = outs[0][0]
    rec["rewind_replay_identical"] = all(o == outs[0] for o in outs)
    rec["state_bytes"] = state.nbytes()
    rec["live_attention_bytes_per_token"] = attention_bytes(model, depth, model.dtype.size)
    rec["peak_memory_bytes"] = mx.get_peak_memory()
    rec["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "depth.ckpt.safetensors"
        t = time.perf_counter()
        save_state_file(path, state, model)
        rec["state_file_write_seconds"] = time.perf_counter() - t
        rec["state_file_bytes"] = path.stat().st_size
        del state
        fresh = model.new_state(**kv)
        t = time.perf_counter()
        restore_state_file(path, model, fresh)
        rec["state_file_restore_seconds"] = time.perf_counter() - t
    _, toks, digest = decode(model, fresh, first, args.decode)
    rec["state_file_identical"] = (toks, digest) == outs[0]
    del fresh
    if depth <= args.peer_max:
        mx.clear_cache()
        peer_state = model.new_state()  # the masked peer reads the contiguous store
        ours_tps, ours_last = prefill(model, ids, peer_state, chunk)
        del peer_state
        real = qsa.QSAAttention._attend_selected
        qsa.QSAAttention._attend_selected = masked_attend
        try:
            peer_state = model.new_state()
            peer_tps, peer_last = prefill(model, ids, peer_state, chunk)
        finally:
            qsa.QSAAttention._attend_selected = real
        del peer_state
        diff = mx.abs(ours_last.astype(mx.float32) - peer_last.astype(mx.float32)).max()
        rec["peer_masked"] = {
            "ours_contiguous_prefill_tokens_per_second": ours_tps,
            "masked_prefill_tokens_per_second": peer_tps,
            "ratio_ours_over_masked": ours_tps / peer_tps,
            "last_logits_max_abs_diff": float(diff.item()),
            "same_greedy": greedy(peer_last) == greedy(ours_last),
        }
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="reduced", choices=["reduced", "flash"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=None)
    ap.add_argument("--ngram-base", type=int, default=None)
    ap.add_argument("--lengths", default="2048,4096,8192,16384")
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--kv-paged", default="on", choices=["on", "off"])
    ap.add_argument("--page-tokens", type=int, default=32)
    ap.add_argument("--pool-tokens", type=int, default=None)
    ap.add_argument("--spill-dir", default=None)
    ap.add_argument("--peer-max", type=int, default=8192)
    ap.add_argument("--experts-bits", type=int, default=None, choices=[2, 3, 4, 5, 6, 8])
    ap.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--op-by-op", action="store_true", help="decode without the compiled block steps"
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.layers < 4 or args.layers % 4:
        ap.error(f"--layers {args.layers}: a multiple of 4 (every 4th layer is QSA)")
    lengths = [int(x) for x in args.lengths.split(",")]
    if any(n < 1 for n in lengths) or args.decode < 1 or args.runs < 1:
        ap.error("--lengths, --decode and --runs must be positive")

    import mlx.core as mx

    if args.op_by_op:
        from qwen38_backend.models.qwen4_exp import Qwen4ExpBlock

        Qwen4ExpBlock.compile_decode = False
    dtype = args.dtype or ("float32" if mx.default_device() == mx.cpu else "bfloat16")
    config = flash_config(args.dims, args.layers, args.experts, args.ngram_base)
    t = time.perf_counter()
    model, weights_bytes = random_model(
        config, dtype, args.seed, args.experts_bits, args.group_size
    )
    kv = {}
    if args.kv_paged == "on":
        kv = {"kv_paged": "on", "kv_page_tokens": args.page_tokens}
        if args.pool_tokens:
            kv.update(kv_pool_tokens=args.pool_tokens, kv_spill_dir=args.spill_dir)
    vocab = config["text_config"]["vocab_size"]
    result = {
        "environment": environment(),
        "dims": args.dims,
        "layers": args.layers,
        "experts": config["text_config"]["num_experts"],
        "dtype": dtype,
        "experts_bits": args.experts_bits,
        "compiled_decode": not args.op_by_op,
        "weights_bytes": weights_bytes,
        "build_seconds": time.perf_counter() - t,
        "kv_options": kv,
        "prefill_chunk": args.chunk or model.prefill_chunk,
        "decode_tokens": args.decode,
        "runs": args.runs,
        "depths": {},
    }
    warm = model.new_state(**kv)
    mx.eval(model.forward(prompt(64, vocab), warm, last_only=True))  # compile kernels
    del warm
    for depth in lengths:
        result["depths"][str(depth)] = one_depth(model, depth, args, kv, vocab)
        print(f"depth {depth}: {result['depths'][str(depth)]}", file=sys.stderr, flush=True)
    base = result["depths"][str(lengths[0])]["decode_tokens_per_second"]["median"]
    result["decode_ratio_vs_first_depth"] = {
        d: r["decode_tokens_per_second"]["median"] / base for d, r in result["depths"].items()
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
