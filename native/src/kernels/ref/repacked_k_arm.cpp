// The K-quants' arm x4 layouts (kernels/repacked_k.h), scalar: the repacks the aarch64 entries
// use. Their tiles' specification is the plain reference (kernels/ref/q4_k.cpp, q6_k.cpp).
#include <cstring>

#include "kernels/blocks.h"
#include "kernels/ref/ref.h"
#include "kernels/repacked_k.h"

namespace ktd::ref {
namespace {

// Row r's n bytes (n % 8 == 0) into the 8-byte interleave of 4 rows: x[32i + 8r + t] = src[8i + t].
void interleave8(uint8_t *x, int r, const uint8_t *src, int n) {
    for (int i = 0; i < n / 8; ++i) std::memcpy(x + 32 * i + 8 * r, src + 8 * i, 8);
}

// Writes groups [g0, g1): each group block zeroed (rows past the end stay zero: d = dmin = 0),
// then put(dst, r, block b of row r).
template <typename Group, typename Block, typename Put>
void repack_x4(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out,
               const Put &put) {
    const int64_t nb = k / QK_K;
    auto *o = static_cast<Group *>(out);
    for (int64_t g = g0; g < g1; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            Group &dst = o[g * nb + b];
            std::memset(&dst, 0, sizeof dst);
            for (int r = 0; r < kRepackRowsKx4 && g * kRepackRowsKx4 + r < rows; ++r)
                put(dst, r, reinterpret_cast<const Block *>(static_cast<const char *>(w) +
                                                            size_t(g * kRepackRowsKx4 + r) * w_stride)[b]);
        }
}

}  // namespace

size_t group_bytes_q4_K_x4(int64_t k) { return size_t(k / QK_K) * sizeof(block_q4_Kx4); }
void repack_q4_K_x4(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out) {
    repack_x4<block_q4_Kx4, block_q4_K>(w, w_stride, rows, k, g0, g1, out,
                                        [](block_q4_Kx4 &dst, int r, const block_q4_K &src) {
                                            dst.d[r] = src.d;
                                            dst.dmin[r] = src.dmin;
                                            std::memcpy(dst.scales[r], src.scales, 12);
                                            interleave8(dst.qs, r, src.qs, QK_K / 2);
                                        });
}

size_t group_bytes_q6_K_x4(int64_t k) { return size_t(k / QK_K) * sizeof(block_q6_Kx4); }
void repack_q6_K_x4(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out) {
    repack_x4<block_q6_Kx4, block_q6_K>(w, w_stride, rows, k, g0, g1, out,
                                        [](block_q6_Kx4 &dst, int r, const block_q6_K &src) {
                                            dst.d[r] = src.d;
                                            std::memcpy(dst.scales[r], src.scales, QK_K / 16);
                                            interleave8(dst.ql, r, src.ql, QK_K / 2);
                                            interleave8(dst.qh, r, src.qh, QK_K / 4);
                                        });
}

}  // namespace ktd::ref
