// What the two execution paths of moe_ffn share (internal to moe.cpp, the general path, and
// moe_decode.cpp, one token).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/kernels.h"
#include "model/moe.h"

namespace ktd::moe_parts {

// v grown to at least n elements (never shrunk, so no allocation once warm).
template <class T>
T *grow(std::vector<T> &v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
}

// One activation format: the quantizer of a weight type and its row size for k = n_embd.
struct ActFormat {
    const TypeKernels *tk = nullptr;
    size_t row = 0;
};

// The index of tk's activation format (row length k) in fmts[0, n_fmt); appended when new.
inline int format_index(ActFormat *fmts, int &n_fmt, const TypeKernels &tk, int64_t k) {
    for (int i = 0; i < n_fmt; ++i)
        if (fmts[i].tk->act_type == tk.act_type && fmts[i].tk->quantize_act_row == tk.quantize_act_row) return i;
    fmts[n_fmt] = {&tk, act_row_size(tk, k)};
    return n_fmt++;
}

// sigmoid(gate [E] · x [E]): the shared expert's gate of one token (qwen2moe).
inline float shexp_gate(const float *gate, const float *x, int64_t E) {
    float dot = 0.0f;
    for (int64_t d = 0; d < E; ++d) dot += gate[d] * x[d];
    return 1.0f / (1.0f + std::exp(-dot));
}

// One token, experts not sharded (moe_decode.cpp).
void moe_ffn_decode(const MoeRun &run, const LayerWeights &w, int il, const float *xn, float *y, MoePart part,
                    const MoeDeviceExperts *dev);

}  // namespace ktd::moe_parts
