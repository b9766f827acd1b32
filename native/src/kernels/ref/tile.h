// The scalar tile loop shared by the reference kernels: every output element is one row·column
// dot product (the specification; no blocking).
#pragma once
#include <cstddef>
#include <cstdint>

namespace ktd::ref {

// y[c * ldy + r] = Dot(k, W row r, activation row c) for r < nr, c < nc.
template <typename BlockW, typename BlockA, float (*Dot)(int64_t, const BlockW *, const BlockA *)>
void gemm_tile(int64_t k, const void *w, size_t w_stride, const void *xq, size_t x_stride, float *y,
               size_t ldy, int nr, int nc) {
    for (int c = 0; c < nc; ++c) {
        const auto *a = reinterpret_cast<const BlockA *>(static_cast<const char *>(xq) + c * x_stride);
        for (int r = 0; r < nr; ++r)
            y[c * ldy + r] = Dot(k, reinterpret_cast<const BlockW *>(static_cast<const char *>(w) + r * w_stride), a);
    }
}

}  // namespace ktd::ref
