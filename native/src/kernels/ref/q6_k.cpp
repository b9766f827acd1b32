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
    const int s = e / 32, h = (e % 32) / 16, j = (e % 16) / 4, t = e % 4;
    const uint8_t *q = g.c[s].q + 96 * h + 4 * r + t;  // + 32j: register j of the half
    if (j < 3) return (q[32 * j] & 0x3F) - 32;
    int v = 0;
    for (int i = 0; i < 3; ++i) v |= (q[32 * i] >> 6) << (2 * i);
    return v - 32;
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

}  // namespace

size_t group_bytes_q6_K_x8(int64_t k) { return size_t(k / QK_K) * sizeof(block_q6_Kx8); }

// Element by element, through q6_K_value: the definition of the layout (the x86 entries use an
// AVX2 twin that writes the same bytes at load-time speed).
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
                // Element 32s + 16h + 4j + t (j < 3) in bits 0-5 of q[96h + 32j + 4r + t] of
                // chunk s; element 32s + 16h + 12 + t spread over bits 6-7 of those three bytes.
                for (int s = 0; s < 8; ++s)
                    for (int h = 0; h < 2; ++h)
                        for (int t = 0; t < 4; ++t) {
                            const int e = 32 * s + 16 * h + t;
                            const int top = q6_K_value(src, e + 12) + 32;
                            for (int j = 0; j < 3; ++j)
                                dst.c[s].q[96 * h + 32 * j + 4 * r + t] =
                                    uint8_t((q6_K_value(src, e + 4 * j) + 32) | (((top >> (2 * j)) & 3) << 6));
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
