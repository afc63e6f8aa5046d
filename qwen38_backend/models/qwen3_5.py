"""qwen3_5: Qwen3.8-27B. 3 Gated DeltaNet layers then 1 gated full-attention layer, repeated;
zero-centred RMSNorm everywhere except the DeltaNet output norm; optional MTP draft head."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from ..config import field, text_config
from ..errors import ConfigError, UnsupportedArchitectureError
from ..kv.contiguous import ContiguousKV
from ..state import SequenceState
from .base import CausalLM
from .gated_deltanet import GatedDeltaNet, GatedDeltaNetState
from .layers import Attention, PreNormBlock, RMSNorm, SwiGLU, compiled, rope_from_config

LINEAR, FULL = "linear_attention", "full_attention"

# Norms that are zero-centred (1 + w). mlx-lm converted repos store them with +1 folded in.
_ZC_NORM_SUFFIXES = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


@dataclass
class Qwen35Config:
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
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    mtp_num_hidden_layers: int

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, config: dict) -> Qwen35Config:
        c = text_config(config)
        mtype = str(c.get("model_type", config.get("model_type", "qwen3_5")))
        where = f"config.json ({mtype})"
        hidden = field(c, "hidden_size", int, where=where)
        heads = field(c, "num_attention_heads", int, where=where)
        kv_heads = field(c, "num_key_value_heads", int, where=where)
        n_layers = field(c, "num_hidden_layers", int, where=where)
        # transformers 5 nests theta / partial factor / mrope in rope_parameters
        rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{where}: rope_parameters should be a dict, got {rope!r}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in (None, "default", "mrope"):
            raise UnsupportedArchitectureError(
                f"{where}: rope type {rope_type!r} is not supported for qwen3_5 (default only)"
            )
        theta = field(rope, "rope_theta", float, None, where + " rope_parameters")
        if theta is None:
            theta = field(c, "rope_theta", float, 10000.0, where)
        partial = field(rope, "partial_rotary_factor", float, None, where + " rope_parameters")
        if partial is None:
            partial = field(c, "partial_rotary_factor", float, 0.25, where)
        head_dim = field(c, "head_dim", int, hidden // max(heads, 1), where)

        layer_types = c.get("layer_types")
        if layer_types is None:
            interval = field(c, "full_attention_interval", int, 4, where)
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
        if not isinstance(layer_types, (list, tuple)):
            raise ConfigError(f"{where}: layer_types should be a list, got {layer_types!r}")
        cfg = cls(
            model_type=mtype,
            vocab_size=field(c, "vocab_size", int, where=where),
            hidden_size=hidden,
            intermediate_size=field(c, "intermediate_size", int, where=where),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=field(c, "rms_norm_eps", float, 1e-6, where),
            rope_theta=theta,
            partial_rotary_factor=partial,
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
        )
        cfg._validate(where, rope, str(c.get("hidden_act", "silu")))
        return cfg

    def _validate(self, where: str, rope: dict, act: str) -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(f"{where}: {msg}")

        if len(self.layer_types) != self.num_hidden_layers:
            raise bad(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        unknown = sorted(set(self.layer_types) - {LINEAR, FULL})
        if unknown:
            raise bad(f"layer_types has unknown entries {unknown} (expected {LINEAR}, {FULL})")
        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
            "vocab_size",
        ):
            if getattr(self, name) <= 0:
                raise bad(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise bad(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.linear_conv_kernel_dim < 2:
            raise bad(f"linear_conv_kernel_dim must be >= 2, got {self.linear_conv_kernel_dim}")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise bad(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dims % 2:
            raise bad(
                f"head_dim * partial_rotary_factor = {self.rotary_dims} rotary dims must be even"
            )
        section = rope.get("mrope_section")
        if section is not None:
            # text positions are equal on every axis, so mRoPE reduces to plain 1-D RoPE as
            # long as the sections cover exactly the rotary frequencies
            if not isinstance(section, (list, tuple)) or sum(int(s) for s in section) * 2 != (
                self.rotary_dims
            ):
                raise bad(
                    f"mrope_section {section!r} must sum to rotary dims / 2 = "
                    f"{self.rotary_dims // 2}"
                )
        if act != "silu":
            raise UnsupportedArchitectureError(f"{where}: hidden_act {act!r} (only silu)")
        if self.mtp_num_hidden_layers not in (0, 1):
            raise UnsupportedArchitectureError(
                f"{where}: mtp_num_hidden_layers {self.mtp_num_hidden_layers} (0 or 1 supported)"
            )


def gated_attention(cfg: Qwen35Config) -> Attention:
    """Full attention of qwen3_5: output gate, zero-centred q/k norm, partial rotary."""
    rope = rope_from_config(cfg.head_dim, cfg.rope_theta, None, cfg.partial_rotary_factor)
    return Attention(
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        rope,
        qkv_bias=cfg.attention_bias,
        o_bias=cfg.attention_bias,
        qk_norm_eps=cfg.rms_norm_eps,
        zero_centered_norm=True,
        output_gate=True,
    )


class Qwen35Block(PreNormBlock):
    def __init__(self, cfg: Qwen35Config, layer_type: str):
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
                gate_activation="silu",
            )
        else:
            self.self_attn = gated_attention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True
        )

    def __call__(self, h: mx.array, layer_state, offset: int) -> mx.array:
        if not self.is_linear:
            return self.attention_block(h, layer_state, offset)
        if h.shape[0] == 1 and self.compile_decode:
            return self.decode_linear(h, layer_state)
        h = h + self.linear_attn(self.input_layernorm(h), layer_state)
        return h + self.mlp(self.post_attention_layernorm(h))

    def decode_linear(self, h: mx.array, state: GatedDeltaNetState) -> mx.array:
        """One token through a Gated DeltaNet block: the whole block is one compiled graph."""
        conv, recurrent = self.linear_attn.initial_state(state, h.dtype)
        self.linear_attn.prepare_decode(h.dtype)
        h, state.conv, state.recurrent = compiled(self, "_linear_step")(h, conv, recurrent)
        state.length += 1
        return h

    def _linear_step(self, h: mx.array, conv: mx.array, recurrent: mx.array):
        out, conv, recurrent = self.linear_attn.step(self.input_layernorm(h), conv, recurrent)
        h = h + out
        return h + self.mlp(self.post_attention_layernorm(h)), conv, recurrent


class Qwen35Body(nn.Module):
    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [Qwen35Block(cfg, t) for t in cfg.layer_types]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)


class Qwen35Model(CausalLM):
    """Causal LM over token ids [T] of one sequence; per-layer state lives in `state`."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__(cfg)
        self.model = Qwen35Body(cfg)
        if cfg.mtp_num_hidden_layers:
            from .mtp import Qwen35MTP

            self.mtp = Qwen35MTP(cfg)

    def make_state(self, kv_factory=ContiguousKV) -> SequenceState:
        return SequenceState(
            [GatedDeltaNetState() if t == LINEAR else kv_factory() for t in self.config.layer_types]
        )

    def hidden(self, ids: mx.array, state: SequenceState) -> mx.array:
        """Final-normed hidden states [T, hidden] (also the MTP head's input)."""
        offset = state.offset
        h = self.model.embed_tokens(ids)
        for layer, layer_state in zip(self.model.layers, state.layers, strict=True):
            h = layer(h, layer_state, offset)
        return self.model.norm(h)

    # ----- MTP -----------------------------------------------------------------------------
    def draft_logits(self, hidden: mx.array, next_tokens: mx.array, mtp_state) -> mx.array:
        """MTP draft logits [T, vocab] for positions mtp_state.offset.. (see mtp.py)."""
        self._require_mtp()
        return self.mtp.draft_logits(
            hidden, next_tokens, mtp_state, self.model.embed_tokens, self.logits_from_hidden
        )

    # ----- weights -------------------------------------------------------------------------
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF / mlx-lm names -> module names.

        `model.language_model.X` or `model.X` -> `model.X`; vision tower dropped; `mtp.*` kept
        (or the MTP module removed when the checkpoint has none); conv1d [C, 1, K] -> [C, K, 1].
        mlx-lm converted checkpoints (conv already [C, K, 1]) folded +1 into the zero-centred
        norms: it is taken back out here, in fp32.
        """
        out = self.canonical_names(weights)
        convs = [n for n in out if n.endswith("conv1d.weight") and not n.startswith("mtp.")]
        mlx_layout = bool(convs) and all(out[n].shape[-1] == 1 for n in convs)
        for n in convs:
            if out[n].shape[-1] != 1:
                out[n] = out[n].swapaxes(1, 2)
        if mlx_layout:
            for n in list(out):
                if n.endswith(_ZC_NORM_SUFFIXES) and not n.startswith("mtp.") and out[n].ndim == 1:
                    dtype = out[n].dtype
                    out[n] = (out[n].astype(mx.float32) - 1.0).astype(dtype)
        if self.has_mtp and not any(n.startswith("mtp.") for n in out):
            # e.g. mlx-lm conversions drop the MTP head: load the trunk without it
            del self["mtp"]
        return out


def build(config: dict) -> Qwen35Model:
    """Entry point used by models.build_model for model_type qwen3_5."""
    return Qwen35Model(Qwen35Config.from_dict(config))
