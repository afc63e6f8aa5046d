"""One rank of a sharded run, started by tests/test_sharding.py under
`mlx.launch -n N --backend ring` (also runs unchanged under the NCCL backend on GPUs).

Loads MODEL split over the world group and writes rank 0's results to OUT/result.npz:
full-prompt logits, greedy tokens with the contiguous and the paged store, and the greedy
continuation after each rank saved its state file and restored it into a fresh state.
Every rank writes OUT/rank{r}.state (its part of the state).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

import qwen38_backend
from qwen38_backend.state_files import restore_state_file, save_state_file


def greedy(model, prompt: list[int], n: int, **kv_options) -> list[int]:
    return list(model.generate_tokens(prompt, max_tokens=n, temperature=0.0, **kv_options))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out", type=Path)
    parser.add_argument("--prompt", required=True, help="comma-separated token ids")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--paged", action="store_true", help="also decode with paged KV")
    args = parser.parse_args()
    group = mx.distributed.init()
    model = qwen38_backend.load(args.model, dtype=args.dtype, group=group)
    prompt = [int(t) for t in args.prompt.split(",")]

    logits = model.logits(prompt)
    tokens = greedy(model, prompt, args.tokens)
    paged = (
        greedy(model, prompt, args.tokens, kv_paged="on", kv_page_tokens=8) if args.paged else []
    )

    # each rank saves its part after the prompt, restores it into a fresh state, continues
    state = model.new_state()
    model.prefill(prompt, state)
    path = args.out / f"rank{group.rank()}.state"
    save_state_file(path, state, model)
    restored = model.new_state()
    restore_state_file(path, model, restored)
    logits_after = model.forward(tokens[:1], restored, last_only=True)
    mx.eval(logits_after)

    if group.rank() == 0:
        np.savez(
            args.out / "result.npz",
            logits=logits,
            tokens=np.array(tokens),
            paged=np.array(paged),
            after_restore=np.array(logits_after.astype(mx.float32)),
            weights_bytes=np.array(sum(p.nbytes for _, p in tree_flatten(model.net.parameters()))),
        )
        (args.out / "meta.json").write_text(json.dumps({"world": group.size()}))


if __name__ == "__main__":
    main()
