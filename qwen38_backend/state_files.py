"""State files: a SequenceState saved on disk, safetensors tensors plus a verified JSON header.

File layout: a valid safetensors file (8-byte header length, JSON table, tensor bytes), so
any safetensors reader can open it. The state file's own header travels in the table's
`__metadata__` under "qwen38_checkpoint" (a JSON string): format name and version, model
fingerprint, compute dtype, token ids, per-layer state kinds, JSON extras, and for every
tensor its dtype, shape, byte count and sha256, plus a sha256 of the header itself.

Tensors are named `layers.<i>.<key>`, `extras.<key>` and (version 2) `mtp.<key>`: the MTP
head's history (drafts.MTPTrack), with its kind in the header as `mtp_kind`. Version 1 files
(no MTP part) still load; the head then starts empty at the restored position.

Tensors are only the live rows each layer's `snapshot()` returns (no empty pool slots, no
capacity padding). Writes go to a temp file in the same directory, are fsynced, then renamed
(and the directory fsynced): a crash or a full disk leaves the old file or nothing, never a
partial one. Loads verify everything (header, sizes, checksums, fingerprint, kinds) before
any tensor reaches a live SequenceState.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from .errors import StateFileError
from .state import RewindError, SequenceState, StateSnapshot

# On-disk names kept from before the rename to "state file", so existing files stay readable.
FORMAT = "qwen38-checkpoint"
FORMAT_VERSION = 2  # 2: the MTP head's history (`mtp.*`, `mtp_kind`); 1 still loads
META_KEY = "qwen38_checkpoint"
SUFFIX = ".ckpt.safetensors"  # any safetensors reader can open it
_MAX_HEADER = 256 * 1024 * 1024  # token ids of a 262K context fit easily; refuse absurd sizes

# mx dtype <-> safetensors name <-> numpy dtype used to carry the raw bytes
_DTYPES: dict[Any, tuple[str, Any]] = {
    mx.float32: ("F32", np.float32),
    mx.float16: ("F16", np.float16),
    mx.bfloat16: ("BF16", np.uint16),  # numpy has no bf16: carry the bits as uint16
    mx.float64: ("F64", np.float64),
    mx.int64: ("I64", np.int64),
    mx.int32: ("I32", np.int32),
    mx.int16: ("I16", np.int16),
    mx.int8: ("I8", np.int8),
    mx.uint64: ("U64", np.uint64),
    mx.uint32: ("U32", np.uint32),
    mx.uint16: ("U16", np.uint16),
    mx.uint8: ("U8", np.uint8),
    mx.bool_: ("BOOL", np.bool_),
}
_BY_NAME = {name: (dt, np_dt) for dt, (name, np_dt) in _DTYPES.items()}


# ----- model fingerprint ----------------------------------------------------------------------
def model_fingerprint(model: Any) -> str:
    """A hash of what makes two models compute the same states.

    Covers the config, every parameter's name, shape and dtype (so the compute dtype and the
    quantization are in it), and a cheap content sample: the first and last 8 values of every
    parameter, so two models with equal shapes but different weights differ. Accepts an
    engine `Model` (cached on it) or a bare network module.
    """
    cached = getattr(model, "_qwen38_fingerprint", None)
    if isinstance(cached, str):
        return cached
    net = getattr(model, "net", model)
    config = getattr(net, "config", None)
    h = hashlib.sha256(b"qwen38-fingerprint-v1\n")
    h.update(_config_bytes(config))
    params = sorted(tree_flatten(net.parameters()), key=lambda kv: kv[0])
    samples = []
    for name, p in params:
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}\n".encode())
        flat = p.reshape(-1)
        samples.append(mx.concatenate([flat[:8], flat[-8:]]) if flat.size > 16 else flat)
    mx.eval(samples)
    for s in samples:
        h.update(_raw_bytes(s))
    digest = h.hexdigest()
    if hasattr(model, "net"):  # an engine Model: cache (weights do not change after loading)
        model._qwen38_fingerprint = digest
    return digest


def _config_bytes(config: Any) -> bytes:
    if config is None:
        return b"{}"
    if hasattr(config, "__dataclass_fields__"):
        from dataclasses import asdict

        config = asdict(config)
    return json.dumps(config, sort_keys=True, default=str).encode()


def _ranks(model: Any) -> list[int]:
    """[rank, world size] of a model split over mx.distributed ranks ([0, 1] when whole)."""
    return [int(getattr(model, "rank", 0)), int(getattr(model, "world_size", 1))]


def _dtype_name(model: Any) -> str:
    dtype = getattr(model, "dtype", None)
    return str(dtype) if dtype is not None else "unknown"


# ----- bytes of arrays ------------------------------------------------------------------------
def _raw_bytes(a: mx.array) -> bytes | memoryview:
    if a.dtype not in _DTYPES:
        raise StateFileError(f"cannot store an array of dtype {a.dtype} in a state file")
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    arr = np.ascontiguousarray(np.asarray(a))
    return memoryview(arr).cast("B") if arr.size else b""


def _from_bytes(data: bytes, st_dtype: str, shape: list[int]) -> mx.array:
    dt, np_dt = _BY_NAME[st_dtype]
    arr = np.frombuffer(data, dtype=np_dt).reshape(shape)
    out = mx.array(arr)
    return out.view(mx.bfloat16) if dt == mx.bfloat16 else out


# ----- write ----------------------------------------------------------------------------------
@dataclass
class StateFileInfo:
    """What a state file holds (from its header; nothing is loaded)."""

    path: Path
    model_fingerprint: str
    n_tokens: int
    nbytes: int  # file size
    created: float
    dtype: str
    kinds: list[str]
    tokens: list[int]
    # the KV options the sequence was created with (Model.new_state), {} for the defaults
    kv_options: dict[str, Any] = field(default_factory=dict)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while view:
        try:
            n = os.write(fd, view[: 1 << 30])
        except InterruptedError:
            continue
        if n == 0:
            raise OSError(errno.EIO, "write returned 0 bytes")
        view = view[n:]


# A live state of at least this many bytes is written one layer at a time (below it, the
# whole state is evaluated at once and the header sized exactly, with no reserve padding).
STREAM_BYTES = 64 << 20


def save_state_file(
    path: str | Path, state: SequenceState | StateSnapshot, model: Any
) -> StateFileInfo:
    """Write `state` (or a snapshot of it) to `path` atomically; returns the header info.

    A large live SequenceState (STREAM_BYTES and up) is written one layer at a time (each
    layer's snapshot evaluated, hashed, written and dropped before the next), so saving a
    sequence whose KV pages are spilled to disk holds one layer's KV in RAM, not the whole
    sequence; its data goes behind a reserved header area, filled in (space-padded) once
    every checksum is known.

    Raises StateFileError (with the OS reason, e.g. "No space left on device") when the file
    cannot be written; the destination is then untouched and no temp file is left behind.
    """
    path = Path(path)
    stream = isinstance(state, SequenceState) and state.nbytes() >= STREAM_BYTES
    if isinstance(state, SequenceState) and not stream:
        state = state.snapshot()
    if isinstance(state, SequenceState):
        tokens, extras, kinds = state.tokens, dict(state.extras), state.kinds()
        n_layers = len(state.layers)
        layers = (layer.snapshot() for layer in state.layers)
        mtp, mtp_kind = state.mtp_snapshot()
    else:
        tokens, extras, kinds = state.tokens, state.extras, state.kinds
        n_layers = len(state.layers)
        layers = iter(state.layers)
        mtp, mtp_kind = state.mtp, state.mtp_kind
    extra_tensors, extras_json = _split_extras(extras)
    tail = [("extras.", extra_tensors)] + ([("mtp.", mtp)] if mtp is not None else [])
    # lazily: a streamed state's layers are snapshotted one at a time
    groups = itertools.chain(((f"layers.{i}.", g) for i, g in enumerate(layers)), tail)
    meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "model_fingerprint": model_fingerprint(model),
        "ranks": _ranks(model),
        "dtype": _dtype_name(model),
        "n_tokens": len(tokens),
        "tokens": [int(t) for t in tokens],
        "n_layers": n_layers,
        "kinds": list(kinds) if kinds is not None else None,
        "extras": extras_json,
        **({"mtp_kind": mtp_kind} if mtp is not None else {}),
        "tensors": {},
        "created": time.time(),
    }
    table: dict[str, Any] = {}
    if stream:
        n_more = len(extra_tensors) + len(mtp or {})
        reserve = _header_reserve(len(tokens), n_layers, n_more, extras_json)
        pending: list[bytes | memoryview] = []
    else:  # everything in memory: hash it all first, the header is then exact
        pending, reserve = _describe(groups, table, meta["tensors"]), 0
        groups = iter(())

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{time.monotonic_ns()}")
    fd = -1
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        if stream:
            os.lseek(fd, 8 + reserve, os.SEEK_SET)
            for group in groups:  # one layer's arrays alive at a time
                for raw in _describe(iter([group]), table, meta["tensors"]):
                    _write_all(fd, raw)
        nbytes = sum(e["nbytes"] for e in meta["tensors"].values())
        header = _header(table, meta)
        if not stream:
            _write_all(fd, struct.pack("<Q", len(header)) + header)
            for raw in pending:
                _write_all(fd, raw)
        elif len(header) > reserve:
            fd = _relocate(fd, tmp, reserve, nbytes, header)
        else:
            header += b" " * (reserve - len(header))  # JSON ends in padding spaces
            os.pwrite(fd, struct.pack("<Q", len(header)) + header, 0)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except OSError as e:
        _discard(fd, tmp)
        reason = e.strerror or str(e)
        raise StateFileError(f"could not write state file {path}: {reason}") from e
    except BaseException:
        _discard(fd, tmp)
        raise
    return StateFileInfo(
        path=path,
        model_fingerprint=meta["model_fingerprint"],
        n_tokens=meta["n_tokens"],
        nbytes=8 + max(len(header), reserve) + nbytes,
        created=meta["created"],
        dtype=meta["dtype"],
        kinds=meta["kinds"] or [],
        tokens=meta["tokens"],
        kv_options=_kv_options(meta),
    )


def _describe(groups, table: dict[str, Any], entries: dict[str, Any]) -> list[memoryview]:
    """Evaluate each (prefix, {key: array}) group, enter its tensors in the safetensors table
    and the header (offsets follow on from what is already there); returns their bytes."""
    offset = sum(e["nbytes"] for e in entries.values())
    out = []
    for prefix, group in groups:
        mx.eval(list(group.values()))
        for key in sorted(group):
            name, a = prefix + key, group[key]
            st_name = _DTYPES.get(a.dtype, (None,))[0]
            if st_name is None:
                raise StateFileError(f"tensor {name}: dtype {a.dtype} cannot be stored")
            raw = _raw_bytes(a)
            n = len(raw)
            shape = list(a.shape)
            table[name] = {"dtype": st_name, "shape": shape, "data_offsets": [offset, offset + n]}
            entries[name] = {
                "dtype": st_name,
                "shape": shape,
                "nbytes": n,
                "sha256": hashlib.sha256(raw).hexdigest(),
            }
            out.append(raw)
            offset += n
    return out


def _header(table: dict[str, Any], meta: dict[str, Any]) -> bytes:
    meta["header_sha256"] = _header_digest(meta)
    table["__metadata__"] = {META_KEY: json.dumps(meta, separators=(",", ":"))}
    header = json.dumps(table, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8)  # safetensors aligns the data start to 8 bytes


def _discard(fd: int, tmp: Path) -> None:
    if fd >= 0:
        os.close(fd)
    tmp.unlink(missing_ok=True)


def _split_extras(extras: dict[str, Any]) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """(array extras, JSON-portable extras); anything else (e.g. a callable) is dropped: a
    restored state rebuilds it."""
    arrays: dict[str, mx.array] = {}
    portable: dict[str, Any] = {}
    for key, value in extras.items():
        if isinstance(value, mx.array):
            arrays[key] = value
            continue
        try:
            json.dumps(value)
        except TypeError:
            continue
        portable[key] = value
    return arrays, portable


def _header_reserve(n_tokens: int, n_layers: int, n_extras: int, extras_json: Any) -> int:
    """Bytes set aside for the header before the data is written: token ids at most 11
    characters each, every tensor's table and header entries well under 1 KiB (a layer has
    a few tensors, 16 at most), and the fixed fields; a multiple of 8 (data alignment)."""
    tensors = 16 * n_layers + n_extras
    n = 4096 + 12 * n_tokens + 1024 * tensors + 2 * len(json.dumps(extras_json))
    return n + (-n % 8)


def _relocate(fd: int, tmp: Path, reserve: int, nbytes: int, header: bytes) -> int:
    """The header outgrew its reserve (never expected): write it and copy the data behind
    it into a new temp file, which replaces `tmp`. Returns the new file's descriptor."""
    moved = tmp.with_name(tmp.name + ".moved")
    out = os.open(moved, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(out, struct.pack("<Q", len(header)) + header)
        done = 0
        while done < nbytes:
            chunk = os.pread(fd, min(64 << 20, nbytes - done), 8 + reserve + done)
            if not chunk:
                raise OSError(errno.EIO, "short read while moving state file data")
            _write_all(out, chunk)
            done += len(chunk)
        os.replace(moved, tmp)
    except BaseException:
        os.close(out)
        moved.unlink(missing_ok=True)
        raise
    os.close(fd)
    return out


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not supported everywhere (e.g. Windows); the rename itself is atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _header_digest(meta: dict[str, Any]) -> str:
    body = {k: v for k, v in meta.items() if k != "header_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# ----- read -----------------------------------------------------------------------------------
def _read_table(f, path: Path, size: int) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(safetensors table, state-file meta, data start), all checked for consistency."""
    if size < 8:
        raise StateFileError(f"state file {path} is truncated: {size} bytes, no header")
    (hlen,) = struct.unpack("<Q", f.read(8))
    if hlen > _MAX_HEADER or 8 + hlen > size:
        raise StateFileError(
            f"state file {path} is truncated or corrupt: header of {hlen} bytes in a "
            f"{size}-byte file"
        )
    try:
        table = json.loads(f.read(hlen))
        meta = json.loads(table["__metadata__"][META_KEY])
    except (ValueError, KeyError, TypeError) as e:
        raise StateFileError(
            f"{path} is not a qwen38 state file or its header is corrupt ({e})"
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise StateFileError(f"{path} is not a qwen38 state file (format {meta.get('format')!r})")
    if meta.get("version") not in range(1, FORMAT_VERSION + 1):
        raise StateFileError(
            f"state file {path} has format version {meta.get('version')!r}; this build reads "
            f"version {FORMAT_VERSION} and older (delete it or re-create it with this version)"
        )
    if meta.get("header_sha256") != _header_digest(meta):
        raise StateFileError(f"state file {path}: header checksum mismatch (corrupt header)")
    return table, meta, 8 + hlen


def read_header(path: str | Path) -> StateFileInfo:
    """Header info of a state file (verified header; tensors not read)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            _, meta, _ = _read_table(f, path, size)
    except OSError as e:
        raise StateFileError(f"cannot read state file {path}: {e.strerror or e}") from e
    return StateFileInfo(
        path=path,
        model_fingerprint=meta["model_fingerprint"],
        n_tokens=int(meta["n_tokens"]),
        nbytes=size,
        created=float(meta.get("created", 0.0)),
        dtype=str(meta.get("dtype")),
        kinds=list(meta.get("kinds") or []),
        tokens=[int(t) for t in meta["tokens"]],
        kv_options=_kv_options(meta),
    )


def _kv_options(meta: dict) -> dict[str, Any]:
    options = (meta.get("extras") or {}).get("kv_options")
    return dict(options) if isinstance(options, dict) else {}


def read_state_file(
    path: str | Path, model: Any, on_error: Callable[[StateFileError], None] | None = None
) -> StateSnapshot:
    """Read and verify a state file for `model`; returns a snapshot ready for restore().

    Refuses (StateFileError, saying which check failed) a file that is truncated, corrupt
    (any tensor's bytes or the header), from another format version, or written by another
    model or compute dtype. Nothing is restored here, so a refusal cannot damage a session.
    A file of STREAM_BYTES and more (a long context's KV) is not read whole: its layers'
    tensors are read and verified one layer at a time as restore() reaches them, so a
    restore holds one layer's tensors at a time (as saving does); a corrupt one then raises
    StateFileError from inside that restore (into the fresh state it fills), after
    `on_error(error)` (the prefix store deletes the file).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        f = open(path, "rb")
    except OSError as e:
        raise StateFileError(f"cannot read state file {path}: {e.strerror or e}") from e
    with f:
        table, meta, start = _read_table(f, path, size)
        saved, ours = meta.get("ranks", [0, 1]), _ranks(model)
        if saved != ours:
            raise StateFileError(
                f"state file {path} holds the part of rank {saved[0]} of a model split over "
                f"{saved[1]} rank(s); this process is rank {ours[0]} of {ours[1]}: a state file "
                "is restored only by the same rank of the same world size"
            )
        want = model_fingerprint(model)
        if meta["model_fingerprint"] != want:
            raise StateFileError(
                f"state file {path} was written by a different model (fingerprint "
                f"{meta['model_fingerprint'][:16]}..., this model {want[:16]}...)"
            )
        if meta.get("dtype") != _dtype_name(model):
            raise StateFileError(
                f"state file {path} holds {meta.get('dtype')} state; this model computes in "
                f"{_dtype_name(model)}"
            )
        entries: dict[str, Any] = meta["tensors"]
        names = sorted(k for k in table if k != "__metadata__")
        if names != sorted(entries):
            raise StateFileError(f"state file {path}: tensor table and header disagree")
        expected_end = start + sum(int(e["nbytes"]) for e in entries.values())
        if size != expected_end:
            raise StateFileError(
                f"state file {path} is truncated or padded: {size} bytes, header describes "
                f"{expected_end}"
            )
        for name in names:
            entry, slot = entries[name], table[name]
            begin, end = slot["data_offsets"]
            if (
                end - begin != int(entry["nbytes"])
                or slot["dtype"] != entry["dtype"]
                or slot["shape"] != entry["shape"]
                or entry["dtype"] not in _BY_NAME
            ):
                raise StateFileError(f"state file {path}: tensor {name} header is inconsistent")
        n_layers = int(meta["n_layers"])
        by_layer: list[list[str]] = [[] for _ in range(n_layers)]
        rest = []
        for name in names:
            if name.startswith(("extras.", "mtp.")):
                rest.append(name)
                continue
            _, index, _ = name.split(".", 2)
            if not 0 <= int(index) < n_layers:
                raise StateFileError(f"state file {path}: tensor {name} names a missing layer")
            by_layer[int(index)].append(name)
        tensors = _TensorReader(path, table, entries, start)
        small = tensors.read(f, rest)
        layers: Sequence[dict[str, mx.array]]
        if size < STREAM_BYTES:
            layers = [_layer_tensors(tensors.read(f, group)) for group in by_layer]
        else:
            layers = _LayersOnDisk(tensors, by_layer, on_error)
    extras: dict[str, Any] = dict(meta.get("extras") or {})
    mtp = {name[4:]: value for name, value in small.items() if name.startswith("mtp.")}
    mtp_kind = meta.get("mtp_kind")
    if bool(mtp) != (mtp_kind is not None):
        raise StateFileError(
            f"state file {path}: its MTP head history is incomplete (header and tensors disagree)"
        )
    for name, value in small.items():
        if name.startswith("extras."):
            extras[name[len("extras.") :]] = value
    tokens = [int(t) for t in meta["tokens"]]
    if len(tokens) != int(meta["n_tokens"]):
        raise StateFileError(f"state file {path}: token count disagrees with its header")
    return StateSnapshot(
        tokens=tokens,
        layers=layers,
        extras=extras,
        kinds=meta.get("kinds"),
        mtp=mtp or None,
        mtp_kind=mtp_kind,
    )


def _layer_tensors(named: dict[str, mx.array]) -> dict[str, mx.array]:
    """`layers.<i>.<key>` -> `<key>`."""
    return {name.split(".", 2)[2]: value for name, value in named.items()}


@dataclass
class _TensorReader:
    """Reads named tensors of a state file whose table was checked, verifying each one's
    sha256 against the header."""

    path: Path
    table: dict[str, Any]
    entries: dict[str, Any]
    start: int

    def read(self, f, names: list[str]) -> dict[str, mx.array]:
        out = {}
        for name in names:
            entry = self.entries[name]
            begin = self.table[name]["data_offsets"][0]
            n = int(entry["nbytes"])
            f.seek(self.start + begin)
            data = f.read(n)
            if len(data) != n:
                raise StateFileError(f"state file {self.path} is truncated inside tensor {name}")
            if hashlib.sha256(data).hexdigest() != entry["sha256"]:
                raise StateFileError(
                    f"state file {self.path}: tensor {name} fails its checksum (corrupt data)"
                )
            try:
                out[name] = _from_bytes(data, entry["dtype"], entry["shape"])
            except ValueError as e:
                raise StateFileError(f"state file {self.path}: tensor {name}: {e}") from None
        return out


class _LayersOnDisk(Sequence):
    """A large state file's layers, each read (and verified) when restore() asks for it."""

    def __init__(self, tensors: _TensorReader, by_layer: list[list[str]], on_error):
        self.tensors, self.by_layer, self.on_error = tensors, by_layer, on_error

    def __len__(self) -> int:
        return len(self.by_layer)

    def __getitem__(self, index):
        try:
            with open(self.tensors.path, "rb") as f:
                return _layer_tensors(self.tensors.read(f, self.by_layer[index]))
        except OSError as e:
            error = StateFileError(f"cannot read state file {self.tensors.path}: {e.strerror or e}")
        except StateFileError as e:
            error = e
        if self.on_error is not None:
            self.on_error(error)
        raise error


def check_compatible(snap: StateSnapshot, state: SequenceState, where: str = "state file") -> None:
    """Refuse a snapshot whose layers do not match `state` (layer count and state kinds), or
    whose MTP head history does not (its kind and shape: SequenceState.check_mtp)."""
    if len(snap.layers) != len(state.layers):
        raise StateFileError(
            f"{where} has {len(snap.layers)} layers; this model's state has {len(state.layers)}"
        )
    kinds = state.kinds()
    if snap.kinds is not None and list(snap.kinds) != kinds:
        bad = next(i for i, (a, b) in enumerate(zip(snap.kinds, kinds, strict=False)) if a != b)
        raise StateFileError(
            f"{where}: layer {bad} holds {snap.kinds[bad]} state; this session uses {kinds[bad]} "
            "(different state format or KV options)"
        )
    try:
        state.check_mtp(snap)
    except RewindError as e:
        raise StateFileError(f"{where}: {e}") from None


def restore_state_file(path: str | Path, model: Any, state: SequenceState) -> StateSnapshot:
    """Load, verify, then restore into `state` (restored only once every check passed)."""
    snap = read_state_file(path, model)
    check_compatible(snap, state, f"state file {path}")
    state.restore(snap)
    return snap
