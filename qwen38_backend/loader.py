"""`qwen38_backend.load()`: from a registry name or path to a ready `Model`.

The one place the steps are put together: resolve the name (loading/registry.py), read the
weights from disk (loading/: `read_weights`), build the module for the config (models/),
assign the weights into it (models/assign.py: sanitize, check shapes, quantize, cast), fuse
projections, and wrap it all in the engine's `Model`.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from .engine import Model
from .loading import read_weights
from .loading.demo import is_demo_file
from .loading.registry import DEMO_NAME, resolve
from .models import build_model
from .models.assign import assign_weights, parse_dtype
from .models.layers import fuse_projections

DEMO_MAX_TOKENS = 512


def load_model(
    path_or_name: str | Path,
    dtype: str | None = None,
    keep_quantized: bool | None = None,
    group: mx.distributed.Group | None = None,
) -> Model:
    path = resolve(str(path_or_name))
    weights = read_weights(path)
    config = dict(weights.config)
    if weights.rope_interleaved:
        config["rope_interleaved"] = True
    net = build_model(config)
    if hasattr(net, "attach_ngram_tables") and weights.source.is_dir():
        # Flash-Next's n-gram table (102 GB in bf16) is read row by row from a memory map
        net.attach_ngram_tables(weights.source)
    compute = parse_dtype(dtype, weights.tensors)
    dequantize = None if keep_quantized is None else not keep_quantized
    assign_weights(
        net, weights.tensors, weights.quantization, compute, dequantize=dequantize, group=group
    )
    fuse_projections(net)
    name = str(path_or_name) if not Path(str(path_or_name)).exists() else path.stem
    model = Model(net, weights, compute, name=name, group=group)
    if name == DEMO_NAME or is_demo_file(Path(path)):
        # a 135M model on a CPU: its repetition loops would run for many minutes at 4096
        model.default_max_tokens = DEMO_MAX_TOKENS
    return model
