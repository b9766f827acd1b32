// Rotary position embedding (RoPE): the angles of one position and their application to head
// vectors, with linear and YaRN context scaling as llama.cpp computes them. The CPU forward
// (model/) and the CUDA kernels' host-side check (cuda/bind_cuda.cpp) share this one definition.
#pragma once
#include <cstdint>

namespace ktd {

enum class RopeType { Norm, Neox };            // pairs (2i, 2i+1) vs (i, i + n_rot/2)
enum class RopeScaling { None, Linear, Yarn };

// Rotary embedding parameters of one layer kind (gemma3's sliding layers have their own base).
struct RopeParams {
    RopeType type = RopeType::Neox;
    int n_rot = 0;                  // rotated dims per head (<= head_dim)
    float freq_base = 10000.0f;
    float freq_scale = 1.0f;        // 1 / rope.scaling.factor for linear and YaRN
    RopeScaling scaling = RopeScaling::None;
    // YaRN (llama.cpp defaults: ext_factor 1, attn_factor 1, beta_fast 32, beta_slow 1).
    int n_ctx_orig = 0;
    float ext_factor = 0.0f;
    float attn_factor = 1.0f;
    float beta_fast = 32.0f, beta_slow = 1.0f;
};

// Rotary angles for one position: cs[2i] = cos θ_i, cs[2i+1] = sin θ_i for i < n_rot/2
// (θ_i = pos · freq_base^(-2i/n_rot) / freq_factors[i], with linear/YaRN scaling applied).
// freq_factors: [n_rot/2] or null.
void rope_cos_sin(const RopeParams &rp, const float *freq_factors, int64_t pos, float *cs);
// Rotates the first n_rot dims of each of n_heads head vectors (head_dim apart) in place.
void rope_apply(const RopeParams &rp, const float *cs, float *x, int n_heads, int64_t head_dim);

}  // namespace ktd
