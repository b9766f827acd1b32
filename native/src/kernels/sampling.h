// The vector passes of the token sampler (sampling/sampler.h) per ISA, registered at load time like
// the element-wise kernels (KTD_REGISTER_SAMPLING). The scalar reference is the specification, and
// here every ISA must give the same bits as it (not merely close values): the same weights and the
// same sums make a seeded token stream independent of the machine it runs on. So the reference
// evaluates e^x with the same polynomial and rounding steps as the SIMD code, and the draw's block
// sums in the same lane pattern (16 running double sums, i % 16, added in a fixed order).
#pragma once
#include <cstdint>

#include "kernels/kernels.h"

namespace ktd {

// Arguments of e^x below this give a weight of exactly 0 (e^-87.34 is the smallest normal float):
// tokens that far below the best are never drawn, and no subnormal reaches the sums.
inline constexpr float kSampleExpFloor = -87.33654f;

struct SamplingKernels {
    // Largest x[i] (-inf when n = 0); *nan is set when any x[i] is NaN (the maximum is then
    // meaningless).
    float (*max)(const float *x, int64_t n, bool *nan) = nullptr;
    // w[i] = e^d, d = (x[i] · scale) − shift with each operation rounded to float (not fused);
    // 0 where d < kSampleExpFloor. e^d as the Cephes expf polynomial (relative error ~2 ulp).
    void (*exp_scaled)(const float *x, int64_t n, float scale, float shift, float *w) = nullptr;
    // The indices i with x[i] >= t, ascending, into out (room for n); returns how many.
    int64_t (*select_ge)(const float *x, int64_t n, float t, int32_t *out) = nullptr;
    // sums[b] = Σ w[i] over the kept i of block b (elements [b·block, min(n, (b+1)·block))),
    // kept: w[i] > v, or w[i] == v and i < tie_end. block % 16 == 0. Float64 sums in 16 lanes
    // (lane l adds the kept w[i] with i % 16 == l in order), reduced as t_l = lane_l + lane_l+8,
    // u_l = t_l + t_l+4, v_l = u_l + u_l+2, sum = v_0 + v_1.
    void (*kept_block_sums)(const float *w, int64_t n, float v, int64_t tie_end, int64_t block,
                            double *sums) = nullptr;
    // One pass of the top-p search over weights w >= 0, comparing float bits (= comparing values),
    // in three ranges: bits < lo, lo <= bits < hi, bits >= hi. mass[r] = Σ w[i] of range r (float64,
    // any order); the bits of the middle range's w[i] written to out_mid and, when out_hi is not
    // null, those of the top range to out_hi, each in index order (room for n + 16: a vector store
    // may write 16 elements past the last); their counts in *n_mid and *n_hi.
    void (*split_pass)(const float *w, int64_t n, uint32_t lo, uint32_t hi, double mass[3], uint32_t *out_mid,
                       int64_t *n_mid, uint32_t *out_hi, int64_t *n_hi) = nullptr;
};

void register_sampling_kernels(Isa isa, const SamplingKernels &k);
const SamplingKernels *find_sampling_kernels(Isa isa);  // nullptr if none for isa
// The active ISA's; under the default AVX2 also AVX-512 where the CPU has it (the same bits).
const SamplingKernels &sampling_kernels();

}  // namespace ktd

#define KTD_REGISTER_SAMPLING(isa, kernels)                                   \
    static const bool KTD_CONCAT(ktd_sampling_registered_, __LINE__) = [] {   \
        ::ktd::register_sampling_kernels(isa, kernels);                       \
        return true;                                                          \
    }()
