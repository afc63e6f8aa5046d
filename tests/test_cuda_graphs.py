"""The package's MLX CUDA graph settings: set where the user has not, never over theirs."""

import sys

from qwen38_backend import cuda_graphs


def test_graph_defaults_fill_what_the_user_left_unset(monkeypatch):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv("MLX_CUDA_GRAPH_CACHE_SIZE", raising=False)
    monkeypatch.setenv("MLX_MAX_OPS_PER_BUFFER", "7")
    cuda_graphs.use_graph_defaults()
    import os

    assert os.environ["MLX_MAX_OPS_PER_BUFFER"] == "7"
    assert (
        os.environ["MLX_CUDA_GRAPH_CACHE_SIZE"]
        == cuda_graphs.GRAPH_DEFAULTS["MLX_CUDA_GRAPH_CACHE_SIZE"]
    )


def test_graph_defaults_leave_other_platforms_alone(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    for name in cuda_graphs.GRAPH_DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    cuda_graphs.use_graph_defaults()
    import os

    assert not any(name in os.environ for name in cuda_graphs.GRAPH_DEFAULTS)
