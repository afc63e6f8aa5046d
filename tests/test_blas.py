"""The system OpenBLAS is used for MLX's CPU matmuls when present (qwen38_backend.blas)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from qwen38_backend.blas import CANDIDATES

PROBE = """
import json, sys
import numpy as np
import qwen38_backend
import mlx.core as mx
from qwen38_backend import blas
a = mx.array(np.random.default_rng(0).standard_normal((64, 96)).astype("float32"))
b = mx.array(np.random.default_rng(1).standard_normal((96, 48)).astype("float32"))
print(json.dumps({"loaded": blas.loaded, "product": np.array(a @ b).tolist()}))
"""


def probe(blas_env: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "QWEN38_BLAS")}
    if blas_env is not None:
        env["QWEN38_BLAS"] = blas_env
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux CPU wheels only")
def test_openblas_is_picked_up_and_agrees_with_the_bundled_blas():
    off = probe("off")
    assert off["loaded"] is None
    found = next((p for p in CANDIDATES if os.path.exists(p)), None)
    auto = probe(None)
    assert auto["loaded"] == found  # None on a machine without OpenBLAS: nothing loaded
    assert probe("/nonexistent/libopenblas.so")["loaded"] is None
    np.testing.assert_allclose(auto["product"], off["product"], rtol=1e-5, atol=1e-5)
