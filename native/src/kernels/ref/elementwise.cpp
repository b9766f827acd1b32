// The element-wise activations' specification (kernels/elementwise.h).
#include <algorithm>
#include <cmath>

#include "kernels/elementwise.h"

namespace ktd::ref {

namespace {

constexpr float kSqrt2OverPi = 0.79788456080286535588f;
constexpr float kGeluCoefA = 0.044715f;

void swiglu(float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; ++i) a[i] = a[i] / (1.0f + std::exp(-a[i])) * b[i];
}

void geglu(float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        const float x = a[i];
        // 0.5·(1 + tanh(u)) = 1 / (1 + e^(-2u)); u = √(2/π)·x·(1 + 0.044715·x²)
        const float u2 = -2.0f * kSqrt2OverPi * x * (1.0f + kGeluCoefA * x * x);
        a[i] = x / (1.0f + std::exp(u2)) * b[i];
    }
}

void relu2glu(float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        const float r = std::max(a[i], 0.0f);
        a[i] = r * r * b[i];
    }
}

}  // namespace

KTD_REGISTER_GLU(Glu::SwiGLU, Isa::Ref, swiglu);
KTD_REGISTER_GLU(Glu::GeGLU, Isa::Ref, geglu);
KTD_REGISTER_GLU(Glu::ReLU2, Isa::Ref, relu2glu);

}  // namespace ktd::ref
