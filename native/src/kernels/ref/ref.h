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

// The reference tile (the specification; no blocking): y[c·ldy + r] = VecDot(k, W row r,
// activation row c) for r < nr, c < nc, each output one dot product.
template <typename WBlock, typename ABlock, float (*VecDot)(int64_t, const WBlock *, const ABlock *)>
void gemm_rows(int64_t k, const void *w, size_t w_stride, const void *xq, size_t x_stride, float *y,
               size_t ldy, int nr, int nc) {
    for (int c = 0; c < nc; ++c)
        for (int r = 0; r < nr; ++r)
            y[size_t(c) * ldy + size_t(r)] = VecDot(
                k, reinterpret_cast<const WBlock *>(static_cast<const char *>(w) + size_t(r) * w_stride),
                reinterpret_cast<const ABlock *>(static_cast<const char *>(xq) + size_t(c) * x_stride));
}

// The reference tile on a row-interleaved layout of R rows per group (wp = the group of row 0,
// groups group_stride bytes apart): y[c·ldy + r] = Dot(k, the group blocks of row r, r % R,
// activation row c).
template <typename Group, typename ABlock, int R, float (*Dot)(int64_t, const Group *, int, const ABlock *)>
void gemm_groups(int64_t k, const void *wp, size_t group_stride, const void *xq, size_t x_stride, float *y,
                 size_t ldy, int nr, int nc) {
    for (int c = 0; c < nc; ++c) {
        const auto *a = reinterpret_cast<const ABlock *>(static_cast<const char *>(xq) + size_t(c) * x_stride);
        for (int r = 0; r < nr; ++r) {
            const auto *g = reinterpret_cast<const Group *>(static_cast<const char *>(wp) + size_t(r / R) * group_stride);
            y[size_t(c) * ldy + size_t(r)] = Dot(k, g, r % R, a);
        }
    }
}

}  // namespace ktd::ref
