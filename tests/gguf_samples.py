"""Small GGUF files for reader tests: one written by gguf-py's GGUFWriter (the independent
writer), and a byte-level builder for what GGUFWriter cannot write (v2, empty arrays, deep
nesting, deliberately broken layouts)."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np

VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType

# Every scalar value type: key -> (value, type). Values chosen at the edges of each range.
SCALARS = {
    "test.u8": (255, VT.UINT8),
    "test.i8": (-128, VT.INT8),
    "test.u16": (65535, VT.UINT16),
    "test.i16": (-32768, VT.INT16),
    "test.u32": (4294967295, VT.UINT32),
    "test.i32": (-2147483648, VT.INT32),
    "test.f32": (0.1, VT.FLOAT32),
    "test.bool_true": (True, VT.BOOL),
    "test.bool_false": (False, VT.BOOL),
    "test.str": ("héllo wörld ✓ 𝄞", VT.STRING),
    "test.str_empty": ("", VT.STRING),
    "test.u64": (2**64 - 1, VT.UINT64),
    "test.i64": (-(2**63), VT.INT64),
    "test.f64": (-1.25e-300, VT.FLOAT64),
}

# Arrays of every element type: key -> (values, element type, numpy dtype of the expected value).
ARRAYS = {
    "test.arr_u8": ([0, 1, 255], VT.UINT8, np.uint8),
    "test.arr_i8": ([-128, 0, 127], VT.INT8, np.int8),
    "test.arr_u16": ([0, 65535], VT.UINT16, np.uint16),
    "test.arr_i16": ([-32768, 32767], VT.INT16, np.int16),
    "test.arr_u32": ([0, 4294967295, 7], VT.UINT32, np.uint32),
    "test.arr_i32": ([-2147483648, 2147483647], VT.INT32, np.int32),
    "test.arr_f32": ([0.5, -1.0e-3, 3.0e38], VT.FLOAT32, np.float32),
    "test.arr_bool": ([True, False, True], VT.BOOL, np.bool_),
    "test.arr_u64": ([0, 2**64 - 1], VT.UINT64, np.uint64),
    "test.arr_i64": ([-(2**63), 2**63 - 1], VT.INT64, np.int64),
    "test.arr_f64": ([1.5, -2.0e-308], VT.FLOAT64, np.float64),
    "test.arr_str": (["a", "", "ünïcode", "<|im_start|>"], VT.STRING, None),
}

# Nested arrays (GGUFWriter infers the inner element type: int -> INT32, str -> STRING).
NESTED = {
    "test.nested_int": [[1, 2, 3], [4], [5, 6]],
    "test.nested_str": [["x", "y"], ["z"]],
}

# Tensors: name -> (numpy data as written, GGML type, shape in GGML order).
RNG = np.random.default_rng(1234)
TENSORS = {
    "tok.f32": (RNG.standard_normal(7).astype(np.float32), QT.F32, (7,)),
    "blk.0.f16": (RNG.standard_normal((3, 5)).astype(np.float16), QT.F16, (5, 3)),
    "blk.0.q8_0": (RNG.integers(0, 256, (2, 34 * 2), dtype=np.uint8), QT.Q8_0, (64, 2)),
    "blk.0.i32_4d": (RNG.integers(-5, 5, (2, 1, 3, 2), dtype=np.int32), QT.I32, (2, 3, 1, 2)),
    "out.q4_k": (RNG.integers(0, 256, (1, 144), dtype=np.uint8), QT.Q4_K, (256, 1)),
}


def write_sample(path: Path, *, scalars=True, arrays=True, nested=True, tensors=True) -> Path:
    """A GGUF v3 file with every value type and a few tensors of several types and ranks."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    if scalars:
        for key, (value, vtype) in SCALARS.items():
            w.add_key_value(key, value, vtype)
    if arrays:
        for key, (values, sub, _) in ARRAYS.items():
            w.add_key_value(key, values, VT.ARRAY, sub_type=sub)
    if nested:
        for key, values in NESTED.items():
            w.add_array(key, values)
    if tensors:
        for name, (data, qtype, _) in TENSORS.items():
            raw = None if qtype in (QT.F32, QT.F16, QT.I32) else qtype
            w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_small(path: Path) -> Path:
    """A small valid file for the mutation fuzzer: a few keys of each kind and three tensors."""
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("test.flag", True)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_key_value("tokenizer.ggml.tokens", ["a", "bc", "def"], VT.ARRAY, sub_type=VT.STRING)
    w.add_key_value("tokenizer.ggml.scores", [0.0, -1.0, 2.5], VT.ARRAY, sub_type=VT.FLOAT32)
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_key_value("test.u64", 12345678901, VT.UINT64)
    rng = np.random.default_rng(5)
    w.add_tensor("token_embd.weight", rng.standard_normal((3, 4)).astype(np.float32))
    w.add_tensor("blk.0.ffn_down.weight", rng.integers(0, 256, (2, 34), dtype=np.uint8), raw_dtype=QT.Q8_0)
    w.add_tensor("output_norm.weight", rng.standard_normal(4).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- byte-level builder -----------------------------------------------------------------------

def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    """One key/value: key string, u32 type, payload (already encoded)."""
    return gstr(key) + struct.pack("<I", vtype) + payload


def array(elem_type: int, count: int, items: bytes) -> bytes:
    return struct.pack("<IQ", elem_type, count) + items


def tensor_info(name: str, dims: list[int], ggml_type: int, offset: int) -> bytes:
    return gstr(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + \
        struct.pack("<IQ", ggml_type, offset)


def build(kvs: list[bytes], infos: list[bytes], data: bytes = b"", *, version: int = 3,
          alignment: int = 32, n_kv: int | None = None, n_tensors: int | None = None) -> bytes:
    """A GGUF file from encoded parts; the data section starts at the next multiple of alignment."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(infos) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(infos)
    pad = (-len(body)) % alignment
    return body + b"\0" * pad + data


def rewrite_gguf(src, dst, *, arch=None, set_kv=None, drop_kv=(), drop=(), reshape=None, retype=None, add=None):
    """Copy GGUF `src` to `dst` with edits, for load-time error tests:
    arch      rename the architecture (and its "{arch}." metadata keys);
    set_kv    {key: (value, GGUFValueType)} metadata to set (replacing or adding);
    drop_kv   metadata keys to leave out;
    drop      tensor names to leave out;
    reshape   (name, numpy shape): that tensor becomes F32 zeros of the wrong shape;
    retype    a 2-D tensor name that becomes Q8_1 zeros (a type without kernels);
    add       {name: F32 array} extra tensors appended."""
    r = gguf.GGUFReader(str(src))
    old_arch = r.fields["general.architecture"].contents()
    new_arch = arch or old_arch
    w = gguf.GGUFWriter(str(dst), new_arch)
    set_kv = dict(set_kv or {})
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in drop_kv:
            continue
        if key.startswith(old_arch + "."):
            key = new_arch + key[len(old_arch):]
        if key in set_kv:
            w.add_key_value(key, *set_kv.pop(key))
        elif f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(key, f.contents(), f.types[0])
    for key, (value, vtype) in set_kv.items():
        w.add_key_value(key, value, vtype)
    for t in r.tensors:
        if t.name in drop:
            continue
        data = np.array(t.data)
        if reshape and t.name == reshape[0]:
            data = np.zeros(reshape[1], np.float32)
        if retype and t.name == retype:
            rows, k = data.shape
            w.add_tensor(t.name, np.zeros((rows, k // 32 * 40), np.uint8),  # Q8_1: 40-byte blocks of 32
                         raw_dtype=gguf.GGMLQuantizationType.Q8_1)
            continue
        w.add_tensor(t.name, data)
    for name, data in (add or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
