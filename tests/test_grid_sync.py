"""kernels/grid_sync.py under the CPU emulation (tests/cuda_emulator.py runs a kernel with the
grid barrier as one OS thread a block, so its blocks wait for each other for real): the
barrier orders phases across blocks, a block that never arrives makes the wait give up and
raise the flag instead of hanging, and the persistent chain of products equals its separate
launches bit for bit and numpy's products within rounding."""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest
from cuda_emulator import EmulatedKernel, clear_caches, emulate
from qwen38_backend.kernels import grid_sync


@pytest.fixture
def emulated(monkeypatch):
    if shutil.which("g++") is None:
        pytest.fail("the emulated kernels need g++ on PATH")
    emulate(monkeypatch, grid_sync)
    monkeypatch.setenv("QWEN38_GRID_SYNC", "auto")
    yield
    clear_caches(grid_sync)


# Each phase, block b waits b * 2000 polls before it writes its value, so without the barrier
# block 0 reads the other blocks' slots before they are written; with it, every block reads
# the sum of the phase before: out[p][b] = sum(out[p - 1]) + b.
_PHASES = """
    unsigned passed = 0;
    const int B = gridDim.x, b = blockIdx.x;
    for (int p = 0; p < P; ++p) {
        float prior = 0.0f;
        for (int i = 0; p > 0 && i < B; ++i) prior += __ldcg(out + (p - 1) * B + i);
        if (threadIdx.x == 0) {
            for (int i = 0; i < b * 2000; ++i) __nanosleep(64);
            out[p * B + b] = prior + b;
        }
        __BARRIER__
    }
"""


def _phases(barrier: str, blocks: int, phases: int):
    kernel = EmulatedKernel(
        name="phases",
        input_names=["x"],
        output_names=["out", "barrier"],
        header=grid_sync.GRID_BARRIER,
        source=_PHASES.replace("__BARRIER__", barrier),
    )
    return kernel(
        inputs=[mx.zeros((1,))],
        template=[("P", phases)],
        grid=(blocks * 32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(phases, blocks), (2,)],
        output_dtypes=[mx.float32, mx.uint32],
        init_value=0,
    )


def _expected(blocks: int, phases: int) -> list[list[float]]:
    rows, prior = [], 0.0
    for _ in range(phases):
        rows.append([prior + b for b in range(blocks)])
        prior = sum(rows[-1])
    return rows


def test_the_barrier_orders_phases_across_blocks(emulated):
    out, barrier = _phases("qwen38_grid::sync(barrier, passed);", 4, 3)
    assert out.tolist() == _expected(4, 3)
    assert barrier.tolist() == [4 * 3, 0]  # every block arrived at every barrier, no give-up
    # the same kernel without the barrier reads slots not yet written
    out, _ = _phases("", 4, 3)
    assert out.tolist() != _expected(4, 3)


def test_a_wait_gives_up_and_flags_instead_of_hanging(emulated):
    """Block 0 never arrives: the others give up after SPIN_LIMIT polls and set the flag."""
    limit = 2000
    header = grid_sync.GRID_BARRIER.replace(f"{grid_sync.SPIN_LIMIT}u", f"{limit}u")
    kernel = EmulatedKernel(
        name="absent",
        input_names=["x"],
        output_names=["out", "barrier"],
        header=header,
        source="""
    unsigned passed = 0;
    if (blockIdx.x == 0) return;
    qwen38_grid::sync(barrier, passed);
    if (threadIdx.x == 0) out[blockIdx.x] = 1.0f;
""",
    )
    out, barrier = kernel(
        inputs=[mx.zeros((1,))],
        grid=(3 * 32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(3,), (2,)],
        output_dtypes=[mx.float32, mx.uint32],
        init_value=0,
    )
    assert barrier.tolist() == [2, 1]
    assert out.tolist() == [0.0, 1.0, 1.0]


def _chain_numpy(x, wa, wb, phases: int, dtype) -> list[np.ndarray]:
    """The chain in float64, each phase's output rounded to `dtype` as the kernel stores it."""
    outs, v = [], x
    for p in range(phases):
        w = wa if p % 2 == 0 else wb
        y = np.array(w.astype(mx.float32), dtype=np.float64) @ np.array(
            v.astype(mx.float32), dtype=np.float64
        )
        v = mx.array(y.astype(np.float32)).astype(dtype)
        outs.append(np.array(v.astype(mx.float32)))
    return outs


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_a_persistent_chain_equals_its_launches(emulated, dtype):
    """3 blocks of 8 warps over phases of 40 and 64 outputs (a warp takes several): each
    phase equals its own launch bit for bit and numpy's product within a rounding; the
    barriers alone leave the fill and count every arrival."""
    n, k, phases, blocks = 40, 64, 5, 3
    keys = mx.random.split(mx.random.key(3), 3)
    wa = (mx.random.normal((n, k), key=keys[0]) / 8).astype(dtype)
    wb = (mx.random.normal((k, n), key=keys[1]) / 6).astype(dtype)
    x = mx.random.normal((k,), key=keys[2]).astype(dtype)
    ys, barrier = grid_sync.chain(x, wa, wb, phases, blocks)
    launches = grid_sync.chain_launches(x, wa, wb, phases)
    assert barrier.tolist() == [blocks * (phases - 1), 0]
    assert grid_sync.same_as_launches(ys, launches)
    eps = 2.0**-7 if dtype == mx.bfloat16 else 2.0**-20
    for p, want in enumerate(_chain_numpy(x, wa, wb, phases, dtype)):
        got = np.array(ys[p, : want.shape[0]].astype(mx.float32))
        assert np.allclose(got, want, rtol=4 * eps, atol=4 * eps * np.abs(want).max())
    _, barrier = grid_sync.chain(x, wa, wb, phases, blocks, work=False)
    assert barrier.tolist() == [blocks * (phases - 1), 0]


def test_the_last_block_reports_and_zeros_the_state(emulated):
    """finish(): every block counts itself done; exactly one (the last) reports [arrivals,
    gave up] and finds the state zeros after it, ready for the next launch."""
    kernel = EmulatedKernel(
        name="finish",
        input_names=["state"],
        output_names=["report", "after", "lasts"],
        header=grid_sync.GRID_BARRIER,
        source="""
    unsigned passed = 0;
    unsigned* barrier = QWEN38_GRID_STATE(state);
    qwen38_grid::sync(barrier, passed);
    qwen38_grid::sync(barrier, passed);
    if (qwen38_grid::finish(barrier, report)) {
        for (int i = 0; i < 3; ++i) after[i] = barrier[i];
        atomicAdd(lasts, 1u);
    }
""",
    )
    report, after, lasts = kernel(
        inputs=[grid_sync.fresh_state()],
        grid=(4 * 32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(2,), (3,), (1,)],
        output_dtypes=[mx.uint32] * 3,
        init_value=7,
    )
    assert report.tolist() == [4 * 2, 0]
    assert after.tolist() == [0, 0, 0]
    assert lasts.tolist() == [7 + 1]  # one block, of four, was the last


def test_the_probe_passes_and_refuses(emulated, monkeypatch):
    """available(): a chain of 3 blocks passes; one whose barrier waits for one block more
    than the grid holds (as when a block is not resident) gives up and is refused."""
    assert grid_sync.available(3)
    clear_caches(grid_sync)
    waits_for_more = grid_sync.GRID_BARRIER.replace("passed * blocks", "(passed + 1) * blocks")
    monkeypatch.setattr(
        grid_sync, "GRID_BARRIER", waits_for_more.replace(f"{grid_sync.SPIN_LIMIT}u", "2000u")
    )
    with pytest.warns(UserWarning, match="a wait gave up: True"):
        assert not grid_sync.available(3)


def test_a_chain_refuses_mismatched_operands():
    x = mx.zeros((64,), mx.bfloat16)
    with pytest.raises(ValueError, match=r"wa \[N, K\], wb \[K, N\]"):
        grid_sync.chain(x, mx.zeros((40, 64), mx.bfloat16), mx.zeros((40, 64), mx.bfloat16), 3, 2)
    with pytest.raises(ValueError, match="one float dtype"):
        grid_sync.chain(x, mx.zeros((40, 64)), mx.zeros((64, 40)), 3, 2)
    with pytest.raises(ValueError, match="multiples of 8"):
        grid_sync.chain(
            mx.zeros((60,), mx.bfloat16),
            mx.zeros((40, 60), mx.bfloat16),
            mx.zeros((60, 40), mx.bfloat16),
            3,
            2,
        )
