"""Read the ``tokenizer.*`` key/value metadata of a GGUF file.

Only the header and the key/value section are parsed (tensor infos and data are never touched), so
a 262k-token vocabulary loads in a fraction of a second. This is the one place that knows the file
format; it is meant to be switched to the native reader (``ktd.model.gguf``) once that exists.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"

# GGUF value types (gguf.h: enum gguf_type) -> numpy dtype for fixed-size scalars/arrays.
_FIXED = {
    0: np.dtype("<u1"), 1: np.dtype("<i1"), 2: np.dtype("<u2"), 3: np.dtype("<i2"),
    4: np.dtype("<u4"), 5: np.dtype("<i4"), 6: np.dtype("<f4"), 7: np.dtype("<u1"),  # 7 = bool
    10: np.dtype("<u8"), 11: np.dtype("<i8"), 12: np.dtype("<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7

# A bound on lengths read from the file, so a corrupt length is an error, not a huge allocation.
_MAX_COUNT = 1 << 31


try:  # the native module is optional here: the reader is pure Python without it
    from ktd._native import gguf_string_array as _native_string_array
except ImportError:  # pragma: no cover - a build without the function
    _native_string_array = None


class GGUFMetadataError(ValueError):
    """The file is not a GGUF file or its metadata section is malformed."""


class _Cursor:
    def __init__(self, buf: memoryview, path: Path):
        self.buf = buf
        self.pos = 0
        self.path = path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise GGUFMetadataError(f"{self.path}: truncated metadata at byte {self.pos}")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def count(self) -> int:
        n = self.u64()
        if n > _MAX_COUNT:
            raise GGUFMetadataError(f"{self.path}: implausible length {n} at byte {self.pos - 8}")
        return n

    def raw_string(self) -> bytes:
        return bytes(self.take(self.count()))

    def value(self, vtype: int, want: bool):
        if vtype in _FIXED:
            dt = _FIXED[vtype]
            v = np.frombuffer(self.take(dt.itemsize), dtype=dt)[0]
            return bool(v) if vtype == _BOOL else v.item()
        if vtype == _STRING:
            s = self.raw_string()
            return s.decode("utf-8", errors="surrogateescape") if want else None
        if vtype == _ARRAY:
            etype = self.u32()
            n = self.count()
            if etype in _FIXED:
                dt = _FIXED[etype]
                data = self.take(n * dt.itemsize)
                if not want:
                    return None
                arr = np.frombuffer(data, dtype=dt).copy()
                return arr.astype(bool) if etype == _BOOL else arr
            if etype == _STRING:
                return self._string_array(n, want)
            if etype == _ARRAY:
                out = [self.value(_ARRAY, want) for _ in range(n)]
                return out if want else None
            raise GGUFMetadataError(f"{self.path}: unknown array element type {etype}")
        raise GGUFMetadataError(f"{self.path}: unknown value type {vtype}")

    def _string_array(self, n: int, want: bool) -> list[bytes] | None:
        if want and _native_string_array is not None:
            # The native loop (a vocabulary's 150k strings in milliseconds); None: malformed,
            # and the loop below says where.
            r = _native_string_array(self.buf, self.pos, n)
            if r is not None:
                out, self.pos = r
                return out
        buf, pos, end = self.buf, self.pos, len(self.buf)
        out: list[bytes] | None = [] if want else None
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(n):
            if pos + 8 > end:
                raise GGUFMetadataError(f"{self.path}: truncated string array at byte {pos}")
            (ln,) = unpack(buf, pos)
            pos += 8
            if ln > end - pos:
                raise GGUFMetadataError(f"{self.path}: string length {ln} past end of file at byte {pos}")
            if out is not None:
                out.append(bytes(buf[pos:pos + ln]))
            pos += ln
        self.pos = pos
        return out


def _read_tokenizer_metadata(path: str | Path) -> dict:
    """Return ``{key: value}`` for the ``tokenizer.*`` keys and ``general.architecture``.

    Strings are ``str`` (undecodable bytes kept via surrogateescape), string arrays are lists of
    ``bytes``, numeric arrays are numpy arrays, scalars are Python ints/floats/bools.
    Raises GGUFMetadataError (a ValueError) on a malformed file and OSError if it cannot be read.
    """
    path = Path(path)
    with open(path, "rb") as f:
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:  # empty file
            raise GGUFMetadataError(f"{path}: not a GGUF file (empty)") from e
    try:
        buf = memoryview(mm)
        try:
            cur = _Cursor(buf, path)
            if bytes(cur.take(4)) != GGUF_MAGIC:
                raise GGUFMetadataError(f"{path}: not a GGUF file (bad magic)")
            version = cur.u32()
            if version not in (2, 3):
                raise GGUFMetadataError(f"{path}: unsupported GGUF version {version}")
            cur.count()  # n_tensors
            n_kv = cur.count()
            out: dict = {}
            for _ in range(n_kv):
                key = cur.raw_string().decode("utf-8", errors="replace")
                vtype = cur.u32()
                want = key.startswith("tokenizer.") or key == "general.architecture"
                value = cur.value(vtype, want)
                if want:
                    out[key] = value
            return out
        finally:
            buf.release()
    finally:
        mm.close()
