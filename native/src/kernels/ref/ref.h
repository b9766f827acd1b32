// Shared pieces of the scalar reference kernels.
#pragma once
#include <cstdint>

namespace ktd::ref {

// Activation quantizers (the specification of the activation formats).
void quantize_row_q8_0(const float *x, void *y, int64_t k);  // k % 32 == 0 → block_q8_0[k/32]
void quantize_row_q8_K(const float *x, void *y, int64_t k);  // k % 256 == 0 → block_q8_K[k/256]

}  // namespace ktd::ref
