"""Admission: exact memory plans from a config or a model, refusals with the shortfall."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from helpers import FIXTURES, dense_fixture
from mlx.utils import tree_flatten

import qwen38_backend
from qwen38_backend.admission import (
    admit,
    available_memory,
    format_plan,
    kv_bytes_per_token,
    memory_plan,
)
from qwen38_backend.errors import AdmissionError, InvalidOptionError


def qwen38_27b_config() -> dict:
    from qwen38_backend.testing.tiny_qwen3_5 import text_config

    return {"model_type": "qwen3_5", "text_config": text_config("27b", None)}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return qwen38_backend.load(str(dense_fixture("qwen3", tmp_path_factory.mktemp("d"))))


def test_27b_at_262144_tokens():
    plan = memory_plan(qwen38_27b_config(), 262_144, dtype="bfloat16")
    # 16 attention layers x 4 kv heads x 256 x (K,V) x 2 bytes = 64 KiB per token
    assert plan["kv"] == 16 * 4 * 256 * 2 * 2 * 262_144 == 16 * 1024**3
    assert kv_bytes_per_token(qwen38_27b_config()) == 65_536
    # 48 GDN layers: 48 heads x 128 x 128 fp32 + conv 3 rows x 10240 channels (bf16)
    assert plan["recurrent"] == 48 * 48 * 128 * 128 * 4 + 48 * 3 * 10240 * 2
    assert plan["mtp_reserve"] == 4 * 256 * 2 * 2 * 262_144  # one MTP layer's own KV
    assert 26e9 < plan.weights / 2 < 28e9  # ~27B parameters in bf16
    text = format_plan(plan, available=10**12)
    for c in plan.components:
        assert f"{c.name}" in text and f"{c.nbytes:,} bytes" in text
    assert f"{plan.ram:,} bytes" in text and "fits" in text
    print(text)


def test_refused_with_the_exact_shortfall():
    plan = memory_plan(qwen38_27b_config(), 262_144, dtype="bfloat16")
    have = plan.ram - 123_456_789
    with pytest.raises(AdmissionError) as err:
        admit(plan, available=have)
    msg = str(err.value)
    assert f"needs {plan.ram:,} bytes, has {have:,}, short by 123,456,789 bytes" in msg
    admit(plan, available=plan.ram)  # exactly enough is enough


def test_plan_matches_what_a_dense_model_allocates(dense):
    n = 300  # prefilled in one chunk of 300 -> contiguous store grows to 512 rows
    plan = memory_plan(dense, n, prompt_tokens=n, prefill_chunk=512)
    state = dense.new_state()
    dense.prefill(list(range(10, 10 + n)), state)
    allocated = sum(layer.keys.nbytes + layer.values.nbytes for layer in state.layers)
    assert plan["kv"] == allocated == 2 * 2 * 32 * 2 * 4 * 512
    params = sum(p.nbytes for _, p in tree_flatten(dense.net.parameters()))
    assert plan.weights == params
    # the same numbers from config.json alone (fp32 compute on CPU)
    config = json.loads((FIXTURES / "dense" / "qwen3" / "config.json").read_text())
    from_config = memory_plan(config, n, prompt_tokens=n, dtype="float32")
    assert from_config.weights == params and from_config["kv"] == plan["kv"]


def test_plan_matches_recurrent_state_of_tiny_qwen3_5(tmp_path):
    from qwen38_backend.testing import make_tiny_weights

    model = qwen38_backend.load(str(make_tiny_weights("qwen3_5", tmp_path, seed=0)))
    state = model.new_state()
    model.prefill(list(range(10, 50)), state)
    recurrent = sum(layer.nbytes() for layer in state.layers if not layer.can_truncate)
    assert memory_plan(model, 40)["recurrent"] == recurrent > 0


def test_paged_plan_counts_pages_and_quest_metadata(dense):
    plan = memory_plan(dense, 100, kv_paged="on", kv_page_tokens=8, prompt_tokens=100)
    assert plan["kv"] == 64 * 8 * 2 * 2 * 32 * 2 * 4  # 64 pages (the minimum block)
    assert plan["quest_meta"] == (100 // 8) * 2 * 2 * 32 * 2 * 4
    n = 3000  # several x1.5 pool growths: the simulated capacity is what the pool allocates
    state = dense.new_state(kv_paged="on", kv_page_tokens=8)
    dense.prefill([i % 400 + 10 for i in range(n)], state)
    grown = memory_plan(dense, n, kv_paged="on", kv_page_tokens=8, prompt_tokens=n)
    assert grown["kv"] == sum(layer.pool.nbytes() for layer in state.layers)
    spill = memory_plan(dense, 1000, kv_pool_tokens=256, prompt_tokens=1000)
    assert spill["kv"] == 256 * 2 * 2 * 32 * 2 * 4
    assert spill["kv_spill"] == (1000 - 256) * 2 * 2 * 32 * 2 * 4 and spill.disk > 0


def test_session_refuses_before_allocating(dense):
    session = dense.session(cache=False, memory_limit=1000)
    before = mx.get_active_memory()
    with pytest.raises(AdmissionError, match=r"needs [\d,]+ bytes, has 1,000, short by"):
        next(session.generate([1, 2, 3, 4], max_tokens=8))
    assert session.state is None and mx.get_active_memory() == before
    plan = session.last_plan
    with pytest.raises(AdmissionError, match=f"short by {plan.per_sequence - 1000:,} bytes"):
        next(session.generate([1, 2, 3, 4], max_tokens=8))
    ok = dense.session(cache=False, memory_limit=plan.per_sequence)
    assert list(ok.generate([1, 2, 3, 4], max_tokens=8))[-1].type == "done"


def test_invalid_options_and_available_memory():
    with pytest.raises(InvalidOptionError, match="unknown memory plan option"):
        memory_plan(qwen38_27b_config(), 10, kv_pool=3)
    with pytest.raises(InvalidOptionError, match="positive"):
        memory_plan(qwen38_27b_config(), 0)
    free = available_memory()
    assert free is None or free > 0
