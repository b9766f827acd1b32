// Mixture-of-experts FFN of one layer (qwen2moe, qwen3moe, Mixtral, deepseek2).
//
//   logits [n][n_expert] = ffn_gate_inp · xn
//   selection: top-n_expert_used of p = softmax(logits) or sigmoid(logits) (+ exp_probs_b for the
//   choice only, group-limited when n_group > 0); weights = the selected p, renormalised when
//   weights_norm, times weights_scale
//   y_i = Σ_j weight_ij · down_e(silu(gate_e · xn_i) ⊙ up_e · xn_i)   (e = j-th selected expert)
//       + shared expert(s) (qwen2moe: times sigmoid(ffn_gate_inp_shexp · xn_i))
//
// Execution: decode shares the work of all selected experts between all threads (work items =
// expert × row block); prefill groups the tokens by expert (one GEMM per expert over its tokens;
// experts that receive no token cost nothing).
#pragma once
#include <cstdint>

namespace ktd {

class Context;
struct LayerWeights;

// xn [n][n_embd] (normed input) → y [n][n_embd] (overwritten). Counts the routing of layer il into
// the context's expert statistics.
void moe_ffn(Context &ctx, const LayerWeights &w, int il, const float *xn, int64_t n, float *y);

}  // namespace ktd
