// CudaDevice: the device half of the hybrid forward (model/hybrid_backend.h) on a CUDA GPU, driven
// only through the C ABI of libktd_cuda.so (cuda/cuda_api.h) — so the same code runs over the real
// library or over its host emulation, which is how CI tests it against the CPU forward.
//
// On the device: every non-routed-expert weight of the layers (attention, dense FFN, shared
// experts, norms, biases) as the GGUF blocks are stored in the file (read from a mapping of its
// own: the CPU's repacked layouts are not used), the KV cache in F16 [n_seq][n_ctx][n_head_kv·hd]
// per layer (MLA: the latent cache, K rows only), each layer's behind LayerMemory
// (sequence_memory.h), the chunk's activations. The embeddings come up per chunk (n_embd floats a row) and
// the residual goes back down at the end of the chunk for the output head, which stays on the
// CPU; per MoE layer XN goes down and the routed sum comes up through page-locked buffers.
//
// Supported: the llama family (llama, qwen2, qwen3, and the MoE ones qwen2moe, qwen3moe, Mixtral
// through HybridBackend), deepseek2 (MLA over a latent cache) and gemma3 (sliding-window layers
// with their own rope, post-norms) and bitnet (TQ1_0/TQ2_0 blocks, tensor scales, sub-norms,
// squared ReLU). Anything else (head sizes over 256, K/V heads of different sizes, a weight type
// with no kernel) is refused at construction with DeviceError naming it.
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda/cuda_api.h"
#include "model/backend_setup.h"
#include "model/hybrid_backend.h"
#include "model/sequence_memory.h"

namespace ktd {

// The device cannot run this model, or a device call failed (the message has the ABI's reason).
// Python: ktd._native.DeviceError (a RuntimeError).
struct DeviceError : std::runtime_error {
    using std::runtime_error::runtime_error;
};
// The device backend's memory does not fit the VRAM budget (the message has the numbers).
// Python: ktd._native.DeviceMemoryError (a DeviceError and a MemoryError).
struct DeviceMemoryError : DeviceError {
    using DeviceError::DeviceError;
};

// What a CudaDevice for this model and context would allocate on the device, in bytes.
struct CudaDevicePlan {
    uint64_t weights = 0, kv_cache = 0, activations = 0;
    uint64_t total() const { return weights + kv_cache + activations; }
};

class CudaDevice final : public DeviceBackend {
public:
    // Uploads the weights and allocates the KV cache and the activations on `device` through
    // `api`, within vram_budget bytes (0: the device's memory is the limit). DeviceError when the
    // model is not supported or the device cannot be used; DeviceMemoryError when the plan does
    // not fit the budget (nothing is allocated then).
    // layers: the first `layers` layers only (gpu.layers; 0: all), the others run on the CPU
    // (HybridBackend); std::invalid_argument outside [0, n_layer].
    // experts: the routed experts it holds per layer (gpu.experts), uploaded and computed here.
    CudaDevice(const BackendSetup &setup, const CudaApi &api, int device, uint64_t vram_budget, int layers = 0,
               const HeldExperts &experts = {});
    ~CudaDevice() override;
    CudaDevice(const CudaDevice &) = delete;
    CudaDevice &operator=(const CudaDevice &) = delete;

    static CudaDevicePlan plan(const BackendSetup &setup, int layers = 0, const HeldExperts &experts = {});
    // Why this model's first `layers` (0: all) and those experts cannot run on the device ("" when
    // they can).
    static std::string unsupported(const Model &model, int layers = 0, const HeldExperts &experts = {});

    void begin_chunk(float *x, const int32_t *positions, const int32_t *seq_ids, int64_t n) override;
    void norm(const std::vector<float> &w, Act in, Act out) override;
    void residual_add(Act t) override;
    void attention_in(const LayerWeights &w, int il) override;
    void attention(int il) override;
    void attention_out(const LayerWeights &w) override;
    void mla_attention(const LayerWeights &w, int il) override;
    void glu_ffn(const LayerWeights &w, Glu act) override;
    void moe_ffn(const LayerWeights &w, int il) override;
    void end_chunk() override;
    std::vector<LayerMemory *> memory() override;

    void to_host(Act a, float *dst) override;
    void add_from_host(Act a, const float *src) override;
    void shared_expert_async(const LayerWeights &w, Act in, Act out) override;
    void sync() override;
    int64_t rows() const override { return n_; }
    float *host_buffer(int slot, size_t floats) override;
    void experts_async(const LayerWeights &w, int il, const std::vector<MoeSelection> &sel, Act in,
                       Act out) override;

    uint64_t device_bytes() const { return used_; }

private:
    struct DMat {
        const void *w = nullptr;  // device
        int type = 0;
        int64_t rows = 0, k = 0;
        explicit operator bool() const { return w != nullptr; }
    };
    // A stack of n equal matrices (deepseek2's per-head attn_k_b, attn_v_b), `stride` bytes apart.
    struct DStack {
        DMat m;  // the first; matrix h at m.w + h·stride
        int64_t n = 0;
        uint64_t stride = 0;
    };
    struct DLayer {
        DMat wq, wk, wv, wo, gate, up, down, gate_sh, up_sh, down_sh, shexp_gate;
        DMat wq_a, wq_b, wkv_a;  // MLA
        DStack wk_b, wv_b;       // MLA
        uint16_t *k_cache = nullptr, *v_cache = nullptr;
        std::vector<std::array<DMat, 3>> experts;  // [n_expert] gate, up, down of the held ones (else null)
    };
    // A layer's KV (or latent) cache on the device as LayerMemory: copy_seq copies rows on the
    // device and waits for them.
    class KvMemory final : public LayerMemory {
    public:
        KvMemory(CudaDevice &dev, const DLayer &l);
        int64_t bytes_per_token() const override;
        void copy_seq(int src, int dst, int64_t n_tokens) override;
        void free_seq(int) override {}

    private:
        CudaDevice &dev_;
        uint16_t *k_, *v_;  // [n_seq][n_ctx][width] (v_ null: no V cache)
        int64_t k_width_ = 0, v_width_ = 0;
    };

    void check(int rc, const char *what) const;
    void *dalloc(uint64_t bytes);
    const float *dvec(const std::vector<float> &v) const;  // the device copy of a weight vector (null: empty)
    float *buf(Act a) const;
    // y = scale · (m · x): the scale is a tensor's (bitnet's "*.scale"; 1 elsewhere).
    void gemv(const DMat &m, const float *x, int64_t n, float *y, float scale = 1.0f);
    // y_h [n][rows] = matrix h · x_h [n][k] for every matrix h of a stack in one batched GEMV: x_h
    // at x + h·x_head with its rows x_pitch floats apart, y_h at y + h·y_head with rows y_pitch apart.
    void per_head_gemv(const DStack &st, const float *x, int64_t x_head, int64_t x_pitch, float *y, int64_t y_head,
                       int64_t y_pitch);
    // Device-to-device copy of `rows` rows of `width` floats, dpitch / spitch floats apart.
    void copy2d(float *dst, int64_t dpitch, const float *src, int64_t spitch, int64_t width, int64_t rows);
    void upload_weights();

    const Model &model_;
    const CudaApi &api_;
    int64_t n_ctx_;
    KtdCudaCtx *c_ = nullptr;
    KtdCudaEvent *ev_ = nullptr;
    std::vector<DLayer> layers_;
    std::vector<std::unique_ptr<KvMemory>> memory_;  // [layers_] their caches
    float *host_x_ = nullptr;  // the chunk's x (begin_chunk)
    std::map<const float *, const float *> vecs_;  // host vector data → device copy
    const float *rope_ff_ = nullptr;
    float *x_ = nullptr, *xn_ = nullptr, *attn_ = nullptr, *tmp_ = nullptr, *q_ = nullptr, *k_ = nullptr, *v_ = nullptr;
    float *g_ = nullptr, *u_ = nullptr, *y_ = nullptr, *gsh_ = nullptr;
    // MLA (mla_attention): q LoRA [nb][q_lora], q [nb][H][nope + rope], the cache rows [nb][r + rope],
    // the latent's norm scratch [nb][r], the MQA query [nb][H][r + rope] and its output [nb][H][r].
    float *mqa_ = nullptr, *mq_ = nullptr, *mkv_ = nullptr, *mlat_ = nullptr, *mqm_ = nullptr, *mout_ = nullptr;
    void *act_ = nullptr;
    int32_t *pos_ = nullptr, *nkv_ = nullptr;
    int64_t *kv_rows_ = nullptr, *kv_first_ = nullptr;
    // The sliding-window layers' key ranges (gemma3; only when the model has a window).
    int32_t *nkv_swa_ = nullptr;
    int64_t *kv_first_swa_ = nullptr;
    // Page-locked staging: the chunk's positions/rows, and the two hybrid buffers.
    int32_t *h_pos_ = nullptr, *h_nkv_ = nullptr, *h_nkv_swa_ = nullptr;
    int64_t *h_rows_ = nullptr, *h_first_ = nullptr, *h_first_swa_ = nullptr;
    float *h_buf_[2] = {nullptr, nullptr};
    // Held experts (experts_async): the gathered rows [nb][E]; the pairs grouped by expert, tokens
    // [sel_cap_] then weights [sel_cap_], on the device and page-locked; the groups' bounds.
    float *xg_ = nullptr;
    int32_t *d_sel_ = nullptr, *h_sel_ = nullptr;
    int64_t sel_cap_ = 0;
    std::vector<int64_t> group_, fill_;
    int64_t n_ = 0, E_ = 0, n_batch_ = 0;
    uint64_t used_ = 0;
};

// The device backend selected by name: "cuda" (libktd_cuda.so) or "cuda-emulated" (the ABI's host
// emulation; tests). DeviceError with the reason when the library cannot be used.
std::unique_ptr<DeviceBackend> make_cuda_device(const BackendSetup &setup, const std::string &name, int device,
                                                uint64_t vram_budget, int layers = 0,
                                                const HeldExperts &experts = {});

}  // namespace ktd
