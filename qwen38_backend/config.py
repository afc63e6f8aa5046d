"""Model configs: config.json read into one typed dataclass per family, validated once.

- `model_family(config)` picks the family from `model_type`; `text_config` unwraps multimodal
  wrappers; `field` reads one key with a ConfigError naming it.
- `DenseConfig` (llama / qwen2 / qwen3), `Qwen35Config` (Qwen3.8-27B) and `Qwen4ExpConfig`
  (Flash-Next): `from_dict(config)` reads config.json (types checked key by key: a missing or
  mistyped field names itself); `__post_init__` checks the values fit together (the same
  checks for a config built in code). Field names are the HF config's.
- `read_rope` reads RoPE the one way every family shares (transformers 5 nests it in
  `rope_parameters`, older configs have top-level keys and `rope_scaling`).
No MLX here: admission and `qwen38 info` read configs without loading the framework.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ConfigError, UnsupportedArchitectureError

DENSE_TYPES = ("llama", "qwen2", "qwen3")
QWEN38_TYPES = ("qwen3_5", "qwen4_exp")

# layer types of the hybrid families
LINEAR = "linear_attention"  # Gated DeltaNet
FULL = "full_attention"  # qwen3_5's gated attention
QSA = "qsa"  # Flash-Next's attention over the QSA indexer's selection


def text_config(config: dict) -> dict:
    """The text part of a config: `text_config` for multimodal wrappers, else the config."""
    inner = config.get("text_config")
    if isinstance(inner, dict):
        merged = dict(inner)
        merged.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
        return merged
    return config


def model_family(config: dict) -> str:
    """'dense', 'qwen3_5' or 'qwen4_exp' from model_type (outer or text_config)."""
    mtype = str(config.get("model_type", ""))
    inner = text_config(config).get("model_type", mtype)
    for name in (mtype, inner):
        if name in DENSE_TYPES:
            return "dense"
        if name.startswith("qwen4_exp"):
            return "qwen4_exp"
        if name.startswith("qwen3_5"):
            return "qwen3_5"
    supported = ", ".join(DENSE_TYPES + QWEN38_TYPES)
    raise UnsupportedArchitectureError(
        f"model_type {mtype or '(missing)'!r} is not supported; supported: {supported}"
    )


_MISSING = object()


def field(cfg: dict, key: str, kind: type, default: Any = _MISSING, where: str = "config") -> Any:
    """cfg[key] checked against `kind`; a clear ConfigError when missing or mistyped."""
    if key not in cfg or cfg[key] is None:
        if default is _MISSING:
            raise ConfigError(f"{where}: required field {key!r} is missing")
        return default
    value = cfg[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(
            f"{where}: field {key!r} should be {kind.__name__}, "
            f"got {type(value).__name__} {value!r}"
        )
    if kind in (int, float) and value < 0:
        raise ConfigError(f"{where}: field {key!r} must not be negative, got {value}")
    return value


def _where(config: dict, default_type: str) -> tuple[dict, str, str]:
    """(text config, model_type, "config.json (model_type)") of a hybrid family's config."""
    c = text_config(config)
    mtype = str(c.get("model_type", config.get("model_type", default_type)))
    return c, mtype, f"config.json ({mtype})"


# ----- RoPE ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rope:
    """RoPE as config.json gives it. `params` is the nested dict (scaling factors,
    `mrope_section`); theta and the partial factor come from it first, else from the top level."""

    kind: str  # rope_type: default, linear, llama3, mrope, ...
    theta: float
    partial_rotary_factor: float
    params: dict


def read_rope(c: dict, where: str, partial_default: float = 1.0) -> Rope:
    """RoPE of a (text) config: `rope_parameters` (transformers 5) or `rope_scaling` plus the
    top-level `rope_theta` / `partial_rotary_factor` (older configs)."""
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: rope_parameters should be a dict, got {params!r}")
    kind = params.get("rope_type", params.get("type")) or "default"
    nested = where + " rope_parameters"
    theta = field(params, "rope_theta", float, None, nested)
    if theta is None:
        theta = field(c, "rope_theta", float, 10000.0, where)
    partial = field(params, "partial_rotary_factor", float, None, nested)
    if partial is None:
        partial = field(c, "partial_rotary_factor", float, partial_default, where)
    return Rope(str(kind), theta, partial, params)


def _default_rope_only(rope: Rope, where: str, family: str) -> None:
    # mRoPE with equal text positions on every axis is plain 1-D RoPE (see mrope_section)
    if rope.kind not in ("default", "mrope"):
        raise UnsupportedArchitectureError(
            f"{where}: rope type {rope.kind!r} is not supported for {family} (default only)"
        )


# ----- dense -----------------------------------------------------------------------------------
@dataclass
class DenseConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # linear / llama3 scaling; None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope_interleaved: bool = False

    @property
    def where(self) -> str:
        return f"config.json ({self.model_type})"

    def __post_init__(self) -> None:
        _check_heads(self, self.where)

    @classmethod
    def from_dict(cls, config: dict) -> DenseConfig:
        c = text_config(config)
        mtype = field(c, "model_type", str)
        where = f"config.json ({mtype})"
        hidden = field(c, "hidden_size", int, where=where)
        heads = field(c, "num_attention_heads", int, where=where)
        rope = read_rope(c, where)
        attn_bias = field(c, "attention_bias", bool, mtype == "qwen2", where)
        return cls(
            model_type=mtype,
            vocab_size=field(c, "vocab_size", int, where=where),
            hidden_size=hidden,
            intermediate_size=field(c, "intermediate_size", int, where=where),
            num_hidden_layers=field(c, "num_hidden_layers", int, where=where),
            num_attention_heads=heads,
            num_key_value_heads=field(c, "num_key_value_heads", int, heads, where),
            head_dim=field(c, "head_dim", int, hidden // max(heads, 1), where),
            rms_norm_eps=field(c, "rms_norm_eps", float, 1e-6, where),
            rope_theta=rope.theta,
            rope_scaling=rope.params if rope.kind != "default" else None,
            max_position_embeddings=field(c, "max_position_embeddings", int, 4096, where),
            tie_word_embeddings=field(c, "tie_word_embeddings", bool, False, where),
            qkv_bias=attn_bias,
            o_bias=attn_bias and mtype == "llama",
            mlp_bias=field(c, "mlp_bias", bool, False, where),
            qk_norm=mtype == "qwen3",
            rope_interleaved=bool(c.get("rope_interleaved", False)),
        )


# ----- what the hybrid families share ----------------------------------------------------------
def _bad(where: str, msg: str) -> ConfigError:
    return ConfigError(f"{where}: {msg}")


def _check_positive(cfg: object, where: str, names: tuple[str, ...]) -> None:
    for name in names:
        if getattr(cfg, name) <= 0:
            raise _bad(where, f"{name} must be positive, got {getattr(cfg, name)}")


def _check_multiple(cfg: object, where: str, name: str, of: str) -> None:
    a, b = getattr(cfg, name), getattr(cfg, of)
    if a % b:
        raise _bad(where, f"{name} ({a}) must be a multiple of {of} ({b})")


_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def _check_heads(cfg: object, where: str) -> None:
    _check_positive(cfg, where, _SIZES + ("num_key_value_heads", "head_dim"))
    _check_multiple(cfg, where, "num_attention_heads", "num_key_value_heads")


def _check_hybrid(cfg: Qwen35Config | Qwen4ExpConfig, where: str, kinds: tuple[str, ...]) -> None:
    """Checks shared by the Gated DeltaNet + attention families."""
    if len(cfg.layer_types) != cfg.num_hidden_layers:
        raise _bad(
            where,
            f"layer_types has {len(cfg.layer_types)} entries but num_hidden_layers is "
            f"{cfg.num_hidden_layers}",
        )
    unknown = sorted(set(cfg.layer_types) - set(kinds))
    if unknown:
        raise _bad(
            where, f"layer_types has unknown entries {unknown} (expected {', '.join(kinds)})"
        )
    _check_heads(cfg, where)
    linear = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim")
    _check_positive(cfg, where, linear + ("linear_value_head_dim", "linear_conv_kernel_dim"))
    _check_multiple(cfg, where, "linear_num_value_heads", "linear_num_key_heads")
    if cfg.linear_conv_kernel_dim < 2:
        raise _bad(where, f"linear_conv_kernel_dim must be >= 2, got {cfg.linear_conv_kernel_dim}")
    if not 0.0 < cfg.partial_rotary_factor <= 1.0:
        raise _bad(
            where, f"partial_rotary_factor must be in (0, 1], got {cfg.partial_rotary_factor}"
        )
    if cfg.rotary_dims % 2:
        raise _bad(
            where, f"head_dim * partial_rotary_factor = {cfg.rotary_dims} rotary dims must be even"
        )


def _layer_types(c: dict, where: str, n_layers: int, attention: str) -> Any:
    """`layer_types` as given, or every `full_attention_interval`-th layer attention."""
    types = c.get("layer_types")
    if types is None:
        interval = field(c, "full_attention_interval", int, 4, where)
        if interval <= 0:
            raise _bad(where, f"full_attention_interval must be positive, got {interval}")
        types = [attention if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
    return types


# ----- qwen3_5 ---------------------------------------------------------------------------------
@dataclass
class Qwen35Config:
    """Qwen3.8-27B: Gated DeltaNet and gated full attention (`layer_types`), dense MLP."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    layer_types: tuple[str, ...]  # LINEAR or FULL per layer
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    mtp_num_hidden_layers: int
    mrope_section: list[int] | tuple[int, ...] | None = None  # must cover the rotary dims
    hidden_act: str = "silu"

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def where(self) -> str:
        return f"config.json ({self.model_type})"

    def __post_init__(self) -> None:
        where = self.where
        _check_hybrid(self, where, (LINEAR, FULL))
        section = self.mrope_section
        if section is not None:
            # text positions are equal on every axis, so mRoPE reduces to plain 1-D RoPE as
            # long as the sections cover exactly the rotary frequencies
            try:
                covered = sum(int(s) for s in section) * 2
            except (TypeError, ValueError):
                covered = -1
            if not isinstance(section, (list, tuple)) or covered != self.rotary_dims:
                raise _bad(
                    where,
                    f"mrope_section {section!r} must sum to rotary dims / 2 = "
                    f"{self.rotary_dims // 2}",
                )
        if self.hidden_act != "silu":
            raise UnsupportedArchitectureError(
                f"{where}: hidden_act {self.hidden_act!r} (only silu)"
            )
        if self.mtp_num_hidden_layers not in (0, 1):
            raise UnsupportedArchitectureError(
                f"{where}: mtp_num_hidden_layers {self.mtp_num_hidden_layers} (0 or 1 supported)"
            )

    @classmethod
    def from_dict(cls, config: dict) -> Qwen35Config:
        c, mtype, where = _where(config, "qwen3_5")
        hidden = field(c, "hidden_size", int, where=where)
        heads = field(c, "num_attention_heads", int, where=where)
        n_layers = field(c, "num_hidden_layers", int, where=where)
        rope = read_rope(c, where, partial_default=0.25)
        _default_rope_only(rope, where, "qwen3_5")
        layer_types = _layer_types(c, where, n_layers, FULL)
        if not isinstance(layer_types, (list, tuple)):
            raise _bad(where, f"layer_types should be a list, got {layer_types!r}")
        return cls(
            model_type=mtype,
            vocab_size=field(c, "vocab_size", int, where=where),
            hidden_size=hidden,
            intermediate_size=field(c, "intermediate_size", int, where=where),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=field(c, "num_key_value_heads", int, where=where),
            head_dim=field(c, "head_dim", int, hidden // max(heads, 1), where),
            rms_norm_eps=field(c, "rms_norm_eps", float, 1e-6, where),
            rope_theta=rope.theta,
            partial_rotary_factor=rope.partial_rotary_factor,
            max_position_embeddings=field(c, "max_position_embeddings", int, 262144, where),
            tie_word_embeddings=field(c, "tie_word_embeddings", bool, False, where),
            attention_bias=field(c, "attention_bias", bool, False, where),
            layer_types=tuple(str(t) for t in layer_types),
            linear_num_key_heads=field(c, "linear_num_key_heads", int, where=where),
            linear_num_value_heads=field(c, "linear_num_value_heads", int, where=where),
            linear_key_head_dim=field(c, "linear_key_head_dim", int, where=where),
            linear_value_head_dim=field(c, "linear_value_head_dim", int, where=where),
            linear_conv_kernel_dim=field(c, "linear_conv_kernel_dim", int, 4, where),
            mtp_num_hidden_layers=field(c, "mtp_num_hidden_layers", int, 0, where),
            mrope_section=rope.params.get("mrope_section"),
            hidden_act=str(c.get("hidden_act", "silu")),
        )


# ----- qwen4_exp -------------------------------------------------------------------------------
@dataclass
class Qwen4ExpConfig:
    """Flash-Next: Gated DeltaNet and QSA attention (`layer_types`), MoE on every layer,
    hyper-connections, n-gram PLE at `ple_layer_ids` (1-based)."""

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
    eos_token_id: int  # -1: none
    indexer_n_heads: int
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int
    mtp_num_hidden_layers: int
    indexer_kv_heads: int = 1

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def where(self) -> str:
        return f"config.json ({self.model_type})"

    def __post_init__(self) -> None:
        where = self.where

        def bad(msg: str) -> None:
            raise _bad(where, msg)

        _check_hybrid(self, where, (LINEAR, QSA))
        if self.output_gate_type not in ("sigmoid", "silu"):
            bad(f"output_gate_type must be sigmoid or silu, got {self.output_gate_type!r}")
        # QSA
        _check_positive(self, where, ("indexer_n_heads", "indexer_head_dim", "indexer_budget"))
        _check_positive(self, where, ("indexer_compress_ratio",))
        if self.indexer_kv_heads != 1:
            bad(f"indexer_kv_heads must be 1 (one shared indexer key), got {self.indexer_kv_heads}")
        if self.indexer_budget % self.indexer_compress_ratio:
            bad(
                f"indexer_budget ({self.indexer_budget}) must be a multiple of "
                f"indexer_compress_ratio ({self.indexer_compress_ratio})"
            )
        if self.rotary_dims > self.indexer_head_dim:
            bad(
                f"rotary dims {self.rotary_dims} (head_dim x partial_rotary_factor) must be even "
                f"and fit indexer_head_dim {self.indexer_head_dim}"
            )
        # hyper-connections
        if self.hc_count <= 1:
            bad(f"hc_count must be > 1, got {self.hc_count}")
        _check_positive(self, where, ("hc_lowrank",))
        # MoE
        _check_positive(self, where, ("num_experts",))
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            bad(
                f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                f"got {self.num_experts_per_tok}"
            )
        _check_positive(self, where, ("moe_intermediate_size", "shared_expert_intermediate_size"))
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

    @classmethod
    def from_dict(cls, config: dict) -> Qwen4ExpConfig:
        c, mtype, where = _where(config, "qwen4_exp")

        def f(key: str, kind: type, default: Any = _MISSING) -> Any:
            return field(c, key, kind, default, where)

        hidden = f("hidden_size", int)
        n_layers = f("num_hidden_layers", int)
        heads = f("num_attention_heads", int)
        rope = read_rope(c, where, partial_default=1.0)
        _default_rope_only(rope, where, "qwen4_exp")
        raw_types = _layer_types(c, where, n_layers, QSA)
        if not isinstance(raw_types, list) or len(raw_types) != n_layers:
            raise _bad(where, f"layer_types must list {n_layers} layer types, got {raw_types!r}")
        # spellings vary ("full_attention", "indexed_attention", ...): every non-linear is QSA
        types = tuple(LINEAR if t == LINEAR else QSA for t in raw_types)

        eos = c.get("eos_token_id", config.get("eos_token_id"))
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        if eos is not None:
            eos = field({"eos_token_id": eos}, "eos_token_id", int, where=where)

        index = {
            key: f(key, int, None)
            for key in (
                "indexer_n_heads",
                "indexer_kv_heads",
                "indexer_head_dim",
                "indexer_budget",
                "indexer_compress_ratio",
            )
        }
        missing = [k for k, v in index.items() if v is None]
        if missing:
            raise _bad(where, f"QSA attention needs {', '.join(missing)} (the indexer_* fields)")

        ple_ids = c.get("ple_layer_ids") or []
        if not isinstance(ple_ids, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in ple_ids
        ):
            raise _bad(where, f"ple_layer_ids should be a list of layer ids, got {ple_ids!r}")

        return cls(
            model_type=mtype,
            vocab_size=f("vocab_size", int),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=f("num_key_value_heads", int),
            head_dim=f("head_dim", int, hidden // max(heads, 1)),
            rms_norm_eps=f("rms_norm_eps", float, 1e-6),
            rope_theta=rope.theta,
            partial_rotary_factor=rope.partial_rotary_factor,
            max_position_embeddings=f("max_position_embeddings", int, 262144),
            tie_word_embeddings=f("tie_word_embeddings", bool, False),
            layer_types=types,
            linear_num_key_heads=f("linear_num_key_heads", int),
            linear_num_value_heads=f("linear_num_value_heads", int),
            linear_key_head_dim=f("linear_key_head_dim", int),
            linear_value_head_dim=f("linear_value_head_dim", int),
            linear_conv_kernel_dim=f("linear_conv_kernel_dim", int, 4),
            output_gate_type=c.get("output_gate_type") or c.get("hidden_act") or "silu",
            num_experts=f("num_experts", int),
            num_experts_per_tok=f("num_experts_per_tok", int),
            moe_intermediate_size=f("moe_intermediate_size", int),
            shared_expert_intermediate_size=f("shared_expert_intermediate_size", int),
            norm_topk_prob=f("norm_topk_prob", bool, True),
            hc_count=f("hc_count", int, 4),
            hc_lowrank=f("hc_lowrank", int),
            ple_layer_ids=tuple(sorted(set(ple_ids))),
            ple_embed_dim=f("ple_embed_dim", int, hidden),
            ple_conv_kernel_size=f("ple_conv_kernel_size", int, 4),
            ngram_size=f("ngram_size", int, 3),
            heads_per_ngram=f("heads_per_ngram", int, 8),
            ngram_vocab_size_base=f("ngram_vocab_size_base", int, 20_000_000),
            make_ngram_vocab_size_divisible_by=f("make_ngram_vocab_size_divisible_by", int, 128),
            split_ngram_parts=f("split_ngram_parts", int, 512),
            seed=f("seed", int, 1234),
            eos_token_id=-1 if eos is None else eos,
            indexer_n_heads=index["indexer_n_heads"],
            indexer_head_dim=index["indexer_head_dim"],
            indexer_budget=index["indexer_budget"],
            indexer_compress_ratio=index["indexer_compress_ratio"],
            mtp_num_hidden_layers=f("mtp_num_hidden_layers", int, 0),
            indexer_kv_heads=index["indexer_kv_heads"],
        )


ModelConfig = DenseConfig | Qwen35Config | Qwen4ExpConfig
