// Element-wise gated activations (the FFN's act(gate) ⊙ up) per ISA, registered at load time like
// the attention kernels (KTD_REGISTER_GLU); the scalar reference is the specification. Every
// element is computed by the same formula whatever its index (the SIMD kernels handle the tail
// with masked loads, not a scalar loop), so splitting an array between threads never changes a bit.
#pragma once
#include <cstdint>

#include "kernels/kernels.h"

namespace ktd {

// In place, for i < n:
//   SwiGLU: a[i] = silu(a[i]) · b[i] = a[i] / (1 + e^-a[i]) · b[i]
//   GeGLU:  a[i] = gelu_tanh(a[i]) · b[i], gelu_tanh(x) = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
//           (Gemma's gelu_pytorch_tanh; computed as x / (1 + e^(-2u)), the same function, which
//           keeps full relative precision for negative x where 1 + tanh(u) cancels)
//   ReLU2:  a[i] = max(a[i], 0)² · b[i]  (BitNet b1.58 2B4T)
enum class Glu { SwiGLU, GeGLU, ReLU2 };
inline constexpr int kNumGlu = 3;
const char *glu_name(Glu g);  // "swiglu", "geglu", "relu2glu"

using GluKernel = void (*)(float *a, const float *b, int64_t n);
using SwigluKernel = GluKernel;

void register_glu_kernel(Glu glu, Isa isa, GluKernel fn);
GluKernel find_glu_kernel(Glu glu, Isa isa);  // nullptr if none for isa
// The active ISA's (AVX-512 falls back to AVX2, then to the reference).
GluKernel glu_kernel(Glu glu);

inline SwigluKernel find_swiglu_kernel(Isa isa) { return find_glu_kernel(Glu::SwiGLU, isa); }
inline SwigluKernel swiglu_kernel() { return glu_kernel(Glu::SwiGLU); }

}  // namespace ktd

#define KTD_REGISTER_GLU(glu, isa, fn)                                   \
    static const bool KTD_CONCAT(ktd_glu_registered_, __LINE__) = [] {   \
        ::ktd::register_glu_kernel(glu, isa, fn);                        \
        return true;                                                     \
    }()
