"""What every model family shares: the LM head (tied or not), logits, and MTP plumbing."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..config import ModelConfig
from ..errors import ConfigError
from ..state import SequenceState


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
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

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
