"""Read GGUF model files: metadata, tensor table and zero-copy tensor bytes.

The parsing and validation are native (``ktd._native.GGUFFile``): the file is mapped read-only
and every count, length, offset, dimension and type id is checked on open. Malformed input raises
:class:`ktd.GGUFError` (a ``ValueError``) naming the field, the key or tensor, and the byte
offset; a file that cannot be opened raises ``OSError``.

Values come back as Python ``int``/``float``/``bool``/``str``; arrays of numbers as numpy
arrays (little-endian, a copy), arrays of strings as ``list[str]``, nested arrays as lists. A
string value that is not valid UTF-8 comes back as ``bytes`` (exact, not decoded lossily).
Values are converted on first access and cached, so opening a model does not build the 150k-entry
token list until someone asks for it.

Shapes are in GGML order: ``shape[0]`` is the row length (contiguous), the reverse of numpy's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

from ktd import _native


class TensorInfo(NamedTuple):
    name: str
    type_name: str       # GGML type, e.g. "Q4_K"
    type_id: int         # GGML type id
    shape: tuple[int, ...]  # GGML order: shape[0] = ne0 = row length
    offset: int          # absolute byte offset of the data in the file
    nbytes: int          # exact size of the data in bytes

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _frozen(value: Any) -> Any:
    """Values are shared through the cache: numpy arrays (nested ones too) become read-only.
    Lists are returned as they are (copying a 150k-token list on every access would cost more
    than it protects); callers must not modify them."""
    if isinstance(value, np.ndarray):
        value.setflags(write=False)
    elif isinstance(value, list):
        for v in value:
            _frozen(v)
    return value


class Metadata(Mapping[str, Any]):
    """Read-only, ordered mapping key -> value, converted lazily and cached."""

    def __init__(self, native: _native.GGUFFile):
        self._native = native
        self._keys: list[str] = native.keys()
        self._key_set = frozenset(self._keys)
        self._cache: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key not in self._key_set:
            raise KeyError(key)
        try:
            return self._cache[key]
        except KeyError:
            value = self._cache[key] = _frozen(self._native.value(key))
            return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._key_set


class GGUFFile:
    """A GGUF v2/v3 file, mapped read-only.

    ``willneed=False`` skips the readahead hint: use it when only the header is needed.
    The mapping stays alive as long as this object or any array from :meth:`tensor_data` does.
    """

    def __init__(self, path: str | os.PathLike[str], *, willneed: bool = True):
        self._native = _native.GGUFFile(os.fspath(path), willneed)
        self.metadata: Mapping[str, Any] = Metadata(self._native)
        self.tensors: Mapping[str, TensorInfo] = _ReadOnlyDict(
            (info[0], TensorInfo(info[0], info[1], info[2], tuple(info[3]), info[4], info[5]))
            for info in self._native.tensor_infos()
        )

    @property
    def path(self) -> str:
        return self._native.path

    @property
    def version(self) -> int:
        return self._native.version

    @property
    def alignment(self) -> int:
        return self._native.alignment

    @property
    def data_offset(self) -> int:
        """Byte offset of the tensor data section (tensor offsets in the file are relative to it)."""
        return self._native.data_offset

    @property
    def file_size(self) -> int:
        return self._native.file_size

    def metadata_type(self, key: str) -> str:
        """GGUF value type name of a key: "UINT32", "STRING", "ARRAY", ... (KeyError if absent)."""
        return self._native.value_type(key)

    def metadata_array_type(self, key: str) -> str | None:
        """Element type name of an array value ("STRING", "INT32", "ARRAY", ...); None for a scalar."""
        return self._native.array_type(key)

    def tensor_data(self, name: str) -> np.ndarray:
        """Read-only uint8 view of the tensor's raw bytes in the mapping (no copy)."""
        return self._native.tensor_data(name)

    def __repr__(self) -> str:
        return (f"GGUFFile({self.path!r}, version={self.version}, {len(self.metadata)} keys, "
                f"{len(self.tensors)} tensors)")


class _ReadOnlyDict(Mapping):
    """An ordered mapping that cannot be changed after construction."""

    def __init__(self, items):
        self._d = dict(items)

    def __getitem__(self, key):
        return self._d[key]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)
