"""qwen3_5: Qwen3.8-27B. 3 Gated DeltaNet layers then 1 gated full-attention layer, repeated;
zero-centred RMSNorm everywhere except the DeltaNet output norm; optional MTP draft head.
The config (`Qwen35Config`, validated) is config.py.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from .. import rows
from ..config import LINEAR, Qwen35Config
from ..kernel_import import kernel_module
from ..kv.contiguous import ContiguousKV
from ..rows import STEP_MAX_ROWS
from ..state import SequenceState
from .base import CausalLM
from .gated_deltanet import GatedDeltaNet, GatedDeltaNetState, decode_step
from .layers import (
    Attention,
    PreNormBlock,
    RMSNorm,
    SwiGLU,
    residual_launches,
    residual_step,
    rope_from_config,
)

# Norms that are zero-centred (1 + w). mlx-lm converted repos store them with +1 folded in.
_ZC_NORM_SUFFIXES = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "model.norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
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
        if h.shape[0] <= STEP_MAX_ROWS and self.compile_decode:
            return self.decode_linear(h, layer_state)
        h = h + self.linear_attn(self.input_layernorm(h), layer_state)
        return h + self.mlp(self.post_attention_layernorm(h))

    def decode_linear(self, h: mx.array, state: GatedDeltaNetState) -> mx.array:
        """A step of a few rows through a Gated DeltaNet block: one compiled graph."""
        if h.shape[0] == 1 and str(h.dtype) not in self._fusion_decided:
            self._decide_fusion(h.dtype)  # outside the trace: its probe runs launches
        (h,) = decode_step(self, h, state)
        return h

    def _linear_step(self, h: mx.array, conv: mx.array, recurrent: mx.array):
        if h.shape[0] == 1 and str(h.dtype) in self._fuse_linear_for:
            fused = kernel_module("fused").run(
                lambda view: self._linear_launches(h, conv, recurrent, view)
            )
            if fused is not None:  # (a one-row step's conv inputs are its history)
                out, last, states = fused
                return out, last, last, states
        mixer = self.linear_attn
        o, *rows = mixer.step_rows(h, conv, recurrent, norm=self.input_layernorm)
        post = self.post_attention_layernorm
        return residual_step(h, o, mixer.out_proj, post, self.mlp), *rows

    # the block input dtypes whose one-row step is one fused launch (_fuses_linear), and
    # those decided (frozensets: an nn.Module would hold a dict as a child)
    _fuse_linear_for: frozenset[str] = frozenset()
    _fusion_decided: frozenset[str] = frozenset()

    def _decide_fusion(self, h_dtype: mx.Dtype) -> None:
        dtype = self.linear_attn.conv1d.weight.dtype  # the step's (decode_step)
        if self._fuses_linear(h_dtype, dtype):
            self._fuse_linear_for |= {str(h_dtype)}
        self._fusion_decided |= {str(h_dtype)}

    def _fuses_linear(self, h_dtype: mx.Dtype, dtype: mx.Dtype) -> bool:
        """Whether a one-row step of this Gated DeltaNet block (the input norm, the
        in-projection, the Gated DeltaNet kernel, out_proj with the residual, the post-mixer
        norm, gate / up with the swiglu, down with the residual) runs as one launch with the
        bits of those launches apart (kernels/fused.py; probed on random rows and state of
        these dtypes, once per shape)."""
        fused = kernel_module("fused")
        if fused is None:
            return False
        mixer = self.linear_attn
        mixer.prepare_decode(dtype)
        keys = mx.random.split(mx.random.key(45), 3)
        h = mx.random.normal((1, mixer.out_proj.weight.shape[0]), key=keys[0])
        conv = mx.random.normal((mixer.conv_kernel - 1, mixer.conv_dim), key=keys[1])
        state = (mixer.n_v_heads, mixer.v_head_dim, mixer.k_head_dim)
        recurrent = 0.1 * mx.random.normal(state, key=keys[2])
        products = [p for _, p in self.named_modules() if isinstance(p, nn.Linear)]
        kinds = [(tuple(p.weight.shape), str(p.weight.dtype)) for p in products]
        key = ("27b gated deltanet layer", mixer._core_spec(), str(h_dtype), str(dtype), kinds)
        return fused.agrees(
            str(key),
            lambda view: self._linear_launches(
                h.astype(h_dtype), conv.astype(dtype), recurrent, view
            ),
        )

    def _linear_launches(self, h, conv, recurrent, view) -> list | None:
        """[the block's output, the conv history after, the recurrent state after] of a
        one-row step as launches with nothing between them (GatedDeltaNet.core_launches,
        then rows.kernel_product with residual_step's epilogues), or None."""
        mixer, post = self.linear_attn, self.post_attention_layernorm
        core = mixer.core_launches(h, conv, recurrent, view, norm=self.input_layernorm)
        if core is None:
            return None
        o, last, states = core
        out = residual_launches(h, o, mixer.out_proj, post, self.mlp)
        return None if out is None else [out, last, states]


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
            self.mtp = Qwen35MTP(cfg)

    def make_state(self, kv_factory=ContiguousKV) -> SequenceState:
        return SequenceState(
            [GatedDeltaNetState() if t == LINEAR else kv_factory() for t in self.config.layer_types]
        )

    def hidden(self, ids: mx.array, state: SequenceState) -> mx.array:
        """Final-normed hidden states [T, hidden] (also the MTP head's input)."""
        offset = state.offset
        h = self.model.embed_tokens(ids)
        rows.prepare(h.dtype, self, ids.shape[0])
        h = state.run_layers(self.model.layers, h, offset, ids.shape[0])
        return self.model.norm(h)

    # ----- MTP -----------------------------------------------------------------------------
    def draft_logits(self, hidden: mx.array, next_tokens: mx.array, mtp_state) -> mx.array:
        """MTP draft logits [T, vocab] for positions mtp_state.offset.. (see Qwen35MTP)."""
        self._require_mtp()
        return self.mtp.draft_logits(
            hidden, next_tokens, mtp_state, self.model.embed_tokens, self.logits_from_hidden
        )

    def mtp_advance(self, features: mx.array, next_tokens: mx.array, mtp_state) -> mx.array:
        self._require_mtp()
        embeds = self.model.embed_tokens(next_tokens.reshape(-1))
        return self.mtp.hidden(features, embeds, mtp_state)

    def mtp_logits(self, mtp_features: mx.array) -> mx.array:
        return self.logits_from_hidden(mtp_features)

    # ----- weights -------------------------------------------------------------------------
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF / mlx-lm names -> module names.

        `model.language_model.X` or `model.X` -> `model.X`; vision tower dropped; `mtp.*` kept
        (or the MTP module removed when the weights have none); conv1d [C, 1, K] -> [C, K, 1].
        mlx-lm converted weights (conv already [C, K, 1]) folded +1 into the zero-centred
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


# ----- MTP draft head ----------------------------------------------------------------------------
# No HF reference; layout and formulas follow vLLM (QWEN38.md "MTP"). 15 tensors under `mtp.`:
#     x = fc(cat[rms_zc(embed[t_{i+1}], pre_fc_norm_embedding), rms_zc(h_i, pre_fc_norm_hidden)])
#     x = decoder layer (gated full attention + dense MLP, own KV cache, position i)
#     draft logits = lm_head(rms_zc(x, norm))            # predicts t_{i+2}
# Embedding and lm_head are the trunk's. Later draft steps feed the post-norm hidden that
# `Qwen35MTP.hidden` returns as the next h.
class Qwen35MTPState:
    """The MTP head's own per-sequence state: a KV store and its position.

    Implements the LayerState protocol (KV is truncatable).
    """

    can_truncate = True

    def __init__(self, kv_factory=ContiguousKV) -> None:
        self.kv = kv_factory()
        self.offset = 0

    def nbytes(self) -> int:
        return self.kv.nbytes()

    def snapshot(self) -> dict[str, mx.array]:
        snap = {f"kv.{k}": v for k, v in self.kv.snapshot().items()}
        snap["offset"] = mx.array(self.offset, dtype=mx.int64)
        return snap

    def restore(self, tensors: dict[str, mx.array]) -> None:
        self.kv.restore({k[3:]: v for k, v in tensors.items() if k.startswith("kv.")})
        self.offset = int(tensors["offset"].item()) if "offset" in tensors else 0

    def truncate(self, length: int) -> None:
        self.kv.truncate(length)
        self.offset = min(self.offset, length)


class Qwen35MTPLayer(nn.Module):
    """One decoder layer: gated full attention + SwiGLU, zero-centred norms."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.self_attn = gated_attention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, zero_centered=True
        )

    def __call__(self, h: mx.array, kv, offset: int) -> mx.array:
        h = h + self.self_attn(self.input_layernorm(h), kv, offset)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen35MTP(nn.Module):
    """The 27B MTP head; parameter names match the weights' `mtp.*` tensors."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(H, eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(H, eps, zero_centered=True)
        self.layers = [Qwen35MTPLayer(cfg) for _ in range(max(cfg.mtp_num_hidden_layers, 1))]
        self.norm = RMSNorm(H, eps, zero_centered=True)

    def make_state(self, kv_factory=ContiguousKV) -> Qwen35MTPState:
        return Qwen35MTPState(kv_factory)

    def hidden(self, hidden: mx.array, next_embeds: mx.array, state: Qwen35MTPState) -> mx.array:
        """hidden [T, H] (trunk's final-normed h_i), next_embeds [T, H] (embed of t_{i+1})
        -> post-norm MTP hidden [T, H]; advances state by T positions."""
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(next_embeds), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        x = self.layers[0](x, state.kv, state.offset)
        state.offset += x.shape[0]
        return self.norm(x)

    def draft_logits(
        self,
        hidden: mx.array,
        next_tokens: mx.array,
        state: Qwen35MTPState,
        embed: nn.Embedding,
        lm_head: Callable[[mx.array], mx.array],
    ) -> mx.array:
        """Draft logits [T, vocab] predicting t_{i+2} for positions i = state.offset..+T-1."""
        return lm_head(self.hidden(hidden, embed(next_tokens.reshape(-1)), state))


def build(config: dict) -> Qwen35Model:
    """Entry point used by models.build_model for model_type qwen3_5."""
    return Qwen35Model(Qwen35Config.from_dict(config))
