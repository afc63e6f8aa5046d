"""Flash-Next n-gram PLE: a hashed bi/tri-gram embedding injected into every residual stream.

Per position the token and its two predecessors (reset to EOS across an EOS) are hashed into
`(ngram_size - 1) * heads_per_ngram` rows of one big table (51B parameters in the real model):
the table is memory-mapped and only the gathered rows are materialised. The embedding gates a
value per stream by its agreement with the residual, then a dilated depthwise conv adds local
context. Decode state: the last `(kernel - 1) * dilation` rows of the conv input and the last
`ngram_size - 1` token ids.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import WeightsError
from ..rows import per_row
from ..state import Replayable, RewindError
from .hyper_connections import GroupedRMSNorm
from .layers import compiled

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_PRIME_1 = 10007


def _splitmix64(x: int) -> int:
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def ngram_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Odd hash multipliers per n-gram position; bounded so token * m fits in int64."""
    half = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _PRIME_1 * ple_index
    return [
        2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half) + 1 for i in range(ngram_size)
    ]


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def head_vocab_sizes(base: int, n_heads: int, ple_index: int = 0) -> list[int]:
    """The primes >= base, consecutive; PLE layer i takes the i-th run of n_heads of them."""
    primes, p = [], base - 1
    while len(primes) < (ple_index + 1) * n_heads:
        p += 1
        while not _is_prime(p):
            p += 1
        primes.append(p)
    return primes[ple_index * n_heads :]


def ngram_rows(
    history: np.ndarray,
    n_new: int,
    eos: int,
    multipliers: list[int],
    sizes: np.ndarray,
    offsets: np.ndarray,
    heads_per_ngram: int,
) -> np.ndarray:
    """Table rows [n_new, heads] for the last n_new ids of `history` (int64, context first).

    A predecessor at or before the last EOS strictly before a position reads as EOS.
    """
    n = len(multipliers)
    pos = np.arange(len(history))
    eos_at = np.where(history == eos, pos, -1)
    last_eos_incl = np.maximum.accumulate(eos_at)
    prev_eos = np.concatenate([[-1], last_eos_incl[:-1]])  # last EOS strictly before p
    seg_start = prev_eos + 1
    shifted = []
    for s in range(n):
        src = pos - s
        ok = (src >= seg_start) & (src >= 0)
        shifted.append(np.where(ok, history[np.maximum(src, 0)], eos).astype(np.int64))
    blocks = []
    mixed = shifted[0] * np.int64(multipliers[0])
    for order in range(2, n + 1):
        mixed = np.bitwise_xor(mixed, shifted[order - 1] * np.int64(multipliers[order - 1]))
        lo = (order - 2) * heads_per_ngram
        v, o = sizes[lo : lo + heads_per_ngram], offsets[lo : lo + heads_per_ngram]
        blocks.append(np.remainder(mixed[:, None], v[None, :]) + o[None, :])
    return np.concatenate(blocks, axis=1)[-n_new:]


# ----- the table -------------------------------------------------------------------------------
_DT = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}
# MLX-array shards up to this size are joined into one (a real table, ~102 GB, is
# memory-mapped from its checkpoint instead: from_safetensors)
JOIN_BYTES = 1 << 30


def _to_f32(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


class NgramTable:
    """Row store over the shards in numeric order: memory-mapped files or (small) MLX arrays."""

    def __init__(self, shards: list, dtypes: list[str] | None = None):
        self.shards = shards
        self.dtypes = dtypes  # set for numpy memmaps (safetensors dtype names)
        self.ends = np.cumsum([s.shape[0] for s in shards])
        self.rows = int(self.ends[-1]) if shards else 0
        self.dim = int(shards[0].shape[1]) if shards else 0

    @classmethod
    def from_arrays(cls, shards: list[mx.array]) -> NgramTable:
        """Shards held as MLX arrays (weights built in process, not a checkpoint directory):
        joined into one array when small, so a step's rows are one gather, not one per
        shard plus the copies that put them back in order."""
        shards = list(shards)
        if len(shards) > 1 and sum(s.nbytes for s in shards) <= JOIN_BYTES:
            shards = [mx.concatenate(shards, axis=0)]
        return cls(shards)

    @classmethod
    def from_safetensors(cls, directory: Path, pattern: re.Pattern) -> NgramTable | None:
        """Memory-map every tensor whose name matches `pattern` (group 1 = shard number)."""
        directory = Path(directory)
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [p.name for p in sorted(directory.glob("*.safetensors"))]
        found: dict[int, tuple[np.ndarray, str]] = {}
        for fname in files:
            path = directory / fname
            with open(path, "rb") as f:
                (hlen,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(hlen))
            for name, info in header.items():
                m = pattern.search(name) if name != "__metadata__" else None
                if m is None:
                    continue
                if info["dtype"] not in _DT:
                    raise WeightsError(f"{path}: {name} has unsupported dtype {info['dtype']}")
                start, end = info["data_offsets"]
                shape = tuple(info["shape"])
                arr = np.memmap(path, _DT[info["dtype"]], "r", 8 + hlen + start, shape)
                if arr.nbytes != end - start:
                    raise WeightsError(f"{path}: {name} byte size does not match its shape")
                found[int(m.group(1))] = (arr, info["dtype"])
        if not found:
            return None
        order = sorted(found)
        if order != list(range(len(order))):
            raise WeightsError(f"{directory}: n-gram table shards are not 0..N-1: {order[:8]}...")
        return cls([found[i][0] for i in order], [found[i][1] for i in order])

    def gather(self, rows: np.ndarray) -> mx.array:
        """rows (any shape, int64) -> float32 [*rows.shape, dim]; reads only those rows."""
        flat = rows.reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= self.rows):
            raise WeightsError(f"n-gram row out of range (table has {self.rows} rows)")
        shard = np.searchsorted(self.ends, flat, side="right")
        local = flat - np.concatenate([[0], self.ends[:-1]])[shard]
        if self.dtypes is None:  # MLX arrays: one gather per run of rows in one shard
            starts = np.flatnonzero(np.diff(shard, prepend=-1))
            ends = [*starts[1:], flat.size]
            parts = [
                mx.take(self.shards[shard[a]], mx.array(local[a:b]), axis=0)
                for a, b in zip(starts, ends, strict=True)
            ]
            out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
            return out.astype(mx.float32).reshape(*rows.shape, self.dim)
        out = np.empty((flat.size, self.dim), np.float32)
        for s in np.unique(shard):
            sel = np.nonzero(shard == s)[0]
            out[sel] = _to_f32(np.asarray(self.shards[s][local[sel]]), self.dtypes[s])
        return mx.array(out.reshape(*rows.shape, self.dim))


# ----- state and layer ---------------------------------------------------------------------------
class PLEState(Replayable):
    """Last (kernel-1)*dilation conv rows and last ngram_size-1 ids; not truncatable."""

    can_truncate = False

    def __init__(self, conv_len: int, ctx_len: int, width: int, eos: int):
        self.conv_len, self.ctx_len, self.width, self.eos = conv_len, ctx_len, width, eos
        self.conv = mx.zeros((conv_len, width))
        self.ctx = np.full(ctx_len, eos, np.int64)
        self.length = 0

    def nbytes(self) -> int:
        return int(self.conv.nbytes + self.ctx.nbytes)

    def snapshot(self) -> dict[str, mx.array]:
        return {
            "ple_conv": mx.array(self.conv),
            "ple_ctx": mx.array(self.ctx.astype(np.int32)),
            "ple_length": mx.array(self.length, dtype=mx.int64),
        }

    def restore(self, tensors: dict[str, mx.array]) -> None:
        if not tensors:
            self.conv = mx.zeros((self.conv_len, self.width))
            self.ctx = np.full(self.ctx_len, self.eos, np.int64)
            self.length = 0
            return
        self.conv = tensors["ple_conv"]
        self.ctx = np.array(tensors["ple_ctx"], dtype=np.int64)
        self.length = int(tensors["ple_length"].item())

    def truncate(self, length: int) -> None:
        if length != self.length:
            raise RewindError(
                f"PLE state holds {self.length} tokens and cannot be truncated to {length}: "
                "restore a snapshot taken at that position instead"
            )


class NgramEmbedding(nn.Module):
    """Hash parameters (checked against the weights' int64 buffers) and the row table."""

    def __init__(
        self,
        vocab_size: int,
        ngram_size: int,
        heads_per_ngram: int,
        vocab_base: int,
        seed: int,
        ple_index: int,
        eos: int,
        embed_dim: int,
        divisible_by: int,
    ):
        super().__init__()
        self.ngram_size, self.heads_per_ngram, self.eos = ngram_size, heads_per_ngram, eos
        n_heads = (ngram_size - 1) * heads_per_ngram
        self.head_dim = embed_dim // n_heads
        self.multipliers = ngram_multipliers(vocab_size, ngram_size, ple_index, seed)
        self.sizes = np.array(head_vocab_sizes(vocab_base, n_heads, ple_index), np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        total = int(self.sizes.sum())
        self.padded_rows = -(-total // divisible_by) * divisible_by
        self.table: NgramTable | None = None
        self.freeze()

    def check_buffers(self, where: str, buffers: dict[str, mx.array]) -> None:
        """Buffers in the weights must equal the derivation (a wrong seed hashes to wrong rows)."""
        expect = {
            "layer_multipliers": np.array(self.multipliers, np.int64),
            "ngram_heads_vocab_sizes": self.sizes,
            "ngram_heads_offsets": self.offsets,
        }
        for name, want in expect.items():
            if name not in buffers:
                continue
            got = np.array(buffers[name]).astype(np.int64).reshape(-1)
            if got.shape != want.shape or not np.array_equal(got, want):
                raise WeightsError(
                    f"{where}.{name} = {got.tolist()[:4]}... does not match the derivation "
                    f"{want.tolist()[:4]}... (seed / vocab / ngram_vocab_size_base in config.json "
                    "disagree with the weights)"
                )

    def rows(self, history: np.ndarray, n_new: int) -> np.ndarray:
        return ngram_rows(
            history,
            n_new,
            self.eos,
            self.multipliers,
            self.sizes,
            self.offsets,
            self.heads_per_ngram,
        )

    def __call__(self, history: np.ndarray, n_new: int) -> mx.array:
        if self.table is None:
            raise WeightsError("the PLE n-gram table was not loaded")
        e = self.table.gather(self.rows(history, n_new))  # [T, heads, head_dim]
        return e.reshape(n_new, -1)


class PLELayer(nn.Module):
    """PLE(R, ids) = Gv + silu(dilated_conv(norm_conv(Gv))), Gv_s = sigmoid(g_s(K_s, Q_s)) * V."""

    def __init__(self, cfg, ple_index: int):
        super().__init__()
        H, hc = cfg.hidden_size, cfg.hc_count
        width, eps = H * hc, cfg.rms_norm_eps
        self.hidden, self.hc_count, self.width = H, hc, width
        self.kernel, self.dilation = cfg.ple_conv_kernel_size, cfg.ngram_size
        self.conv_len = (self.kernel - 1) * self.dilation
        self.ple_embedding = NgramEmbedding(
            cfg.vocab_size,
            cfg.ngram_size,
            cfg.heads_per_ngram,
            cfg.ngram_vocab_size_base,
            cfg.seed,
            ple_index,
            cfg.eos_token_id,
            cfg.ple_embed_dim,
            cfg.make_ngram_vocab_size_divisible_by,
        )
        self.key_proj = nn.Linear(cfg.ple_embed_dim, width, bias=False)
        self.value_proj = nn.Linear(cfg.ple_embed_dim, H, bias=False)
        self.norm_key = GroupedRMSNorm(width, H, eps)
        self.norm_query = GroupedRMSNorm(width, H, eps)
        self.norm_conv = GroupedRMSNorm(width, H, eps)
        self.conv1d = {"weight": mx.zeros((width, 1, self.kernel))}  # HF depthwise layout

    def make_state(self) -> PLEState:
        return PLEState(
            self.conv_len, self.ple_embedding.ngram_size - 1, self.width, self.ple_embedding.eos
        )

    def __call__(
        self, R: mx.array, ids: mx.array, state: PLEState, compile: bool = False
    ) -> mx.array:
        """PLE(R, ids), advancing `state`; `compile`: the mixing as one compiled graph (the
        fixed shapes of a decode step; the n-gram rows are looked up on the host either way)."""
        state.keep(self, R, ids)  # a speculative verify's rows, for a rollback's replay
        T = R.shape[0]
        new = np.array(ids, dtype=np.int64).reshape(-1)
        history = np.concatenate([state.ctx, new])
        E = self.ple_embedding(history, T).astype(R.dtype)
        mix = compiled(self, "mix") if compile else self.mix
        out, state.conv = mix(R, E, state.conv)
        state.ctx = history[-state.ctx_len :]
        state.length += T
        return out

    def mix(self, R: mx.array, E: mx.array, conv_state: mx.array) -> tuple[mx.array, mx.array]:
        """(PLE output [T, W], the new conv state) from the residual and the n-gram rows E."""
        T = R.shape[0]
        shape = (T, self.hc_count, self.hidden)
        # per_row: a verify row's products are a plain step's on the CPU (rows.py)
        K = self.norm_key(per_row(self.key_proj, E)).reshape(shape)
        V = per_row(self.value_proj, E)
        Q = self.norm_query(R).reshape(shape)
        g = (K * Q).sum(axis=-1) / math.sqrt(self.hidden)  # [T, hc]
        g = mx.sign(g) * mx.sqrt(mx.maximum(mx.abs(g), 1e-6))
        Gv = (mx.sigmoid(g)[..., None] * V[:, None, :]).reshape(T, self.width)
        C = self.norm_conv(Gv)
        hist = mx.concatenate([conv_state.astype(C.dtype), C], axis=0)  # [conv_len + T, W]
        w = self.conv1d["weight"].astype(C.dtype)  # [W, 1, K]
        conv = sum(
            w[:, 0, j] * hist[j * self.dilation : j * self.dilation + T] for j in range(self.kernel)
        )
        return Gv + nn.silu(conv), hist[-self.conv_len :]
