// Attention kernels: a block of query rows × the query heads of one GQA group against one
// sequence's F16 K/V cache, tile by tile with an online softmax (running max and sum per query),
// so memory does not grow with the context length.
//
// All the query heads of a group read the same K/V head, and consecutive rows of one sequence
// read overlapping key ranges: each K/V tile of kAttnTile keys is converted to F32 once per block
// and used by all n_rows × n_group queries of the block.
//
// Every ISA's kernel is registered at load time (KTD_REGISTER_ATTENTION); the scalar reference
// (Isa::Ref) is the specification, the others must agree with it within F32 rounding
// (tests/kernels/test_attention.py). A kernel's result for one query depends only on that query and its
// key range, never on the block it was computed in, the thread, or the other rows — so the
// forward is independent of the thread count and the block split, bitwise, for a given ISA.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/kernels.h"

namespace ktd {

// Keys per tile: the K/V tile converted to F32 (kAttnTile × head_dim floats each) stays in L1/L2.
constexpr int kAttnTile = 64;

struct AttnBlock {
    // Queries, already scaled: row r, group head g at q + r * q_row_stride + g * head_dim_k.
    const float *q = nullptr;
    size_t q_row_stride = 0;  // floats
    int n_rows = 0;           // R >= 1
    int n_group = 0;          // G >= 1 query heads sharing the K/V head
    // Row r attends keys [lo[r], hi[r]) of the sequence (lo[r] < hi[r]).
    const int64_t *lo = nullptr, *hi = nullptr;
    // Key j at k + j * k_stride, value j at v + j * v_stride (F16, elements).
    const uint16_t *k = nullptr, *v = nullptr;
    size_t k_stride = 0, v_stride = 0;
    int64_t head_dim_k = 0, head_dim_v = 0;
    // Output: row r, head g at out + r * out_row_stride + g * head_dim_v (head_dim_v floats).
    float *out = nullptr;
    size_t out_row_stride = 0;
    // Optional, for a row whose keys are split into ranges computed apart (attn_merge): query
    // (r, g)'s max score and Σ exp(score - max) over its range at m_out[r·n_group + g],
    // l_out[r·n_group + g]. out is normalised either way.
    float *m_out = nullptr, *l_out = nullptr;
};

// Keys per group of the SIMD kernels' scores at most (AVX2: 8, NEON: 4).
constexpr int kAttnMaxKeyGroup = 8;

// The per-thread scratch of a block of Q = n_rows × n_group queries, offsets in floats (multiples
// of 8; the kernels use unaligned loads, so the scratch needs no particular alignment):
//   pad [2][kAttnMaxKeyGroup][head_dim_k] F16  attn_pad_key_groups' copies
//   s  [Q][kAttnTile]  scores / probabilities  m, l [Q]  running max and sum
//   acc [Q][head_dim_v]  unnormalised output
struct AttnScratchLayout {
    size_t pad, s, m, l, acc, total;
};
// Not inline: the ISA translation units call it too (no shared inline code, see kernels/x86/common.h).
AttnScratchLayout attn_scratch_layout(int n_rows, int n_group, int64_t head_dim_k, int64_t head_dim_v);

// The SIMD kernels read the keys of a tile [t0, t0 + kAttnTile) straight from the cache, `width`
// keys at a time from multiples of width, of which only [ta, tb) are the block's keys (rows outside
// may not exist). The (at most two) width-key groups that reach outside [ta, tb) are copied to
// pad (the layout's pad; width <= kAttnMaxKeyGroup): their keys in [ta, tb) as they are, the
// others zero. pad_at[i] = the offset from t0 of the group copied to pad + i × width × head_dim_k,
// -1 if none. Not inline: the ISA translation units call it.
void attn_pad_key_groups(const AttnBlock &b, int64_t t0, int64_t ta, int64_t tb, int width, uint16_t *pad,
                         int pad_at[2]);

// One block; scratch: attn_scratch_layout(n_rows, n_group, ...).total floats.
using AttnKernel = void (*)(const AttnBlock &b, float *scratch);

// One query head's output from the results of n_parts disjoint key ranges of its row: part c's
// normalised output o + c·o_stride [head_dim_v], max score m[c·ml_stride], sum l[c·ml_stride]
// (AttnBlock::m_out/l_out). out [head_dim_v] = Σ_c w_c·o_c / Σ_c w_c with w_c = l_c·exp(m_c - M),
// M = max_c m_c, summed in part order: the result depends on the split, never on the thread that
// computed a part. Versus one unsplit range it differs by F32 rounding only (a few ulp per part).
void attn_merge(int n_parts, const float *m, const float *l, size_t ml_stride, const float *o, size_t o_stride,
                int64_t head_dim_v, float *out);

void register_attention_kernel(Isa isa, AttnKernel fn);
// The kernel registered for isa, or nullptr.
AttnKernel find_attention_kernel(Isa isa);
// The kernel for the active ISA (AVX-512 falls back to AVX2, then to the reference).
AttnKernel attention_kernel();

}  // namespace ktd

#define KTD_REGISTER_ATTENTION(isa, fn)                                     \
    static const bool KTD_CONCAT(ktd_attn_registered_, __LINE__) = [] {     \
        ::ktd::register_attention_kernel(isa, fn);                          \
        return true;                                                        \
    }()
