"""Independent oracle for the kernel tests: gguf-py's dequantizer + a float64 matmul."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType, GGML_QUANT_SIZES
from gguf.quants import dequantize


def qtype(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name]


def row_bytes(name: str, k: int) -> int:
    blck, size = GGML_QUANT_SIZES[qtype(name)]
    assert k % blck == 0
    return k // blck * size


def dequantize_ref(name: str, w: np.ndarray, rows: int, k: int) -> np.ndarray:
    """gguf-py's dequantization of [rows, k] weights (uint8 bytes) -> float64 [rows, k]."""
    raw = np.ascontiguousarray(w, dtype=np.uint8).reshape(rows, row_bytes(name, k))
    return dequantize(raw, qtype(name)).astype(np.float64).reshape(rows, k)


def matmul_ref(name: str, w: np.ndarray, rows: int, k: int, x: np.ndarray) -> np.ndarray:
    """Y[n, rows] = X[n, k] @ W[rows, k]^T in float64 from gguf-py's dequantization."""
    return x.astype(np.float64) @ dequantize_ref(name, w, rows, k).T


def nmse(y: np.ndarray, ref: np.ndarray) -> float:
    """Normalised squared error sum((y-ref)^2) / sum(ref^2)."""
    ref = ref.astype(np.float64)
    den = float(np.sum(ref * ref))
    return float(np.sum((y.astype(np.float64) - ref) ** 2)) / (den if den > 0 else 1.0)
