"""``python -m ktd.bench.kernels``: the type names it accepts (any case, as llama.cpp's tools and
gguf-py spell them) and its errors."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType

from ktd import _native
from ktd.bench import kernels as bk

K = _native.kernels
ISA = K.active_isa()


def test_type_names_in_any_case():
    assert "Q4_K" in K.supported_types(ISA)
    assert bk.resolve_types(["q4_k"], ISA) == ["Q4_K"]
    assert bk.resolve_types(["Q4_K", "q6_K", "q4_k", "f32"], ISA) == ["Q4_K", "Q6_K", "F32"]


def test_unknown_and_unsupported_types_are_named():
    with pytest.raises(ValueError, match=r"not a GGML type: q9_x") as e:
        bk.resolve_types(["q4_k", "q9_x"], ISA)
    assert "Q4_K" in str(e.value)  # lists what is supported
    missing = [t.name for t in GGMLQuantizationType if t.name not in K.supported_types(ISA)]
    assert missing  # e.g. Q8_K (an activation format) has no matmul kernels
    with pytest.raises(ValueError, match=f"no {ISA} kernels for: {missing[0]}"):
        bk.resolve_types([missing[0].lower()], ISA)


def test_main_rejects_a_bad_type_before_timing(capsys, tmp_path):
    assert bk.main(["--types", "nope", "--out", str(tmp_path / "k.json")]) == 1
    assert "not a GGML type: nope" in capsys.readouterr().err
    assert not (tmp_path / "k.json").exists()
