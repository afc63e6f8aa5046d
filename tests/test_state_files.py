"""State files: bit-identical resume in a fresh process, refusals, atomic writes, rollback.

Run as a script (`python test_state_files.py child ...`, through CHILD) it is the fresh process
of the resume tests: it loads the model, restores each state file and writes the continuation
logits.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import dense_fixture  # noqa: E402

import qwen38_backend  # noqa: E402
from qwen38_backend import state_files as sf  # noqa: E402
from qwen38_backend.errors import StateFileError  # noqa: E402
from qwen38_backend.sampling import SamplingParams  # noqa: E402
from qwen38_backend.speculative import DraftOptions  # noqa: E402
from qwen38_backend.state import RewindError  # noqa: E402

PROMPT = [(i * 37 + 11) % 480 + 10 for i in range(40)]
PROMPT[20] = 7  # an EOS inside the prompt: the n-gram context resets there (qwen4_exp)
CONT = [101, 202, 303, 44, 55, 66, 77, 88, 99, 111, 122]
# (boundary, prefill chunk): inside a page / QSA block, on their edges, after chunked prefill
CASES = [(13, 512), (16, 512), (30, 8), (32, 8)]


def continue_logits(model, state, cont=CONT) -> np.ndarray:
    """Six decode-like single steps then one chunk: every position's logits, fp32."""
    outs = [model.forward([t], state) for t in cont[:6]]
    outs.append(model.forward(cont[6:], state))
    return np.concatenate([np.array(o.astype(mx.float32)) for o in outs])


# The fresh process imports the package before this file imports MLX, as the test process did
# (conftest.py): MLX then binds the same BLAS in both (qwen38_backend/blas.py).
CHILD = (
    "import sys, runpy, qwen38_backend; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def child(model_path: str, kv_json: str, ck_dir: str, out: str, cases_json: str) -> None:
    model = qwen38_backend.load(model_path)
    kv = json.loads(kv_json)
    got = {}
    for b, _ in json.loads(cases_json):
        state = model.new_state(**kv)
        sf.restore_state_file(Path(ck_dir) / f"{b}{sf.SUFFIX}", model, state)
        got[f"tokens{b}"] = np.array(state.tokens)
        got[str(b)] = continue_logits(model, state)
    np.savez(out, **got)


# ----- models ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory) -> Path:
    return dense_fixture("qwen3", tmp_path_factory.mktemp("dense"))


@pytest.fixture(scope="module")
def dense_model(dense_dir):
    return qwen38_backend.load(str(dense_dir))


def _tiny_dir(tmp_path_factory, arch: str) -> Path:
    from qwen38_backend.testing import make_tiny_weights

    return make_tiny_weights(arch, tmp_path_factory.mktemp(arch), seed=0)


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory) -> Path:
    return _tiny_dir(tmp_path_factory, "qwen3_5")


@pytest.fixture(scope="module")
def qwen4_exp_dir(tmp_path_factory) -> Path:
    return _tiny_dir(tmp_path_factory, "qwen4_exp")


def _resume_equality(
    model_path: Path, kv: dict, tmp_path: Path, prompt=PROMPT, model=None, cases=CASES
) -> None:
    """State files of `prompt` cut at each case's boundary, restored in a fresh process,
    continue bit for bit as this process's states do (`model`: the loaded `model_path`)."""
    model = model or qwen38_backend.load(str(model_path))
    ck_dir = tmp_path / "ck"
    expected = {}
    for b, chunk in cases:
        state = model.new_state(**kv)
        model.prefill(prompt[:b], state, chunk=chunk)
        info = sf.save_state_file(ck_dir / f"{b}{sf.SUFFIX}", state, model)
        assert info.n_tokens == b
        expected[str(b)] = continue_logits(model, state)  # the run that never stopped
    out = tmp_path / "child.npz"
    args = [__file__, "child", str(model_path), json.dumps(kv), str(ck_dir), str(out)]
    args.append(json.dumps(cases))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(out)
    for b, _ in cases:
        assert got[f"tokens{b}"].tolist() == prompt[:b]
        assert np.array_equal(got[str(b)], expected[str(b)]), f"boundary {b} differs"


KV_CASES = [{}, {"kv_paged": "on", "kv_page_tokens": 8}]


@pytest.mark.parametrize("kv", KV_CASES, ids=["contiguous", "paged8"])
def test_resume_in_fresh_process_dense(dense_dir, kv, tmp_path):
    _resume_equality(dense_dir, kv, tmp_path)


@pytest.mark.parametrize("kv", KV_CASES, ids=["contiguous", "paged8"])
def test_resume_in_fresh_process_qwen3_5(qwen3_5_dir, kv, tmp_path):
    _resume_equality(qwen3_5_dir, kv, tmp_path)


def test_resume_in_fresh_process_qwen4_exp(qwen4_exp_dir, tmp_path):
    # tiny QSA: blocks of 4, budget 8 -> sparse selection from position 11 on. Contiguous KV
    # only: the paged store does not serve QSA layers yet (QSAState + PagedKV fails in prefill).
    _resume_equality(qwen4_exp_dir, {}, tmp_path)


@pytest.mark.demo
def test_resume_in_fresh_process_demo(demo_gguf, demo_model, tmp_path):
    """The demo's real weights, paged: a boundary on a page edge after a one-chunk prefill
    and one inside a page after a chunked one (every case of CASES runs on the tiny models
    above, contiguous and paged)."""
    prompt = [(i * 7919) % 40000 + 100 for i in range(40)]
    kv = {"kv_paged": "on", "kv_page_tokens": 16}
    _resume_equality(demo_gguf, kv, tmp_path, prompt, demo_model, [(16, 512), (30, 8)])


# ----- the file holds live rows only and a complete header -------------------------------------
def test_file_holds_live_rows_and_header(dense_model, tmp_path):
    state = dense_model.new_state()
    dense_model.prefill(PROMPT[:13], state)  # the contiguous store has 256 rows allocated
    path = tmp_path / f"a{sf.SUFFIX}"
    info = sf.save_state_file(path, state, dense_model)
    tensors = mx.load(str(path))  # a plain safetensors reader opens it
    cfg = dense_model.config
    for i in range(cfg.num_hidden_layers):
        assert tensors[f"layers.{i}.keys"].shape == (1, cfg.num_key_value_heads, 13, cfg.head_dim)
    header = sf.read_header(path)
    assert header.tokens == PROMPT[:13] and header.n_tokens == 13
    assert header.model_fingerprint == sf.model_fingerprint(dense_model)
    assert header.kinds == ["ContiguousKV/v1"] * cfg.num_hidden_layers
    assert info.nbytes == path.stat().st_size
    live = sum(t.nbytes for t in tensors.values())
    assert path.stat().st_size - live < 4096 + 8 * len(PROMPT)  # header only, no padding rows


# ----- refusals ---------------------------------------------------------------------------------
def _saved(model, tmp_path, n=13) -> Path:
    state = model.new_state()
    model.prefill(PROMPT[:n], state)
    path = tmp_path / f"c{n}{sf.SUFFIX}"
    sf.save_state_file(path, state, model)
    return path


def test_corrupt_tensor_bytes_refused(dense_model, tmp_path):
    path = _saved(dense_model, tmp_path)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # one bit in the last tensor's data
    path.write_bytes(bytes(data))
    with pytest.raises(StateFileError, match="fails its checksum"):
        sf.read_state_file(path, dense_model)


def _layer_tensor_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (first byte, end) in the file of each `layers.*` tensor."""
    data = path.read_bytes()
    hlen = int.from_bytes(data[:8], "little")
    table = json.loads(data[8 : 8 + hlen])
    return {
        name: (8 + hlen + slot["data_offsets"][0], 8 + hlen + slot["data_offsets"][1])
        for name, slot in table.items()
        if name.startswith("layers.")
    }


def test_a_large_state_file_is_restored_one_layer_at_a_time(dense_model, tmp_path, monkeypatch):
    """A state file of STREAM_BYTES and more is read as the restore goes: layer i's tensors
    are read, then restored, before layer i + 1's are read; the restored state continues as
    the saved one; and a corrupt layer is refused from inside the restore (on_error first)."""
    monkeypatch.setattr(sf, "STREAM_BYTES", 0)  # this tiny state counts as large
    model = dense_model
    state = model.new_state()
    model.prefill(PROMPT[:30], state)
    path = tmp_path / f"big{sf.SUFFIX}"
    sf.save_state_file(path, state, model)
    want = continue_logits(model, state)
    log = []
    read = sf._TensorReader.read

    def reading(self, f, names):
        log.extend(("read", layer) for layer in sorted({n.split(".")[1] for n in names}))
        return read(self, f, names)

    monkeypatch.setattr(sf._TensorReader, "read", reading)
    snap = sf.read_state_file(path, model)
    assert log == []  # no layer read yet
    restored = model.new_state()
    for i, layer in enumerate(restored.layers):

        def restoring(tensors, i=i, restore=layer.restore):
            log.append(("restore", str(i)))
            return restore(tensors)

        layer.restore = restoring
    restored.restore(snap)
    n = len(restored.layers)
    assert log == [step for i in range(n) for step in (("read", str(i)), ("restore", str(i)))]
    np.testing.assert_array_equal(continue_logits(model, restored), want)

    # a corrupt layer: read_state_file succeeds, the restore refuses that layer
    name, (begin, _) = max(_layer_tensor_offsets(path).items(), key=lambda kv: kv[1][0])
    data = bytearray(path.read_bytes())
    data[begin + 1] ^= 0xFF
    path.write_bytes(bytes(data))
    refused = []
    snap = sf.read_state_file(path, model, on_error=refused.append)
    with pytest.raises(StateFileError, match=f"tensor {name} fails its checksum"):
        model.new_state().restore(snap)
    assert len(refused) == 1 and "fails its checksum" in str(refused[0])


def test_corrupt_header_refused(dense_model, tmp_path):
    path = _saved(dense_model, tmp_path)
    data = path.read_bytes()
    i = data.index(b'"n_tokens')
    data = data[:i] + data[i:].replace(b"13", b"12", 1)  # a plausible but wrong header value
    path.write_bytes(data)
    with pytest.raises(StateFileError, match="header checksum mismatch"):
        sf.read_state_file(path, dense_model)


def test_truncated_refused(dense_model, tmp_path):
    path = _saved(dense_model, tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(StateFileError, match="truncated"):
        sf.read_state_file(path, dense_model)
    path.write_bytes(data[:5])
    with pytest.raises(StateFileError, match="truncated"):
        sf.read_state_file(path, dense_model)
    path.write_bytes(b"")
    with pytest.raises(StateFileError, match="truncated"):
        sf.read_state_file(path, dense_model)


def test_wrong_model_refused(dense_model, tmp_path):
    other = qwen38_backend.load(str(dense_fixture("qwen2", tmp_path / "m")))
    path = _saved(other, tmp_path)
    with pytest.raises(StateFileError, match="different model"):
        sf.read_state_file(path, dense_model)
    # same architecture, one weight changed: the content sample catches it
    fp = sf.model_fingerprint(dense_model.net)
    w = dense_model.net.model.norm.weight
    dense_model.net.model.norm.weight = w + 1
    try:
        assert sf.model_fingerprint(dense_model.net) != fp
    finally:
        dense_model.net.model.norm.weight = w


def test_wrong_version_refused(dense_model, tmp_path, monkeypatch):
    version = sf.FORMAT_VERSION
    monkeypatch.setattr(sf, "FORMAT_VERSION", version + 1)  # as written by a future build
    path = _saved(dense_model, tmp_path)
    monkeypatch.setattr(sf, "FORMAT_VERSION", version)
    with pytest.raises(
        StateFileError, match=f"format version {version + 1}; this build reads version {version}"
    ):
        sf.read_state_file(path, dense_model)


def test_wrong_state_layout_refused(dense_model, tmp_path):
    path = _saved(dense_model, tmp_path)
    paged = dense_model.new_state(kv_paged="on", kv_page_tokens=8)
    with pytest.raises(StateFileError, match="layer 0 holds ContiguousKV/v1 state"):
        sf.restore_state_file(path, dense_model, paged)
    assert paged.offset == 0  # untouched


def test_not_a_state_file_refused(dense_model, dense_dir):
    with pytest.raises(StateFileError, match="not a qwen38 state file"):
        sf.read_state_file(dense_dir / "model.safetensors", dense_model)


# ----- atomic writes ----------------------------------------------------------------------------
def test_disk_full_leaves_no_file(dense_model, tmp_path, monkeypatch):
    state = dense_model.new_state()
    dense_model.prefill(PROMPT, state)
    real_write = os.write
    calls = {"n": 0}

    def full_disk(fd, data):
        calls["n"] += 1
        if calls["n"] > 2:  # the header goes through, then the disk fills up
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    target = tmp_path / "store" / f"x{sf.SUFFIX}"
    with pytest.raises(StateFileError, match="No space left on device"):
        sf.save_state_file(target, state, dense_model)
    assert calls["n"] == 3
    assert list(target.parent.iterdir()) == []  # no partial file, no temp file
    monkeypatch.setattr(os, "write", real_write)
    sf.save_state_file(target, state, dense_model)  # and the next write works
    assert sf.read_state_file(target, dense_model).tokens == PROMPT


def test_overwrite_is_atomic(dense_model, tmp_path, monkeypatch):
    path = _saved(dense_model, tmp_path)
    before = path.read_bytes()
    state = dense_model.new_state()
    dense_model.prefill(PROMPT[:20], state)

    def failing_fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(StateFileError, match="Input/output error"):
        sf.save_state_file(path, state, dense_model)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


# ----- the MTP head's history (format version 2) -------------------------------------------------
@pytest.fixture(scope="module")
def qwen3_5_model(qwen3_5_dir):
    return qwen38_backend.load(str(qwen3_5_dir))


MTP = DraftOptions("mtp", 2)


def _drafted(model, n=8):
    """A state whose MTP head has a history: PROMPT[:20] fed to it, then n tokens drafted."""
    state = model.new_state()
    list(model.run(PROMPT[:20], state, SamplingParams(max_tokens=n, stop_token_ids=[]), MTP))
    return state


def _history(state) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in (state.mtp.snapshot() or {}).items()}


@pytest.mark.parametrize("stream", [False, True], ids=["snapshot", "streamed"])
def test_mtp_history_round_trips(qwen3_5_model, tmp_path, monkeypatch, stream):
    model, state = qwen3_5_model, _drafted(qwen3_5_model)
    if stream:  # a live state written one layer at a time
        monkeypatch.setattr(sf, "STREAM_BYTES", 0)
    path = tmp_path / f"m{sf.SUFFIX}"
    sf.save_state_file(path, state, model)
    assert any(name.startswith("mtp.head.") for name in mx.load(str(path)))
    restored = model.new_state()
    snap = sf.restore_state_file(path, model, restored)
    assert snap.mtp_kind == state.mtp.kind
    want, got = _history(state), _history(restored)
    assert sorted(got) == sorted(want)
    fed = len(want["positions"]) + len(want.get("queue_ids", []))
    assert fed == state.offset - 1  # every position but the last (its token is not known)
    for name in want:
        assert np.array_equal(got[name], want[name]), name


def test_old_state_file_without_mtp_history_restores(qwen3_5_model, tmp_path, monkeypatch):
    """A version 1 file (written before the MTP part existed) restores with an empty head,
    which then follows from the restored position; the drafted tokens are the plain ones."""
    model, state = qwen3_5_model, _drafted(qwen3_5_model)
    path = tmp_path / f"v1{sf.SUFFIX}"
    with monkeypatch.context() as m:
        m.setattr(sf, "FORMAT_VERSION", 1)
        sf.save_state_file(path, replace(state.snapshot(), mtp=None, mtp_kind=None), model)
    hlen = int.from_bytes(path.read_bytes()[:8], "little")
    table = json.loads(path.read_bytes()[8 : 8 + hlen])
    meta = json.loads(table["__metadata__"][sf.META_KEY])
    assert meta["version"] == 1 and "mtp_kind" not in meta
    assert not any(name.startswith("mtp.") for name in table)
    outs = []
    for draft in (MTP, None):
        restored = model.new_state()
        sf.restore_state_file(path, model, restored)
        assert restored.tokens == state.tokens and restored.mtp.snapshot() is None
        params = SamplingParams(max_tokens=10, stop_token_ids=[])
        outs.append(list(model.run(CONT[:3], restored, params, draft)))
    assert outs[0] == outs[1]
    assert restored.offset > len(state.tokens)


def _refused_mtp(model, tmp_path, snap, match: str) -> None:
    path = tmp_path / f"bad{sf.SUFFIX}"
    sf.save_state_file(path, snap, model)
    target = model.new_state()
    with pytest.raises(StateFileError, match=match):
        sf.restore_state_file(path, model, target)
    assert target.offset == 0 and target.mtp.snapshot() is None  # untouched


def test_mismatched_or_corrupt_mtp_history_refused(qwen3_5_model, tmp_path):
    model, state = qwen3_5_model, _drafted(qwen3_5_model)
    snap = state.snapshot()
    mtp = dict(snap.mtp)
    bad = {
        "kind": (replace(snap, mtp_kind="MTPTrack/v0"), "MTP head history is MTPTrack/v0"),
        "entries": (
            replace(snap, mtp={**mtp, "positions": mtp["positions"][:-1]}),
            "MTP head history: its head holds",
        ),
        "seen": (
            replace(snap, mtp={**mtp, "seen": mx.array(snap.offset + 1, dtype=mx.int64)}),
            "MTP head history: it has seen",
        ),
        "missing": (
            replace(snap, mtp={k: v for k, v in mtp.items() if k != "positions"}),
            "MTP head history: it has no 'positions'",
        ),
    }
    for why, (bad_snap, match) in bad.items():
        _refused_mtp(model, tmp_path / why, bad_snap, match)
    # tensors without the header's kind: refused on read
    path = tmp_path / f"nokind{sf.SUFFIX}"
    sf.save_state_file(path, replace(snap, mtp_kind=None), model)
    with pytest.raises(StateFileError, match="MTP head history is incomplete"):
        sf.read_state_file(path, model)
    # one flipped bit in the head's keys
    path = tmp_path / f"flip{sf.SUFFIX}"
    sf.save_state_file(path, snap, model)
    data = bytearray(path.read_bytes())
    hlen = int.from_bytes(data[:8], "little")
    begin, _ = json.loads(data[8 : 8 + hlen])["mtp.head.kv.keys"]["data_offsets"]
    data[8 + hlen + begin] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(StateFileError, match="tensor mtp.head.kv.keys fails its checksum"):
        sf.read_state_file(path, model)


# ----- rollback ---------------------------------------------------------------------------------
def _rollback(model, total: int = 50, back: int = 20) -> None:
    """Generate `total` greedily, rewind `back`, regenerate: identical (save point at the
    target)."""
    prompt = PROMPT[:17]
    greedy = dict(stop_token_ids=[])
    full = list(model.run(prompt, model.new_state(), SamplingParams(max_tokens=total, **greedy)))
    state = model.new_state()
    first = list(model.run(prompt, state, SamplingParams(max_tokens=total - back, **greedy)))
    point = state.save_point()  # prompt + (total - back - 1) fed: where a rewind returns to
    assert point == len(prompt) + total - back - 1
    rest = list(model.run([first[-1]], state, SamplingParams(max_tokens=back, **greedy)))
    assert first + rest == full
    state.rewind(back)
    assert state.offset == point and state.tokens == prompt + full[: total - back - 1]
    again = list(model.run([first[-1]], state, SamplingParams(max_tokens=back, **greedy)))
    assert again == full[total - back :]


def test_rollback_dense(dense_model):
    _rollback(dense_model)
    # attention-only states also rewind anywhere without a save point
    state = dense_model.new_state()
    out = list(dense_model.run(PROMPT[:5], state, SamplingParams(max_tokens=12, stop_token_ids=[])))
    state.rewind(7)
    assert state.tokens == PROMPT[:5] + out[:4]


def test_rollback_qwen3_5(qwen3_5_dir):
    model = qwen38_backend.load(str(qwen3_5_dir))
    _rollback(model)
    state = model.new_state()
    model.prefill(PROMPT[:10], state)
    with pytest.raises(RewindError, match="needs a save point there"):
        state.rewind(3)  # no save point at 7: refused, state unchanged
    assert state.offset == 10


def test_rollback_qwen4_exp(qwen4_exp_dir):
    _rollback(qwen38_backend.load(str(qwen4_exp_dir)))


@pytest.mark.demo
def test_rollback_demo(demo_model):
    _rollback(demo_model, total=24, back=10)  # the tiny models above run 50 and rewind 20


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "child":
    child(*sys.argv[2:7])
