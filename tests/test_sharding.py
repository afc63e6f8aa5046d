"""A model split over two ranks (mx.distributed, ring backend, two local processes) computes
what the whole model computes: logits within fp32 tolerance, identical greedy tokens (also
on the paged store), and state files that round-trip per rank and are refused elsewhere."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import dense_fixture

import qwen38_backend
from qwen38_backend.admission import RankShare, memory_plan
from qwen38_backend.errors import ShardingError, StateFileError
from qwen38_backend.state_files import read_state_file, save_state_file
from qwen38_backend.testing import make_tiny_weights

WORKER = Path(__file__).parent / "ranks" / "worker.py"
# 40 tokens: Flash-Next's 2 experts per token make 80 (token, expert) pairs, past the
# threshold where experts run grouped (prefill) rather than gathered (decode)
PROMPT = [(i * 7) % 50 + 3 for i in range(40)]
TOKENS = 8


# ring between local processes on a CPU; QWEN38_TEST_BACKEND=nccl runs the same tests with one
# GPU per rank
BACKEND = os.environ.get("QWEN38_TEST_BACKEND", "ring")


def launcher() -> list[str]:
    found = shutil.which("mlx.launch") or Path(sys.executable).parent / "mlx.launch"
    if Path(found).exists():
        return [str(found)]
    # what the mlx.launch script runs (the module has no __main__ entry)
    return [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()"]


def launch(n: int, model: Path, out: Path, paged: bool) -> dict:
    cmd = launcher() + ["-n", str(n), "--backend", BACKEND, "--", sys.executable, str(WORKER)]
    cmd += [str(model), str(out), "--prompt", ",".join(map(str, PROMPT))]
    cmd += ["--tokens", str(TOKENS)] + (["--paged"] if paged else [])
    root = str(Path(__file__).parents[1])
    path = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=root + (os.pathsep + path if path else ""))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return dict(np.load(out / "result.npz"))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sharded")
    return {
        "qwen3_5": make_tiny_weights("qwen3_5", root / "qwen3_5"),
        "qwen4_exp": make_tiny_weights("qwen4_exp", root / "qwen4_exp"),
        "qwen3": dense_fixture("qwen3", root),
    }


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen4_exp", "qwen3"])
def test_two_ranks_equal_one(arch, models, tmp_path):
    paged = arch != "qwen4_exp"  # Flash-Next's QSA runs on the contiguous store
    got = launch(2, models[arch], tmp_path, paged)
    whole = qwen38_backend.load(str(models[arch]))
    want_logits = whole.logits(PROMPT)
    scale = np.abs(want_logits).max()
    assert np.abs(got["logits"] - want_logits).max() <= 1e-5 * max(scale, 1.0)
    want = list(whole.generate_tokens(PROMPT, max_tokens=TOKENS, temperature=0.0))
    assert got["tokens"].tolist() == want
    if paged:
        assert got["paged"].tolist() == want
    # the state file each rank saved restores its part: the next step's logits match
    state = whole.new_state()
    whole.prefill(PROMPT, state)
    after = np.array(whole.forward(want[:1], state, last_only=True).astype(mx.float32))
    assert np.abs(got["after_restore"] - after).max() <= 1e-5 * max(np.abs(after).max(), 1.0)
    # admission plans one rank's share: its parameter bytes are what rank 0 holds
    plan = memory_plan(whole.weights.config, 64, ranks=2, dtype="float32")
    assert plan.weights == int(got["weights_bytes"])
    assert plan.weights < memory_plan(whole.weights.config, 64, dtype="float32").weights
    # a rank's state file is refused by a process that is not that rank of that world size
    with pytest.raises(StateFileError, match="rank 0 of a model split over 2 rank"):
        read_state_file(tmp_path / "rank0.state", whole)


def test_uneven_split_refused_by_name(models):
    net = qwen38_backend.load(str(models["qwen3_5"])).net
    # 2 Gated DeltaNet key heads (the first layer): 3 ranks cannot share them
    with pytest.raises(ShardingError, match=r"DeltaNet key heads \(2\) .* over 3 ranks"):
        net.shard(RankShare(0, 3))
    attention = net.model.layers[3].self_attn
    with pytest.raises(ShardingError, match=r"attention heads \(4\) .* over 3 ranks"):
        attention.shard(RankShare(0, 3))


def test_flash_next_experts_split_refused_by_name(models):
    net = qwen38_backend.load(str(models["qwen4_exp"])).net
    moe = net.model.layers[0].mlp
    with pytest.raises(ShardingError, match=r"experts \(8\) cannot be split evenly over 3"):
        moe.shard(RankShare(0, 3))


def test_state_file_of_whole_model_refused_by_a_rank(models, tmp_path):
    whole = qwen38_backend.load(str(models["qwen3"]))
    state = whole.new_state()
    whole.prefill(PROMPT[:8], state)
    save_state_file(tmp_path / "whole.state", state, whole)

    class RankOne:  # what read_state_file asks of a model before reading any tensor
        rank, world_size = 1, 2

    with pytest.raises(StateFileError, match="rank 0 of a model split over 1 rank"):
        read_state_file(tmp_path / "whole.state", RankOne())
