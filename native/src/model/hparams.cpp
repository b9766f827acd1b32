#include "model/hparams.h"

#include <cmath>
#include <variant>

#include "common/error.h"
#include "gguf/gguf_file.h"

namespace ktd {

float gguf_get_float(const GGUFFile &f, const std::string &key) {
    const GGUFKeyValue *kv = f.find_key(key);
    if (!kv) throw GGUFError("missing metadata key " + key);
    if (auto p = std::get_if<float>(&kv->value)) return *p;
    if (auto p = std::get_if<double>(&kv->value)) return float(*p);
    throw GGUFError("metadata key " + key + " has type " +
                    std::string(gguf_value_type_name(gguf_value_type(kv->value))) + ", expected FLOAT32");
}

float gguf_get_float_or(const GGUFFile &f, const std::string &key, float dflt) {
    return f.find_key(key) ? gguf_get_float(f, key) : dflt;
}

uint64_t gguf_get_uint_or(const GGUFFile &f, const std::string &key, uint64_t dflt) {
    return f.find_key(key) ? f.get_uint(key) : dflt;
}

bool gguf_get_bool_or(const GGUFFile &f, const std::string &key, bool dflt) {
    const GGUFKeyValue *kv = f.find_key(key);
    if (!kv) return dflt;
    if (auto p = std::get_if<bool>(&kv->value)) return *p;
    throw GGUFError("metadata key " + key + " has type " +
                    std::string(gguf_value_type_name(gguf_value_type(kv->value))) + ", expected BOOL");
}

namespace {

// llama.cpp's LLAMA_MAX_EXPERTS is 512; leave room without letting a corrupt count size buffers.
constexpr uint64_t kMaxExperts = 4096;

int checked_int(uint64_t v, const std::string &key, uint64_t max) {
    if (v == 0 || v > max) throw GGUFError("metadata key " + key + " = " + std::to_string(v) + " is out of range");
    return int(v);
}

// Routed-expert keys (present only in MoE files). Defaults where a key is absent follow llama.cpp:
// experts as wide as n_ff / n_expert_used (Mixtral: n_ff itself, set by its arch), softmax gating,
// no renormalisation, no scaling, no groups.
void read_moe_hparams(const GGUFFile &f, const std::string &p, HParams &hp) {
    MoeParams &m = hp.moe;
    const uint64_t n_expert = f.get_uint(p + "expert_count");
    if (n_expert == 0) return;  // a dense model that writes the key
    m.n_expert = checked_int(n_expert, p + "expert_count", kMaxExperts);
    const uint64_t used = f.get_uint(p + "expert_used_count");
    if (used == 0 || used > n_expert)
        throw GGUFError("metadata key " + p + "expert_used_count = " + std::to_string(used) +
                        " is out of range [1, " + std::to_string(n_expert) + "] (expert_count)");
    m.n_expert_used = int(used);
    const uint64_t ff_default = uint64_t(hp.n_ff / m.n_expert_used);
    m.n_ff_exp = checked_int(gguf_get_uint_or(f, p + "expert_feed_forward_length", ff_default),
                             p + "expert_feed_forward_length", 1 << 22);
    m.n_expert_shared = int(gguf_get_uint_or(f, p + "expert_shared_count", 0));
    if (m.n_expert_shared > 64) throw GGUFError("metadata key " + p + "expert_shared_count is out of range");
    m.n_ff_shexp = int64_t(gguf_get_uint_or(f, p + "expert_shared_feed_forward_length",
                                            uint64_t(m.n_ff_exp) * uint64_t(m.n_expert_shared)));
    if (m.n_ff_shexp > (1 << 22)) throw GGUFError("metadata key " + p + "expert_shared_feed_forward_length is out of range");
    m.n_layer_dense_lead = int(gguf_get_uint_or(f, p + "leading_dense_block_count", 0));
    if (m.n_layer_dense_lead > hp.n_layer)
        throw GGUFError("metadata key " + p + "leading_dense_block_count = " + std::to_string(m.n_layer_dense_lead) +
                        " exceeds block_count " + std::to_string(hp.n_layer));
    // 0 (llama.cpp's "none") or absent: softmax, as the pinned llama.cpp does for deepseek2 ("for
    // compatibility with DeepSeek V2/V2.5 GGUFs"), also for files whose model routes by sigmoid
    // (tests/model/test_deepseek2.py::test_absent_gating_func_is_softmax_as_in_llama_cpp).
    const uint64_t gating = gguf_get_uint_or(f, p + "expert_gating_func", 0);
    if (gating == 0 || gating == 1)
        m.gating = ExpertGating::Softmax;
    else if (gating == 2)
        m.gating = ExpertGating::Sigmoid;
    else
        throw GGUFError("unsupported " + p + "expert_gating_func " + std::to_string(gating) +
                        " (supported: 1 softmax, 2 sigmoid)");
    m.weights_norm = gguf_get_bool_or(f, p + "expert_weights_norm", false);
    const float scale = gguf_get_float_or(f, p + "expert_weights_scale", 0.0f);
    if (!std::isfinite(scale) || scale < 0.0f)
        throw GGUFError("metadata key " + p + "expert_weights_scale must be finite and non-negative");
    m.weights_scale = scale == 0.0f ? 1.0f : scale;  // llama.cpp: 0 means "not scaled"
    const uint64_t n_group = gguf_get_uint_or(f, p + "expert_group_count", 0);
    const uint64_t n_group_used = gguf_get_uint_or(f, p + "expert_group_used_count", 0);
    if (n_group > 1) {  // llama.cpp groups only when there are at least two
        if (n_expert % n_group != 0 || n_expert / n_group < 2)
            throw GGUFError("metadata key " + p + "expert_group_count = " + std::to_string(n_group) +
                            " must divide expert_count " + std::to_string(n_expert) + " into groups of at least 2");
        if (n_group_used == 0 || n_group_used > n_group || n_group_used * (n_expert / n_group) < used)
            throw GGUFError("metadata key " + p + "expert_group_used_count = " + std::to_string(n_group_used) +
                            " is out of range: need 1..expert_group_count groups holding at least expert_used_count experts");
        m.n_group = int(n_group);
        m.n_group_used = int(n_group_used);
    }
}

}  // namespace

HParams read_hparams(const GGUFFile &f, const std::string &arch) {
    const std::string p = arch + ".";
    HParams hp;
    hp.arch = arch;
    const GGUFTensorInfo *embd = f.find_tensor("token_embd.weight");
    if (!embd) throw GGUFError("missing tensor token_embd.weight");
    hp.n_vocab = int64_t(embd->ne[1]);
    hp.n_embd = checked_int(f.get_uint(p + "embedding_length"), p + "embedding_length", 1 << 20);
    hp.n_layer = checked_int(f.get_uint(p + "block_count"), p + "block_count", 4096);
    hp.n_ff = checked_int(f.get_uint(p + "feed_forward_length"), p + "feed_forward_length", 1 << 22);
    hp.n_head = checked_int(f.get_uint(p + "attention.head_count"), p + "attention.head_count", 4096);
    hp.n_head_kv = checked_int(gguf_get_uint_or(f, p + "attention.head_count_kv", uint64_t(hp.n_head)),
                               p + "attention.head_count_kv", 4096);
    if (hp.n_head % hp.n_head_kv != 0)
        throw GGUFError(p + "attention.head_count (" + std::to_string(hp.n_head) +
                        ") is not a multiple of head_count_kv (" + std::to_string(hp.n_head_kv) + ")");
    const uint64_t hd_default = uint64_t(hp.n_embd / hp.n_head);
    hp.head_dim_k = checked_int(gguf_get_uint_or(f, p + "attention.key_length", hd_default),
                                p + "attention.key_length", 1 << 16);
    hp.head_dim_v = checked_int(gguf_get_uint_or(f, p + "attention.value_length", uint64_t(hp.head_dim_k)),
                                p + "attention.value_length", 1 << 16);
    hp.norm_eps = gguf_get_float_or(f, p + "attention.layer_norm_rms_epsilon", 1e-5f);
    // NaN, 0 or a negative epsilon loads and makes every logit NaN (1 / sqrt(mean + eps)).
    if (!(hp.norm_eps > 0.0f) || !std::isfinite(hp.norm_eps))
        throw GGUFError(p + "attention.layer_norm_rms_epsilon must be a positive finite number");
    hp.n_ctx_train = int64_t(gguf_get_uint_or(f, p + "context_length", 0));
    hp.attn_scale = 1.0f / std::sqrt(float(hp.head_dim_k));

    RopeParams &r = hp.rope;
    r.n_rot = checked_int(gguf_get_uint_or(f, p + "rope.dimension_count", uint64_t(hp.head_dim_k)),
                          p + "rope.dimension_count", uint64_t(hp.head_dim_k));
    if (r.n_rot % 2 != 0) throw GGUFError(p + "rope.dimension_count must be even");
    r.freq_base = gguf_get_float_or(f, p + "rope.freq_base", 10000.0f);
    if (!(r.freq_base > 0.0f)) throw GGUFError(p + "rope.freq_base must be positive");
    std::string scaling = "none";
    if (f.find_key(p + "rope.scaling.type")) scaling = std::string(f.get_string(p + "rope.scaling.type"));
    float factor = gguf_get_float_or(f, p + "rope.scaling.factor", 0.0f);
    // Older files give the linear factor as rope.scale_linear.
    if (scaling == "none" && f.find_key(p + "rope.scale_linear")) {
        factor = gguf_get_float(f, p + "rope.scale_linear");
        scaling = factor > 0.0f && factor != 1.0f ? "linear" : "none";
    }
    if (scaling == "linear" || scaling == "yarn") {
        if (!(factor > 0.0f)) throw GGUFError(p + "rope.scaling.factor must be positive for " + scaling + " scaling");
        r.freq_scale = 1.0f / factor;
        r.scaling = scaling == "linear" ? RopeScaling::Linear : RopeScaling::Yarn;
        if (r.scaling == RopeScaling::Yarn) {
            r.n_ctx_orig = int(gguf_get_uint_or(f, p + "rope.scaling.original_context_length",
                                                uint64_t(hp.n_ctx_train)));
            if (r.n_ctx_orig <= 0) throw GGUFError(p + "rope.scaling.original_context_length is required for YaRN");
            r.ext_factor = 1.0f;
            r.attn_factor = gguf_get_float_or(f, p + "rope.scaling.attn_factor", 1.0f);
            r.beta_fast = gguf_get_float_or(f, p + "rope.scaling.yarn_beta_fast", 32.0f);
            r.beta_slow = gguf_get_float_or(f, p + "rope.scaling.yarn_beta_slow", 1.0f);
        }
    } else if (scaling != "none") {
        throw GGUFError("unsupported " + p + "rope.scaling.type '" + scaling + "' (supported: none, linear, yarn)");
    }
    hp.rope_swa = r;
    hp.layer_swa.assign(size_t(hp.n_layer), false);
    if (f.find_key(p + "expert_count")) read_moe_hparams(f, p, hp);
    return hp;
}

}  // namespace ktd
