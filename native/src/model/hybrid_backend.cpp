// The hybrid orchestration and its loopback device (see hybrid_backend.h).
#include "model/hybrid_backend.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "model/blocks.h"
#include "model/cpu_backend.h"
#include "model/model.h"

namespace ktd {

// --- Stream -----------------------------------------------------------------------------------

Stream::Stream() : thread_([this] { loop(); }) {}

Stream::~Stream() {
    {
        std::lock_guard<std::mutex> l(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
}

void Stream::submit(std::function<void()> fn) {
    {
        std::lock_guard<std::mutex> l(mu_);
        queue_.push_back(std::move(fn));
    }
    cv_.notify_all();
}

void Stream::sync() {
    std::unique_lock<std::mutex> l(mu_);
    done_cv_.wait(l, [&] { return queue_.empty() && !busy_; });
    if (error_) {
        std::exception_ptr e = error_;
        error_ = nullptr;
        std::rethrow_exception(e);
    }
}

void Stream::loop() {
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
        cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and nothing left
        std::function<void()> fn = std::move(queue_.front());
        queue_.erase(queue_.begin());
        busy_ = true;
        l.unlock();
        try {
            fn();
        } catch (...) {
            std::lock_guard<std::mutex> g(mu_);
            if (!error_) error_ = std::current_exception();
        }
        l.lock();
        busy_ = false;
        done_cv_.notify_all();
    }
}

// --- held experts -----------------------------------------------------------------------------

int device_layer_count(int n_layer, int layers) {
    if (layers < 0 || layers > n_layer)
        throw std::invalid_argument("device layers " + std::to_string(layers) + " outside [0, " +
                                    std::to_string(n_layer) + "] (0: all)");
    return layers == 0 ? n_layer : layers;
}

std::vector<std::vector<uint8_t>> held_expert_masks(const Model &model, const HeldExperts &experts,
                                                   int device_layers) {
    const int n_layer = model.hparams().n_layer, n_expert = model.hparams().moe.n_expert;
    const int on_device = device_layers == 0 ? n_layer : device_layers;
    std::vector<std::vector<uint8_t>> masks(static_cast<size_t>(n_layer));
    for (size_t il = 0; il < experts.size(); ++il) {
        if (experts[il].empty()) continue;
        const std::string where = "hot experts of layer " + std::to_string(il);
        if (int(il) >= on_device)
            throw std::invalid_argument(where + ": the layer is not on the device (device layers " +
                                        std::to_string(on_device) + ")");
        if (!model.weights().layers[il].ffn_gate_exps) throw std::invalid_argument(where + ": not a MoE layer");
        masks[il].assign(size_t(n_expert), 0);
        for (int32_t e : experts[il]) {
            if (e < 0 || e >= n_expert)
                throw std::invalid_argument(where + ": expert " + std::to_string(e) + " outside [0, " +
                                            std::to_string(n_expert) + ")");
            masks[il][size_t(e)] = 1;
        }
    }
    return masks;
}

void DeviceBackend::experts_async(const LayerWeights &, int, const std::vector<MoeSelection> &, Act, Act) {
    throw std::logic_error("DeviceBackend::experts_async: this device holds no routed experts");
}

// --- LoopbackDevice ---------------------------------------------------------------------------

LoopbackDevice::LoopbackDevice(const BackendSetup &setup, const HeldExperts &experts, int device_layers)
    : E_(setup.model.hparams().n_embd) {
    held_ = held_expert_masks(setup.model, experts, device_layers);
    cpu_ = std::make_unique<CpuBackend>(setup, 0, device_layer_count(setup.model.hparams().n_layer, device_layers));
}

LoopbackDevice::~LoopbackDevice() = default;

void LoopbackDevice::begin_chunk(float *x, const int32_t *positions, const int32_t *seq_ids, int64_t n) {
    n_ = n;
    cpu_->begin_chunk(x, positions, seq_ids, n);
}

std::vector<LayerMemory *> LoopbackDevice::memory() { return cpu_->memory(); }
void LoopbackDevice::norm(const std::vector<float> &w, Act in, Act out) { cpu_->norm(w, in, out); }
void LoopbackDevice::residual_add(Act t) { cpu_->residual_add(t); }
void LoopbackDevice::attention_in(const LayerWeights &w, int il) { cpu_->attention_in(w, il); }
void LoopbackDevice::attention(int il) { cpu_->attention(il); }
void LoopbackDevice::attention_out(const LayerWeights &w) { cpu_->attention_out(w); }
void LoopbackDevice::mla_attention(const LayerWeights &w, int il) { cpu_->mla_attention(w, il); }
void LoopbackDevice::glu_ffn(const LayerWeights &w, Glu act) { cpu_->glu_ffn(w, act); }

void LoopbackDevice::moe_ffn(const LayerWeights &, int) {
    throw std::logic_error("LoopbackDevice::moe_ffn: routed experts run on the host (HybridBackend)");
}

float *LoopbackDevice::buf(Act a) { return cpu_->buf(a); }  // the CPU backend's host activations

void LoopbackDevice::to_host(Act a, float *dst) {
    std::memcpy(dst, buf(a), size_t(n_ * E_) * sizeof(float));
}

void LoopbackDevice::add_from_host(Act a, const float *src) {
    float *d = buf(a);
    for (int64_t i = 0; i < n_ * E_; ++i) d[i] += src[i];
}

void LoopbackDevice::shared_expert_async(const LayerWeights &w, Act in, Act out) {
    const float *x = buf(in);
    float *y = buf(out);
    const int64_t n = n_, E = E_;
    // One thread, as a device stream runs beside the host: single-threaded matmuls, own scratch.
    stream_.submit([&w, x, y, n, E, this] { moe_shared_ffn(w, x, n, E, y, nullptr, shared_); });
}

// Each pair as the CPU's MoE computes an expert (its matrices' NUMA parts by rows), one thread.
void LoopbackDevice::experts_async(const LayerWeights &w, int, const std::vector<MoeSelection> &sel, Act in,
                                   Act out) {
    const float *x = buf(in);
    float *y = buf(out);
    stream_.submit([&w, &sel, x, y, this] {
        const int64_t E = E_, ff = w.ffn_gate_exps.rows;
        eg_.resize(size_t(ff));
        eu_.resize(size_t(ff));
        ey_.resize(size_t(E));
        auto run = [&](const MatrixStack &st, int32_t e, const float *in_row, float *out_row) {
            for (int p = 0; p < st.n_parts(); ++p)
                matmul(nullptr, st.parts(size_t(e))[p], in_row, 1, out_row + st.part_rows(p).first, shared_.mm);
        };
        for (const MoeSelection &s : sel) {
            const float *xi = x + int64_t(s.token) * E;
            run(w.ffn_gate_exps, s.expert, xi, eg_.data());
            run(w.ffn_up_exps, s.expert, xi, eu_.data());
            swiglu(eg_.data(), eu_.data(), ff);
            run(w.ffn_down_exps, s.expert, eg_.data(), ey_.data());
            float *yi = y + int64_t(s.token) * E;
            for (int64_t d = 0; d < E; ++d) yi[d] += s.weight * ey_[size_t(d)];
        }
    });
}

void LoopbackDevice::sync() { stream_.sync(); }

// --- HybridBackend ----------------------------------------------------------------------------

HybridBackend::HybridBackend(const BackendSetup &setup, std::unique_ptr<DeviceBackend> device, int device_layers)
    : model_(setup.model), taps_(setup.taps), dev_(std::move(device)) {
    const int n_layer = model_.hparams().n_layer;
    stats_.device_layers = device_layer_count(n_layer, device_layers);
    if (stats_.device_layers < n_layer) cpu_ = std::make_unique<CpuBackend>(setup, stats_.device_layers, n_layer);
    const size_t rows = size_t(setup.n_batch) * size_t(model_.hparams().n_embd);
    xn_ = dev_->host_buffer(0, rows);
    y_ = dev_->host_buffer(1, rows);
    if (!xn_) {
        host_xn_.resize(rows);
        xn_ = host_xn_.data();
    }
    if (!y_) {
        host_y_.resize(rows);
        y_ = host_y_.data();
    }
}

HybridBackend::~HybridBackend() = default;

Backend &HybridBackend::at() {
    if (on_device()) return *dev_;
    return *cpu_;
}

void HybridBackend::begin_chunk(float *x, const int32_t *positions, const int32_t *seq_ids, int64_t n) {
    x_ = x, positions_ = positions, seq_ids_ = seq_ids, n_ = n, il_ = 0;
    dev_->begin_chunk(x, positions, seq_ids, n);
}

std::vector<LayerMemory *> HybridBackend::memory() {
    std::vector<LayerMemory *> out = dev_->memory();
    if (cpu_)
        for (LayerMemory *m : cpu_->memory()) out.push_back(m);
    return out;
}

void HybridBackend::begin_layer(int il) {
    // The first CPU layer: the residual comes down (the device's end of chunk waits for its
    // stream), and the CPU backend takes the chunk from there.
    if (cpu_ && il == stats_.device_layers && il_ < il) {
        dev_->end_chunk();
        cpu_->begin_chunk(x_, positions_, seq_ids_, n_);
        stats_.bytes_to_host += uint64_t(n_) * uint64_t(model_.hparams().n_embd) * sizeof(float);
    }
    il_ = il;
}

void HybridBackend::end_chunk() {
    if (on_device()) dev_->end_chunk();
    else cpu_->end_chunk();
}

void HybridBackend::moe_ffn(const LayerWeights &w, int il) {
    if (!on_device()) {
        cpu_->moe_ffn(w, il);
        return;
    }
    const int64_t n = dev_->rows(), E = model_.hparams().n_embd;
    const MoeRun host{model_, moe_, mm_, taps_};
    const uint64_t bytes = uint64_t(n * E) * sizeof(float);
    using clock = std::chrono::steady_clock;
    const auto ns = [](clock::time_point a, clock::time_point b) {
        return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count());
    };
    const auto t0 = clock::now();
    dev_->to_host(Act::XN, xn_);
    stats_.bytes_to_host += bytes;
    const auto t1 = clock::now();
    dev_->shared_expert_async(w, Act::XN, Act::Tmp);
    const uint8_t *held = dev_->experts_held(il);
    try {
        if (held) {
            // The host routes every token and computes the experts the device does not hold; the
            // held ones' pairs go to the device as soon as they are known (from inside the host's
            // call, on this thread), which adds them after the shared expert while the host computes
            // the others.
            dev_sel_.clear();
            bool launched = false;
            std::exception_ptr launch_error;
            MoeDeviceExperts split{held, &dev_sel_, nullptr};
            split.routed = [&] {
                launched = true;
                if (dev_sel_.empty()) return;
                try {
                    dev_->experts_async(w, il, dev_sel_, Act::XN, Act::Tmp);
                } catch (...) {
                    launch_error = std::current_exception();
                }
            };
            ::ktd::moe_ffn(host, w, il, xn_, n, y_, MoePart::Routed, &split);
            const bool early = launched;
            if (!launched) split.routed();  // (every path calls it; this keeps the pairs if one did not)
            if (launch_error) std::rethrow_exception(launch_error);
            if (early && !dev_sel_.empty()) stats_.early_launches += 1;
            stats_.device_pairs += dev_sel_.size();
            stats_.bytes_to_device += dev_sel_.size() * sizeof(MoeSelection);  // the pairs go up
        } else {
            ::ktd::moe_ffn(host, w, il, xn_, n, y_, MoePart::Routed);
        }
    } catch (...) {
        dev_->sync();  // never leave the stream writing into buffers the caller may free
        throw;
    }
    const auto t2 = clock::now();
    dev_->sync();
    const auto t3 = clock::now();
    dev_->add_from_host(Act::Tmp, y_);
    const auto t4 = clock::now();
    stats_.to_host_ns += ns(t0, t1);
    stats_.host_experts_ns += ns(t1, t2);
    stats_.sync_wait_ns += ns(t2, t3);
    stats_.from_host_ns += ns(t3, t4);
    stats_.bytes_to_device += bytes;
    stats_.moe_calls += 1;
    stats_.routed_pairs += uint64_t(n) * uint64_t(model_.hparams().moe.n_expert_used);
}

}  // namespace ktd
