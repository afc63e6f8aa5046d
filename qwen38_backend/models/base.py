"""What every model family shares: the LM head (tied or not), logits, and MTP plumbing."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..config import ModelConfig
from ..errors import ConfigError
from ..rows import project
from ..state import SequenceState
from .parallel import shard_modules


class CausalLM(nn.Module):
    """Base for a family's top-level module; subclasses build `self.model` (with
    `embed_tokens`) and implement `hidden(ids, state)` and `make_state(kv_factory)`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        if self.config.tie_word_embeddings:
            return project(self.model.embed_tokens.as_linear, h)
        return project(self.lm_head, h)

    def __call__(self, ids: mx.array, state: SequenceState, last_only: bool = False) -> mx.array:
        h = self.hidden(ids, state)
        if last_only:
            h = h[-1:]
        return self.logits_from_hidden(h)

    def canonical_names(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Weight names -> module names: `model.language_model.X` (multimodal wrappers) or
        `language_model.model.X` -> `model.X`; the vision tower, rotary caches and a tied
        lm_head dropped."""
        out: dict[str, mx.array] = {}
        for name, w in weights.items():
            if name.startswith(("model.visual.", "visual.", "vision_tower.")):
                continue
            if "rotary_emb.inv_freq" in name:
                continue
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model.") :]
            elif name.startswith("language_model.model."):
                name = "model." + name[len("language_model.model.") :]
            elif name.startswith("language_model.lm_head."):
                name = name[len("language_model.") :]
            if name.startswith("lm_head.") and self.config.tie_word_embeddings:
                continue
            out[name] = w
        return out

    def shard(self, group: mx.distributed.Group) -> None:
        """Split this model over the ranks of `group` (after loading, before `fuse`): each
        sub-module that knows how cuts itself (models/parallel.py); the rest, and the MTP
        head, stay whole on every rank."""
        shard_modules(self, group)

    # ----- MTP (families with a draft head set self.mtp) ------------------------------------
    @property
    def has_mtp(self) -> bool:
        return "mtp" in self

    def _require_mtp(self) -> None:
        if not self.has_mtp:
            raise ConfigError("these weights have no MTP head (no mtp.* tensors)")

    def make_mtp_state(self):
        self._require_mtp()
        return self.mtp.make_state()

    # ----- features: what the MTP head reads of the trunk (speculative decoding) ------------
    def features(self, ids: mx.array, state: SequenceState) -> mx.array:
        """The trunk's output rows [T, ...] for the MTP head (final-normed hidden states)."""
        return self.hidden(ids, state)

    def logits_from_features(self, features: mx.array) -> mx.array:
        """Logits of `features` rows: the same ops as __call__, so rows are bit-identical."""
        return self.logits_from_hidden(features)

    def mtp_advance(self, features: mx.array, next_tokens: mx.array, mtp_state) -> mx.array:
        """Run the head at its next positions on (trunk or chained features [T, ...], ids of
        the tokens after them [T]); returns its output features (chainable), no logits."""
        self._require_mtp()  # a family without a head (dense) says so here
        raise ConfigError(f"{type(self).__name__} does not run an MTP draft head")

    def mtp_logits(self, mtp_features: mx.array) -> mx.array:
        """Draft logits of the head's output features (they predict two tokens ahead)."""
        self._require_mtp()
        raise ConfigError(f"{type(self).__name__} does not run an MTP draft head")
