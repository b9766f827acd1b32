// Σ x[i]² in double, the RMSNorm's sum of squares, in one fixed order that the CPU forward
// (model/blocks.cpp) and the emulated device (cuda/emu_device.cpp) share: 8 partial sums (element
// i into sum i % 8) added pairwise. One chain of n dependent adds took 1.7 us for n = 1536 on a
// Zen 3, this 0.47 us; a decode step runs two norms per layer on the calling thread while the
// workers wait. Each square of a float is exact in double, so the order moves the sum by about an
// ulp of a double.
#pragma once
#include <cstdint>

namespace ktd {

inline double sum_squares_f64(const float *x, int64_t n) {
    double s[8] = {};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; ++j) s[j] += double(x[i + j]) * double(x[i + j]);
    for (int j = 0; i < n; ++i, ++j) s[j] += double(x[i]) * double(x[i]);
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

}  // namespace ktd
