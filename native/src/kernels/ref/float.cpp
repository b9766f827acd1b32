// Float weights F32, F16 and BF16, scalar reference. Activations stay F32 for all three: the
// weights already carry ≥ 8 mantissa bits, so quantizing activations would add error without
// saving bandwidth (activations are a tiny fraction of the bytes streamed), and FMA on F32 is
// the natural inner loop once F16/BF16 are widened in registers.
#include <cstring>

#include "common/float16.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"

namespace ktd::ref {

void copy_row_f32(const float *x, void *y, int64_t k) { std::memcpy(y, x, size_t(k) * sizeof(float)); }

namespace {
inline float load_f32(const float *w, int64_t i) { return w[i]; }
inline float load_f16(const uint16_t *w, int64_t i) { return fp16_to_fp32(w[i]); }
inline float load_bf16(const uint16_t *w, int64_t i) { return bf16_to_fp32(w[i]); }

template <typename T, float (*Load)(const T *, int64_t)>
void dequantize_row(const void *vx, float *y, int64_t k) {
    const T *x = static_cast<const T *>(vx);
    for (int64_t i = 0; i < k; ++i) y[i] = Load(x, i);
}

template <typename T, float (*Load)(const T *, int64_t)>
float vec_dot(int64_t k, const T *w, const float *a) {
    float sum = 0.0f;
    for (int64_t i = 0; i < k; ++i) sum += Load(w, i) * a[i];
    return sum;
}
}  // namespace

KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::F32, GGMLType::F32, dequantize_row<float, load_f32>,
                                           copy_row_f32, gemm_rows<float, float, vec_dot<float, load_f32>>});
KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::F16, GGMLType::F32, dequantize_row<uint16_t, load_f16>,
                                           copy_row_f32,
                                           gemm_rows<uint16_t, float, vec_dot<uint16_t, load_f16>>});
KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{GGMLType::BF16, GGMLType::F32, dequantize_row<uint16_t, load_bf16>,
                                           copy_row_f32,
                                           gemm_rows<uint16_t, float, vec_dot<uint16_t, load_bf16>>});

}  // namespace ktd::ref
