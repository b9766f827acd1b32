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

namespace {

int checked_int(uint64_t v, const std::string &key, uint64_t max) {
    if (v == 0 || v > max) throw GGUFError("metadata key " + key + " = " + std::to_string(v) + " is out of range");
    return int(v);
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
    return hp;
}

}  // namespace ktd
