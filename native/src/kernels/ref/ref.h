// Shared pieces of the scalar reference kernels.
#pragma once
#include <cstddef>
#include <cstdint>

namespace ktd::ref {

// Activation quantizers (the specification of the activation formats).
void quantize_row_q8_0(const float *x, void *y, int64_t k);  // k % 32 == 0 → block_q8_0[k/32]
void quantize_row_q8_K(const float *x, void *y, int64_t k);  // k % 256 == 0 → block_q8_K[k/256]
// The F32 "activation format" of the float weight types: a plain copy of the row.
void copy_row_f32(const float *x, void *y, int64_t k);

// The reference tile: every output element is one row·activation dot product, in order.
// VecDot: float(int64_t k, const WBlock *w_row, const ABlock *act_row).
template <typename WBlock, typename ABlock, float (*VecDot)(int64_t, const WBlock *, const ABlock *)>
void gemm_rows(int64_t k, const void *w, size_t w_stride, const void *xq, size_t x_stride, float *y,
               size_t ldy, int nr, int nc) {
    for (int c = 0; c < nc; ++c)
        for (int r = 0; r < nr; ++r)
            y[size_t(c) * ldy + size_t(r)] = VecDot(
                k, reinterpret_cast<const WBlock *>(static_cast<const char *>(w) + size_t(r) * w_stride),
                reinterpret_cast<const ABlock *>(static_cast<const char *>(xq) + size_t(c) * x_stride));
}

}  // namespace ktd::ref
