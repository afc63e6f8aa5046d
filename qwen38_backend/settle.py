"""A wait that also frees: `settle(*arrays)` waits for `arrays` and for the device to release
the buffers of the work that finished; `settled()` runs a prefill that settles as it goes.

On MLX's CUDA backend, waiting for an array (mx.eval) returns once the device computed it,
but the buffers that work held are released later, on a worker thread. A host that goes on
queueing work meanwhile has the new buffers allocated on top of the old ones: on the H200 a
131K prefill chunk's peak was 2.9 GB above weights + KV in most chunks and up to 5.7-6.1 GB in
others, varying run to run. mx.synchronize waits for that release too. On the CPU it is a
cheap wait.

Model.prefill settles every chunk and every state.PREFILL_SETTLE_EVERY-th layer (late
releases otherwise pile up over a chunk's layers: 262K's peak reached 1.101x). A settled
prefill (`settled()`, Model.prefill(settle=True)) also settles every layer before handing over
the next (state.SequenceState.layer_built) and every block of the attention walk before the
next (kv/blocked.py): the device then idles while each is handed over, so it runs only where
memory is tight (admission: a plan that fits only without RELEASE_LAG). H200, 131K, 64 layers
of 27B dims: peak 1.029x weights + KV at 1,830 tok/s, against 1.06-1.10x at 1,971-2,455 tok/s
unsettled (benchmarks/results/h200/depth131k_settle_*.json).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import mlx.core as mx

_SETTLED: ContextVar[bool] = ContextVar("qwen38_settled", default=False)


def settle(*arrays: mx.array) -> None:
    """Wait for `arrays` (and so for everything queued before them), then for the release of
    what the finished work held."""
    if arrays:
        mx.eval(*arrays)
    mx.synchronize()


@contextmanager
def settled(on: bool = True) -> Iterator[None]:
    """Inside (when `on`): prefill layers and walk blocks are settled one by one."""
    token = _SETTLED.set(on)
    try:
        yield
    finally:
        _SETTLED.reset(token)


def settling() -> bool:
    """Whether the running prefill settles every layer and walk block (`settled`)."""
    return _SETTLED.get()


def releases_late() -> bool:
    """Whether this device releases finished work's buffers late (MLX's CUDA backend)."""
    return mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()
