#include "sampling/greedy.h"

#if defined(__SSE2__)
#include <emmintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace ktd::sampling {

const char *greedy_error(int32_t code) {
    switch (code) {
        case kGreedyNaN: return "sampling: the logits contain NaN";
        case kGreedyPosInf: return "sampling: the logits contain +inf";
        case kGreedyNoFinite: return "sampling: no logit is finite";
        default: return nullptr;
    }
}

namespace {

// The largest non-NaN value of x[0, n) (-inf if none) into m; whether any is NaN. The baseline
// vector unit of each target (SSE2, NEON): this runs on every logit of a greedy step.
bool piece_max(const float *x, int64_t n, float &m) {
    int64_t j = 0;
    bool has_nan = false;
    float best = -std::numeric_limits<float>::infinity();
#if defined(__SSE2__)
    __m128 vm0 = _mm_set1_ps(best), vm1 = vm0, bad = _mm_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m128 a = _mm_loadu_ps(x + j), b = _mm_loadu_ps(x + j + 4);
        vm0 = _mm_max_ps(a, vm0);  // a NaN lane of a keeps vm0's (maxps returns its second operand)
        vm1 = _mm_max_ps(b, vm1);
        bad = _mm_or_ps(bad, _mm_or_ps(_mm_cmpunord_ps(a, a), _mm_cmpunord_ps(b, b)));
    }
    alignas(16) float lanes[8];
    _mm_store_ps(lanes, vm0);
    _mm_store_ps(lanes + 4, vm1);
    for (float v : lanes) best = v > best ? v : best;
    has_nan = _mm_movemask_ps(bad) != 0;
#elif defined(__aarch64__)
    float32x4_t vm0 = vdupq_n_f32(best), vm1 = vm0;
    uint32x4_t ok = vdupq_n_u32(~0u);
    for (; j + 8 <= n; j += 8) {
        const float32x4_t a = vld1q_f32(x + j), b = vld1q_f32(x + j + 4);
        vm0 = vmaxnmq_f32(vm0, a);  // the number when one operand is NaN
        vm1 = vmaxnmq_f32(vm1, b);
        ok = vandq_u32(ok, vandq_u32(vceqq_f32(a, a), vceqq_f32(b, b)));
    }
    best = vmaxvq_f32(vmaxnmq_f32(vm0, vm1));
    has_nan = vminvq_u32(ok) == 0;
#endif
    for (; j < n; ++j) {
        best = x[j] > best ? x[j] : best;
        has_nan |= x[j] != x[j];
    }
    m = best;
    return has_nan;
}

}  // namespace

void GreedyBest::add(const float *x, int64_t id0, int64_t n) {
    if (n <= 0) return;
    // The piece's maximum over its non-NaN values, then, only when it can win, its first id: two
    // passes over a piece that is still in cache.
    float m;
    nan |= piece_max(x, n, m);
    if (m < max || (m == max && id0 >= id)) return;
    for (int64_t j = 0; j < n; ++j)
        if (x[j] == m) {
            if (m > max || id0 + j < id) {
                max = m;
                id = id0 + j;
            }
            return;
        }
}

void GreedyBest::merge(const GreedyBest &o) {
    nan |= o.nan;
    if (o.max > max || (o.max == max && o.id < id)) {
        max = o.max;
        id = o.id;
    }
}

int32_t GreedyBest::result() const {
    if (nan) return kGreedyNaN;
    if (max == std::numeric_limits<float>::infinity()) return kGreedyPosInf;
    if (max == -std::numeric_limits<float>::infinity()) return kGreedyNoFinite;
    return int32_t(id);
}

}  // namespace ktd::sampling
