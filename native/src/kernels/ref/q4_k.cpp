// Q4_K weights × Q8_K activations, scalar reference.
// Block of 256 = 8 sub-blocks of 32; element e = 64c + 32h + l is nibble h of qs[32c + l] and
// belongs to sub-block e/32:  w = (d·sc) · q − (dmin·m).
#include <cstring>

#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/k_scales.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"
#include "kernels/repacked_k.h"

namespace ktd::ref {
namespace {

void dequantize_row_q4_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q4_K *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = fp16_to_fp32(x[b].d), dmin = fp16_to_fp32(x[b].dmin);
        uint8_t sc[8], m[8];
        unpack_scale_min_k4(x[b].scales, sc, m);
        for (int e = 0; e < QK_K; ++e) {
            const int c = e / 64, h = (e / 32) % 2, l = e % 32;
            const int q = (x[b].qs[32 * c + l] >> (4 * h)) & 0xF;
            const float dl = d * float(sc[e / 32]), ml = dmin * float(m[e / 32]);
            y[b * QK_K + e] = dl * float(q) - ml;
        }
    }
}

float vec_dot_q4_K_q8_K(int64_t k, const block_q4_K *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        uint8_t sc[8], m[8];
        unpack_scale_min_k4(w[b].scales, sc, m);
        int32_t sumq = 0, summ = 0;
        for (int j = 0; j < 8; ++j) {
            int32_t s = 0;
            for (int l = 0; l < 32; ++l) {
                const int e = 32 * j + l;
                const int q = (w[b].qs[32 * (e / 64) + l] >> (4 * (j % 2))) & 0xF;
                s += q * a[b].qs[e];
            }
            sumq += sc[j] * s;
            summ += m[j] * (a[b].bsums[2 * j] + a[b].bsums[2 * j + 1]);
        }
        sum += a[b].d * fp16_to_fp32(w[b].d) * float(sumq) - a[b].d * fp16_to_fp32(w[b].dmin) * float(summ);
    }
    return sum;
}

// ---- repacked layout (block_q4_Kx8, kernels/repacked_k.h) ------------------------------------

// Element e (< 256) of row r: sub-block j = e/32; x = e%32 < 16 is the low nibble of chunk
// register byte 32(x/4) + 4r + x%4, x ≥ 16 the high nibble of the byte of x − 16.
inline int q4_Kx8_value(const block_q4_Kx8 &g, int r, int e) {
    const int j = e / 32, x = e % 32, hi = x / 16, xl = x % 16;
    return (g.qs[128 * j + 32 * (xl / 4) + 4 * r + xl % 4] >> (4 * hi)) & 0xF;
}

// Scale (which = 0) or min (which = 1) of sub-block j of row r.
inline int q4_Kx8_scale(const block_q4_Kx8 &g, int r, int j, int which) {
    const int idx = 8 * j + r, x = idx % 32, half = idx / 32;
    const uint8_t *nib = which ? g.mnl : g.scl;
    return ((nib[x] >> (4 * half)) & 0xF) | (((g.sh[x] >> (4 * which + 2 * half)) & 3) << 4);
}

// As vec_dot_q4_K_q8_K, on row r of a run of group blocks (the same integer sums and float
// operations, hence the same result).
float vec_dot_q4_Kx8_q8_K(int64_t k, const block_q4_Kx8 *w, int r, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int32_t sumq = 0, summ = 0;
        for (int j = 0; j < 8; ++j) {
            int32_t s = 0;
            for (int l = 0; l < 32; ++l) s += q4_Kx8_value(w[b], r, 32 * j + l) * a[b].qs[32 * j + l];
            sumq += q4_Kx8_scale(w[b], r, j, 0) * s;
            summ += q4_Kx8_scale(w[b], r, j, 1) * (a[b].bsums[2 * j] + a[b].bsums[2 * j + 1]);
        }
        sum += a[b].d * fp16_to_fp32(w[b].d[r]) * float(sumq) - a[b].d * fp16_to_fp32(w[b].dmin[r]) * float(summ);
    }
    return sum;
}

inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

}  // namespace

size_t group_bytes_q4_K_x8(int64_t k) { return size_t(k / QK_K) * sizeof(block_q4_Kx8); }

// Word-wise (4 bytes = 4 elements of one row at a time) so that repacking at load time runs near
// memory speed.
void repack_q4_K_x8(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out) {
    const int64_t nb = k / QK_K;
    auto *o = static_cast<block_q4_Kx8 *>(out);
    for (int64_t g = g0; g < g1; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            block_q4_Kx8 &dst = o[g * nb + b];
            std::memset(&dst, 0, sizeof dst);  // rows past the end stay zero (d = dmin = 0)
            uint8_t sc[64] = {}, mn[64] = {};
            for (int r = 0; r < kRepackRowsK && g * kRepackRowsK + r < rows; ++r) {
                const block_q4_K &src = reinterpret_cast<const block_q4_K *>(
                    static_cast<const char *>(w) + size_t(g * kRepackRowsK + r) * w_stride)[b];
                dst.d[r] = src.d;
                dst.dmin[r] = src.dmin;
                uint8_t s8[8], m8[8];
                unpack_scale_min_k4(src.scales, s8, m8);
                for (int j = 0; j < 8; ++j) {
                    sc[8 * j + r] = s8[j];
                    mn[8 * j + r] = m8[j];
                }
                // Source chunk c (qs[32c..32c+31]): low nibbles = sub-block 2c, high = 2c + 1.
                for (int c = 0; c < 4; ++c)
                    for (int i = 0; i < 4; ++i) {
                        const uint32_t lo = load_u32(src.qs + 32 * c + 4 * i), hi = load_u32(src.qs + 32 * c + 16 + 4 * i);
                        const uint32_t even = (lo & 0x0F0F0F0Fu) | ((hi << 4) & 0xF0F0F0F0u);
                        const uint32_t odd = ((lo >> 4) & 0x0F0F0F0Fu) | (hi & 0xF0F0F0F0u);
                        std::memcpy(dst.qs + 128 * (2 * c) + 32 * i + 4 * r, &even, 4);
                        std::memcpy(dst.qs + 128 * (2 * c + 1) + 32 * i + 4 * r, &odd, 4);
                    }
            }
            for (int x = 0; x < 32; ++x) {
                dst.scl[x] = uint8_t((sc[x] & 0xF) | ((sc[x + 32] & 0xF) << 4));
                dst.mnl[x] = uint8_t((mn[x] & 0xF) | ((mn[x + 32] & 0xF) << 4));
                dst.sh[x] = uint8_t((sc[x] >> 4) | ((sc[x + 32] >> 4) << 2) | ((mn[x] >> 4) << 4) | ((mn[x + 32] >> 4) << 6));
            }
        }
}

KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{.type = GGMLType::Q4_K,
                                           .act_type = GGMLType::Q8_K,
                                           .dequantize_row = dequantize_row_q4_K,
                                           .quantize_act_row = quantize_row_q8_K,
                                           .gemm = gemm_rows<block_q4_K, block_q8_K, vec_dot_q4_K_q8_K>,
                                           .repack_rows = kRepackRowsK,
                                           .repack_layout = kRepackLayoutQ4_K,
                                           .repacked_group_bytes = group_bytes_q4_K_x8,
                                           .repack = repack_q4_K_x8,
                                           .gemm_repacked = gemm_groups<block_q4_Kx8, block_q8_K, kRepackRowsK, vec_dot_q4_Kx8_q8_K>});

}  // namespace ktd::ref
