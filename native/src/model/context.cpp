// Context: batch validation, the chunking, the layer loop and the output head over a backend that
// owns the layers' scratch and sequence memory (context.h).
#include "model/context.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "model/blocks.h"
#include "model/cpu_backend.h"
#include "model/cuda_device.h"
#include "model/hybrid_backend.h"
#include "model/model.h"

namespace ktd {

Context::Context(const Model &model, int64_t n_ctx, int n_seq_max, int64_t n_batch)
    : model_(model), n_ctx_(n_ctx), n_seq_max_(n_seq_max), n_batch_(n_batch) {
    if (n_ctx < 1 || n_ctx > (int64_t(1) << 24)) throw std::invalid_argument("n_ctx must be in [1, 2^24]");
    if (n_seq_max < 1 || n_seq_max > 4096) throw std::invalid_argument("n_seq_max must be in [1, 4096]");
    if (n_batch < 1 || n_batch > 65536) throw std::invalid_argument("n_batch must be in [1, 65536]");
    const HParams &hp = model.hparams();
    next_pos_.assign(size_t(n_seq_max), -1);
    taps_.expert_counts.assign(size_t(hp.n_layer) * size_t(hp.moe.n_expert), 0);
    x_.resize(size_t(n_batch) * size_t(hp.n_embd));
    head_xn_.resize(size_t(n_batch) * size_t(hp.n_embd));
    use_backend(std::make_unique<CpuBackend>(setup()), nullptr, "cpu", 0, {});
}

Context::~Context() = default;

int64_t Context::seq_len(int seq_id) const {
    mem_->check_seq(seq_id, "seq_len");
    return mem_->seq_len(seq_id);
}

void Context::reset_expert_counts() {
    std::fill(taps_.expert_counts.begin(), taps_.expert_counts.end(), uint64_t(0));
}

void Context::use_backend(std::unique_ptr<Backend> be, const HybridBackend *hybrid, const std::string &name,
                          int layers, const HeldExperts &experts) {
    auto mem = std::make_unique<SequenceMemory>(n_seq_max_, be->memory());
    backend_ = std::move(be);
    mem_ = std::move(mem);
    hybrid_ = hybrid;
    backend_name_ = name;
    backend_layers_ = layers;
    backend_experts_ = experts;
}

void Context::set_backend(const std::string &name, int layers, const HeldExperts &experts) {
    if (name == backend_name_ && layers == backend_layers_ && experts == backend_experts_) return;
    if (name == "cpu") {
        use_backend(std::make_unique<CpuBackend>(setup()), nullptr, name, 0, {});
    } else if (name == "loopback") {
        auto hybrid =
            std::make_unique<HybridBackend>(setup(), std::make_unique<LoopbackDevice>(setup(), experts, layers), layers);
        const HybridBackend *h = hybrid.get();
        use_backend(std::move(hybrid), h, name, layers, experts);
    } else if (name == "cuda" || name == "cuda-emulated") {
        set_device_backend(name, 0, 0, layers, experts);
    } else {
        throw std::invalid_argument("unknown backend '" + name + "' (cpu, loopback, cuda)");
    }
}

void Context::set_device_backend(const std::string &name, int device, uint64_t vram_budget, int layers,
                                 const HeldExperts &experts) {
    if (name != "cuda" && name != "cuda-emulated")
        throw std::invalid_argument("unknown device backend '" + name + "' (cuda)");
    // Built before the old backend goes: a refusal (DeviceError) leaves the context as it was.
    auto hybrid = std::make_unique<HybridBackend>(
        setup(), make_cuda_device(setup(), name, device, vram_budget, layers, experts), layers);
    const HybridBackend *h = hybrid.get();
    use_backend(std::move(hybrid), h, name, layers, experts);
}

HybridStats Context::hybrid_stats() const { return hybrid_ ? hybrid_->stats() : HybridStats{}; }

void Context::check_batch(const Batch &b) {
    if (b.n < 0) throw std::invalid_argument("forward: negative batch size");
    const HParams &hp = model_.hparams();
    // Validate every row before touching the memory: a rejected batch changes nothing.
    std::vector<int64_t> &next = next_pos_;  // expected next position per sequence, -1: none yet
    std::fill(next.begin(), next.end(), -1);
    for (int64_t i = 0; i < b.n; ++i) {
        const int s = b.seq_ids[i];
        mem_->check_seq(s, "forward");
        const int64_t p = b.positions[i];
        if (b.tokens[i] < 0 || b.tokens[i] >= hp.n_vocab)
            throw std::invalid_argument("forward: token id " + std::to_string(b.tokens[i]) + " out of range [0, " +
                                        std::to_string(hp.n_vocab) + ")");
        if (p >= n_ctx_)
            throw ContextOverflowError("position " + std::to_string(p) + " of sequence " + std::to_string(s) +
                                       " reaches the context limit n_ctx = " + std::to_string(n_ctx_));
        int64_t &nx = next[size_t(s)];
        if (nx < 0 ? !mem_->can_start(s, p) : p != nx)
            throw std::invalid_argument("forward: row " + std::to_string(i) + " has position " + std::to_string(p) +
                                        " for sequence " + std::to_string(s) + ", expected " +
                                        (nx < 0 ? mem_->start_rule(s) : std::to_string(nx)) +
                                        " (positions of a sequence must be consecutive)");
        nx = p + 1;
    }
}

void Context::forward(const Batch &b, float *logits, int32_t *greedy, const uint8_t *keep) {
    if (keep && (!greedy || !logits)) throw std::invalid_argument("forward: keep needs the greedy ids and logits");
    OpTimer timer(taps_.profile, ForwardOp::Forward);
    check_batch(b);
    // One row (decode): the first such steps tune the decode prefetch (kernels.h).
    const int tune = b.n == 1 ? k_decode_prefetch_tune_begin() : -1;
    const auto t0 = std::chrono::steady_clock::now();
    const HParams &hp = model_.hparams();
    int64_t out_row = 0, kept_row = 0;  // marked rows, and those of them whose logits are kept
    for (int64_t r0 = 0; r0 < b.n; r0 += n_batch_) {
        const int64_t n = std::min(n_batch_, b.n - r0);
        const int64_t first = keep ? kept_row : out_row;
        forward_chunk(b, r0, n, logits ? logits + first * hp.n_vocab : nullptr, greedy ? greedy + out_row : nullptr,
                      keep);
        for (int64_t i = r0; i < r0 + n; ++i) {
            out_row += b.want_logits[i] ? 1 : 0;
            kept_row += b.want_logits[i] && keep && keep[i] ? 1 : 0;
        }
    }
    if (tune >= 0)
        k_decode_prefetch_tune_end(
            tune, uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
                               .count()));
}

void Context::embed(const Batch &b, int64_t r0, int64_t n) {
    const HParams &hp = model_.hparams();
    const ModelWeights &w = model_.weights();
    const int64_t E = hp.n_embd;
    const size_t embd_row_bytes = size_t(*ggml_row_size(w.token_embd->type, w.token_embd->ne[0]));
    const uint8_t *embd = w.token_embd_data;
    for_each_row(model_.pool(), n, kMinParallelRows, [&](int64_t i) {
        float *xi = x_.data() + i * E;
        w.token_embd_tk->dequantize_row(embd + size_t(b.tokens[r0 + i]) * embd_row_bytes, xi, E);
        if (hp.embd_scale != 1.0f)
            for (int64_t d = 0; d < E; ++d) xi[d] *= hp.embd_scale;
    });
}

void Context::forward_chunk(const Batch &b, int64_t r0, int64_t n, float *logits, int32_t *greedy,
                            const uint8_t *keep) {
    const HParams &hp = model_.hparams();
    const ModelWeights &w = model_.weights();
    Backend &be = *backend_;
    {
        OpTimer embed_timer(taps_.profile, ForwardOp::Embed);
        embed(b, r0, n);
        // The sequence slots grow before the layers run: attention reads positions [0, p] of each row.
        for (int64_t i = r0; i < r0 + n; ++i) mem_->set_len(b.seq_ids[i], int64_t(b.positions[i]) + 1);
        be.begin_chunk(x_.data(), b.positions + r0, b.seq_ids + r0, n);
    }
    Blocks blocks(be, taps_.profile);
    const ArchSpec &arch = model_.arch();
    for (int il = 0; il < hp.n_layer; ++il) {
        be.begin_layer(il);
        arch.layer(blocks, hp, w.layers[size_t(il)], il);
    }
    be.end_chunk();
    OpTimer head_timer(taps_.profile, ForwardOp::OutputHead);
    output_head(b, r0, n, logits, greedy, keep);
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

void Context::output_head(const Batch &b, int64_t r0, int64_t n, float *logits, int32_t *greedy,
                          const uint8_t *keep) {
    const HParams &hp = model_.hparams();
    const ModelWeights &w = model_.weights();
    const int64_t E = hp.n_embd, V = hp.n_vocab;
    // Gather and norm the marked rows: xn [n_marked][n_embd].
    int64_t n_out = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (!b.want_logits[r0 + i]) continue;
        rms_norm(x_.data() + i * E, w.output_norm.data(), head_xn_.data() + n_out * E, E, hp.norm_eps);
        ++n_out;
    }
    if (n_out == 0) return;
    if (!greedy) {
        matmul(&model_.pool(), w.output.pw, head_xn_.data(), n_out, logits, head_mm_);
        if (hp.final_logit_softcap > 0.0f) softcap_logits(logits, n_out * V, hp.final_logit_softcap);
        return;
    }
    // Every marked row's logits into `logits`, or into the scratch when only some (keep) or none
    // are wanted.
    float *all = logits;
    if (keep || !logits) {
        if (greedy_logits_.size() < size_t(n_out * V)) greedy_logits_.resize(size_t(n_out * V));
        all = greedy_logits_.data();
    }
    greedy_head(n_out, all, greedy);
    if (!keep) return;
    int64_t c = 0, k = 0;  // marked row, kept row
    for (int64_t i = 0; i < n; ++i) {
        if (!b.want_logits[r0 + i]) continue;
        if (keep[r0 + i]) std::copy_n(all + c * V, V, logits + (k++) * V);
        ++c;
    }
}

void Context::greedy_head(int64_t n_out, float *logits, int32_t *greedy) {
    const HParams &hp = model_.hparams();
    ThreadPool &pool = model_.pool();
    const size_t n_views = size_t(pool.size()) * size_t(n_out);
    if (greedy_best_.size() < n_views) greedy_best_.resize(n_views);
    std::fill(greedy_best_.begin(), greedy_best_.begin() + ptrdiff_t(n_views), sampling::GreedyBest{});
    GreedyHook h{greedy_best_.data(), n_out, hp.final_logit_softcap};
    const MatmulRowHook hook{&GreedyHook::fn, &h};
    const MatmulJob job{&model_.weights().output.pw, logits, nullptr, &hook};
    matmul_multi(&pool, &job, 1, head_xn_.data(), n_out, head_mm_);
    for (int64_t c = 0; c < n_out; ++c) {
        sampling::GreedyBest best = greedy_best_[size_t(c)];
        for (int t = 1; t < pool.size(); ++t) best.merge(greedy_best_[size_t(t) * size_t(n_out) + size_t(c)]);
        greedy[c] = best.result();
    }
}

}  // namespace ktd
