// Element-wise activation kernels per ISA, registered at load time like the attention kernels
// (KTD_REGISTER_SWIGLU); the scalar reference is the specification. Every element is computed by
// the same formula whatever its index (the SIMD kernels handle the tail with masked loads, not a
// scalar loop), so splitting an array between threads never changes a bit.
#pragma once
#include <cstdint>

#include "kernels/kernels.h"

namespace ktd {

// In place: a[i] = silu(a[i]) · b[i] = a[i] / (1 + e^-a[i]) · b[i] for i < n  (SwiGLU)
using SwigluKernel = void (*)(float *a, const float *b, int64_t n);

void register_swiglu_kernel(Isa isa, SwigluKernel fn);
SwigluKernel find_swiglu_kernel(Isa isa);  // nullptr if none for isa
// The active ISA's (AVX-512 falls back to AVX2, then to the reference).
SwigluKernel swiglu_kernel();

}  // namespace ktd

#define KTD_REGISTER_SWIGLU(isa, fn)                                       \
    static const bool KTD_CONCAT(ktd_swiglu_registered_, __LINE__) = [] {  \
        ::ktd::register_swiglu_kernel(isa, fn);                            \
        return true;                                                       \
    }()
