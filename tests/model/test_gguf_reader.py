"""The native GGUF reader (ktd.model.gguf) against gguf-py: the writer makes the files, the reader is
the independent oracle for what they contain; corrupt files must raise GGUFError naming the
field, key or tensor, and the byte offset."""

from __future__ import annotations

import gc
import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

import ktd
from ktd.model.gguf import GGUFFile
from gguf_samples import ARRAYS, NESTED, QT, SCALARS, TENSORS, VT, array, build, gstr, kv, tensor_info, write_sample

# --- helpers ----------------------------------------------------------------------------------


def reader_value(field: gguf.ReaderField):
    """A gguf-py field's value in ktd's conventions (arrays of numbers as lists)."""
    return field.contents()


def ktd_value(v):
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, list):
        return [ktd_value(x) for x in v]
    return v


def part_offset(field: gguf.ReaderField, index: int) -> int:
    """Byte offset of field.parts[index] in the file."""
    return field.offset + sum(int(p.nbytes) for p in field.parts[:index])


def patched(path: Path, offset: int, data: bytes, out: Path) -> Path:
    b = bytearray(path.read_bytes())
    b[offset:offset + len(data)] = data
    out.write_bytes(bytes(b))
    return out


def assert_matches_reader(f: GGUFFile, r: gguf.GGUFReader, *, check_data: bool = True) -> None:
    """Every key, value type and value, and every tensor info, agree with gguf-py's reader."""
    fields = {k: v for k, v in r.fields.items() if not k.startswith("GGUF.")}
    assert list(f.metadata) == list(fields)
    for key, field in fields.items():
        assert f.metadata_type(key) == field.types[0].name, key
        if field.types[0] == VT.ARRAY:
            if len(field.types) == 1:  # gguf-py drops the element type of an empty array
                assert len(f.metadata[key]) == 0 and field.contents() == [], key
                continue
            assert f.metadata_array_type(key) == field.types[1].name, key
            if field.types[1] == VT.ARRAY:
                continue  # gguf-py cannot decode nested arrays; checked against the writer input
        else:
            assert f.metadata_array_type(key) is None
        assert ktd_value(f.metadata[key]) == reader_value(field), key
    assert f.alignment == r.alignment
    assert f.data_offset == r.data_offset
    assert list(f.tensors) == [t.name for t in r.tensors]
    for t in r.tensors:
        mine = f.tensors[t.name]
        assert mine.type_id == int(t.tensor_type)
        assert mine.type_name == t.tensor_type.name
        assert mine.shape == tuple(int(d) for d in t.shape)
        assert mine.offset == t.data_offset
        assert mine.nbytes == t.n_bytes
        assert mine.n_elements == t.n_elements
        if check_data:
            assert f.tensor_data(t.name).tobytes() == t.data.tobytes()


@pytest.fixture
def sample(tmp_path) -> Path:
    return write_sample(tmp_path / "sample.gguf")


# --- valid files ------------------------------------------------------------------------------


def test_every_value_type_round_trips(sample):
    f = GGUFFile(sample)
    assert f.version == 3
    assert f.metadata["general.architecture"] == "llama"
    for key, (value, vtype) in SCALARS.items():
        got = f.metadata[key]
        assert f.metadata_type(key) == vtype.name
        if vtype == VT.FLOAT32:
            assert got == float(np.float32(value))
        else:
            assert got == value and type(got) is type(value), key
    for key, (values, sub, dtype) in ARRAYS.items():
        got = f.metadata[key]
        assert f.metadata_type(key) == "ARRAY" and f.metadata_array_type(key) == sub.name
        if dtype is None:
            assert got == values
        else:
            assert isinstance(got, np.ndarray) and got.dtype == dtype
            np.testing.assert_array_equal(got, np.array(values, dtype=dtype))
    for key, values in NESTED.items():
        assert f.metadata_array_type(key) == "ARRAY"
        assert ktd_value(f.metadata[key]) == values


def test_tensor_table_and_bytes(sample):
    f = GGUFFile(sample)
    assert list(f.tensors) == list(TENSORS)
    raw = sample.read_bytes()
    for name, (data, qtype, shape) in TENSORS.items():
        t = f.tensors[name]
        assert (t.type_name, t.shape, t.nbytes) == (qtype.name, shape, data.nbytes)
        assert t.offset % f.alignment == 0 and t.offset >= f.data_offset
        view = f.tensor_data(name)
        assert view.tobytes() == data.tobytes() == raw[t.offset:t.offset + t.nbytes]


def test_matches_gguf_reader_on_generated_file(sample):
    assert_matches_reader(GGUFFile(sample), gguf.GGUFReader(sample))


def test_tensor_data_is_a_read_only_view_that_keeps_the_mapping(sample):
    f = GGUFFile(sample)
    view = f.tensor_data("blk.0.q8_0")
    assert view.dtype == np.uint8 and not view.flags.writeable and not view.flags.owndata
    with pytest.raises(ValueError):
        view[0] = 1
    again = f.tensor_data("blk.0.q8_0")
    assert np.shares_memory(view, again)  # both are the mapping, not copies
    expected = TENSORS["blk.0.q8_0"][0].tobytes()
    del f, again
    gc.collect()
    assert view.tobytes() == expected  # the view kept the mapping alive


def test_metadata_is_a_read_only_mapping(sample):
    f = GGUFFile(sample)
    with pytest.raises(TypeError):
        f.metadata["test.u8"] = 1  # type: ignore[index]
    with pytest.raises(KeyError):
        f.metadata["no.such.key"]
    with pytest.raises(KeyError):
        f.tensor_data("no.such.tensor")
    arr = f.metadata["test.arr_u32"]
    with pytest.raises(ValueError):
        arr[0] = 1
    assert f.metadata["test.arr_u32"][0] == 0


def test_gguf_v2_reads_like_v3(sample, tmp_path):
    # v2 has the same layout as v3 (u64 counts and lengths); only the version field differs.
    v2 = patched(sample, 4, struct.pack("<I", 2), tmp_path / "v2.gguf")
    f = GGUFFile(v2)
    assert f.version == 2
    assert_matches_reader(f, gguf.GGUFReader(v2))


def test_hand_built_v2_file_with_empty_arrays(tmp_path):
    data = np.arange(8, dtype=np.float32).tobytes()
    blob = build(
        [kv("a.empty_u32", VT.ARRAY, array(VT.UINT32, 0, b"")),
         kv("a.empty_str", VT.ARRAY, array(VT.STRING, 0, b"")),
         kv("a.str", VT.STRING, gstr("x"))],
        [tensor_info("t", [8], QT.F32, 0)], data, version=2)
    p = tmp_path / "v2.gguf"
    p.write_bytes(blob)
    f = GGUFFile(p)
    assert f.version == 2
    assert f.metadata["a.empty_u32"].shape == (0,) and f.metadata["a.empty_u32"].dtype == np.uint32
    assert f.metadata["a.empty_str"] == []
    np.testing.assert_array_equal(f.tensor_data("t").view(np.float32), np.arange(8, dtype=np.float32))
    assert_matches_reader(f, gguf.GGUFReader(p))


def test_custom_alignment(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), arch="llama")
    w.add_custom_alignment(64)
    w.add_tensor("a", np.ones(3, dtype=np.float32))
    w.add_tensor("b", np.ones(5, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(tmp_path / "a.gguf")
    assert f.alignment == 64 and f.data_offset % 64 == 0
    assert all(t.offset % 64 == 0 for t in f.tensors.values())
    assert_matches_reader(f, gguf.GGUFReader(tmp_path / "a.gguf"))


def test_invalid_utf8_string_value_is_returned_exactly_as_bytes(tmp_path):
    p = tmp_path / "u.gguf"
    p.write_bytes(build([kv("a.bad", VT.STRING, gstr(b"ok\xff\xfe")),
                         kv("a.arr", VT.ARRAY, array(VT.STRING, 2, gstr("fine") + gstr(b"\xc3")))], []))
    f = GGUFFile(p)
    assert f.metadata["a.bad"] == b"ok\xff\xfe"
    assert f.metadata["a.arr"] == ["fine", b"\xc3"]


def test_gguf_error_is_exported_and_a_value_error():
    assert ktd.GGUFError is ktd._native.GGUFError and issubclass(ktd.GGUFError, ValueError)


# --- files that cannot be opened --------------------------------------------------------------


def test_missing_file_is_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        GGUFFile(tmp_path / "nope.gguf")


def test_path_with_nul_byte_is_oserror(sample):
    with pytest.raises(OSError, match="NUL byte"):
        GGUFFile(str(sample) + "\0.x")


def test_directory_is_oserror(tmp_path):
    with pytest.raises(IsADirectoryError):
        GGUFFile(tmp_path)


# --- corrupt files ----------------------------------------------------------------------------


@pytest.mark.parametrize("content, expect", [
    (b"", "empty file"),
    (b"GGU", "not a GGUF file"),
    (b"GGML" + b"\0" * 60, "not a GGUF file"),
    (b"GGUF" + struct.pack("<I", 1) + b"\0" * 60, "version 1 is not supported"),
    (b"GGUF" + struct.pack("<I", 7) + b"\0" * 60, "unsupported GGUF version 7"),
    (b"GGUF" + struct.pack(">I", 3) + b"\0" * 60, "big-endian"),
    (b"GGUF" + struct.pack("<IQQ", 3, 2**60, 0), "cannot fit"),
    (b"GGUF" + struct.pack("<IQQ", 3, 0, 2**64 - 1), "cannot fit"),
])
def test_bad_header(tmp_path, content, expect):
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    with pytest.raises(ktd.GGUFError, match=expect) as e:
        GGUFFile(p)
    assert str(p) in str(e.value) and "byte offset" in str(e.value)


def test_truncation_at_every_length(sample, tmp_path):
    """Every prefix shorter than the end of the last tensor's data is rejected; longer prefixes
    (cutting only the trailing padding) are still valid."""
    raw = sample.read_bytes()
    r = gguf.GGUFReader(sample)
    data_end = max(t.data_offset + t.n_bytes for t in r.tensors)
    # Section boundaries per gguf-py: every part of every field, the data section, each tensor.
    boundaries = {part_offset(f, i) for f in [*r.fields.values(), *(t.field for t in r.tensors)]
                  for i in range(len(f.parts) + 1)}
    boundaries |= {r.data_offset} | {t.data_offset for t in r.tensors} | {t.data_offset + t.n_bytes for t in r.tensors}
    p = tmp_path / "cut.gguf"
    for n in range(len(raw)):
        p.write_bytes(raw[:n])
        if n < data_end:
            with pytest.raises(ktd.GGUFError) as e:
                GGUFFile(p)
            msg = str(e.value)
            assert "byte offset" in msg
            if n in boundaries and n < r.data_offset:
                assert re.search("truncated|exceeds|cannot fit|past the end|remain", msg), (n, msg)
        else:
            assert len(GGUFFile(p).tensors) == len(r.tensors)


def _tensor_field(r: gguf.GGUFReader, name: str) -> gguf.ReaderField:
    return next(t.field for t in r.tensors if t.name == name)


# Tensor-info parts (gguf-py): 0 name length, 1 name, 2 n_dims, 3 dims, 4 type, 5 offset.
@pytest.mark.parametrize("tensor, part, dim, value, expect", [
    ("blk.0.f16", 3, 1, struct.pack("<Q", 0), "dimension 1 = 0"),
    ("blk.0.f16", 2, None, struct.pack("<I", 0), "n_dims = 0"),
    ("blk.0.f16", 2, None, struct.pack("<I", 5), "n_dims = 5"),
    ("blk.0.f16", 4, None, struct.pack("<I", 4), "unknown GGML type id 4"),
    ("blk.0.f16", 4, None, struct.pack("<I", 1000), "unknown GGML type id 1000"),
    ("blk.0.q8_0", 3, 0, struct.pack("<Q", 33), "not a multiple of the block size 32 of Q8_0"),
    ("blk.0.i32_4d", 3, 1, struct.pack("<Q", 2**62), "element count overflows int64 at dimension 1"),
    ("blk.0.f16", 5, None, struct.pack("<Q", 32 + 8), "not a multiple of the alignment"),
    ("out.q4_k", 5, None, struct.pack("<Q", 2**20), "extends past the end of the file"),
    ("out.q4_k", 5, None, struct.pack("<Q", 2**64 - 32), "extends past the end of the file"),
    ("out.q4_k", 3, 1, struct.pack("<Q", 2), "extends past the end of the file"),
])
def test_corrupt_tensor_info(sample, tmp_path, tensor, part, dim, value, expect):
    r = gguf.GGUFReader(sample)
    field = _tensor_field(r, tensor)
    at = part_offset(field, part) + (8 * dim if dim else 0)
    p = patched(sample, at, value, tmp_path / "bad.gguf")
    with pytest.raises(ktd.GGUFError, match=expect) as e:
        GGUFFile(p)
    msg = str(e.value)
    assert f"tensor '{tensor}'" in msg
    # The offset named is the field's own, except for checks that span the whole tensor info.
    assert f"byte offset {at}" in msg or (
        "past the end" in msg and f"byte offset {part_offset(field, 5)}" in msg) or (
        "block size" in msg and f"byte offset {part_offset(field, 3)}" in msg), msg


def test_duplicate_tensor_name(tmp_path):
    first = tensor_info("same", [4], QT.F32, 0)
    p = tmp_path / "dup.gguf"
    p.write_bytes(build([], [first, tensor_info("same", [4], QT.F32, 32)], b"\0" * 64))
    with pytest.raises(ktd.GGUFError, match=f"tensor 'same': duplicate tensor name at byte offset {24 + len(first)}"):
        GGUFFile(p)


def test_overlapping_tensor_data(tmp_path):
    # a: bytes [0, 64) of the data section; b: [32, 64).
    first, second = tensor_info("a", [16], QT.F32, 0), tensor_info("b", [8], QT.F32, 32)
    p = tmp_path / "overlap.gguf"
    p.write_bytes(build([], [first, second], b"\0" * 128))
    b_offset_field = 24 + len(first) + len(second) - 8
    with pytest.raises(ktd.GGUFError, match=f"tensor 'b': data at .* overlaps tensor 'a' .* at byte offset {b_offset_field}"):
        GGUFFile(p)
    # Back to back is fine.
    p.write_bytes(build([], [first, tensor_info("b", [8], QT.F32, 64)], b"\0" * 128))
    assert list(GGUFFile(p).tensors) == ["a", "b"]


def test_duplicate_key(tmp_path):
    p = tmp_path / "dup.gguf"
    first = kv("a.k", VT.UINT8, b"\1")
    p.write_bytes(build([first, kv("a.k", VT.UINT8, b"\2")], []))
    with pytest.raises(ktd.GGUFError, match=f"key 'a.k': duplicate key at byte offset {24 + len(first)}"):
        GGUFFile(p)


# Key/value parts (gguf-py): 0 key length, 1 key, 2 type, then the value's parts.
@pytest.mark.parametrize("key, part, value, expect", [
    ("test.u32", 2, struct.pack("<I", 13), "unknown value type 13"),
    ("test.bool_true", 3, b"\x02", "BOOL value is 2"),
    ("test.str", 3, struct.pack("<Q", 2**62), "STRING value length 4611686018427387904 exceeds"),
    ("test.arr_u32", 3, struct.pack("<I", 99), "unknown array element type 99"),
    ("test.arr_u32", 4, struct.pack("<Q", 2**61), "array length 2305843009213693952 of UINT32"),
    ("test.arr_u64", 4, struct.pack("<Q", 2**64 - 1), "array length 18446744073709551615 of UINT64"),
    ("test.arr_str", 4, struct.pack("<Q", 2**40), "array length 1099511627776 of STRING"),
    ("test.arr_str", 5, struct.pack("<Q", 2**40), "array string length 1099511627776 exceeds"),
    ("test.arr_bool", 5, b"\x07", "array element 0 is BOOL but holds 7"),
    ("test.nested_int", 4, struct.pack("<Q", 2**59), "array length 576460752303423488 of ARRAY"),
    ("test.nested_int", 5, struct.pack("<I", 42), "unknown array element type 42"),
])
def test_corrupt_key_value(sample, tmp_path, key, part, value, expect):
    r = gguf.GGUFReader(sample)
    at = part_offset(r.fields[key], part)
    p = patched(sample, at, value, tmp_path / "bad.gguf")
    with pytest.raises(ktd.GGUFError, match=expect) as e:
        GGUFFile(p)
    assert f"key '{key}'" in str(e.value) and f"byte offset {at}" in str(e.value), str(e.value)


def test_key_length_past_end(sample, tmp_path):
    r = gguf.GGUFReader(sample)
    at = r.fields["test.u8"].offset
    p = patched(sample, at, struct.pack("<Q", 2**63), tmp_path / "bad.gguf")
    with pytest.raises(ktd.GGUFError, match=f"metadata key #1: key length 9223372036854775808 exceeds .* at byte offset {at}"):
        GGUFFile(p)


def test_invalid_utf8_key_and_tensor_name(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(build([kv(b"a.\xff", VT.UINT8, b"\1")], []))
    with pytest.raises(ktd.GGUFError, match=r"key 'a.\\xff' is not valid UTF-8 at byte offset 24"):
        GGUFFile(p)
    p.write_bytes(build([], [gstr(b"\xc0\x80") + struct.pack("<IQIQ", 1, 4, 0, 0)], b"\0" * 16))
    with pytest.raises(ktd.GGUFError, match="tensor name .* is not valid UTF-8"):
        GGUFFile(p)


@pytest.mark.parametrize("payload, vtype, expect", [
    (struct.pack("<I", 48), VT.UINT32, "alignment 48 is not a power of two"),
    (struct.pack("<I", 0), VT.UINT32, "alignment 0 is not a power of two"),
    (struct.pack("<Q", 32), VT.UINT64, "must be UINT32, not UINT64"),
])
def test_bad_alignment(tmp_path, payload, vtype, expect):
    p = tmp_path / "bad.gguf"
    p.write_bytes(build([kv("general.alignment", vtype, payload)], []))
    with pytest.raises(ktd.GGUFError, match=f"key 'general.alignment': {expect}"):
        GGUFFile(p)


def test_arrays_nested_too_deep(tmp_path):
    def nest(depth: int) -> bytes:
        # depth - 1 arrays of one array each, around an array of one UINT8.
        return array(VT.ARRAY, 1, b"") * (depth - 1) + array(VT.UINT8, 1, b"\7")

    p = tmp_path / "deep.gguf"
    p.write_bytes(build([kv("a.deep", VT.ARRAY, nest(8))], []))
    assert ktd_value(GGUFFile(p).metadata["a.deep"]) == [[[[[[[[7]]]]]]]]
    p.write_bytes(build([kv("a.deep", VT.ARRAY, nest(9))], []))
    with pytest.raises(ktd.GGUFError, match="key 'a.deep': arrays nested more than 8 deep"):
        GGUFFile(p)
    # A deep nest that would blow the stack without the bound: still a clean error.
    p.write_bytes(build([kv("a.deep", VT.ARRAY, nest(100_000))], []))
    with pytest.raises(ktd.GGUFError, match="nested more than 8 deep"):
        GGUFFile(p)


# --- the real models --------------------------------------------------------------------------

REAL_MODELS = ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m"]


@pytest.mark.slow  # gguf-py's reader takes tens of seconds on a 150k-token vocabulary
@pytest.mark.realmodel
@pytest.mark.parametrize("name", REAL_MODELS)
def test_real_model_matches_gguf_reader(real_model, real_model_reader, name):
    path = real_model(name)
    f = GGUFFile(path, willneed=False)
    r = real_model_reader(name)
    assert f.file_size == path.stat().st_size
    assert_matches_reader(f, r, check_data=False)
    # Spot-check the bytes of the first, a middle and the last tensor (all of them would read the
    # whole file).
    for t in (r.tensors[0], r.tensors[len(r.tensors) // 2], r.tensors[-1]):
        assert np.array_equal(f.tensor_data(t.name), t.data.reshape(-1).view(np.uint8))


def test_mapping_is_read_only_and_advised_for_huge_pages(sample):
    """The kernel's own view of the mapping (/proc/self/smaps): read-only, private, and marked
    MADV_HUGEPAGE ("hg" in VmFlags)."""
    if not Path("/sys/kernel/mm/transparent_hugepage").exists():
        pytest.skip("this kernel has no transparent huge pages, so MADV_HUGEPAGE cannot be observed")
    f = GGUFFile(sample)
    lines = Path("/proc/self/smaps").read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.endswith(" " + str(sample))]
    assert len(starts) == 1, "exactly one mapping of the file"
    assert lines[starts[0]].split()[1] == "r--p"
    flags = next(line for line in lines[starts[0]:] if line.startswith("VmFlags:")).split()[1:]
    assert "hg" in flags and "wr" not in flags
    del f
