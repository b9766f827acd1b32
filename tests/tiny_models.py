"""The tiny generated models the tests share (conftest.py's session fixture ``tiny_model``): each
distinct file is written once per test session into one temporary directory, by the generators
of tests/models (tiny_dense for the dense architectures, synthetic_moe for the MoE ones and
Mixtral = llama with experts, synthetic_moe.make_dynamic_iq for i-quant expert stacks).

The files are shared: a test that changes, replaces or deletes its model file writes its own
copy with the generator instead.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from models import synthetic_moe, tiny_dense

# Weight types synthetic_moe writes itself; the others come from llama.cpp's quantizer.
MOE_DIRECT_WTYPES = ("F32", "F16", "BF16", "Q8_0")


class TinyModels:
    """``tiny_model(arch, wtype="F32", *, variant=None, seed=0, moe=None, expert_types=None, **cfg)``
    -> the path of that model, written on first use.

    moe: the MoE generator (default: for the architectures tiny_dense does not have; llama with
    moe=True is Mixtral). cfg: MoeConfig fields replaced in the tiny preset (MoE only).
    expert_types: {expert tensor suffix: i-quant type} replaces the routed expert stacks of the
    ``wtype`` file by random i-quant blocks (synthetic_moe.make_dynamic_iq)."""

    def __init__(self, root: Path):
        self.root = root
        self.made: dict[tuple, Path] = {}

    def __call__(self, arch: str, wtype: str = "F32", *, variant: str | None = None, seed: int = 0,
                 moe: bool | None = None, expert_types: dict[str, str] | None = None, **cfg) -> Path:
        moe = arch not in tiny_dense.ARCHS if moe is None else moe
        if not moe and (cfg or expert_types):
            raise ValueError(f"cfg {sorted(cfg)} and expert_types are for the MoE generator, not dense {arch}")
        key = (arch, wtype, variant, seed, moe, tuple(sorted((expert_types or {}).items())), tuple(sorted(cfg.items())))
        if key not in self.made:
            self.made[key] = self._write(len(self.made), arch, wtype, variant, seed, moe, expert_types, cfg)
        return self.made[key]

    def _write(self, index: int, arch: str, wtype: str, variant: str | None, seed: int, moe: bool,
               expert_types: dict[str, str] | None, cfg: dict) -> Path:
        if not moe:
            path = self.root / tiny_dense.model_filename(arch, wtype, seed, variant)
            return tiny_dense.make_model(arch, path, wtype=wtype, seed=seed, variant=variant)
        if wtype not in MOE_DIRECT_WTYPES:
            pytest.importorskip("llama_cpp", reason=f"{wtype} files need llama.cpp's quantizer (tools/oracle.sh "
                                "installs llama-cpp-python)")
        variant = variant or synthetic_moe.default_variant(arch)
        base = synthetic_moe.config(arch, "tiny", variant)
        config = dataclasses.replace(base, **cfg) if cfg else base
        # index: files of the same arch, type and variant with other cfg or expert types
        path = self.root / f"synthetic-{arch}{'-' + variant if variant else ''}-{wtype}-s{seed}-{index}.gguf"
        if expert_types is not None:
            return synthetic_moe.make_dynamic_iq(arch, path, cfg=config, seed=seed, expert_types=expert_types,
                                                 base_wtype=wtype)
        return synthetic_moe.make_model(arch, path, wtype=wtype, seed=seed, variant=variant, cfg=config)


def k_quant_widths(arch: str) -> dict:
    """MoeConfig fields that widen a tiny MoE model to rows of 256 (one K-quant block per row), so
    that llama.cpp's Q4_K_M mixes Q4_K, Q5_K, Q6_K, Q8_0 and F16 tensors in it: the experts'
    gate/up and down (and the shared expert) then use different activation formats."""
    return dict(n_embd=256, n_head=4, n_embd_head=64, n_ff=256, n_ff_exp=256 if arch != "llama" else 0,
                n_ff_shexp=256 if arch == "qwen2moe" else 0)
