// The hybrid forward (KTransformers' design): everything read every token — attention and its KV
// cache, norms, dense FFN layers, the shared experts, the output head — runs on an accelerator,
// and the routed experts run on the CPU pool, from CPU memory. Per MoE layer only activations
// cross: the normed hidden state XN goes to the host, the routed experts' sum comes back and is
// added to the shared expert's output, which the device computed meanwhile. Expert weights never
// move.
//
//   device:  ... norm → XN ──to_host──┐            shared expert(XN) → Tmp ─┐
//   host:                             └→ router + routed experts (pool) → y ─┴→ add_from_host: Tmp += y
//
// HybridBackend is that orchestration, written against DeviceBackend: a Backend (the blocks the
// layers call) plus the copies and the device's stream. LoopbackDevice plays the device on the
// CPU — its blocks are the CPU backend's, its copies memcpys, its stream one thread — so the
// split, the copies, the synchronisation and the overlap are tested for every architecture on
// any machine against the plain CPU forward; a CUDA device plugs into the same place.
//
// A card too small for every layer's dense part (gpu.layers = N): layers [0, N) run as above and
// layers [N, n_layer) wholly on the CPU backend (their routed and shared experts in the CPU's MoE,
// their KV cache in host memory). The per-sequence memory is the device's layers' and the CPU
// layers', in layer order. At layer N the residual comes down once (the device's end of
// chunk); the output head is on the host either way.
//
// Hot experts (gpu.experts): a device may hold some routed experts of its MoE layers (the most
// used ones, from the routing profile). The host still routes every token; the pairs whose expert
// the device holds go up as (token, expert, weight) and the device adds those experts' weighted
// outputs after the shared expert. The pairs are enqueued from inside the host's MoE call as soon
// as it has routed (MoeDeviceExperts::routed, on the calling thread), so the device computes them
// while the pool computes the others. The sum's order differs from the CPU's (held experts are
// added after the shared expert): float rounding, not bits.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "kernels/kernels.h"
#include "model/backend.h"
#include "model/backend_setup.h"
#include "model/moe.h"

namespace ktd {

class CpuBackend;
class Model;

// What crossed between host and device, in bytes, and how many MoE layers did it.
struct HybridStats {
    uint64_t bytes_to_host = 0, bytes_to_device = 0, moe_calls = 0;
    int device_layers = 0;  // layers [0, device_layers) run on the device, the rest on the CPU
    // Where the MoE layers' time went (steady clock, ns): copies to and from the host, the routed
    // experts on the CPU pool, and the wait for the device's shared expert after them (the sync
    // overhead: 0 when the device finished first).
    uint64_t to_host_ns = 0, host_experts_ns = 0, sync_wait_ns = 0, from_host_ns = 0;
    // Routed (token, expert) pairs of the device's MoE layers, and how many of them the device
    // computed (its held experts): the hot experts' hit rate is device_pairs / routed_pairs.
    uint64_t routed_pairs = 0, device_pairs = 0;
    // MoE layers whose held experts went to the device from inside the host's MoE call, once
    // routed (beside the host's experts), of those with any pair for the device.
    uint64_t early_launches = 0;
};

// experts as masks [n_layer][n_expert] (1: held; a layer with none is empty). std::invalid_argument
// for an expert out of range, a layer that is not a MoE layer or not among the first
// device_layers (0: all).
std::vector<std::vector<uint8_t>> held_expert_masks(const Model &model, const HeldExperts &experts,
                                                   int device_layers);
// The layers a device runs when asked for `layers` (0: all): std::invalid_argument outside
// [0, n_layer].
int device_layer_count(int n_layer, int layers);

class DeviceBackend : public Backend {
public:
    // The chunk's rows of activation a (n_embd wide) → dst [n][n_embd] in host memory.
    virtual void to_host(Act a, float *dst) = 0;
    // a += src [n][n_embd] from host memory (a copy to the device, then an add there).
    virtual void add_from_host(Act a, const float *src) = 0;
    // Start the shared expert of layer w on `in` into `out` on the device's stream (out = 0 when the
    // layer has none); returns at once. sync() waits for it.
    virtual void shared_expert_async(const LayerWeights &w, Act in, Act out) = 0;
    virtual void sync() = 0;
    virtual int64_t rows() const = 0;  // rows of the current chunk
    // Host memory for the per-layer copies, `floats` long, slot 0 (XN down) or 1 (the routed sum up):
    // page-locked on a CUDA device, so the copies are DMA; null: HybridBackend uses its own vectors.
    virtual float *host_buffer(int /*slot*/, size_t /*floats*/) { return nullptr; }
    // Layer il's routed experts this device holds ([n_expert], nonzero: held); null: none.
    const uint8_t *experts_held(int il) const {
        return size_t(il) < held_.size() && !held_[size_t(il)].empty() ? held_[size_t(il)].data() : nullptr;
    }
    // out rows += Σ weight · expert(row `token` of in) over sel (experts it holds), on the stream
    // after what was enqueued (the shared expert); sel stays valid until sync().
    virtual void experts_async(const LayerWeights &w, int il, const std::vector<MoeSelection> &sel, Act in,
                               Act out);

protected:
    // [n_layer][n_expert] the routed experts the device holds (held_expert_masks); set by the
    // device's constructor, empty: none.
    std::vector<std::vector<uint8_t>> held_;
};

// One worker thread running submitted work in order: the loopback device's stream.
class Stream {
public:
    Stream();
    ~Stream();
    Stream(const Stream &) = delete;
    Stream &operator=(const Stream &) = delete;
    void submit(std::function<void()> fn);
    void sync();  // waits until everything submitted has run; rethrows the first exception

private:
    void loop();
    std::mutex mu_;
    std::condition_variable cv_, done_cv_;
    std::vector<std::function<void()>> queue_;
    bool stop_ = false, busy_ = false;
    std::exception_ptr error_;
    std::thread thread_;
};

class LoopbackDevice final : public DeviceBackend {
public:
    explicit LoopbackDevice(const BackendSetup &setup, const HeldExperts &experts = {}, int device_layers = 0);
    ~LoopbackDevice() override;

    void begin_chunk(float *x, const int32_t *positions, const int32_t *seq_ids, int64_t n) override;
    void norm(const std::vector<float> &w, Act in, Act out) override;
    void residual_add(Act t) override;
    void attention_in(const LayerWeights &w, int il) override;
    void attention(int il) override;
    void attention_out(const LayerWeights &w) override;
    void mla_attention(const LayerWeights &w, int il) override;
    void glu_ffn(const LayerWeights &w, Glu act) override;
    // A device runs no routed experts: HybridBackend sends them to the host.
    void moe_ffn(const LayerWeights &w, int il) override;

    void to_host(Act a, float *dst) override;
    void add_from_host(Act a, const float *src) override;
    void shared_expert_async(const LayerWeights &w, Act in, Act out) override;
    void sync() override;
    int64_t rows() const override { return n_; }
    void experts_async(const LayerWeights &w, int il, const std::vector<MoeSelection> &sel, Act in,
                       Act out) override;
    std::vector<LayerMemory *> memory() override;

private:
    float *buf(Act a);
    std::unique_ptr<CpuBackend> cpu_;  // the device's layers, their KV caches in host memory
    Stream stream_;
    MoeSharedScratch shared_;
    std::vector<float> eg_, eu_, ey_;  // a held expert's gate/up rows and output (the stream's)
    int64_t n_ = 0, E_ = 0;
};

class HybridBackend final : public Backend {
public:
    // device_layers: layers [0, device_layers) on the device, the others on the CPU backend
    // (0 or n_layer: every layer on the device); the device holds only its layers.
    HybridBackend(const BackendSetup &setup, std::unique_ptr<DeviceBackend> device, int device_layers = 0);
    ~HybridBackend() override;

    void begin_chunk(float *x, const int32_t *positions, const int32_t *seq_ids, int64_t n) override;
    void begin_layer(int il) override;
    void norm(const std::vector<float> &w, Act in, Act out) override { at().norm(w, in, out); }
    void residual_add(Act t) override { at().residual_add(t); }
    void attention_in(const LayerWeights &w, int il) override { at().attention_in(w, il); }
    void attention(int il) override { at().attention(il); }
    void attention_out(const LayerWeights &w) override { at().attention_out(w); }
    void mla_attention(const LayerWeights &w, int il) override { at().mla_attention(w, il); }
    void glu_ffn(const LayerWeights &w, Glu act) override { at().glu_ffn(w, act); }
    // XN → Tmp. A device layer: XN to the host; routed experts on the CPU pool while the device
    // runs the shared expert; their sum back to the device and added. A CPU layer: the CPU's MoE.
    void moe_ffn(const LayerWeights &w, int il) override;
    void end_chunk() override;
    std::vector<LayerMemory *> memory() override;

    const HybridStats &stats() const { return stats_; }

private:
    bool on_device() const { return il_ < stats_.device_layers; }
    Backend &at();  // the backend of the current layer

    const Model &model_;
    ForwardTaps &taps_;
    std::unique_ptr<DeviceBackend> dev_;
    std::unique_ptr<CpuBackend> cpu_;  // the layers past device_layers (null when the device has all)
    MoeScratch moe_;                   // the routed experts' on the host
    MatmulScratch mm_;
    float *x_ = nullptr;
    const int32_t *positions_ = nullptr, *seq_ids_ = nullptr;
    int64_t n_ = 0;
    int il_ = 0;
    std::vector<MoeSelection> dev_sel_;    // the current MoE layer's pairs for the device's held experts
    std::vector<float> host_xn_, host_y_;  // [n_batch][n_embd] host-side activations (when the device has no pinned ones)
    float *xn_ = nullptr, *y_ = nullptr;   // the buffers used: the device's host_buffer(), else those vectors
    HybridStats stats_;
};

}  // namespace ktd
