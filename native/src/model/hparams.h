// Hyperparameters of a decoder-only transformer, read from GGUF metadata ("{arch}.*" keys, the
// names llama.cpp's converters write). Everything the forward needs comes from here; nothing is
// assumed per model name.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/rope.h"

namespace ktd {

class GGUFFile;

// Routed experts (qwen2moe, qwen3moe, Mixtral, deepseek2). n_expert == 0: a dense model.
enum class ExpertGating { Softmax, Sigmoid };  // deepseek2.expert_gating_func 1 / 2
struct MoeParams {
    int n_expert = 0, n_expert_used = 0;   // expert_count, expert_used_count
    int64_t n_ff_exp = 0;                  // expert_feed_forward_length (Mixtral: feed_forward_length)
    int64_t n_ff_shexp = 0;                // shared-expert FFN width (0: none); deepseek2: n_ff_exp · n_expert_shared
    int n_expert_shared = 0;               // expert_shared_count (deepseek2)
    int n_layer_dense_lead = 0;            // leading_dense_block_count: layers [0, n) have a dense FFN
    ExpertGating gating = ExpertGating::Softmax;
    bool weights_norm = false;             // renormalise the selected experts' weights to sum 1
    float weights_scale = 1.0f;            // expert_weights_scale
    int n_group = 0, n_group_used = 0;     // group-limited top-k (DeepSeek-V3); 0: off
};

// Multi-head latent attention (deepseek2). kv_lora_rank == 0: not MLA.
// The attention is computed in the absorbed form: the cache holds per token the normed latent
// c [kv_lora_rank] and the roped key k_pe [qk_rope_head_dim] shared by all heads, and head h scores
// (W_kb_h · q_nope_h)·c + q_pe_h·k_pe, so MLA is multi-query attention with head_dim_k =
// kv_lora_rank + qk_rope, head_dim_v = kv_lora_rank and n_head_kv = 1.
struct MlaParams {
    int64_t q_lora_rank = 0;               // 0: a plain wq (DeepSeek-V2-Lite)
    int64_t kv_lora_rank = 0;              // width of the cached latent
    int64_t qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
    int64_t n_embd_head_k() const { return qk_nope_head_dim + qk_rope_head_dim; }  // decompressed q/k head
};

struct HParams {
    std::string arch;
    int64_t n_vocab = 0;            // rows of token_embd
    int64_t n_embd = 0;
    int n_layer = 0;
    int64_t n_ff = 0;
    int n_head = 0, n_head_kv = 0;
    int64_t head_dim_k = 0, head_dim_v = 0;  // attention.key_length / value_length
    float norm_eps = 1e-5f;
    int64_t n_ctx_train = 0;
    RopeParams rope;                // global (full-attention) layers
    RopeParams rope_swa;            // sliding-window layers (gemma3)
    int n_swa = 0;                  // sliding window in tokens, 0 = none
    std::vector<bool> layer_swa;    // [n_layer] true: the layer uses the sliding window
    float attn_scale = 0.0f;        // q·k multiplier (1/sqrt(head_dim_k) unless the arch says)
    float embd_scale = 1.0f;        // token embedding multiplier (gemma: sqrt(n_embd))
    bool ffn_relu2 = false;         // bitnet: relu(gate)² ⊙ up instead of SwiGLU
    float final_logit_softcap = 0;  // logits = c·tanh(logits/c) when > 0 (gemma)
    MoeParams moe;
    MlaParams mla;

    int64_t n_embd_q() const { return int64_t(n_head) * head_dim_k; }
    int64_t n_embd_k_gqa() const { return int64_t(n_head_kv) * head_dim_k; }
    int64_t n_embd_v_gqa() const { return int64_t(n_head_kv) * head_dim_v; }
    bool is_mla() const { return mla.kv_lora_rank > 0; }
    // Per-token widths of the K and V caches. MLA caches one row [latent; rope key] of
    // kv_lora_rank + qk_rope (= n_embd_k_gqa: one kv head of head_dim_k) and no V: the values are
    // the latent itself.
    int64_t n_embd_k_cache() const { return n_embd_k_gqa(); }
    int64_t n_embd_v_cache() const { return is_mla() ? 0 : n_embd_v_gqa(); }
};

// Typed metadata helpers (GGUFError naming the key when absent or of another type).
float gguf_get_float(const GGUFFile &f, const std::string &key);
float gguf_get_float_or(const GGUFFile &f, const std::string &key, float dflt);
uint64_t gguf_get_uint_or(const GGUFFile &f, const std::string &key, uint64_t dflt);
bool gguf_get_bool_or(const GGUFFile &f, const std::string &key, bool dflt);

// Reads the hyperparameters common to all supported architectures; n_vocab is the row count of
// token_embd.weight. Architecture-specific values (embd_scale, swa) are set by the arch table.
// With "{arch}.expert_count" present (and non-zero) it also reads the routed-expert keys into moe:
// GGUFError when expert_used_count is not in [1, expert_count], the gating function is not
// softmax/sigmoid, or the groups do not divide the experts.
HParams read_hparams(const GGUFFile &f, const std::string &arch);

}  // namespace ktd
