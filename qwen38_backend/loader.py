"""From a name or path to a ready Model: resolve, read the checkpoint, build, load weights."""

from __future__ import annotations

from pathlib import Path

from .engine import Model
from .loading import read_checkpoint
from .loading.demo import demo_path
from .loading.registry import DEMO_NAME, resolve
from .models import build_model
from .models.layers import fuse_projections
from .models.load import load_into, parse_dtype

DEMO_MAX_TOKENS = 512


def load_model(
    path_or_name: str | Path, dtype: str | None = None, keep_quantized: bool | None = None
) -> Model:
    path = resolve(str(path_or_name))
    ckpt = read_checkpoint(path)
    config = dict(ckpt.config)
    if ckpt.rope_interleaved:
        config["rope_interleaved"] = True
    net = build_model(config)
    if hasattr(net, "attach_ngram_tables") and ckpt.source.is_dir():
        # Flash-Next's n-gram table (102 GB in bf16) is read row by row from a memory map
        net.attach_ngram_tables(ckpt.source)
    compute = parse_dtype(dtype, ckpt.weights)
    dequantize = None if keep_quantized is None else not keep_quantized
    load_into(net, ckpt.weights, ckpt.quantization, compute, dequantize=dequantize)
    fuse_projections(net)
    name = str(path_or_name) if not Path(str(path_or_name)).exists() else path.stem
    model = Model(net, ckpt, compute, name=name)
    if name == DEMO_NAME or Path(path).resolve() == demo_path().resolve():
        # a 135M model on a CPU: its repetition loops would run for many minutes at 4096
        model.default_max_tokens = DEMO_MAX_TOKENS
    return model
