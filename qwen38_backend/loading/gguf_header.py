"""A bounds-checked walk over a GGUF header, run before `mx.load` (which may crash on bad files)."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from ..errors import WeightsError

# ggml type id -> (elements per block, bytes per block)
GGML_TYPES = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 36), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176),
    14: (256, 210), 15: (256, 292), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8),
    28: (1, 8), 30: (1, 2),
}  # fmt: skip
_SCALAR = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))


class _Cursor:
    """Reads little-endian values from a buffer, raising WeightsError past its end."""

    def __init__(self, path: Path, buf: mmap.mmap | bytes):
        self.path, self.buf, self.pos = path, buf, 0

    def take(self, fmt: str) -> int | float:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise WeightsError(f"{self.path}: truncated GGUF header (at byte {self.pos})")
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise WeightsError(f"{self.path}: truncated GGUF header (at byte {self.pos})")
        self.pos += n

    def string(self) -> bytes:
        n = int(self.take("Q"))
        start = self.pos
        self.skip(n)
        return bytes(self.buf[start : self.pos])

    def value(self, vtype: int, depth: int = 0) -> int | None:
        """Skip one metadata value; return it when it is an integer scalar."""
        if vtype in _SCALAR:
            v = self.take(_SCALAR[vtype])
            return v if isinstance(v, int) else None
        if vtype == 8:
            self.string()
        elif vtype == 9 and depth == 0:
            sub, count = int(self.take("I")), int(self.take("Q"))
            if sub in _SCALAR:
                self.skip(struct.calcsize("<" + _SCALAR[sub]) * count)
            else:
                for _ in range(count):
                    self.value(sub, depth + 1)
        else:
            raise WeightsError(f"{self.path}: corrupt GGUF header: value type {vtype}")
        return None


def validate_gguf(path: Path) -> None:
    """Check magic, version, metadata and that every tensor lies inside the file."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            _walk(_Cursor(path, buf), len(buf))
    except (OSError, ValueError) as e:  # ValueError: mmap of an empty file
        raise WeightsError(f"{path}: cannot read GGUF file: {e}") from e


def _walk(c: _Cursor, size: int) -> None:
    if c.take("4s") != b"GGUF":
        raise WeightsError(f"{c.path}: not a GGUF file (bad magic)")
    version = c.take("I")
    if version not in (2, 3):
        raise WeightsError(f"{c.path}: unsupported GGUF version {version} (need 2 or 3)")
    n_tensors, n_kv = int(c.take("Q")), int(c.take("Q"))
    alignment = 32
    for _ in range(n_kv):
        key = c.string()
        v = c.value(int(c.take("I")))
        if key == b"general.alignment" and v:
            alignment = v
    infos = [_tensor_info(c) for _ in range(n_tensors)]
    data_start = -(-c.pos // alignment) * alignment
    for name, nbytes, offset in infos:
        if data_start + offset + nbytes > size:
            raise WeightsError(
                f"{c.path}: truncated GGUF file: tensor {name!r} needs bytes "
                f"{data_start + offset}..{data_start + offset + nbytes}, file has {size}"
            )


def _tensor_info(c: _Cursor) -> tuple[str, int, int]:
    name = c.string().decode("utf-8", "replace")
    n_dims = int(c.take("I"))
    if n_dims > 8:
        raise WeightsError(f"{c.path}: corrupt GGUF tensor info for {name!r} ({n_dims} dims)")
    n_elems = 1
    for _ in range(n_dims):
        n_elems *= int(c.take("Q"))
    ttype, offset = int(c.take("I")), int(c.take("Q"))
    if ttype not in GGML_TYPES:
        raise WeightsError(f"{c.path}: tensor {name!r} has unsupported GGML type {ttype}")
    block, block_bytes = GGML_TYPES[ttype]
    return name, -(-n_elems // block) * block_bytes, offset
