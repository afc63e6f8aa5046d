"""How many spilled pages a Quest decode step fetches: real text against random token ids.

    python benchmarks/spill_fetch_rate.py --model qwen38-demo --prompt 4096 --decode 32 \
        --pools 1024,2048 --topk 512 --out benchmarks/results/cpu/spill_fetch_rate_demo.json

The H200 spilled-decode runs use random weights and random prompts, whose Quest selection
changes from step to step; a fetch costs host work and a wait, so the fetch rate decides the
spilled/resident ratio. Here the demo model (real weights) prefills `--prompt` tokens of real
English (quest_reference.py's texts) or of random ids into a paged state whose pool holds
`--pools` tokens per layer (the rest spills), then decodes greedily; reported per input and
pool: pages fetched per attention layer and decode step (after the prefill), the pages a step
selects, and the share of the selection that had to be fetched.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
from common import environment, write_json
from quest_reference import load_text

import qwen38_backend
from qwen38_backend.kv import collect_kv_stats
from qwen38_backend.sampling import SamplingParams


def prompt_ids(model, kind: str, n: int) -> list[int]:
    if kind == "random":
        rng = np.random.default_rng(0)
        return rng.integers(100, min(model.config.vocab_size, 32000) - 100, n).tolist()
    ids = model.tokenizer.encode(load_text(kind))
    if len(ids) < n:
        raise SystemExit(f"text {kind!r} has {len(ids)} tokens, fewer than --prompt {n}")
    return ids[:n]


def one_run(model, ids: list[int], decode: int, pool: int, topk: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="qwen38-spill-") as spill_dir:
        state = model.new_state(
            kv_paged="on", kv_topk=topk, kv_pool_tokens=pool, kv_spill_dir=spill_dir
        )
        t = time.perf_counter()
        logits = model.prefill(ids, state)
        prefill_seconds = time.perf_counter() - t
        before = collect_kv_stats(state)
        first = int(logits.argmax().item())
        params = SamplingParams(max_tokens=decode, stop_token_ids=[])
        t = time.perf_counter()
        tokens = list(model.run([first], state, params))
        decode_seconds = time.perf_counter() - t
        after = collect_kv_stats(state)
        state.close()
    layers = sum(1 for layer in state.layers if hasattr(layer, "budget_pages"))
    # the counters are summed over layers, the step counts are per layer (collect_kv_stats)
    layer_steps = (after["sparse_steps"] - before["sparse_steps"]) * layers
    fetched = after["pages_fetched"] - before["pages_fetched"]
    kv_heads = model.config.num_key_value_heads  # pages_selected counts per KV head
    selected = (after["pages_selected"] - before["pages_selected"]) / kv_heads
    return {
        "pool_tokens": pool,
        "attention_layers": layers,
        "layer_steps": layer_steps,
        "fetched_per_layer_step": fetched / layer_steps if layer_steps else None,
        "selected_per_layer_step": selected / layer_steps if layer_steps else None,
        "fetched_share_of_selection": fetched / selected if selected else None,
        "prefill_seconds": prefill_seconds,
        "decode_tok_s": len(tokens) / decode_seconds,
        "tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen38-demo")
    ap.add_argument(
        "--inputs", default="numpy_license,random", help="quest_reference texts or random"
    )
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--pools", default="1024,2048")
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = qwen38_backend.load(args.model)
    result: dict = {"environment": environment(), "args": vars(args), "runs": {}}
    for kind in args.inputs.split(","):
        ids = prompt_ids(model, kind, args.prompt)
        for pool in (int(p) for p in args.pools.split(",")):
            row = one_run(model, ids, args.decode, pool, args.topk)
            result["runs"].setdefault(kind, {})[str(pool)] = row
            print(kind, {k: v for k, v in row.items() if k != "tokens"}, flush=True)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
