// The code books (grids) of the GGUF i-quant types, defined in kernels/iq_grids.cpp (generated
// from gguf-py's tables by tools/gen_iq_grids.py). Entry i is grid point i, element j in byte j:
//   iq2xxs_grid[256], iq2xs_grid[512], iq2s_grid[1024]: 8 unsigned magnitudes each in {8, 25, 43}
//   iq3xxs_grid[256]: 4 magnitudes in {4, 12, ..., 52, 62};  iq3s_grid[512]: 4 in {1, 3, ..., 15}
//   iq1s_grid[2048]: 8 signed values in {−1, 0, 1} (int8 bytes), shared by IQ1_S and IQ1_M.
// Plain extern data (no inline definitions), so the ISA translation units share one copy with
// the baseline code (tests/kernels/test_isa_isolation.py).
#pragma once
#include <cstdint>

namespace ktd {

extern const uint64_t iq2xxs_grid[256];
extern const uint64_t iq2xs_grid[512];
extern const uint64_t iq2s_grid[1024];
extern const uint32_t iq3xxs_grid[256];
extern const uint32_t iq3s_grid[512];
extern const uint64_t iq1s_grid[2048];

// The IQ2_XXS / IQ2_XS / IQ3_XXS sign code: 8 signs stored as 7 bits, the 8th the parity
// (the number of negative signs is even). Bit j of the result set ⇔ element j is negative.
constexpr uint8_t iq_signs_from7(uint32_t s7) {
    uint32_t p = s7 ^ (s7 >> 4);
    p ^= p >> 2;
    p ^= p >> 1;
    return uint8_t((s7 & 0x7F) | ((p & 1) << 7));
}

// IQ1_S / IQ1_M: each grid value is shifted by ±1/8 (the sign chosen per group).
constexpr float kIQ1Delta = 0.125f;

}  // namespace ktd
