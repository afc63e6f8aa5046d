"""Shared fixtures: an isolated QWEN38_HOME per test, the demo model, and opt-in markers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Imported before any test module imports MLX: the package decides which BLAS MLX binds
# (qwen38_backend/blas.py: the system OpenBLAS where present, as in a user's program), so the
# suite's numerics do not depend on which test file pytest happens to import first.
import qwen38_backend

# The demo GGUF (98 MB) is fetched once into a persistent cache, not per test run.
DEMO_HOME = Path(os.environ.get("QWEN38_TEST_HOME", Path.home() / ".cache" / "qwen38-test-home"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")
    parser.addoption("--run-gpu", action="store_true", help="run tests that need a CUDA GPU")
    parser.addoption(
        "--run-nvcc", action="store_true", help="compile the CUDA kernels' sources with nvcc"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    opt_in = {"slow": "--run-slow", "gpu": "--run-gpu", "nvcc": "--run-nvcc"}
    for item in items:
        for marker, flag in opt_in.items():
            if marker in item.keywords and not config.getoption(flag):
                item.add_marker(pytest.mark.skip(reason=f"opt-in: pass {flag} to run"))


@pytest.fixture(autouse=True)
def isolated_home(tmp_path_factory, monkeypatch) -> Path:
    """Each test gets its own registry / cache / prefix store directory."""
    home = tmp_path_factory.mktemp("qwen38_home")
    monkeypatch.setenv("QWEN38_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def demo_gguf() -> Path:
    """Path to the demo model's GGUF, fetched and verified once per machine."""
    override = os.environ.get("QWEN38_DEMO_GGUF")
    if override:
        return Path(override)
    from qwen38_backend.loading.demo import ensure_demo

    previous = os.environ.get("QWEN38_HOME")
    os.environ["QWEN38_HOME"] = str(DEMO_HOME)
    try:
        return ensure_demo(progress=False)
    finally:
        if previous is None:
            os.environ.pop("QWEN38_HOME", None)
        else:
            os.environ["QWEN38_HOME"] = previous


@pytest.fixture(scope="session")
def demo_model(demo_gguf):
    """The demo model loaded once per test session (fp32 on CPU)."""
    return qwen38_backend.load(str(demo_gguf))


@pytest.fixture(scope="session")
def demo_gguf_reader(demo_gguf):
    """gguf's own reader (gguf-py, the independent reference) over the demo GGUF, parsed once
    per session: parsing reads its 49,152-token vocabulary field by field (~6 s here).
    Read-only (a memory map)."""
    import gguf

    return gguf.GGUFReader(str(demo_gguf))
