// Q8_K, the activation format of the 256-element block types: reference quantizer.
// As ggml's quantize_row_q8_K_ref: the element of largest magnitude maps to exactly -127
// (scale -127/max, so d may be negative), the rest round to nearest (ties to even) and are
// clamped to 127; bsums[g] = Σ of the 16 values of group g (the K-quants' mins and the ternary
// types' -1 offset are applied through them). An all-zero block gets d = 0 and zero values; a
// block holding a NaN or an infinity gets d = NaN and zero values, so every dot product it enters
// is NaN (non-finite in, non-finite out, identically on every ISA).
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/blocks.h"
#include "kernels/ref/ref.h"

namespace ktd::ref {

void quantize_row_q8_K(const float *x, void *vy, int64_t k) {
    auto *y = static_cast<block_q8_K *>(vy);
    for (int64_t b = 0; b < k / QK_K; ++b, x += QK_K) {
        float amax = 0.0f, max = 0.0f;
        bool finite = true;
        for (int j = 0; j < QK_K; ++j) {
            const float ax = std::fabs(x[j]);
            finite = finite && std::isfinite(ax);
            if (ax > amax) {
                amax = ax;
                max = x[j];
            }
        }
        if (amax == 0.0f || !finite) {
            y[b].d = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
            std::memset(y[b].qs, 0, sizeof(y[b].qs));
            std::memset(y[b].bsums, 0, sizeof(y[b].bsums));
            continue;
        }
        const float iscale = -127.0f / max;
        for (int j = 0; j < QK_K; ++j) {
            const int v = int(std::nearbyint(iscale * x[j]));  // default rounding: ties to even
            y[b].qs[j] = int8_t(v < 127 ? v : 127);
        }
        for (int g = 0; g < QK_K / 16; ++g) {
            int sum = 0;
            for (int j = 0; j < 16; ++j) sum += y[b].qs[g * 16 + j];
            y[b].bsums[g] = int16_t(sum);
        }
        y[b].d = 1.0f / iscale;
    }
}

}  // namespace ktd::ref
