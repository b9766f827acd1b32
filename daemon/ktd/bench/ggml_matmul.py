"""llama.cpp's own matrix multiply (ggml's CPU backend, from llama-cpp-python's bundled libggml),
timed on the same weight bytes, shapes and thread counts as ktd's kernels, for the side-by-side
columns of ``python -m ktd.bench.kernels``.

Only a benchmark aid: llama-cpp-python is a development dependency (tools/oracle.sh), so
:func:`load` returns None with the reason when it is missing. The ggml calls used are its public C
API (ggml.h, ggml-cpu.h): ggml_init, ggml_new_tensor_2d, ggml_get_data, ggml_mul_mat,
ggml_new_graph, ggml_build_forward_expand, ggml_graph_compute_with_ctx, ggml_free.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


GGML_TYPE_F32 = 0


class GGMLMatmul:
    def __init__(self, lib_dir: Path):
        self.base = ctypes.CDLL(str(lib_dir / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(lib_dir / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        b, c = self.base, self.cpu
        b.ggml_init.argtypes, b.ggml_init.restype = [_InitParams], vp
        b.ggml_free.argtypes, b.ggml_free.restype = [vp], None
        b.ggml_new_tensor_2d.argtypes, b.ggml_new_tensor_2d.restype = [vp, ctypes.c_int, i64, i64], vp
        b.ggml_get_data.argtypes, b.ggml_get_data.restype = [vp], vp
        b.ggml_mul_mat.argtypes, b.ggml_mul_mat.restype = [vp, vp, vp], vp
        b.ggml_new_graph.argtypes, b.ggml_new_graph.restype = [vp], vp
        b.ggml_build_forward_expand.argtypes, b.ggml_build_forward_expand.restype = [vp, vp], None
        c.ggml_graph_compute_with_ctx.argtypes, c.ggml_graph_compute_with_ctx.restype = [vp, vp, ctypes.c_int], ctypes.c_int
        if hasattr(c, "ggml_cpu_init"):
            c.ggml_cpu_init.argtypes, c.ggml_cpu_init.restype = [], None
            c.ggml_cpu_init()

    def _graph(self, type_id: int, w: np.ndarray, rows: int, k: int, x: np.ndarray, threads: int, n_computes: int):
        w = np.ascontiguousarray(w, dtype=np.uint8)
        x = np.ascontiguousarray(x, dtype=np.float32)
        n = x.shape[0]
        # weights, activations, output, and per computation the work buffer ggml carves from the
        # context (quantized activations, per-thread padding)
        work = n * k * 2 + threads * (1 << 16) + (1 << 20)
        mem = w.nbytes + n * k * 4 + n * rows * 4 + (n_computes + 2) * work + (16 << 20)
        ctx = self.base.ggml_init(_InitParams(mem, None, False))
        if not ctx:
            raise MemoryError(f"ggml_init({mem} bytes) failed")
        a = self.base.ggml_new_tensor_2d(ctx, type_id, k, rows)
        ctypes.memmove(self.base.ggml_get_data(a), w.ctypes.data, w.nbytes)
        xt = self.base.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n)
        ctypes.memmove(self.base.ggml_get_data(xt), x.ctypes.data, x.nbytes)
        y = self.base.ggml_mul_mat(ctx, a, xt)
        gf = self.base.ggml_new_graph(ctx)
        self.base.ggml_build_forward_expand(gf, y)
        return ctx, gf, y

    def _compute(self, ctx, gf, threads: int) -> None:
        status = self.cpu.ggml_graph_compute_with_ctx(ctx, gf, threads)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute_with_ctx returned {status}")

    def matmul(self, type_id: int, w: np.ndarray, rows: int, k: int, x: np.ndarray, threads: int = 1) -> np.ndarray:
        """Y [n × rows] = X [n × k] · Wᵀ as llama.cpp computes it (W: rows of ggml type `type_id`)."""
        ctx, gf, y = self._graph(type_id, w, rows, k, x, threads, 1)
        try:
            self._compute(ctx, gf, threads)
            out = np.empty((x.shape[0], rows), np.float32)
            ctypes.memmove(out.ctypes.data, self.base.ggml_get_data(y), out.nbytes)
            return out
        finally:
            self.base.ggml_free(ctx)

    def time_matmul(self, type_id: int, w: np.ndarray, rows: int, k: int, n: int, threads: int, reps: int) -> float:
        """Best wall time in seconds of ggml_mul_mat(W [rows × k] of ggml type `type_id`, X [n × k]
        F32) over `reps` graph computations (each computation also quantizes X, as ktd's does)."""
        xs = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
        ctx, gf, _ = self._graph(type_id, w, rows, k, xs, threads, reps)
        try:
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                self._compute(ctx, gf, threads)
                best = min(best, time.perf_counter() - t0)
            return best
        finally:
            self.base.ggml_free(ctx)


def load() -> tuple[GGMLMatmul | None, str]:
    """(the ggml matmul, "") or (None, why not)."""
    try:
        import llama_cpp
    except ImportError as e:
        return None, f"llama-cpp-python is not installed ({e}; tools/oracle.sh installs it)"
    lib_dir = Path(llama_cpp.__file__).resolve().parent / "lib"
    if not (lib_dir / "libggml-cpu.so").exists():
        return None, f"no libggml-cpu.so in {lib_dir}"
    try:
        return GGMLMatmul(lib_dir), ""
    except (OSError, AttributeError) as e:
        return None, f"cannot load ggml from {lib_dir}: {e}"
