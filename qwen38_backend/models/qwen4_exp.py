"""qwen4_exp: Qwen3.8-Flash-Next. Gated DeltaNet (sigmoid output gate) and QSA attention in a
3:1 pattern, MoE on every layer, 4-stream hyper-connections, n-gram PLE at one layer, and an
optional MTP head. Layer loop (QWEN38.md):

    R = repeat(embed[ids], hc)
    for l: if PLE at l: R += PLE(R, ids); R = GR(R, attn_hc, mixer); R = GR(R, mlp_hc, MoE)
    logits = lm_head(read(R, hyper_connection_mixer))      # no final norm

The config (`Qwen4ExpConfig`, validated) is config.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .. import rows, scalars
from ..config import LINEAR, QSA, Qwen4ExpConfig
from ..errors import InvalidOptionError, WeightsError
from ..kernel_import import kernel_module
from ..kv.contiguous import ContiguousKV
from ..rows import STEP_MAX_ROWS, kernel_product, unpadded
from ..state import SequenceState
from .base import CausalLM
from .gated_deltanet import GatedDeltaNet, GatedDeltaNetState, decode_step
from .hyper_connections import GatedResidual
from .layers import RMSNorm, RopeSpec, compiled
from .moe import SparseMoE, fuse_expert_weights
from .ple import NgramTable, PLELayer, PLEState
from .qsa import QSAAttention, QSAState, positions_after

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

    def set_record(self, on: bool) -> None:  # the Replayable protocol, for both parts
        self.mixer.set_record(on)
        self.ple.set_record(on)

    def reads_back(self) -> bool:
        """PLE looks its n-gram rows up on the host (the table is too large for a device),
        so a step reads its token ids back at this layer: in pipelined decoding, building
        step t+1 waits here for step t to finish. Reported (SequenceState.reads_back) so a
        step hands its layers to the device as they are built, instead of the device idling
        until the host has built the whole step after the wait."""
        return True

    def replay(self, n: int) -> None:
        self.ple.replay(n)
        self.mixer.replay(n)


# ----- the model -------------------------------------------------------------------------------
def _rope(cfg: Qwen4ExpConfig) -> RopeSpec:
    # mRoPE with equal text positions on every axis is plain 1-D RoPE on the first dims
    return RopeSpec(cfg.rotary_dims, cfg.rope_theta)


def _checked_store(store, cfg: Qwen4ExpConfig):
    """A QSA layer's KV store: a paged one needs whole blocks per page (a block never
    straddles two pages, so a selected block is one page's rows)."""
    page = getattr(store, "page_tokens", None)
    if page is not None and page % cfg.indexer_compress_ratio:
        raise InvalidOptionError(
            f"kv_page_tokens={page}: Flash-Next (qwen4_exp) needs a multiple of "
            f"indexer_compress_ratio ({cfg.indexer_compress_ratio}) so QSA blocks fill pages"
        )
    return store


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
            return QSAState(_checked_store(store, cfg), cfg.indexer_compress_ratio)
        if self.has_ple:
            return PLEMixerState(GatedDeltaNetState(), self.ple.make_state())
        return GatedDeltaNetState()

    # False: decode builds the step op by op like prefill (tests compare the two)
    compile_decode = True

    def __call__(
        self, R: mx.array, ids: mx.array | None, st, offset: int, unclosed: tuple = ()
    ) -> tuple[mx.array, tuple]:
        """(R, unclosed) after this layer. A step leaves its MoE's close to the next layer,
        `unclosed` = (the MoE's inject weights, its output): the next layer adds it to R in
        the launch that norms R for its mixer (where the stream kernels run; `close_streams`
        adds it otherwise). Elsewhere `unclosed` is () and R is the layer's whole output."""
        # a step (a token, or a verify's few rows: the same graphs, so the same fusions)
        decode = R.shape[0] <= STEP_MAX_ROWS and self.compile_decode
        if self.has_ple:
            R = close_streams(self.attn_hyper_connection, R, unclosed)
            unclosed = ()
            R = R + self.ple(R, ids, st.ple, compile=decode)
            st = st.mixer
        # a step: the mixer, the router, experts, shared expert and both stream mixes
        # replayed as compiled graphs instead of ~150 ops encoded from Python per layer
        prepared = self._prepared  # (MLX's dtypes do not compare with None)
        if decode and (prepared is None or prepared != R.dtype):  # once decided: one compare
            self.prepare_decode(R.dtype)
        if self.is_linear and decode:
            return self.decode_linear(R, st, unclosed)
        if decode:
            return self.decode_attention(R, st, offset, unclosed)
        R = close_streams(self.attn_hyper_connection, R, unclosed)
        if self.is_linear:
            R = self.attn_hyper_connection(R, lambda x: self.linear_attn(x, st))
        else:
            R = self.attn_hyper_connection(R, lambda x: self.self_attn(x, st, offset))
        return self.mlp_hyper_connection(R, self.mlp), ()

    _prepared = None  # the dtype whose steps' kernels were chosen (prepare_decode)

    def prepare_decode(self, dtype: mx.Dtype) -> None:
        """Choose the step kernels of the MoE, both stream mixes and a QSA layer's q/k norms
        and RoPE for steps of `dtype` (outside any trace: the kernels' probes run ops)."""
        if not self.is_linear:
            self.self_attn.prepare_decode()
        self.mlp.prepare_decode()
        self.attn_hyper_connection.prepare_decode(dtype)
        self.mlp_hyper_connection.prepare_decode(dtype)
        self._fuse_linear_for = str(dtype) if self._fuses_linear(dtype) else ""
        self._fuse_moe_for = str(dtype) if self._fuses_moe(dtype) else ""
        self._fuse_attention_for = str(dtype) if self._fuses_attention_in(dtype) else ""
        self._prepared = dtype

    _fuse_linear_for = ""  # the dtype whose one-row mixer side is one launch ("": none)
    _fuse_moe_for = ""  # the dtype whose one-row MoE side is two launches ("": none)
    _fuse_attention_for = ""  # the dtype whose one-row QSA input side is one launch

    def _fuses_moe(self, dtype: mx.Dtype) -> bool:
        """Whether a one-row step's close, the MoE's open and its MoE up to the experts' down
        launch (router product, routing, the experts' up launch) run as one launch with the
        bits of the six (kernels/fused.py; probed on random streams, once per shape)."""
        fused, hc, moe = kernel_module("fused"), self.mlp_hyper_connection, self.mlp
        if fused is None or not hc._fuse_for or "router_gate_proj" not in moe:
            return False
        R, unclosed = hc.step_operands(dtype, 47)
        e = moe.experts
        shape = (e.num_experts, moe.top_k, e.hidden, e.intermediate, getattr(e, "group_size", 0))
        weights = [moe.router_gate_proj.weight, *(v for _, v in tree_flatten(e.parameters()))]
        kinds = [str(v.dtype) for v in weights]
        key = ("moe side", hc.hc_count, hc.lowrank, shape, str(dtype), kinds)
        return fused.agrees(str(key), lambda view: self._moe_launches(R, *unclosed, view))

    def _moe_launches(self, R, inj, out, view) -> list | None:
        """[closed streams, the MoE's input, gated product, then SparseMoE.step_launches'] of
        a one-row step's close, the MoE's open and its MoE up to the down launch, or None."""
        opened = self.mlp_hyper_connection._open_launches(R, inj, out, view)
        if opened is None:
            return None
        moe = self.mlp.step_launches(opened[1], view)
        return None if moe is None else [*opened, *moe]

    def _fuses_linear(self, dtype: mx.Dtype) -> bool:
        """Whether a one-row step's close, this layer's mixer open and its Gated DeltaNet
        (in-projection, the kernel, out_proj) run as one launch with the bits of the six
        (kernels/fused.py; probed on random streams and state, once per shape)."""
        fused = kernel_module("fused")
        hc = self.attn_hyper_connection
        if not self.is_linear or fused is None or not hc._fuse_for:
            return False
        mixer = self.linear_attn
        mixer.prepare_decode(dtype)
        H, S = hc.hidden, hc.hc_count
        R, unclosed = hc.step_operands(dtype, 43)
        keys = mx.random.split(mx.random.key(44), 2)
        conv = mx.random.normal((mixer.conv_kernel - 1, mixer.conv_dim), key=keys[0])
        state = (mixer.n_v_heads, mixer.v_head_dim, mixer.k_head_dim)
        recurrent = 0.1 * mx.random.normal(state, key=keys[1])
        products = (mixer.in_proj_all, mixer.out_proj) if "in_proj_all" in mixer else ()
        kinds = [(type(p).__name__, str(p.weight.dtype)) for p in products]
        key = ("gated deltanet side", H, S, hc.lowrank, mixer._core_spec(), state, dtype, kinds)
        return fused.agrees(
            str(key),
            lambda view: self._linear_launches(R, unclosed, conv.astype(dtype), recurrent, view),
        )

    def _linear_launches(self, R, unclosed: tuple, conv, recurrent, view) -> list | None:
        """[closed streams, block input, gated product, mixer output, conv history, recurrent
        state] of a one-row step's close, this layer's mixer open and its Gated DeltaNet as
        launches (GatedResidual._open_launches, GatedDeltaNet.step_launches), or None."""
        opened = self.attn_hyper_connection._open_launches(R, *unclosed, view)
        if opened is None:
            return None
        stepped = self.linear_attn.step_launches(opened[1], conv, recurrent, view)
        return None if stepped is None else [*opened, *stepped]

    def _fused_linear(self, R, unclosed: tuple, conv, recurrent) -> tuple | None:
        """(R closed, the inject weights, the mixer output, its conv history, its recurrent
        state) of a one-row step as one fused launch, or None (then apart)."""
        hc = self.attn_hyper_connection
        if not hc.closes_fused(R, *unclosed):
            return None
        fused = kernel_module("fused").run(
            lambda view: self._linear_launches(R, unclosed, conv, recurrent, view)
        )
        if fused is None:
            return None
        closed, _, gated, out, last, states = fused
        return closed, gated[:, hc.lowrank :], out, last, states

    def decode_linear(
        self, R: mx.array, state: GatedDeltaNetState, unclosed: tuple
    ) -> tuple[mx.array, tuple]:
        """One token through the whole layer (Gated DeltaNet, MoE, stream mixes), compiled."""
        R, *unclosed = decode_step(self, R, state, *unclosed, outputs=3)
        return R, tuple(unclosed)

    def decode_attention(
        self, R: mx.array, st: QSAState, offset: int, unclosed: tuple
    ) -> tuple[mx.array, tuple]:
        """A step through the whole layer: compiled up to QSA's state writes, then its
        selection (compiled apart: its shapes follow the index buffer) and the store's gather,
        and compiled again from the attention output on (MoE included)."""
        at = scalars.int32(offset)  # an input: a Python int would be traced in
        R, inj, qi, raw, q, k, v, gate = compiled(self, "_attention_in")(R, at, *unclosed)
        self.self_attn.cache_keys(raw, st, compile=True)
        out = self.self_attn.attend(q, k, v, qi, None, st, offset)
        R, *unclosed = compiled(self, "_attention_out")(R, inj, out, gate)
        return R, tuple(unclosed)

    def _attention_in(self, R: mx.array, offset: mx.array, *unclosed) -> tuple[mx.array, ...]:
        attn = self.self_attn
        positions = positions_after(offset, R.shape[0])
        if unclosed and self._fuse_attention_for == str(R.dtype):
            fused = self._fused_attention_in(R, unclosed, offset)
            if fused is not None:
                R, inj, qk, heads = fused
                return (R, inj, *attn.index_from(qk, positions), *attn.heads_from(*heads))
        R, x, inj = self._open(R, unclosed)
        qi, raw = attn.index_query(x, positions)
        return (R, inj, qi, raw, *attn.project_qkv(x, offset))

    def _attention_in_launches(self, R, unclosed: tuple, offset, view) -> list | None:
        """[closed streams, block input, gated product, the indexer's product, then
        Attention.qkv_launches'] of a one-row step's close, this layer's attention open, the
        indexer's product and the q/k/v side as launches, or None."""
        opened = self.attn_hyper_connection._open_launches(R, *unclosed, view)
        if opened is None:
            return None
        attn = self.self_attn
        qk = kernel_product(attn.indexer.index_qk_proj, opened[1])  # index_query's product
        heads = None if qk is None else attn.qkv_launches(opened[1], offset)
        return None if heads is None else [*opened, qk, *heads]

    def _fused_attention_in(self, R, unclosed: tuple, offset) -> tuple | None:
        """(R closed, the inject weights, the indexer's product, qkv_launches' outputs) of a
        one-row step as one fused launch, or None (then apart)."""
        hc = self.attn_hyper_connection
        if not hc.closes_fused(R, *unclosed):
            return None
        fused = kernel_module("fused").run(
            lambda view: self._attention_in_launches(R, unclosed, offset, view)
        )
        if fused is None:
            return None
        closed, _, gated, qk, *heads = fused
        return closed, gated[:, hc.lowrank :], qk, heads

    def _fuses_attention_in(self, dtype: mx.Dtype) -> bool:
        """Whether a one-row step's close, this QSA layer's open, the indexer's product and
        its q/k/v side run as one launch with the bits of the six (kernels/fused.py; probed
        on random streams, once per shape)."""
        fused = kernel_module("fused")
        hc = self.attn_hyper_connection
        if self.is_linear or fused is None or not hc._fuse_for:
            return False
        R, unclosed = hc.step_operands(dtype, 48)
        offset = mx.array(37, dtype=mx.int32)
        attn = self.self_attn
        products = [attn.indexer.index_qk_proj, attn.get("qkv_proj")]
        kinds = [(type(p).__name__, str(p.weight.dtype)) for p in products if p is not None]
        key = ("qsa in", hc.hidden, hc.hc_count, hc.lowrank, attn.head_dim, str(dtype), kinds)
        return fused.agrees(
            str(key), lambda view: self._attention_in_launches(R, unclosed, offset, view)
        )

    def _attention_out(self, R: mx.array, inj: mx.array, out: mx.array, gate: mx.array):
        return self._moe_step(R, inj, self.self_attn.output(out, gate))

    def _linear_step(self, R: mx.array, *args):
        """args: the layer before's `unclosed` (maybe none), then the conv and recurrent
        states; returns (R, inject weights, MoE output, *GatedDeltaNetState.advance's)."""
        *unclosed, conv, recurrent = args
        if unclosed and self._fuse_linear_for == str(R.dtype):
            fused = self._fused_linear(R, tuple(unclosed), conv, recurrent)
            if fused is not None:  # (a one-row step's conv inputs are its history)
                R, inj, out, last, states = fused
                return *self._moe_step(R, inj, out), last, last, states
        R, x, inj = self._open(R, unclosed)
        out, *new = self.linear_attn.step(x, conv, recurrent)
        return *self._moe_step(R, inj, out), *new

    def _open(self, R: mx.array, unclosed) -> tuple[mx.array, mx.array, mx.array]:
        """(R with the layer before's MoE added, the mixer's input, its inject weights): the
        close and this mixer's norm in one launch where the stream kernels run (with the
        open's two products too where they fuse: GatedResidual.close_then_open)."""
        hc = self.attn_hyper_connection
        if unclosed:
            return hc.close_then_open(R, *unclosed, hc)
        x, inj = hc.open(R)
        return R, x, inj

    def _moe_step(self, R: mx.array, inj: mx.array, out: mx.array) -> tuple[mx.array, ...]:
        """A step's mixer close and its MoE with its stream mix (the close and the MoE's norm
        in one launch where the stream kernels run): (R, the MoE's inject weights, its
        output), closed by the next layer (`unclosed`)."""
        hc, mlp_hc = self.attn_hyper_connection, self.mlp_hyper_connection
        if self._fuse_moe_for == str(R.dtype) and hc.closes_fused(R, inj, out):
            fused = kernel_module("fused").run(lambda v: self._moe_launches(R, inj, out, v))
            if fused is not None:  # the close to the experts' up launch, then the down
                closed, _, gated, *moe = fused
                return closed, gated[:, mlp_hc.lowrank :], self.mlp.finish(*moe)
        R, x, inj = hc.close_then_open(R, inj, out, mlp_hc)
        return R, inj, self.mlp(x)


def close_streams(hc: GatedResidual, R: mx.array, unclosed: tuple) -> mx.array:
    """R with a step's `unclosed` (inject weights, block output) added on every stream, as
    one compiled launch (R itself where nothing is unclosed)."""
    return compiled(hc, "close")(R, *unclosed) if unclosed else R


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
            self.mtp = Qwen4ExpMTP(cfg)

    def make_state(self, kv_factory=ContiguousKV) -> SequenceState:
        return SequenceState([b.make_state(self.config, kv_factory) for b in self.model.layers])

    def residual(self, ids: mx.array, state: SequenceState) -> mx.array:
        """The residual streams after the last layer, [T, hc * hidden] (the MTP head's input)."""
        offset = state.offset
        R = mx.tile(self.model.embed_tokens(ids), (1, self.config.hc_count))
        eager = state.eager_layers(ids.shape[0])
        with unpadded():  # see logits_from_residual
            rows.prepare(R.dtype, self, ids.shape[0])
            layers = zip(self.model.layers, state.layers, strict=True)
            unclosed: tuple = ()
            for i, (layer, layer_state) in enumerate(layers):
                R, unclosed = layer(R, ids, layer_state, offset, unclosed)
                state.layer_built(i, unclosed[-1] if unclosed else R, ids.shape[0], eager)
            return close_streams(self.model.hyper_connection_mixer, R, unclosed)

    def hidden(self, ids: mx.array, state: SequenceState) -> mx.array:
        """The mixer's read of the final residual, [T, hidden] (what lm_head sees)."""
        return self.model.hyper_connection_mixer.read(self.residual(ids, state))

    def logits_from_residual(self, R: mx.array) -> mx.array:
        read = self.model.hyper_connection_mixer.read
        # Unpadded: a step keeps its one-row kernels (the experts' gather_qmm among them); a
        # verify's rows take the row-invariant kernel or run one by one (rows._split_plan).
        with unpadded():
            if R.shape[0] <= STEP_MAX_ROWS and Qwen4ExpBlock.compile_decode:  # one replay
                self.model.hyper_connection_mixer.prepare_decode(R.dtype)
                read = compiled(self.model.hyper_connection_mixer, "read")
            return self.logits_from_hidden(read(R))

    def __call__(self, ids: mx.array, state: SequenceState, last_only: bool = False) -> mx.array:
        R = self.residual(ids, state)
        if last_only:
            R = R[-1:]
        return self.logits_from_residual(R)

    # ----- MTP -----------------------------------------------------------------------------
    def draft_logits(self, residual: mx.array, next_tokens: mx.array, mtp_state) -> mx.array:
        """MTP draft logits [T, vocab] from trunk residuals [T, hc*hidden] (see Qwen4ExpMTP)."""
        self._require_mtp()
        return self.mtp.draft_logits(residual, next_tokens, mtp_state, self)

    def features(self, ids: mx.array, state: SequenceState) -> mx.array:
        return self.residual(ids, state)

    def logits_from_features(self, features: mx.array) -> mx.array:
        return self.logits_from_residual(features)

    def mtp_advance(self, features: mx.array, next_tokens: mx.array, mtp_state) -> mx.array:
        self._require_mtp()
        embeds = self.model.embed_tokens(next_tokens.reshape(-1))
        return self.mtp.residual(features, embeds, mtp_state)

    def mtp_logits(self, mtp_features: mx.array) -> mx.array:
        return self.logits_from_hidden(self.mtp.hyper_connection_mixer.read(mtp_features))

    # ----- weights -------------------------------------------------------------------------
    def ple_layers(self) -> list[tuple[int, PLELayer]]:
        return [(i, b.ple) for i, b in enumerate(self.model.layers) if b.has_ple]

    def attach_ngram_tables(self, directory: str | Path) -> bool:
        """Memory-map the n-gram tables from a weights directory's safetensors files.

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
        (or the MTP module removed when the weights have none); per-expert tensors fused;
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


# ----- MTP draft head ----------------------------------------------------------------------------
# No HF reference; layout and formulas follow vLLM / SGLang (QWEN38.md "MTP"). 31 tensors under
# `mtp.`:
#     e  = fc_embedding(rms_zc(embed[t_{i+1}], pre_fc_norm_embedding))             [H]
#     Hn = rms_zc(H_i, pre_fc_norm_hidden)     ONE statistic over all hc*H features (not grouped)
#     S  = fc_hidden(Hn per stream) + e on every stream                            [hc*H]
#     S  = one Flash-Next layer (QSA with its own indexer + MoE, hyper-connections, no PLE)
#     draft logits = lm_head(read(S, mtp.hyper_connection_mixer))      predicts t_{i+2}
# H_i is the trunk's residual after its last layer (before the mixer). Embedding and lm_head
# are the trunk's. Later draft steps feed the returned residual S as the next H.
class Qwen4ExpMTPState:
    """The head's own per-sequence state: one QSA layer state per MTP layer, and its position."""

    can_truncate = True

    def __init__(self, layers: list[QSAState]) -> None:
        self.layers = layers
        self.offset = 0
        self.last_residual: mx.array | None = None

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.layers)

    def snapshot(self) -> dict[str, mx.array]:
        snap = {
            f"layer{i}.{k}": v for i, s in enumerate(self.layers) for k, v in s.snapshot().items()
        }
        snap["offset"] = mx.array(self.offset, dtype=mx.int64)
        return snap

    def restore(self, tensors: dict[str, mx.array]) -> None:
        for i, s in enumerate(self.layers):
            p = f"layer{i}."
            s.restore({k[len(p) :]: v for k, v in tensors.items() if k.startswith(p)})
        self.offset = int(tensors["offset"].item()) if "offset" in tensors else 0
        self.last_residual = None

    def truncate(self, length: int) -> None:
        for s in self.layers:
            s.truncate(length)
        self.offset = min(self.offset, length)


class Qwen4ExpMTP(nn.Module):
    """Parameter names match the weights' `mtp.*` tensors."""

    def __init__(self, cfg: Qwen4ExpConfig):
        super().__init__()
        H, hc, eps = cfg.hidden_size, cfg.hc_count, cfg.rms_norm_eps
        self.hidden_size, self.hc_count = H, hc
        self.ratio = cfg.indexer_compress_ratio
        self.pre_fc_norm_embedding = RMSNorm(H, eps, zero_centered=True)
        self.pre_fc_norm_hidden = RMSNorm(H * hc, eps, zero_centered=True)
        self.fc_embedding = nn.Linear(H, H, bias=False)
        self.fc_hidden = nn.Linear(H, H, bias=False)
        self.layers = [Qwen4ExpBlock(cfg, QSA) for _ in range(max(cfg.mtp_num_hidden_layers, 1))]
        self.hyper_connection_mixer = GatedResidual(H, hc, cfg.hc_lowrank, eps, inject=False)

    def make_state(self, kv_factory=ContiguousKV) -> Qwen4ExpMTPState:
        return Qwen4ExpMTPState([QSAState(kv_factory(), self.ratio) for _ in self.layers])

    def fuse(self, residual: mx.array, next_embeds: mx.array) -> mx.array:
        """S0 [T, hc*H] from trunk residuals [T, hc*H] and embeddings of t_{i+1} [T, H]."""
        T = residual.shape[0]
        e = self.fc_embedding(self.pre_fc_norm_embedding(next_embeds))
        Hn = self.pre_fc_norm_hidden(residual).reshape(T, self.hc_count, self.hidden_size)
        return (self.fc_hidden(Hn) + e[:, None, :]).reshape(T, -1)

    def residual(
        self, residual: mx.array, next_embeds: mx.array, state: Qwen4ExpMTPState
    ) -> mx.array:
        """The head's residual after its layer(s) [T, hc*H]; advances `state` by T."""
        S = self.fuse(residual, next_embeds)
        unclosed: tuple = ()
        for layer, st in zip(self.layers, state.layers, strict=True):
            S, unclosed = layer(S, None, st, state.offset, unclosed)
        S = close_streams(self.hyper_connection_mixer, S, unclosed)
        state.offset += S.shape[0]
        state.last_residual = S
        return S

    def draft_logits(
        self,
        residual: mx.array,
        next_tokens: mx.array,
        state: Qwen4ExpMTPState,
        trunk: Qwen4ExpModel,
    ) -> mx.array:
        """Draft logits [T, vocab] predicting t_{i+2} for positions i = state.offset..+T-1.

        `trunk` supplies the shared embedding and lm_head. The head's residual is kept in
        `state.last_residual` to chain further draft steps.
        """
        embeds = trunk.model.embed_tokens(next_tokens.reshape(-1))
        S = self.residual(residual, embeds, state)
        return trunk.logits_from_hidden(self.hyper_connection_mixer.read(S))


def build(config: dict) -> Qwen4ExpModel:
    """Entry point used by models.build_model for model_type qwen4_exp*."""
    return Qwen4ExpModel(Qwen4ExpConfig.from_dict(config))
