"""Prefill memory (issue 12): what a chunk needs above weights + state is one layer's
activations, not a pile that grows with the number of layers, and the state pins nothing."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from helpers import recorded

from qwen38_backend.admission import memory_plan
from qwen38_backend.engine import Model, state_arrays
from qwen38_backend.loading import Weights
from qwen38_backend.models import build_model
from qwen38_backend.testing.tiny_qwen3_5 import text_config

CHUNK = 256
# wide enough that a chunk's activations dwarf the fixed costs (weights are not measured)
DIMS = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    mrope_section=[3, 3, 2],  # 16 rotary dims of 64
)


def qwen3_5_model(layers: int) -> Model:
    tc = text_config("tiny", layers, mtp_num_hidden_layers=0, **DIMS)
    config = {"model_type": "qwen3_5", "text_config": tc, "tie_word_embeddings": False}
    net = build_model(config)
    mx.eval(net.parameters())
    weights = Weights(config=config, tensors={}, quantization={}, generation_config={})
    return Model(net, weights, mx.float32, name="prefill-memory")


def held_bytes(state) -> int:
    """Bytes of the arrays the state holds (allocated capacity, not just its length)."""
    return sum({id(a): a.nbytes for a in state_arrays(state)}.values())


def prefill_memory(model: Model, chunks: int = 2) -> tuple[int, int]:
    """(peak above weights + state, memory still held after it above weights + state)."""
    ids = [(7 * i) % 500 + 3 for i in range(CHUNK * chunks)]
    mx.eval(model.prefill(ids[:64], model.new_state(), chunk=64))  # warm-up
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    state = model.new_state()
    logits = model.prefill(ids, state, chunk=CHUNK)
    mx.eval(logits)
    held = held_bytes(state) + logits.nbytes
    return mx.get_peak_memory() - base - held, mx.get_active_memory() - base - held


@pytest.fixture(scope="module")
def models() -> dict[int, Model]:
    return {layers: qwen3_5_model(layers) for layers in (8, 16)}


@pytest.fixture(scope="module")
def measured(models) -> dict[int, tuple[int, int]]:
    return {layers: prefill_memory(model) for layers, model in models.items()}


def test_state_pins_no_chunk_buffer(measured):
    """A Gated DeltaNet's conv rows are a copy: a view would keep the chunk's whole conv
    input [chunk + 3, conv channels] alive in the state, one per layer."""
    conv_input = CHUNK * (2 * 4 * 32 + 8 * 32) * 4
    for layers, (_, after) in measured.items():
        assert after < conv_input // 4, (layers, after)


def test_prefill_peak_does_not_grow_with_depth(measured):
    """Each layer's output and new state are handed to the device as it is built: evaluated
    with the whole chunk, every layer's state came last and kept its chunk-sized inputs
    alive through all later layers."""
    shallow, deep = measured[8][0], measured[16][0]
    assert deep <= shallow * 1.1, (shallow, deep)


def test_plan_scratch_matches_the_measured_peak(models, measured):
    """Admission's scratch is what a chunk needs above weights + state: here the Gated
    DeltaNet block's chunked form (PREFILL_ROWS_LIVE fp32 value rows per token) and the
    one-shot attention scores of the CPU."""
    for layers, model in models.items():
        plan = memory_plan(model, 2 * CHUNK, prefill_chunk=CHUNK)["scratch"]
        peak = measured[layers][0]
        assert 0.75 * plan <= peak <= 1.25 * plan, (layers, peak, plan)


def test_prefill_waits_for_layers_so_few_are_queued(monkeypatch):
    """A prefill chunk queues each layer on the device and then waits for the layer
    PREFILL_LAYERS_AHEAD before it, so the host never has more layers' buffers queued (on a
    GPU a host running ahead queued every layer's at once)."""
    from qwen38_backend import state as state_module

    model = qwen3_5_model(8)
    state = model.new_state()
    queued, waited = [], set()
    real_async, real_eval = mx.async_eval, mx.eval

    def on_queue(*arrays):
        queued.append(arrays[0])
        ahead = [a for a in queued if id(a) not in waited]
        assert len(ahead) <= state_module.PREFILL_LAYERS_AHEAD + 1, len(ahead)
        return real_async(*arrays)

    def on_eval(*arrays):
        waited.update(id(a) for a in arrays)
        return real_eval(*arrays)

    monkeypatch.setattr(mx, "async_eval", on_queue)
    monkeypatch.setattr(mx, "eval", on_eval)
    model.forward(list(range(3, 3 + CHUNK)), state)
    assert len(queued) == 8
    assert sum(id(a) in waited for a in queued) == 8 - state_module.PREFILL_LAYERS_AHEAD


def test_prefill_settles_each_chunk_and_on_request_each_layer():
    """settle.py: a prefill waits for each chunk and lets the device release what it held
    (mx.synchronize) before the next chunk allocates; with settle_layers each layer
    is also settled before the next one is handed over, so at most one is ever queued.
    Either way the logits are the same bit for bit."""
    model = qwen3_5_model(4)
    ids = [3 + i % 500 for i in range(3 * CHUNK)]
    expected = np.array(model.prefill(ids, model.new_state(), chunk=CHUNK))
    for per_layer in (False, True):
        with recorded(mx, "async_eval", "synchronize") as calls:
            logits = model.prefill(ids, model.new_state(), chunk=CHUNK, settle_layers=per_layer)
        assert np.array_equal(np.array(logits), expected)
        queues = calls.count("async_eval")
        assert queues >= 3 * 4  # every layer of every chunk handed over
        syncs = calls.count("synchronize")
        if per_layer:  # one before every hand-over but each chunk's first, plus chunk ends
            assert syncs >= queues - 3 + 3, calls
            assert "async_eval async_eval" not in " ".join(calls), calls
        else:
            assert syncs == 3, calls  # the chunk ends


def test_prefill_settles_every_few_layers(monkeypatch):
    """Within a chunk the prefill settles the layer it waits for every PREFILL_SETTLE_EVERY
    layers (on CUDA late releases otherwise pile up over a long chunk's layers), with the
    same logits bit for bit as never settling."""
    from qwen38_backend import state as state_module

    model = qwen3_5_model(8)
    ids = [3 + i % 500 for i in range(2 * CHUNK)]
    runs = {}
    for every in (0, 2, 8):
        monkeypatch.setattr(state_module, "PREFILL_SETTLE_EVERY", every)
        with recorded(mx, "synchronize") as calls:
            logits = model.prefill(ids, model.new_state(), chunk=CHUNK)
        runs[every] = (np.array(logits), calls.count("synchronize"))
    assert runs[0][1] == 2  # the chunk ends
    assert runs[2][1] == 2 * (8 // 2) + 2  # layers 1, 3, 5, 7 of each chunk, then its end
    assert runs[8][1] == 2 * 1 + 2
    assert np.array_equal(runs[0][0], runs[2][0]) and np.array_equal(runs[0][0], runs[8][0])
