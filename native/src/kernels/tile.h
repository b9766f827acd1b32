// The tile both weight-streaming drivers are built from: the matmul driver (matmul.cpp) and the
// routed experts (model/moe.cpp) cut a prepared matrix into row ranges and run each with this.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/kernels.h"

namespace ktd {

// The row-block unit: tiles, work items and NUMA row slices start on multiples of kRowBlock rows.
// Every repacked row group (TypeKernels::repack_rows divides 16) then lies within one block, so a
// range repacks, and is computed, on its own.
constexpr int64_t kRowBlock = 16;

// Rows [r0, r1) of a prepared matrix (repacked or plain rows) on quantized activations:
//   y[c·ldy + (r - r0)] = W row r · activation row c,  r0 <= r < r1, c < nc
// xq: nc rows in w's activation format, x_stride bytes apart. r0 % kRowBlock == 0. Worker tid reads
// its own node's copy of replicated weights (PreparedWeights::for_worker).
void matmul_tile(const PreparedWeights &w, int64_t r0, int64_t r1, const uint8_t *xq, size_t x_stride, float *y,
                 size_t ldy, int nc, int tid);

}  // namespace ktd
