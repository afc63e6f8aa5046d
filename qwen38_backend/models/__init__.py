"""Model families and the factory that picks one from a config."""

from __future__ import annotations

import mlx.nn as nn

from ..config import DenseConfig, model_family


def build_model(config: dict) -> nn.Module:
    """Instantiate the architecture a config.json describes (weights not loaded)."""
    family = model_family(config)
    if family == "dense":
        from .dense import DenseModel

        return DenseModel(DenseConfig.from_dict(config))
    if family == "qwen3_5":
        from .qwen3_5 import build

        return build(config)
    from .qwen4_exp import build

    return build(config)
