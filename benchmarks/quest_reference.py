"""Dense reference runs for the Quest quality benchmark (quest_quality.py), cached on disk.

One dense prefill per text is the expensive part on this CPU, so it is done once and kept:
the prefix's K/V, the logits after it, a teacher-forced dense decode of the next `steps`
tokens (log-probs, and each attention layer's query per step) and a dense greedy run.

Texts are real English the environment installs (no download): numpy's wheel LICENSE.txt
(its BSD licence, the licences of bundled code, then the GPL-3 in full; the decoded positions
fall inside the GPL) and pydantic's package description (README and changelog).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from bench_kv import prefill

from qwen38_backend.kv import ContiguousKV

TEXTS = {
    # name: (dist-info glob under site-packages, file)
    "numpy_license": ("numpy-*.dist-info", "licenses/LICENSE.txt"),
    "pydantic_docs": ("pydantic-*.dist-info", "METADATA"),
}


def text_path(name: str) -> Path:
    import site

    pattern, member = TEXTS[name]
    for root in site.getsitepackages():
        for dist in sorted(Path(root).glob(pattern)):
            if (dist / member).is_file():
                return dist / member
    raise SystemExit(f"text {name!r}: no {pattern}/{member} in site-packages")


def load_text(name: str) -> str:
    return text_path(name).read_text(encoding="utf-8")


class RecordingKV(ContiguousKV):
    """The contiguous store, remembering each decode step's query [Hq, D] (fp32)."""

    state_kind = "ContiguousKV"  # the same snapshot format

    def __init__(self) -> None:
        super().__init__()
        self.queries: list[mx.array] = []

    def attend(self, q, k, v, scale):
        if q.shape[2] == 1:
            self.queries.append(q[0, :, 0, :].astype(mx.float32))
        return super().attend(q, k, v, scale)


def log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def reference(net, tok, name: str, prefix: int, steps: int, greedy_n: int, cache: Path) -> Path:
    """Compute (or reuse) the dense reference of one text; returns its .npz path."""
    text = load_text(name)
    ids = tok.encode(text)[: prefix + steps + 1]
    if len(ids) < prefix + steps + 1:
        raise SystemExit(f"text {name!r} has {len(ids)} tokens, need {prefix + steps + 1}")
    digest = hashlib.sha256(np.array(ids, np.int64).tobytes()).hexdigest()[:16]
    path = cache / f"ref_{name}_{prefix}_{steps}_{greedy_n}_{digest}.npz"
    if path.exists():
        return path
    state = net.make_state(kv_factory=RecordingKV)
    t0 = time.perf_counter()
    last = prefill(net, ids[:prefix], state)
    prefill_s = time.perf_counter() - t0
    kv_prefix = [(layer.keys[0, :, :prefix], layer.values[0, :, :prefix]) for layer in state.layers]
    kv_prefix = [(mx.array(k), mx.array(v)) for k, v in kv_prefix]
    mx.eval(kv_prefix)
    snap = state.snapshot()
    # Teacher-forced dense decode: feed ids[prefix + i], predict ids[prefix + i + 1].
    logprobs = []
    t0 = time.perf_counter()
    for i in range(steps):
        token = ids[prefix + i]
        out = net(mx.array([token], dtype=mx.int32), state, last_only=True)[-1]
        state.advance([token])
        lp = log_softmax(out)
        mx.eval(lp)
        logprobs.append(np.array(lp))
    forced_s = time.perf_counter() - t0
    queries = np.stack(
        [np.stack([np.array(q) for q in layer.queries]) for layer in state.layers]
    )  # [layers, steps, Hq, D]
    keys = np.stack([np.array(layer.keys[0, :, : prefix + steps]) for layer in state.layers])
    values = np.stack([np.array(layer.values[0, :, : prefix + steps]) for layer in state.layers])
    # Dense greedy from the prefix.
    g_state = net.make_state(kv_factory=ContiguousKV)
    g_state.restore(snap)
    logits, out = last, []
    for _ in range(greedy_n):
        token = int(mx.argmax(logits).item())
        out.append(token)
        logits = net(mx.array([token], dtype=mx.int32), g_state, last_only=True)[-1]
        g_state.advance([token])
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        ids=np.array(ids, np.int64),
        last_logits=np.array(last.astype(mx.float32)),
        prefix_keys=np.stack([np.array(k) for k, _ in kv_prefix]),
        prefix_values=np.stack([np.array(v) for _, v in kv_prefix]),
        logprobs=np.stack(logprobs),
        queries=queries,
        keys=keys,
        values=values,
        greedy=np.array(out, np.int64),
        seconds=np.array([prefill_s, forced_s]),
    )
    tmp.rename(path)
    return path
