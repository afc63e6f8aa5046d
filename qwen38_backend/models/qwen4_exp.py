"""qwen4_exp: Qwen3.8-Flash-Next. Gated DeltaNet (sigmoid output gate) and QSA attention in a
3:1 pattern, MoE on every layer, 4-stream hyper-connections, n-gram PLE at one layer, and an
optional MTP head. Layer loop (QWEN38.md):

    R = repeat(embed[ids], hc)
    for l: if PLE at l: R += PLE(R, ids); R = GR(R, attn_hc, mixer); R = GR(R, mlp_hc, MoE)
    logits = lm_head(read(R, hyper_connection_mixer))      # no final norm
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..config import field, text_config
from ..errors import ConfigError, UnsupportedArchitectureError
from ..kv.contiguous import ContiguousKV
from ..state import SequenceState
from .base import CausalLM
from .gated_deltanet import GatedDeltaNet, GatedDeltaNetState
from .hyper_connections import GatedResidual
from .layers import RopeSpec
from .moe import SparseMoE, fuse_expert_weights
from .ple import NgramTable, PLELayer, PLEState
from .qsa import QSAAttention, QSAState

LINEAR = "linear_attention"
QSA = "qsa"

# Zero-centred norms (1 + w); mlx-lm style conversions store them with +1 folded in.
_ZC_NORM_SUFFIXES = (
    ".hc_norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    ".q_layernorm.weight",
    ".k_layernorm.weight",
    ".norm_key.weight",
    ".norm_query.weight",
    ".norm_conv.weight",
)
_NGRAM_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


@dataclass
class Qwen4ExpConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]  # LINEAR or QSA per layer
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    output_gate_type: str
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    hc_count: int
    hc_lowrank: int
    ple_layer_ids: tuple[int, ...]  # 1-based
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    split_ngram_parts: int
    seed: int
    eos_token_id: int
    indexer_n_heads: int
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int
    mtp_num_hidden_layers: int

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, config: dict) -> Qwen4ExpConfig:
        c = text_config(config)
        mtype = str(c.get("model_type", config.get("model_type", "qwen4_exp")))
        where = f"config.json ({mtype})"

        def f(key, kind, default=...):
            return (
                field(c, key, kind, where=where)
                if default is ...
                else field(c, key, kind, default, where)
            )

        hidden = f("hidden_size", int)
        n_layers = f("num_hidden_layers", int)
        heads = f("num_attention_heads", int)
        kv_heads = f("num_key_value_heads", int)
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{where}: rope_parameters should be a dict, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in (None, "default", "mrope"):
            raise UnsupportedArchitectureError(
                f"{where}: rope type {rope_type!r} is not supported for qwen4_exp (default only)"
            )
        rwhere = where + " rope_parameters"
        theta = field(rope, "rope_theta", float, None, rwhere)
        theta = f("rope_theta", float, 10000.0) if theta is None else theta
        partial = field(rope, "partial_rotary_factor", float, None, rwhere)
        partial = f("partial_rotary_factor", float, 1.0) if partial is None else partial

        raw_types = c.get("layer_types")
        if raw_types is None:
            interval = f("full_attention_interval", int, 4)
            raw_types = [LINEAR if (i + 1) % interval else QSA for i in range(n_layers)]
        if not isinstance(raw_types, list) or len(raw_types) != n_layers:
            raise ConfigError(
                f"{where}: layer_types must list {n_layers} layer types, got {raw_types!r}"
            )
        # spellings vary ("full_attention", "indexed_attention", ...): every non-linear is QSA
        types = tuple(LINEAR if t == LINEAR else QSA for t in raw_types)

        eos = c.get("eos_token_id", config.get("eos_token_id"))
        if isinstance(eos, list):
            eos = eos[0] if eos else None

        gate = c.get("output_gate_type") or c.get("hidden_act") or "silu"
        if gate not in ("sigmoid", "silu"):
            raise ConfigError(f"{where}: output_gate_type must be sigmoid or silu, got {gate!r}")

        index = {}
        for key in (
            "indexer_n_heads",
            "indexer_kv_heads",
            "indexer_head_dim",
            "indexer_budget",
            "indexer_compress_ratio",
        ):
            index[key] = f(key, int, None)
        missing = [k for k, v in index.items() if v is None]
        if missing:
            raise ConfigError(
                f"{where}: QSA attention needs {', '.join(missing)} (the indexer_* fields)"
            )

        cfg = cls(
            model_type=mtype,
            vocab_size=f("vocab_size", int),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=f("head_dim", int, hidden // max(heads, 1)),
            rms_norm_eps=f("rms_norm_eps", float, 1e-6),
            rope_theta=theta,
            partial_rotary_factor=partial,
            max_position_embeddings=f("max_position_embeddings", int, 262144),
            tie_word_embeddings=f("tie_word_embeddings", bool, False),
            layer_types=types,
            linear_num_key_heads=f("linear_num_key_heads", int),
            linear_num_value_heads=f("linear_num_value_heads", int),
            linear_key_head_dim=f("linear_key_head_dim", int),
            linear_value_head_dim=f("linear_value_head_dim", int),
            linear_conv_kernel_dim=f("linear_conv_kernel_dim", int, 4),
            output_gate_type=gate,
            num_experts=f("num_experts", int),
            num_experts_per_tok=f("num_experts_per_tok", int),
            moe_intermediate_size=f("moe_intermediate_size", int),
            shared_expert_intermediate_size=f("shared_expert_intermediate_size", int),
            norm_topk_prob=f("norm_topk_prob", bool, True),
            hc_count=f("hc_count", int, 4),
            hc_lowrank=f("hc_lowrank", int),
            ple_layer_ids=tuple(sorted(set(c.get("ple_layer_ids") or []))),
            ple_embed_dim=f("ple_embed_dim", int, hidden),
            ple_conv_kernel_size=f("ple_conv_kernel_size", int, 4),
            ngram_size=f("ngram_size", int, 3),
            heads_per_ngram=f("heads_per_ngram", int, 8),
            ngram_vocab_size_base=f("ngram_vocab_size_base", int, 20_000_000),
            make_ngram_vocab_size_divisible_by=f("make_ngram_vocab_size_divisible_by", int, 128),
            split_ngram_parts=f("split_ngram_parts", int, 512),
            seed=f("seed", int, 1234),
            eos_token_id=-1 if eos is None else int(eos),
            indexer_n_heads=index["indexer_n_heads"],
            indexer_head_dim=index["indexer_head_dim"],
            indexer_budget=index["indexer_budget"],
            indexer_compress_ratio=index["indexer_compress_ratio"],
            mtp_num_hidden_layers=f("mtp_num_hidden_layers", int, 0),
        )
        cfg.validate(where, index["indexer_kv_heads"])
        return cfg

    def validate(self, where: str, indexer_kv_heads: int) -> None:
        def bad(msg: str) -> None:
            raise ConfigError(f"{where}: {msg}")

        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if getattr(self, key) <= 0:
                bad(f"{key} must be positive")
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads:
            bad("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_key_heads <= 0 or (
            self.linear_num_value_heads % self.linear_num_key_heads
        ):
            bad("linear_num_value_heads must be a multiple of linear_num_key_heads")
        # QSA
        for key in ("indexer_n_heads", "indexer_head_dim", "indexer_budget"):
            if getattr(self, key) <= 0:
                bad(f"{key} must be positive, got {getattr(self, key)}")
        if self.indexer_compress_ratio <= 0:
            bad(f"indexer_compress_ratio must be positive, got {self.indexer_compress_ratio}")
        if indexer_kv_heads != 1:
            bad(f"indexer_kv_heads must be 1 (one shared indexer key), got {indexer_kv_heads}")
        if self.indexer_budget % self.indexer_compress_ratio:
            bad(
                f"indexer_budget ({self.indexer_budget}) must be a multiple of "
                f"indexer_compress_ratio ({self.indexer_compress_ratio})"
            )
        if self.rotary_dims > self.indexer_head_dim or self.rotary_dims % 2:
            bad(
                f"rotary dims {self.rotary_dims} (head_dim x partial_rotary_factor) must be even "
                f"and fit indexer_head_dim {self.indexer_head_dim}"
            )
        # hyper-connections
        if self.hc_count <= 1:
            bad(f"hc_count must be > 1, got {self.hc_count}")
        if self.hc_lowrank <= 0:
            bad(f"hc_lowrank must be positive, got {self.hc_lowrank}")
        # MoE
        if self.num_experts <= 0:
            bad(f"num_experts must be positive, got {self.num_experts}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            bad(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        if self.moe_intermediate_size <= 0 or self.shared_expert_intermediate_size <= 0:
            bad("moe_intermediate_size and shared_expert_intermediate_size must be positive")
        # PLE
        if self.ple_layer_ids:
            heads = (self.ngram_size - 1) * self.heads_per_ngram
            if self.ngram_size < 2 or heads <= 0 or self.ple_embed_dim % heads:
                bad(
                    f"ple_embed_dim ({self.ple_embed_dim}) must split evenly over "
                    f"(ngram_size - 1) * heads_per_ngram = {heads} n-gram heads"
                )
            for lid in self.ple_layer_ids:
                if not 1 <= lid <= self.num_hidden_layers:
                    bad(f"ple_layer_ids are 1-based in [1, {self.num_hidden_layers}], got {lid}")
                if self.layer_types[lid - 1] != LINEAR:
                    bad(f"PLE is only supported on linear_attention layers (layer id {lid})")
            if self.eos_token_id < 0:
                bad("eos_token_id must be set when PLE is enabled (it resets the n-gram context)")
            if self.ple_conv_kernel_size <= 0 or self.ngram_vocab_size_base <= 1:
                bad("ple_conv_kernel_size and ngram_vocab_size_base must be positive")


# ----- per-layer state with PLE -----------------------------------------------------------------
class PLEMixerState:
    """State of a Gated DeltaNet layer that also carries PLE: both or neither."""

    can_truncate = False

    def __init__(self, mixer: GatedDeltaNetState, ple: PLEState):
        self.mixer, self.ple = mixer, ple

    def arrays(self) -> list[mx.array]:
        return [
            a
            for a in (self.mixer.conv, self.mixer.recurrent, self.ple.conv)
            if isinstance(a, mx.array)
        ]

    def nbytes(self) -> int:
        return self.mixer.nbytes() + self.ple.nbytes()

    def snapshot(self) -> dict[str, mx.array]:
        out = {f"gdn.{k}": v for k, v in self.mixer.snapshot().items()}
        out.update(self.ple.snapshot())
        return out

    def restore(self, tensors: dict[str, mx.array]) -> None:
        self.mixer.restore({k[4:]: v for k, v in tensors.items() if k.startswith("gdn.")})
        self.ple.restore({k: v for k, v in tensors.items() if k.startswith("ple_")})

    def truncate(self, length: int) -> None:
        self.mixer.truncate(length)
        self.ple.truncate(length)


# ----- the model -------------------------------------------------------------------------------
def _rope(cfg: Qwen4ExpConfig) -> RopeSpec:
    # mRoPE with equal text positions on every axis is plain 1-D RoPE on the first dims
    return RopeSpec(cfg.rotary_dims, cfg.rope_theta)


class Qwen4ExpBlock(nn.Module):
    def __init__(self, cfg: Qwen4ExpConfig, layer_type: str, ple_index: int | None = None):
        super().__init__()
        self.is_linear = layer_type == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(
                cfg.hidden_size,
                cfg.linear_num_key_heads,
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
                cfg.linear_conv_kernel_dim,
                cfg.rms_norm_eps,
                gate_activation=cfg.output_gate_type,
            )
        else:
            self.self_attn = QSAAttention(
                cfg.hidden_size,
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                _rope(cfg),
                cfg.rms_norm_eps,
                index_heads=cfg.indexer_n_heads,
                index_dim=cfg.indexer_head_dim,
                budget=cfg.indexer_budget,
                ratio=cfg.indexer_compress_ratio,
            )
        self.mlp = SparseMoE(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.shared_expert_intermediate_size,
            cfg.norm_topk_prob,
        )
        hc = (cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank, cfg.rms_norm_eps)
        self.attn_hyper_connection = GatedResidual(*hc)
        self.mlp_hyper_connection = GatedResidual(*hc)
        self.has_ple = ple_index is not None
        if self.has_ple:
            self.ple = PLELayer(cfg, ple_index)

    def make_state(self, cfg: Qwen4ExpConfig, kv_factory):
        if not self.is_linear:
            store = kv_factory()
            if not isinstance(store, ContiguousKV):
                from ..errors import InvalidOptionError

                # QSA reads its own token sets out of the store; the paged QSA store is the
                # long-context issue's work, not done yet
                raise InvalidOptionError(
                    "Flash-Next (qwen4_exp) selects with its own QSA indexer over the "
                    "contiguous KV store; kv_paged/kv_topk options are not supported for it yet"
                )
            return QSAState(store, cfg.indexer_compress_ratio)
        if self.has_ple:
            return PLEMixerState(GatedDeltaNetState(), self.ple.make_state())
        return GatedDeltaNetState()

    def __call__(self, R: mx.array, ids: mx.array | None, st, offset: int) -> mx.array:
        if self.has_ple:
            R = R + self.ple(R, ids, st.ple)
            st = st.mixer
        if self.is_linear:
            R = self.attn_hyper_connection(R, lambda x: self.linear_attn(x, st))
        else:
            R = self.attn_hyper_connection(R, lambda x: self.self_attn(x, st, offset))
        return self.mlp_hyper_connection(R, self.mlp)


class Qwen4ExpBody(nn.Module):
    def __init__(self, cfg: Qwen4ExpConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [
            Qwen4ExpBlock(
                cfg,
                t,
                cfg.ple_layer_ids.index(i + 1) if (i + 1) in cfg.ple_layer_ids else None,
            )
            for i, t in enumerate(cfg.layer_types)
        ]
        self.hyper_connection_mixer = GatedResidual(
            cfg.hidden_size, cfg.hc_count, cfg.hc_lowrank, cfg.rms_norm_eps, inject=False
        )


class Qwen4ExpModel(CausalLM):
    """Causal LM over token ids [T] of one sequence; per-layer state lives in `state`."""

    def __init__(self, cfg: Qwen4ExpConfig):
        super().__init__(cfg)
        self.model = Qwen4ExpBody(cfg)
        if cfg.mtp_num_hidden_layers:
            from .mtp_qwen4 import Qwen4ExpMTP

            self.mtp = Qwen4ExpMTP(cfg)

    def make_state(self, kv_factory=ContiguousKV) -> SequenceState:
        return SequenceState([b.make_state(self.config, kv_factory) for b in self.model.layers])

    def residual(self, ids: mx.array, state: SequenceState) -> mx.array:
        """The residual streams after the last layer, [T, hc * hidden] (the MTP head's input)."""
        offset = state.offset
        R = mx.tile(self.model.embed_tokens(ids), (1, self.config.hc_count))
        for layer, layer_state in zip(self.model.layers, state.layers, strict=True):
            R = layer(R, ids, layer_state, offset)
        return R

    def hidden(self, ids: mx.array, state: SequenceState) -> mx.array:
        """The mixer's read of the final residual, [T, hidden] (what lm_head sees)."""
        return self.model.hyper_connection_mixer.read(self.residual(ids, state))

    def logits_from_residual(self, R: mx.array) -> mx.array:
        return self.logits_from_hidden(self.model.hyper_connection_mixer.read(R))

    def __call__(self, ids: mx.array, state: SequenceState, last_only: bool = False) -> mx.array:
        R = self.residual(ids, state)
        if last_only:
            R = R[-1:]
        return self.logits_from_residual(R)

    # ----- MTP -----------------------------------------------------------------------------
    def draft_logits(self, residual: mx.array, next_tokens: mx.array, mtp_state) -> mx.array:
        """MTP draft logits [T, vocab] from trunk residuals [T, hc*hidden] (see mtp_qwen4.py)."""
        self._require_mtp()
        return self.mtp.draft_logits(residual, next_tokens, mtp_state, self)

    # ----- weights -------------------------------------------------------------------------
    def ple_layers(self) -> list[tuple[int, PLELayer]]:
        return [(i, b.ple) for i, b in enumerate(self.model.layers) if b.has_ple]

    def attach_ngram_tables(self, directory: str | Path) -> bool:
        """Memory-map the n-gram tables from a checkpoint directory's safetensors files.

        Preferred over the arrays sanitize sees: only gathered rows are ever read. Returns
        whether every PLE layer found its shards.
        """
        ok = True
        for i, ple in self.ple_layers():
            pat = re.compile(
                rf"layers\.{i}\.ple\.ple_embedding\.ngram_embedding\.shard_(\d+)\.weight$"
            )
            table = NgramTable.from_safetensors(Path(directory), pat)
            if table is None:
                ok = False
                continue
            self._check_table(i, ple, table)
            ple.ple_embedding.table = table
        return ok

    def _check_table(self, i: int, ple: PLELayer, table: NgramTable) -> None:
        from ..errors import WeightsError

        emb = ple.ple_embedding
        if table.rows != emb.padded_rows or table.dim != emb.head_dim:
            raise WeightsError(
                f"layers.{i}.ple n-gram table is [{table.rows}, {table.dim}] over "
                f"{len(table.shards)} shards; config.json implies [{emb.padded_rows}, "
                f"{emb.head_dim}]"
            )

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF / mlx-lm names -> module names.

        `model.language_model.X` or `model.X` -> `model.X`; vision tower dropped; `mtp.*` kept
        (or the MTP module removed when the checkpoint has none); per-expert tensors fused;
        GDN conv1d [C, 1, K] -> [C, K, 1]; the n-gram tables and their int64 hash buffers are
        taken out (checked against the derivation, tables kept as lazy shards unless
        `attach_ngram_tables` memory-maps them).
        """
        out = self.canonical_names(weights)
        out = fuse_expert_weights(out)
        self._take_ngram(out)
        convs = [n for n in out if n.endswith("linear_attn.conv1d.weight")]
        mlx_layout = bool(convs) and all(out[n].shape[-1] == 1 for n in convs)
        for n in convs:
            if out[n].shape[-1] != 1:
                out[n] = out[n].swapaxes(1, 2)
        for n in [n for n in out if n.endswith("ple.conv1d.weight")]:
            if out[n].shape[1] != 1:  # an MLX-layout [C, K, 1] PLE conv
                out[n] = out[n].swapaxes(1, 2)
        if mlx_layout:
            for n in list(out):
                if n.endswith(_ZC_NORM_SUFFIXES) and not n.startswith("mtp.") and out[n].ndim == 1:
                    dtype = out[n].dtype
                    out[n] = (out[n].astype(mx.float32) - 1.0).astype(dtype)
        if self.has_mtp and not any(n.startswith("mtp.") for n in out):
            del self["mtp"]
        return out

    def _take_ngram(self, out: dict[str, mx.array]) -> None:
        from ..errors import WeightsError

        for i, ple in self.ple_layers():
            prefix = f"model.layers.{i}.ple.ple_embedding."
            buffers = {b: out.pop(prefix + b) for b in _NGRAM_BUFFERS if prefix + b in out}
            ple.ple_embedding.check_buffers(prefix.rstrip("."), buffers)
            pat = re.compile(re.escape(prefix) + r"ngram_embedding\.shard_(\d+)\.weight$")
            shards = {}
            for name in [n for n in out if pat.match(n)]:
                shards[int(pat.match(name).group(1))] = out.pop(name)
            single = prefix + "ngram_embedding.weight"
            if single in out:
                shards = {0: out.pop(single)}
            if ple.ple_embedding.table is not None:
                continue  # already memory-mapped by attach_ngram_tables
            if not shards:
                raise WeightsError(f"{prefix}ngram_embedding: no n-gram table shards found")
            if sorted(shards) != list(range(len(shards))):
                raise WeightsError(f"{prefix}ngram_embedding shards are not 0..N-1")
            table = NgramTable.from_arrays([shards[k] for k in sorted(shards)])
            self._check_table(i, ple, table)
            ple.ple_embedding.table = table


def build(config: dict) -> Qwen4ExpModel:
    """Entry point used by models.build_model for model_type qwen4_exp*."""
    return Qwen4ExpModel(Qwen4ExpConfig.from_dict(config))
