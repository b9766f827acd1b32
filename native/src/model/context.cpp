// Context: the KV cache with its sequence slots, the forward's scratch and its backend; forward()
// checks a batch, cuts it into chunks of n_batch rows and runs each chunk through the layers.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>

#include "common/float16.h"
#include "kernels/attention.h"
#include "model/blocks.h"
#include "model/cpu_backend.h"
#include "model/cuda_device.h"
#include "model/model.h"

namespace ktd {

Context::Context(const Model &model, int64_t n_ctx, int n_seq_max, int64_t n_batch)
    : model_(model), n_ctx_(n_ctx), n_seq_max_(n_seq_max), n_batch_(n_batch) {
    if (n_ctx < 1 || n_ctx > (int64_t(1) << 24)) throw std::invalid_argument("n_ctx must be in [1, 2^24]");
    if (n_seq_max < 1 || n_seq_max > 4096) throw std::invalid_argument("n_seq_max must be in [1, 4096]");
    if (n_batch < 1 || n_batch > 65536) throw std::invalid_argument("n_batch must be in [1, 65536]");
    const HParams &hp = model.hparams();
    const size_t rows = size_t(n_seq_max) * size_t(n_ctx);
    for (int il = 0; il < hp.n_layer; ++il) {
        // Not value-initialized: pages are touched only as positions are written.
        k_cache_.emplace_back(new uint16_t[rows * size_t(hp.n_embd_k_cache())]);
        v_cache_.emplace_back(hp.n_embd_v_cache() > 0 ? new uint16_t[rows * size_t(hp.n_embd_v_cache())] : nullptr);
    }
    seq_len_.assign(size_t(n_seq_max), 0);
    next_pos_.assign(size_t(n_seq_max), -1);
    expert_counts_.assign(size_t(hp.n_layer) * size_t(hp.moe.n_expert), 0);
    const size_t nb = size_t(n_batch);
    s_.x.resize(nb * size_t(hp.n_embd));
    s_.xn.resize(nb * size_t(hp.n_embd));
    s_.tmp.resize(nb * size_t(std::max(hp.n_embd, int64_t(hp.n_head) * hp.head_dim_v)));
    s_.q.resize(nb * size_t(hp.n_embd_q()));
    s_.k.resize(nb * size_t(hp.n_embd_k_gqa()));
    s_.v.resize(nb * size_t(hp.n_embd_v_gqa()));
    s_.attn.resize(nb * size_t(int64_t(hp.n_head) * hp.head_dim_v));
    s_.gate.resize(nb * size_t(hp.n_ff));
    s_.up.resize(nb * size_t(hp.n_ff));
    s_.rope_cs.resize(nb * size_t(hp.rope.n_rot));
    s_.rope_cs_swa.resize(nb * size_t(hp.rope_swa.n_rot));
    s_.attn_tmp_stride = attn_scratch_layout(attn_rows_per_block(hp), hp.n_head / hp.n_head_kv, hp.head_dim_k,
                                             hp.head_dim_v).total;
    s_.attn_tmp.resize(size_t(model.pool().size()) * s_.attn_tmp_stride);
    if (hp.is_mla()) {
        const MlaParams &mla = hp.mla;
        s_.mla_q_a.resize(nb * size_t(mla.q_lora_rank));
        s_.mla_q.resize(nb * size_t(hp.n_head) * size_t(mla.n_embd_head_k()));
        s_.mla_heads.resize(nb * size_t(hp.n_head) * size_t(std::max(mla.qk_nope_head_dim, mla.v_head_dim)));
        s_.mm_thread.resize(size_t(model.pool().size()));
    }
    backend_ = std::make_unique<CpuBackend>(*this);
}

Context::~Context() = default;

int64_t Context::kv_bytes_per_token() const {
    const HParams &hp = model_.hparams();
    return int64_t(hp.n_layer) * (hp.n_embd_k_cache() + hp.n_embd_v_cache()) * int64_t(sizeof(uint16_t));
}

void Context::check_seq(int seq_id, const char *what) const {
    if (seq_id < 0 || seq_id >= n_seq_max_)
        throw std::invalid_argument(std::string(what) + ": sequence id " + std::to_string(seq_id) +
                                    " out of range [0, " + std::to_string(n_seq_max_) + ")");
}

int64_t Context::seq_len(int seq_id) const {
    check_seq(seq_id, "seq_len");
    return seq_len_[size_t(seq_id)];
}

void Context::free_seq(int seq_id) {
    check_seq(seq_id, "free_seq");
    seq_len_[size_t(seq_id)] = 0;
}

void Context::copy_seq(int src, int dst, int64_t n_tokens) {
    check_seq(src, "copy_seq");
    check_seq(dst, "copy_seq");
    if (n_tokens < 0 || n_tokens > seq_len_[size_t(src)])
        throw std::invalid_argument("copy_seq: n_tokens " + std::to_string(n_tokens) + " exceeds the " +
                                    std::to_string(seq_len_[size_t(src)]) + " tokens of sequence " +
                                    std::to_string(src));
    if (src == dst) {
        seq_len_[size_t(dst)] = n_tokens;
        return;
    }
    backend_->copy_kv(src, dst, n_tokens);
    const HParams &hp = model_.hparams();
    for (int il = 0; il < hp.n_layer; ++il) {
        // [n_seq][n_head_kv][n_ctx][head_dim]: the first n_tokens rows of each KV head.
        for (auto [cache, hd] : {std::pair{k_cache_[size_t(il)].get(), hp.head_dim_k},
                                 std::pair{v_cache_[size_t(il)].get(), hp.n_embd_v_cache() > 0 ? hp.head_dim_v : 0}}) {
            if (hd == 0) continue;  // no V cache (MLA)
            for (int64_t h = 0; h < hp.n_head_kv; ++h)
                std::memcpy(cache + kv_head_offset(dst, h, hp.n_head_kv, n_ctx_, hd),
                            cache + kv_head_offset(src, h, hp.n_head_kv, n_ctx_, hd),
                            size_t(n_tokens) * size_t(hd) * sizeof(uint16_t));
        }
    }
    seq_len_[size_t(dst)] = n_tokens;
}

void Context::set_backend(const std::string &name, int layers, const HeldExperts &experts) {
    if (name == backend_name_ && layers == backend_layers_ && experts == backend_experts_) return;
    // Leaving a device: its KV cache goes with it, the host's is stale.
    if (backend_name_.rfind("cuda", 0) == 0) std::fill(seq_len_.begin(), seq_len_.end(), int64_t(0));
    if (name == "cpu") {
        backend_ = std::make_unique<CpuBackend>(*this);
        hybrid_ = nullptr;
    } else if (name == "loopback") {
        auto hybrid =
            std::make_unique<HybridBackend>(*this, std::make_unique<LoopbackDevice>(*this, experts, layers), layers);
        hybrid_ = hybrid.get();
        backend_ = std::move(hybrid);
    } else if (name == "cuda" || name == "cuda-emulated") {
        set_device_backend(name, 0, 0, layers, experts);
        return;
    } else {
        throw std::invalid_argument("unknown backend '" + name + "' (cpu, loopback, cuda)");
    }
    backend_name_ = name;
    backend_layers_ = name == "cpu" ? 0 : layers;
    backend_experts_ = name == "cpu" ? HeldExperts{} : experts;
    if (profiling_) profiling_ = std::make_unique<ProfilingBackend>(*backend_, profile_);
}

void Context::set_device_backend(const std::string &name, int device, uint64_t vram_budget, int layers,
                                 const HeldExperts &experts) {
    if (name != "cuda" && name != "cuda-emulated")
        throw std::invalid_argument("unknown device backend '" + name + "' (cuda)");
    // Built before the old backend goes: a refusal (DeviceError) leaves the context as it was.
    auto hybrid = std::make_unique<HybridBackend>(
        *this, make_cuda_device(*this, name, device, vram_budget, layers, experts), layers);
    // The device's KV cache starts empty: the sequences held so far are dropped.
    std::fill(seq_len_.begin(), seq_len_.end(), int64_t(0));
    const bool prof_on = profiling_ != nullptr;
    profiling_.reset();
    hybrid_ = hybrid.get();
    backend_ = std::move(hybrid);
    backend_name_ = name;
    backend_layers_ = layers;
    backend_experts_ = experts;
    if (prof_on) profiling_ = std::make_unique<ProfilingBackend>(*backend_, profile_);
}

HybridStats Context::hybrid_stats() const { return hybrid_ ? hybrid_->stats() : HybridStats{}; }

void Context::set_profiling(bool on) {
    if (on && !profiling_) profiling_ = std::make_unique<ProfilingBackend>(*backend_, profile_);
    if (!on) profiling_.reset();
}

void Context::check_batch(const Batch &b) {
    if (b.n < 0) throw std::invalid_argument("forward: negative batch size");
    const HParams &hp = model_.hparams();
    // Validate every row before touching the cache: a rejected batch changes nothing.
    std::vector<int64_t> &next = next_pos_;  // expected next position per sequence, -1: none yet
    std::fill(next.begin(), next.end(), -1);
    for (int64_t i = 0; i < b.n; ++i) {
        const int s = b.seq_ids[i];
        check_seq(s, "forward");
        const int64_t p = b.positions[i];
        if (b.tokens[i] < 0 || b.tokens[i] >= hp.n_vocab)
            throw std::invalid_argument("forward: token id " + std::to_string(b.tokens[i]) + " out of range [0, " +
                                        std::to_string(hp.n_vocab) + ")");
        if (p >= n_ctx_)
            throw ContextOverflowError("position " + std::to_string(p) + " of sequence " + std::to_string(s) +
                                       " reaches the context limit n_ctx = " + std::to_string(n_ctx_));
        int64_t &nx = next[size_t(s)];
        if (nx < 0 ? (p < 0 || p > seq_len_[size_t(s)]) : p != nx)
            throw std::invalid_argument("forward: row " + std::to_string(i) + " has position " + std::to_string(p) +
                                        " for sequence " + std::to_string(s) + ", expected " +
                                        (nx < 0 ? "at most " + std::to_string(seq_len_[size_t(s)])
                                                : std::to_string(nx)) +
                                        " (positions of a sequence must be consecutive)");
        nx = p + 1;
    }
}

void Context::forward(const Batch &b, float *logits, int32_t *greedy) {
    OpTimer timer(profiling_ ? &profile_ : nullptr, ForwardOp::Forward);
    check_batch(b);
    // One row (decode): the first such steps tune the decode prefetch (kernels.h).
    const int tune = b.n == 1 ? k_decode_prefetch_tune_begin() : -1;
    const auto t0 = std::chrono::steady_clock::now();
    const HParams &hp = model_.hparams();
    int64_t out_row = 0;
    for (int64_t r0 = 0; r0 < b.n; r0 += n_batch_) {
        const int64_t n = std::min(n_batch_, b.n - r0);
        forward_chunk(b, r0, n, logits ? logits + out_row * hp.n_vocab : nullptr, greedy ? greedy + out_row : nullptr);
        for (int64_t i = r0; i < r0 + n; ++i) out_row += b.want_logits[i] ? 1 : 0;
    }
    if (tune >= 0)
        k_decode_prefetch_tune_end(
            tune, uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
                               .count()));
}

namespace {

// The final logit softcap (gemma3): y = c·tanh(y / c) on n logits, c > 0.
void softcap_logits(float *y, int64_t n, float c) {
    for (int64_t j = 0; j < n; ++j) y[j] = c * std::tanh(y[j] / c);
}

// The output head's row hook for a greedy forward: the final softcap (when the model has one) on
// the fresh logits, then each worker's argmax view of each row (sampling/greedy.h).
struct GreedyHook {
    sampling::GreedyBest *best;  // [n_threads][n_out]
    int64_t n_out;
    float softcap;

    static void fn(void *ctx, float *y, int64_t rows, int64_t r0, int64_t r1, int64_t n, int tid) {
        const GreedyHook &h = *static_cast<const GreedyHook *>(ctx);
        for (int64_t c = 0; c < n; ++c) {
            float *yc = y + c * rows + r0;
            if (h.softcap > 0.0f) softcap_logits(yc, r1 - r0, h.softcap);
            h.best[size_t(tid) * size_t(h.n_out) + size_t(c)].add(yc, r0, r1 - r0);
        }
    }
};

}  // namespace

void Context::forward_chunk(const Batch &b, int64_t r0, int64_t n, float *logits, int32_t *greedy) {
    const HParams &hp = model_.hparams();
    const ModelWeights &w = model_.weights();
    ThreadPool &pool = model_.pool();
    const int64_t E = hp.n_embd;

    // Per row: the embedding x [n][n_embd] and the rotary angles [n][n_rot] (and those of the
    // sliding-window layers, when they differ).
    const size_t embd_row_bytes = size_t(*ggml_row_size(w.token_embd->type, w.token_embd->ne[0]));
    const uint8_t *embd = w.token_embd_data;
    const float *ff = w.rope_freqs.empty() ? nullptr : w.rope_freqs.data();
    ForwardProfile *prof = profiling_ ? &profile_ : nullptr;
    std::optional<OpTimer> embed_timer(std::in_place, prof, ForwardOp::Embed);
    for_each_row(pool, n, kMinParallelRows, [&](int64_t i) {
        float *xi = s_.x.data() + i * E;
        w.token_embd_tk->dequantize_row(embd + size_t(b.tokens[r0 + i]) * embd_row_bytes, xi, E);
        if (hp.embd_scale != 1.0f)
            for (int64_t d = 0; d < E; ++d) xi[d] *= hp.embd_scale;
        rope_cos_sin(hp.rope, ff, b.positions[r0 + i], s_.rope_cs.data() + i * hp.rope.n_rot);
        rope_cos_sin(hp.rope_swa, ff, b.positions[r0 + i], s_.rope_cs_swa.data() + i * hp.rope_swa.n_rot);
    });
    // The sequence slots grow before the layers run: attention reads positions [0, p] of each row.
    for (int64_t i = r0; i < r0 + n; ++i) seq_len_[size_t(b.seq_ids[i])] = int64_t(b.positions[i]) + 1;
    embed_timer.reset();

    Backend &be = profiling_ ? *profiling_ : *backend_;
    be.begin_chunk(b.positions + r0, b.seq_ids + r0, n);
    const ArchSpec &arch = model_.arch();
    for (int il = 0; il < hp.n_layer; ++il) {
        be.begin_layer(il);
        arch.layer(be, hp, w.layers[size_t(il)], il);
    }
    be.end_chunk();

    // Output head on the marked rows only: gather, norm, logits [n_marked][n_vocab].
    OpTimer head_timer(prof, ForwardOp::OutputHead);
    int64_t n_out = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (!b.want_logits[r0 + i]) continue;
        rms_norm(s_.x.data() + i * E, w.output_norm.data(), s_.xn.data() + n_out * E, E, hp.norm_eps);
        ++n_out;
    }
    if (n_out == 0) return;
    if (!greedy) {
        matmul(&pool, w.output.pw, s_.xn.data(), n_out, logits, s_.mm);
        if (hp.final_logit_softcap > 0.0f) softcap_logits(logits, n_out * hp.n_vocab, hp.final_logit_softcap);
        return;
    }
    if (!logits) {
        if (s_.greedy_logits.size() < size_t(n_out * hp.n_vocab)) s_.greedy_logits.resize(size_t(n_out * hp.n_vocab));
        logits = s_.greedy_logits.data();
    }
    const size_t n_views = size_t(pool.size()) * size_t(n_out);
    if (s_.greedy_best.size() < n_views) s_.greedy_best.resize(n_views);
    std::fill(s_.greedy_best.begin(), s_.greedy_best.begin() + ptrdiff_t(n_views), sampling::GreedyBest{});
    GreedyHook h{s_.greedy_best.data(), n_out, hp.final_logit_softcap};
    const MatmulRowHook hook{&GreedyHook::fn, &h};
    const MatmulJob job{&w.output.pw, logits, nullptr, &hook};
    matmul_multi(&pool, &job, 1, s_.xn.data(), n_out, s_.mm);
    for (int64_t c = 0; c < n_out; ++c) {
        sampling::GreedyBest best = s_.greedy_best[size_t(c)];
        for (int t = 1; t < pool.size(); ++t) best.merge(s_.greedy_best[size_t(t) * size_t(n_out) + size_t(c)]);
        greedy[c] = best.result();
    }
}

void Context::linear(const Matrix &m, const float *x, int64_t n, float *y, const std::vector<float> *bias) {
    matmul(&model_.pool(), m.pw, x, n, y, s_.mm);
    if (bias && !bias->empty()) {
        const int64_t rows = m.pw.rows;
        const float *bv = bias->data();
        for_each_row(model_.pool(), n, kMinParallelRows, [&](int64_t i) {
            for (int64_t r = 0; r < rows; ++r) y[i * rows + r] += bv[r];
        });
    }
}

}  // namespace ktd
