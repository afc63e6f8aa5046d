"""Blocked prefill attention (kv/blocked.py): equal to one-shot attention and prefill."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest
from helpers import DENSE_ARCHS, dense_fixture, recorded

import qwen38_backend
from qwen38_backend.kv import ContiguousKV, PagedKV, PagePool
from qwen38_backend.kv import blocked as blocked_module
from qwen38_backend.kv.blocked import blocked_attention, spans


def tiny_weights(arch: str, directory, seed: int = 0):
    from qwen38_backend.testing import make_tiny_weights

    return make_tiny_weights(arch, directory, seed=seed)


def rand(rng, *shape, scale=1.0):
    return mx.array((rng.normal(size=shape) * scale).astype(np.float32))


@pytest.mark.parametrize(
    "past,T,block", [(0, 5, 4), (37, 1, 8), (37, 9, 8), (100, 16, 1), (64, 7, 64)]
)
def test_blocked_equals_one_shot(past, T, block):
    rng = np.random.default_rng(past * 100 + T)
    hq, hkv, d = 6, 2, 8
    q = rand(rng, 1, hq, T, d, scale=3)  # large scores: the running max matters
    keys, values = rand(rng, 1, hkv, past + T, d, scale=3), rand(rng, 1, hkv, past + T, d)
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.4, mask="causal")
    blocks = [(keys[:, :, a:b], values[:, :, a:b]) for a, b in spans(past, block)]
    out = blocked_attention(q, blocks, keys[:, :, past:], values[:, :, past:], 0.4)
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-5, atol=1e-5)
    # Block order does not matter beyond rounding.
    rev = list(reversed(blocks))
    out = blocked_attention(q, rev, keys[:, :, past:], values[:, :, past:], 0.4)
    np.testing.assert_allclose(np.array(out), np.array(ref), rtol=1e-5, atol=1e-5)


def test_blocks_read_from_host_stay_bounded_in_memory():
    """Blocks that arrive as fresh uploads (as the spill file's reads do) are queued one
    behind another and freed as the walk goes: the walk's peak does not grow with the
    number of blocks (a lazy walk would hold every block until the end)."""
    rng = np.random.default_rng(5)
    hq, hkv, T, d, B = 4, 2, 8, 64, 4096
    q = rand(rng, 1, hq, T, d)
    k, v = rand(rng, 1, hkv, T, d), rand(rng, 1, hkv, T, d)
    host = (rng.normal(size=(1, hkv, B, d)).astype(np.float32) for _ in range(2))
    kh, vh = next(host), next(host)

    def uploads(n):  # a new device copy per block, like SpillFile reads + upload
        for _ in range(n):
            yield mx.array(kh), mx.array(vh)

    block_bytes = kh.nbytes + vh.nbytes
    peaks = []
    for n in (4, 24):
        mx.eval(q, k, v)
        mx.synchronize()
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(blocked_attention(q, uploads(n), k, v, 0.125))
        peaks.append(mx.get_peak_memory() - base)
    assert peaks[1] < peaks[0] + 2 * block_bytes, (peaks, block_bytes)
    assert peaks[1] < 8 * block_bytes, (peaks, block_bytes)


def test_bf16_blocks_err_like_the_fused_attention():
    """A bf16 store's walk runs its matmuls in bf16 (the carry in fp32): against fp32
    attention it errs about as much as the fused bf16 attention does, no more."""
    rng = np.random.default_rng(3)
    hq, hkv, T, past, d = 8, 2, 32, 1000, 64
    q = rand(rng, 1, hq, T, d, scale=2)
    keys, values = rand(rng, 1, hkv, past + T, d, scale=2), rand(rng, 1, hkv, past + T, d)
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask="causal")
    qb, kb, vb = (a.astype(mx.bfloat16) for a in (q, keys, values))
    fused = mx.fast.scaled_dot_product_attention(qb, kb, vb, scale=0.125, mask="causal")
    blocks = [(kb[:, :, a:b], vb[:, :, a:b]) for a, b in spans(past, 128)]
    out = blocked_attention(qb, blocks, kb[:, :, past:], vb[:, :, past:], 0.125)
    assert out.dtype == mx.bfloat16
    err = mx.abs(out.astype(mx.float32) - ref).max().item()
    fused_err = mx.abs(fused.astype(mx.float32) - ref).max().item()
    assert 0 < err <= 2 * fused_err, (err, fused_err)


def test_a_bf16_walk_holds_no_fp32_copy_of_its_scores(monkeypatch):
    """A bf16 store's scores stay bf16 until exp's kernel casts them: with an fp32 copy of
    each block's scores besides, the walk held 6.6 blocks of fp32 scores (the H200: ~0.8 GiB
    more per attention layer at a 2048-token chunk); the result is the same bit for bit."""
    rng = np.random.default_rng(11)
    hq, hkv, T, d, B = 8, 2, 128, 32, 1024
    q = rand(rng, 1, hq, T, d).astype(mx.bfloat16)
    k, v = (rand(rng, 1, hkv, T, d).astype(mx.bfloat16) for _ in range(2))
    past = [tuple(rand(rng, 1, hkv, B, d).astype(mx.bfloat16) for _ in range(2)) for _ in range(4)]
    mx.eval(q, k, v, past)
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    out = blocked_attention(q, iter(past), k, v, 0.125)
    mx.eval(out)
    blocks = (mx.get_peak_memory() - base) / (hq * T * B * 4)
    assert blocks <= blocked_module.SCORE_BLOCKS_LIVE, blocks

    def fp32_scores_first(qs, kb, vb, carry, mask=None):  # the form that kept the copy
        s = (qs @ kb.swapaxes(1, 2)).astype(mx.float32)
        if mask is not None:
            s = mx.where(mask, s, mx.array(-mx.inf, mx.float32))
        if carry is None:
            return blocked_module._first_compiled(s, vb)
        return blocked_module._merge_compiled(s, vb, *carry)

    monkeypatch.setattr(blocked_module, "_carry_step", fp32_scores_first)
    assert mx.array_equal(out, blocked_attention(q, iter(past), k, v, 0.125)).item()


def test_the_walk_waits_for_what_came_before_it(monkeypatch):
    """Work queued before a walk (the layer before, still on the device) finishes before
    the walk queues its first block, so their buffers are never alive together: the walk's
    first call to MLX's scheduler is a wait on its queries, which depend on that work."""
    rng = np.random.default_rng(12)
    hq, hkv, T, d = 4, 2, 8, 16
    k, v = rand(rng, 1, hkv, T, d), rand(rng, 1, hkv, T, d)
    past = [(rand(rng, 1, hkv, 32, d), rand(rng, 1, hkv, 32, d)) for _ in range(3)]
    mx.eval(k, v, past)
    before = rand(rng, 1, hq, T, d) * 2  # "the layer before": queued, not waited for
    mx.async_eval(before)
    calls = []
    real_async, real_eval = mx.async_eval, mx.eval

    def on_queue(*arrays):
        calls.append("queue")
        return real_async(*arrays)

    def on_wait(*arrays):
        calls.append("wait")
        return real_eval(*arrays)

    monkeypatch.setattr(mx, "async_eval", on_queue)
    monkeypatch.setattr(mx, "eval", on_wait)
    out = blocked_attention(before, iter(past), k, v, 0.25)
    monkeypatch.undo()
    mx.eval(out)
    assert calls[:2] == ["wait", "queue"], calls


@pytest.mark.parametrize("on", [False, True])
def test_a_settled_walk_releases_each_block_before_queueing_the_next(on):
    """settle.py: in a settled prefill every block after the first is handed over only after
    the block before was waited for and released (mx.synchronize), so no two blocks' buffers
    are alive even where the device releases them late; without it the walk queues a block
    before waiting for the one before it. The result is the same bit for bit."""
    from qwen38_backend.settle import settled

    rng = np.random.default_rng(13)
    hq, hkv, T, d = 4, 2, 8, 16
    q, k, v = rand(rng, 1, hq, T, d), rand(rng, 1, hkv, T, d), rand(rng, 1, hkv, T, d)
    past = [(rand(rng, 1, hkv, 32, d), rand(rng, 1, hkv, 32, d)) for _ in range(4)]
    mx.eval(q, k, v, past)
    expected = blocked_attention(q, iter(past), k, v, 0.25)
    mx.eval(expected)
    with settled(on), recorded(mx, "async_eval", "eval", "synchronize") as calls:
        out = blocked_attention(q, iter(past), k, v, 0.25)
    mx.eval(out)
    assert np.array_equal(np.array(out), np.array(expected))
    walk = calls[calls.index("async_eval") :]  # from the first block's hand-over on
    queues = [i for i, c in enumerate(walk) if c == "async_eval"]
    assert len(queues) == len(past)
    for before, after in zip(queues[:-1], queues[1:], strict=True):
        between = walk[before + 1 : after]
        if on:
            assert between == ["eval", "synchronize"], walk
        else:  # the next block queued first, then the one before it waited for
            assert between in ([], ["eval"]), walk
    if not on:
        assert walk[:2] == ["async_eval", "async_eval"], walk


def test_blocked_peak_memory_does_not_grow_with_the_past():
    hq, hkv, T, d, block = 8, 2, 128, 32, 512
    peaks = []
    for past in (8192, 65536):
        q = mx.random.normal((1, hq, T, d))
        keys = mx.random.normal((1, hkv, past + T, d))
        mx.eval(q, keys)
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        blocks = ((keys[:, :, a:b], keys[:, :, a:b]) for a, b in spans(past, block))
        mx.eval(blocked_attention(q, blocks, keys[:, :, past:], keys[:, :, past:], 0.2))
        peaks.append(mx.get_peak_memory() - base)
    scores_one_shot = hq * T * 65536 * 4  # what one-shot attention materialises
    assert peaks[1] < scores_one_shot / 4, peaks
    assert peaks[1] <= peaks[0] * 1.1 + 64 * 1024, peaks


def chunked_logits(net, ids, factory, chunk):
    state = net.make_state(kv_factory=factory)
    out = []
    for s in range(0, len(ids), chunk):
        out.append(net(mx.array(ids[s : s + chunk]), state))
        state.advance(ids[s : s + chunk])
    stores = [layer for layer in state.layers if isinstance(layer, PagedKV)]
    if len(stores) > 1 and stores[0].pool is stores[1].pool:
        assert not any(store.identity for store in stores)
    return np.concatenate([np.array(o.astype(mx.float32)) for o in out])


def shared_pool_factory():
    # Every layer's store on one pool: layers take turns, so no page table is identity-mapped.
    pool = PagePool(8)
    return lambda: PagedKV(page_tokens=8, budget=10**6, pool=pool)


def check_blocked_prefill(net, monkeypatch, n=150, chunk=40, block=16):
    ids = np.random.default_rng(1).integers(10, net.config.vocab_size - 10, n).tolist()
    one_shot = chunked_logits(net, ids, ContiguousKV, n)
    makers = {
        "contiguous": lambda: ContiguousKV,
        "paged": lambda: functools.partial(PagedKV, page_tokens=8, budget=10**6),
        "paged, not identity": shared_pool_factory,
    }
    for name, maker in makers.items():
        unblocked = chunked_logits(net, ids, maker(), chunk)
        monkeypatch.setattr(blocked_module, "ONE_SHOT_BYTES", 0)
        monkeypatch.setattr(ContiguousKV, "block_tokens", block)
        monkeypatch.setattr(PagedKV, "block_tokens", block)
        blocked = chunked_logits(net, ids, maker(), chunk)
        monkeypatch.undo()
        # fp32 rounding: the walk sums in another order. One attention output is as far
        # from a float64 reference as one-shot SDPA is (~2e-6); through the layers that
        # grows to ~1.4e-5 on logits of magnitude 2-8, so the bound is 1e-5 x the largest.
        tol = 1e-5 * max(1.0, float(np.abs(one_shot).max()))
        assert np.abs(blocked - one_shot).max() <= tol, name
        assert np.abs(blocked - unblocked).max() <= tol, name
        # The blocked walk really ran: with the default block it is another graph.
        assert not np.array_equal(blocked, unblocked), name


@pytest.mark.parametrize("arch", DENSE_ARCHS)
def test_blocked_prefill_equals_one_shot_dense(arch, tmp_path, monkeypatch):
    model = qwen38_backend.load(str(dense_fixture(arch, tmp_path)))
    check_blocked_prefill(model.net, monkeypatch)


def test_blocked_prefill_equals_one_shot_qwen3_5(tmp_path, monkeypatch):
    from qwen38_backend.testing import make_tiny_weights

    model = qwen38_backend.load(str(make_tiny_weights("qwen3_5", tmp_path / "q", seed=5)))
    check_blocked_prefill(model.net, monkeypatch)


def test_walk_block_keeps_one_blocks_scores_within_budget():
    from qwen38_backend.kv.blocked import BLOCK_SCORE_BYTES, BLOCK_TOKENS, walk_block

    # 27B's 24 query heads keep whole 2048-key blocks at Metal's 512-token chunk and at
    # CUDA's 2048 (384 MiB of scores); a 4096-token chunk walks 1024-key blocks and 64 heads
    # at 4096 walk 384 keys (a multiple of 32-token pages too)
    assert walk_block(24, 512) == BLOCK_TOKENS
    assert walk_block(24, 2048) == BLOCK_SCORE_BYTES // (24 * 2048 * 4) == 2048
    assert walk_block(24, 4096) == 1024
    assert walk_block(64, 4096) == 384
    assert walk_block(64, 4096, unit=32) == 384
    assert walk_block(64, 16384) == 256
    for heads, rows, unit in [(24, 2048, 16), (64, 4096, 32), (8, 100, 1), (40, 3000, 64)]:
        keys = walk_block(heads, rows, unit=unit)
        assert keys % unit == 0 and 0 < keys <= BLOCK_TOKENS
        assert heads * rows * keys * 4 <= BLOCK_SCORE_BYTES or keys <= 256


@pytest.mark.parametrize("store", ["contiguous", "paged"])
def test_long_chunk_walks_shorter_blocks_and_equals_one_shot(store, monkeypatch):
    """A chunk whose block of scores would pass the budget walks shorter blocks (each
    block the store hands over has the budgeted length), and equals one-shot attention."""
    rng = np.random.default_rng(7)
    hq, hkv, d, past, T = 4, 2, 8, 96, 24
    monkeypatch.setattr(blocked_module, "ONE_SHOT_BYTES", 0)
    monkeypatch.setattr(blocked_module, "MIN_BLOCK_TOKENS", 1)
    # one block of 32 keys would hold 4 x 24 x 32 x 4 B of scores: allow half of that
    monkeypatch.setattr(blocked_module, "BLOCK_SCORE_BYTES", hq * T * 16 * 4)
    kv = ContiguousKV() if store == "contiguous" else PagedKV(page_tokens=8, budget=10**6)
    kv.block_tokens = 32
    keys, values = rand(rng, 1, hkv, past + T, d), rand(rng, 1, hkv, past + T, d)
    q = rand(rng, 1, hq, past + T, d, scale=2)
    mx.eval(kv.attend(q[:, :, :past], keys[:, :, :past], values[:, :, :past], 0.3))
    seen = []
    real = blocked_module.blocked_attention

    def spy(q, blocks, k, v, scale):
        blocks = list(blocks)
        seen.extend(b[0].shape[2] for b in blocks)
        return real(q, blocks, k, v, scale)

    monkeypatch.setattr(blocked_module, "blocked_attention", spy)
    out = kv.attend(q[:, :, past:], keys[:, :, past:], values[:, :, past:], 0.3)
    assert seen == [16] * (past // 16)
    ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.3, mask="causal")
    np.testing.assert_allclose(np.array(out), np.array(ref[:, :, past:]), rtol=1e-5, atol=1e-5)
