// The element-wise activations' specification (kernels/elementwise.h).
#include <cmath>

#include "kernels/elementwise.h"

namespace ktd::ref {

namespace {

void swiglu(float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; ++i) a[i] = a[i] / (1.0f + std::exp(-a[i])) * b[i];
}

}  // namespace

KTD_REGISTER_SWIGLU(Isa::Ref, swiglu);

}  // namespace ktd::ref
