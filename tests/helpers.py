"""Test helpers: tiny dense weights with a tokenizer, ready to load."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures"
DENSE_ARCHS = ("llama", "qwen2", "qwen3")


def dense_fixture(arch: str, target: Path) -> Path:
    """Copy committed tiny dense weights into target and give it the tiny tokenizer."""
    from qwen38_backend.templates import write_tiny_tokenizer

    src = FIXTURES / "dense" / arch
    dst = target / arch
    shutil.copytree(src, dst)
    write_tiny_tokenizer(dst)
    return dst


def dense_reference(arch: str) -> tuple[list[int], np.ndarray]:
    d = FIXTURES / "dense" / arch
    return json.loads((d / "reference_tokens.json").read_text()), np.load(
        d / "reference_logits.npy"
    )


@contextlib.contextmanager
def recorded(module, *names: str):
    """Inside: each call of module.<name> (for `names`) is appended to the yielded list by
    name, in order, then made as usual."""
    calls: list[str] = []
    real = {name: getattr(module, name) for name in names}

    def recorder(name):
        def call(*args, **kwargs):
            calls.append(name)
            return real[name](*args, **kwargs)

        return call

    for name in names:
        setattr(module, name, recorder(name))
    try:
        yield calls
    finally:
        for name, fn in real.items():
            setattr(module, name, fn)
