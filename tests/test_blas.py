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


# Imports the package first, as a user's program does, so MLX binds whichever BLAS blas.py
# picks (OpenBLAS where present), whatever the pytest process bound; then the premise of
# speculative decoding: the rows of a verify forward are the plain steps' bits.
ROWS_PROBE = """
import json, sys, tempfile
from pathlib import Path
import qwen38_backend
import mlx.core as mx
import numpy as np
from qwen38_backend import blas
from qwen38_backend.testing import make_tiny_weights
sys.path.insert(0, sys.argv[1])
from helpers import dense_fixture
tmp = Path(tempfile.mkdtemp())
paths = {
    "dense": dense_fixture("qwen3", tmp / "d"),
    "hybrid": make_tiny_weights("qwen3_5", tmp / "h"),
    "flash": make_tiny_weights("qwen4_exp", tmp / "f"),
}
differ = {}
for name, path in paths.items():
    model = qwen38_backend.load(str(path))
    one, many = model.new_state(), model.new_state()
    model.prefill(list(range(3, 40)), one)
    model.prefill(list(range(3, 40)), many)
    tail = [7, 8, 9, 10, 11]
    steps = [np.array(model.forward([t], one)[-1].astype(mx.float32)) for t in tail]
    rows = np.array(model.net.logits_from_features(model.forward_features(tail, many)))
    differ[name] = [i for i, step in enumerate(steps) if not np.array_equal(rows[i], step)]
print(json.dumps({"loaded": blas.loaded, "differ": differ}))
"""


def test_verify_rows_equal_plain_steps_with_the_blas_a_user_gets():
    """With OpenBLAS (loaded when the package is imported before MLX) a product's rows
    depended on the row count, so verify rows differed from plain steps; in the pytest
    process the BLAS depends on which test file imported MLX first, hence a fresh process."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "QWEN38_BLAS")}
    env.pop("QWEN38_PAD_ROWS", None)  # the CPU's own plan: nothing padded
    tests = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", ROWS_PROBE, tests],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loaded"] == next((p for p in CANDIDATES if os.path.exists(p)), None)
    assert got["differ"] == {"dense": [], "hybrid": [], "flash": []}
