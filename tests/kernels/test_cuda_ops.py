"""The CUDA backend's non-matrix kernels (native/src/cuda/ops.cu): RMSNorm, rotary embedding with
linear and YaRN scaling, SwiGLU/GeGLU, residual add, decode attention over an F16 KV cache (GQA).

Without a GPU: their arithmetic (cuda/ops_math.h, the __host__ __device__ code the kernels run,
compiled here for the CPU) against numpy's transcription of llama.cpp's rope/YaRN formulas, and
bit for bit against the CPU forward's rope_cos_sin (kernels/rope.cpp). With a GPU (`gpu` marker;
they skip with cuda_status()'s reason otherwise): every kernel against numpy in float64.
Tolerances: the device's cosf/sinf/expf/tanhf differ from glibc's by a few ulp; the rotation is
checked against the CPU forward's float32 angles (at position 4000 float32 angles differ from
float64 ones by up to ~1e-3 rad, for the CPU and llama.cpp alike)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ktd import _native

CM = _native.cuda_math

ROPES = {
    "neox": {"n_rot": 64, "neox": True, "freq_base": 1e6},
    "norm": {"n_rot": 32, "neox": False, "freq_base": 10000.0},
    "linear": {"n_rot": 64, "neox": True, "freq_base": 10000.0, "freq_scale": 0.25},
    "yarn": {"n_rot": 64, "neox": True, "freq_base": 10000.0, "freq_scale": 0.25, "yarn": True,
             "n_ctx_orig": 4096, "ext_factor": 1.0, "attn_factor": 1.0, "beta_fast": 32.0, "beta_slow": 1.0},
    "yarn_deepseek": {"n_rot": 64, "neox": False, "freq_base": 10000.0, "freq_scale": 1 / 40, "yarn": True,
                      "n_ctx_orig": 4096, "ext_factor": 1.0, "attn_factor": 1.1, "beta_fast": 32.0, "beta_slow": 1.0},
}


def rope_ref(p: dict, pos: int, ff: np.ndarray | None = None) -> np.ndarray:
    """llama.cpp's rope_yarn (ggml-cpu ops.cpp) in float64: theta_extrap = pos·base^(-2i/n_rot)/ff_i,
    interp = freq_scale·extrap, YaRN ramp between the correction dims, mscale·(1 + 0.1 ln(1/s))."""
    n_rot = p["n_rot"]
    base, s = p.get("freq_base", 10000.0), p.get("freq_scale", 1.0)
    yarn = p.get("yarn", False) and p.get("ext_factor", 0.0) != 0.0
    mscale = p.get("attn_factor", 1.0)
    lo = hi = 0.0
    if yarn:
        def corr(beta):
            return n_rot * math.log(p["n_ctx_orig"] / (beta * 2 * math.pi)) / (2 * math.log(base))
        lo = max(0.0, math.floor(corr(p["beta_fast"])))
        hi = min(n_rot - 1.0, math.ceil(corr(p["beta_slow"])))
        mscale *= 1 + 0.1 * math.log(1 / s)
    out = np.empty(n_rot)
    for i in range(n_rot // 2):
        extrap = pos * base ** (-2 * i / n_rot) / (ff[i] if ff is not None else 1.0)
        theta = s * extrap
        if yarn:
            y = (i - lo) / max(0.001, hi - lo)
            mix = (1 - min(1.0, max(0.0, y))) * p["ext_factor"]
            theta = theta * (1 - mix) + extrap * mix
        out[2 * i], out[2 * i + 1] = math.cos(theta) * mscale, math.sin(theta) * mscale
    return out


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("pos", [0, 1, 17, 4095, 30000])
def test_rope_angles_match_llama_cpp_and_the_cpu_forward(name, pos):
    p = ROPES[name]
    ff = np.linspace(1.0, 8.0, p["n_rot"] // 2).astype(np.float32) if name == "neox" else None
    got = CM.rope_cos_sin(p, pos, ff)
    cpu = CM.rope_cos_sin(p, pos, ff, cpu_forward=True)
    np.testing.assert_array_equal(got.view(np.uint32), cpu.view(np.uint32))
    # float32 angles, as llama.cpp computes them: θ_i = pos·scale^i by repeated multiplication
    # carries about (i + 2) float32 roundings of a value <= pos, so |Δθ| <= eps32·pos·(n_rot/2 + 2);
    # cos/sin move by at most that, times mscale. Tight at small positions, where a wrong ramp or
    # mscale would show.
    want = rope_ref(p, pos, ff)
    mscale = np.max(np.abs(want.reshape(-1, 2)).sum(axis=1)) if pos else 1.0
    tol = (2.0 ** -23 * max(pos, 1) * (p["n_rot"] // 2 + 2) + 1e-6) * max(1.0, mscale)
    assert np.max(np.abs(got - want)) <= tol, (np.max(np.abs(got - want)), tol)


def test_rope_bad_params_are_clear_errors():
    with pytest.raises(ValueError, match="n_rot must be even"):
        CM.rope_cos_sin({"n_rot": 7}, 0)
    with pytest.raises(ValueError, match="YaRN needs n_ctx_orig"):
        CM.rope_cos_sin({"n_rot": 8, "yarn": True}, 0)
    with pytest.raises(ValueError, match="freq_factors must have n_rot/2"):
        CM.rope_cos_sin({"n_rot": 8}, 0, np.ones(3, np.float32))


def _gpu_or_skip():
    st = _native.cuda_status()
    if not st["available"]:
        pytest.skip(f"no usable CUDA device: {st['reason']}")


def test_gpu_entry_points_without_a_device_say_why():
    st = _native.cuda_status()
    if st["available"]:
        pytest.skip("a CUDA device is usable here (this checks the error without one)")
    for call in (lambda: CM.gpu_rmsnorm(np.ones((1, 32), np.float32)),
                 lambda: CM.gpu_rope({"n_rot": 8}, np.zeros(1, np.int32), np.ones((1, 1, 8), np.float32)),
                 lambda: CM.gpu_glu("silu", np.ones(4, np.float32), np.ones(4, np.float32)),
                 lambda: CM.gpu_add(np.ones(4, np.float32), np.ones(4, np.float32)),
                 lambda: CM.gpu_attention(np.ones((2, 8), np.float32), np.ones((3, 1, 8), np.uint16),
                                          np.ones((3, 1, 8), np.uint16), 1.0)):
        with pytest.raises(RuntimeError) as e:
            call()
        # the library loaded, so the failure is the runtime's (no driver here), with its name
        assert "cudaErrorInsufficientDriver" in str(e.value) or "cudaErrorNoDevice" in str(e.value) \
            or str(e.value) == st["reason"], str(e.value)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [64, 896, 4096, 7168])
def test_gpu_rmsnorm(n):
    _gpu_or_skip()
    rng = np.random.default_rng(n)
    x = rng.standard_normal((3, n)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, n).astype(np.float32)
    got = CM.gpu_rmsnorm(x, w, 1e-6)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(CM.gpu_rmsnorm(x, None, 1e-6), want / w, rtol=2e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ROPES))
def test_gpu_rope(name):
    _gpu_or_skip()
    p = ROPES[name]
    rng = np.random.default_rng(3)
    n_tok, n_heads, hd = 5, 4, p["n_rot"] + 16       # dims past n_rot stay as they are
    x = rng.standard_normal((n_tok, n_heads, hd)).astype(np.float32)
    pos = np.array([0, 1, 7, 511, 4000], np.int32)
    got = CM.gpu_rope(p, pos, x)
    want = x.astype(np.float64).copy()
    half = p["n_rot"] // 2
    for t in range(n_tok):
        # the CPU forward's float32 angles (checked against llama.cpp's formula above): the GPU
        # must rotate by those; what is left is the device's cosf/sinf and float rounding
        cs = CM.rope_cos_sin(p, int(pos[t]), cpu_forward=True).astype(np.float64)
        for i in range(half):
            a, b = (i, i + half) if p["neox"] else (2 * i, 2 * i + 1)
            x0, x1 = want[t, :, a].copy(), want[t, :, b].copy()
            want[t, :, a] = x0 * cs[2 * i] - x1 * cs[2 * i + 1]
            want[t, :, b] = x0 * cs[2 * i + 1] + x1 * cs[2 * i]
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    np.testing.assert_array_equal(got[..., p["n_rot"]:], x[..., p["n_rot"]:])


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "gelu", "relu2"])
def test_gpu_glu_and_add(act):
    _gpu_or_skip()
    rng = np.random.default_rng(1)
    a = (rng.standard_normal(10000) * 4).astype(np.float32)
    b = rng.standard_normal(10000).astype(np.float32)
    a64 = a.astype(np.float64)
    if act == "silu":
        want = a64 / (1 + np.exp(-a64)) * b
    elif act == "relu2":
        want = np.maximum(a64, 0) ** 2 * b
    else:
        want = 0.5 * a64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (a64 + 0.044715 * a64 ** 3))) * b
    np.testing.assert_allclose(CM.gpu_glu(act, a, b), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(CM.gpu_add(a, b), a + b)


@pytest.mark.gpu
@pytest.mark.parametrize("n_head, n_head_kv, hd, n_kv", [(14, 2, 64, 1), (14, 2, 64, 300), (8, 8, 128, 77),
                                                         (16, 1, 256, 40)])
def test_gpu_attention_decode(n_head, n_head_kv, hd, n_kv):
    _gpu_or_skip()
    rng = np.random.default_rng(n_kv)
    q = rng.standard_normal((n_head, hd)).astype(np.float32)
    k = rng.standard_normal((n_kv, n_head_kv, hd)).astype(np.float16)
    v = rng.standard_normal((n_kv, n_head_kv, hd)).astype(np.float16)
    scale = 1 / math.sqrt(hd)
    got = CM.gpu_attention(q, k.view(np.uint16), v.view(np.uint16), scale)
    group = n_head // n_head_kv
    want = np.empty((n_head, hd))
    for h in range(n_head):
        kh, vh = k[:, h // group].astype(np.float64), v[:, h // group].astype(np.float64)
        s = kh @ q[h].astype(np.float64) * scale
        p = np.exp(s - s.max())
        want[h] = p @ vh / p.sum()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
