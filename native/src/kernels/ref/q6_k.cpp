// Q6_K weights × Q8_K activations, scalar reference.
// Block of 256 = 16 sub-blocks of 16 with int8 scales. Element e = 128t + 64h + m (m < 64) has
// its low 4 bits in nibble h of ql[64t + m]; element e = 128t + 32s + l (l < 32) has its high
// 2 bits at bit 2s of qh[32t + l]:  w = (d·sc[e/16]) · (q − 32), q in 0..63.
#include <cstring>

#include "common/float16.h"
#include "kernels/blocks.h"
#include "kernels/kernels.h"
#include "kernels/ref/ref.h"
#include "kernels/repacked_k.h"

namespace ktd::ref {
namespace {

inline int q6_K_value(const block_q6_K &x, int e) {
    const int t = e / 128, r = e % 128;
    const int lo = (x.ql[64 * t + r % 64] >> (4 * (r / 64))) & 0xF;
    const int hi = (x.qh[32 * t + r % 32] >> (2 * (r / 32))) & 3;
    return (lo | (hi << 4)) - 32;
}

void dequantize_row_q6_K(const void *vx, float *y, int64_t k) {
    const auto *x = static_cast<const block_q6_K *>(vx);
    for (int64_t b = 0; b < k / QK_K; ++b) {
        const float d = fp16_to_fp32(x[b].d);
        for (int e = 0; e < QK_K; ++e) {
            const float dl = d * float(x[b].scales[e / 16]);
            y[b * QK_K + e] = dl * float(q6_K_value(x[b], e));
        }
    }
}

float vec_dot_q6_K_q8_K(int64_t k, const block_q6_K *w, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int32_t sumq = 0;
        for (int g = 0; g < 16; ++g) {
            int32_t s = 0;
            for (int l = 0; l < 16; ++l) s += q6_K_value(w[b], 16 * g + l) * a[b].qs[16 * g + l];
            sumq += w[b].scales[g] * s;
        }
        sum += a[b].d * fp16_to_fp32(w[b].d) * float(sumq);
    }
    return sum;
}

// ---- repacked layout (block_q6_Kx8, kernels/repacked_k.h) ------------------------------------

// q − 32 of element e (< 256) of row r.
inline int q6_Kx8_value(const block_q6_Kx8 &g, int r, int e) {
    const int s = e / 32, x = e % 32, hi = x / 16, xl = x % 16;
    const int lo = (g.c[s].ql[32 * (xl / 4) + 4 * r + xl % 4] >> (4 * hi)) & 0xF;
    const int f = xl / 4, t = e % 4;
    const int h2 = (g.c[s].qh[32 * hi + 4 * r + t] >> (2 * f)) & 3;
    return (lo | (h2 << 4)) - 32;
}

inline int q6_Kx8_scale(const block_q6_Kx8 &g, int r, int sb) { return g.c[sb / 2].scales[2 * r + sb % 2]; }

// As vec_dot_q6_K_q8_K on row r of a run of group blocks (same sums and float operations).
float vec_dot_q6_Kx8_q8_K(int64_t k, const block_q6_Kx8 *w, int r, const block_q8_K *a) {
    float sum = 0.0f;
    for (int64_t b = 0; b < k / QK_K; ++b) {
        int32_t sumq = 0;
        for (int g = 0; g < 16; ++g) {
            int32_t s = 0;
            for (int l = 0; l < 16; ++l) s += q6_Kx8_value(w[b], r, 16 * g + l) * a[b].qs[16 * g + l];
            sumq += q6_Kx8_scale(w[b], r, g) * s;
        }
        sum += a[b].d * fp16_to_fp32(w[b].d[r]) * float(sumq);
    }
    return sum;
}

inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

}  // namespace

size_t group_bytes_q6_K_x8(int64_t k) { return size_t(k / QK_K) * sizeof(block_q6_Kx8); }

// Word-wise (4 elements of one row at a time) so that repacking at load time runs near memory
// speed. Source positions as in dequantize_row_q6_K above.
void repack_q6_K_x8(const void *w, size_t w_stride, int64_t rows, int64_t k, int64_t g0, int64_t g1, void *out) {
    const int64_t nb = k / QK_K;
    auto *o = static_cast<block_q6_Kx8 *>(out);
    for (int64_t g = g0; g < g1; ++g)
        for (int64_t b = 0; b < nb; ++b) {
            block_q6_Kx8 &dst = o[g * nb + b];
            std::memset(&dst, 0, sizeof dst);  // rows past the end stay zero (d = 0)
            for (int r = 0; r < kRepackRowsK && g * kRepackRowsK + r < rows; ++r) {
                const block_q6_K &src = reinterpret_cast<const block_q6_K *>(
                    static_cast<const char *>(w) + size_t(g * kRepackRowsK + r) * w_stride)[b];
                dst.d[r] = src.d;
                for (int sb = 0; sb < 16; ++sb) dst.c[sb / 2].scales[2 * r + sb % 2] = src.scales[sb];
                // Chunk s (elements 32s..32s+31): half t = s/4 of the block, nibble h = (s%4)/2 of
                // ql[64t + 32(s%2) + x].
                for (int s = 0; s < 8; ++s) {
                    const uint8_t *q = src.ql + 64 * (s / 4) + 32 * (s % 2);
                    const int h = (s % 4) / 2;
                    for (int i = 0; i < 4; ++i) {
                        const uint32_t lo = load_u32(q + 4 * i), hi = load_u32(q + 16 + 4 * i);
                        const uint32_t v = h == 0 ? (lo & 0x0F0F0F0Fu) | ((hi << 4) & 0xF0F0F0F0u)
                                                  : ((lo >> 4) & 0x0F0F0F0Fu) | (hi & 0xF0F0F0F0u);
                        std::memcpy(dst.c[s].ql + 32 * i + 4 * r, &v, 4);
                    }
                }
                // Sub-block sb = 8u + 2s + v (elements 16sb + 4f + t) takes bits 2s of
                // qh[32u + 16v + 4f + t]. For fixed (u, v) the four source words a[f] hold field
                // (f, s) at bits 2s of each byte and the four destination words field (f, s) at
                // bits 2f: a 4×4 transpose of 2-bit fields per byte, done with two masked swaps.
                for (int u = 0; u < 2; ++u)
                    for (int v = 0; v < 2; ++v) {
                        uint32_t a[4];
                        for (int f = 0; f < 4; ++f) a[f] = load_u32(src.qh + 32 * u + 16 * v + 4 * f);
                        for (int f = 0; f < 4; f += 2) {  // swap (f, s odd) with (f + 1, s even)
                            const uint32_t x = ((a[f] >> 2) ^ a[f + 1]) & 0x33333333u;
                            a[f + 1] ^= x;
                            a[f] ^= x << 2;
                        }
                        for (int f = 0; f < 2; ++f) {  // swap (f, s ≥ 2) with (f + 2, s < 2)
                            const uint32_t x = ((a[f] >> 4) ^ a[f + 2]) & 0x0F0F0F0Fu;
                            a[f + 2] ^= x;
                            a[f] ^= x << 4;
                        }
                        // Sub-block 8u + 2sh + v: chunk 4u + sh, register v of its qh.
                        for (int sh = 0; sh < 4; ++sh) std::memcpy(dst.c[4 * u + sh].qh + 32 * v + 4 * r, &a[sh], 4);
                    }
            }
        }
}

KTD_REGISTER_KERNELS(Isa::Ref, TypeKernels{.type = GGMLType::Q6_K,
                                           .act_type = GGMLType::Q8_K,
                                           .dequantize_row = dequantize_row_q6_K,
                                           .quantize_act_row = quantize_row_q8_K,
                                           .gemm = gemm_rows<block_q6_K, block_q8_K, vec_dot_q6_K_q8_K>,
                                           .repack_rows = kRepackRowsK,
                                           .repack_layout = kRepackLayoutQ6_K,
                                           .repacked_group_bytes = group_bytes_q6_K_x8,
                                           .repack = repack_q6_K_x8,
                                           .gemm_repacked = gemm_groups<block_q6_Kx8, block_q8_K, kRepackRowsK, vec_dot_q6_Kx8_q8_K>});

}  // namespace ktd::ref
