// CudaDevice (model/cuda_device.h): the hybrid forward's device half over the ktd_cuda ABI.
#include "model/cuda_device.h"

#include <algorithm>
#include <cstring>
#include <span>

#include "cuda/block_math.h"
#include "gguf/gguf_file.h"
#include "model/model.h"

namespace ktd {

namespace {

bool kernel_type(GGMLType t) {
    return t == GGMLType::F32 || t == GGMLType::F16 || t == GGMLType::BF16 || bm::visit_block_type(t, [](auto) {});
}

// The matrices of a layer that live on the device (the routed experts and the router stay on the CPU).
template <class F>
void for_each_device_matrix(const LayerWeights &w, F &&f) {
    for (const Matrix *m : {&w.wq, &w.wk, &w.wv, &w.wo, &w.ffn_gate, &w.ffn_up, &w.ffn_down, &w.ffn_gate_shexp,
                            &w.ffn_up_shexp, &w.ffn_down_shexp, &w.wq_a, &w.wq_b, &w.wkv_a_mqa})
        if (*m) f(*m);
}

// The per-head matrix stacks of a layer (MLA's attn_k_b and attn_v_b), on the device whole.
template <class F>
void for_each_device_stack(const LayerWeights &w, F &&f) {
    for (const MatrixStack *st : {&w.wk_b, &w.wv_b})
        if (*st) f(*st);
}

template <class F>
void for_each_device_vector(const LayerWeights &w, F &&f) {
    for (const std::vector<float> *v : {&w.attn_norm, &w.ffn_norm, &w.bq, &w.bk, &w.bv, &w.bo, &w.attn_q_norm,
                                        &w.attn_k_norm, &w.ffn_gate_inp_shexp, &w.attn_q_a_norm, &w.attn_kv_a_norm,
                                        &w.post_attention_norm, &w.post_ffw_norm, &w.attn_sub_norm, &w.ffn_sub_norm})
        if (!v->empty()) f(*v);
}

KtdRope ktd_rope(const RopeParams &rp) {
    KtdRope r{};
    r.n_rot = rp.n_rot;
    r.neox = rp.type == RopeType::Neox ? 1 : 0;
    r.yarn = rp.scaling == RopeScaling::Yarn ? 1 : 0;
    r.n_ctx_orig = rp.n_ctx_orig;
    r.freq_base = rp.freq_base;
    r.freq_scale = rp.freq_scale;
    r.ext_factor = rp.ext_factor;
    r.attn_factor = rp.attn_factor;
    r.beta_fast = rp.beta_fast;
    r.beta_slow = rp.beta_slow;
    return r;
}

// ktd_cuda_glu's activation code.
int glu_code(Glu act) {
    switch (act) {
        case Glu::SwiGLU: return 0;
        case Glu::GeGLU: return 1;
        case Glu::ReLU2: return 2;
    }
    throw std::logic_error("CudaDevice: a GLU with no ABI code");
}

std::string mib(uint64_t b) { return std::to_string((b + (1u << 19)) >> 20) + " MiB"; }

constexpr uint64_t kAlign = 256;  // every allocation's bytes rounded up (as cudaMalloc's granularity)
uint64_t aligned(uint64_t b) { return (b + kAlign - 1) / kAlign * kAlign; }

// The layers a device with `layers` (0: all) holds: the first ones of the model.
std::span<const LayerWeights> device_layers(const Model &model, int layers) {
    const std::vector<LayerWeights> &all = model.weights().layers;
    if (layers < 0 || size_t(layers) > all.size())
        throw std::invalid_argument("CUDA device: layers " + std::to_string(layers) + " outside [0, " +
                                    std::to_string(all.size()) + "] (0: all)");
    return {all.data(), layers == 0 ? all.size() : size_t(layers)};
}

// Widest row any device matmul reads (the activation scratch) and the widest FFN.
int64_t max_k(const Model &model) {
    const HParams &hp = model.hparams();
    int64_t k = std::max<int64_t>(hp.n_embd, int64_t(hp.n_head) * hp.head_dim_v);
    for (const LayerWeights &w : model.weights().layers) {
        for_each_device_matrix(w, [&](const Matrix &m) { k = std::max<int64_t>(k, int64_t(m.info->ne[0])); });
        if (w.ffn_down_exps) k = std::max<int64_t>(k, int64_t(w.ffn_down_exps.info->ne[0]));  // held experts
        // A stack's batched GEMV quantizes every matrix's input at once: n_mat · k per row.
        for_each_device_stack(w, [&](const MatrixStack &st) {
            k = std::max<int64_t>(k, int64_t(st.info->ne[0]) * int64_t(st.info->ne[2]));
        });
    }
    return k;
}

// The held experts' grouping scratch (experts_async): a chunk's gathered rows [n_batch][n_embd],
// and its (token, weight) pairs [n_batch · n_expert_used] of each.
uint64_t held_pairs(const Model &model, int64_t n_batch) {
    return uint64_t(n_batch) * uint64_t(std::max(1, model.hparams().moe.n_expert_used));
}
bool any_held(const std::vector<std::vector<uint8_t>> &masks) {
    return std::any_of(masks.begin(), masks.end(), [](const auto &m) { return !m.empty(); });
}
uint64_t held_scratch_bytes(const Model &model, int64_t n_batch) {
    return aligned(uint64_t(n_batch) * uint64_t(model.hparams().n_embd) * 4) + aligned(held_pairs(model, n_batch) * 8);
}

int64_t max_ff(const Model &model) {
    int64_t ff = 1;
    for (const LayerWeights &w : model.weights().layers) {
        for (const Matrix *m : {&w.ffn_gate, &w.ffn_gate_shexp})
            if (*m) ff = std::max<int64_t>(ff, int64_t(m->info->ne[1]));
        if (w.ffn_gate_exps) ff = std::max<int64_t>(ff, w.ffn_gate_exps.rows);  // held experts
    }
    return ff;
}

// MLA's device buffers, in floats per batch row and floats of padding each (mla_attention ropes
// k_pe and q_pe as "heads" that start inside a row, so the last row's range runs past the data by
// the padding; only its first rope dims are touched): q LoRA, q, the cache rows, the latent's
// norm scratch, the MQA query and its output.
std::vector<std::pair<int64_t, int64_t>> mla_widths(const HParams &hp) {
    const MlaParams &m = hp.mla;
    const int64_t H = hp.n_head, nope = m.qk_nope_head_dim, rope = m.qk_rope_head_dim, r = m.kv_lora_rank;
    return {{std::max<int64_t>(m.q_lora_rank, 1), 0}, {H * (nope + rope), nope}, {r + rope, r}, {r, 0},
            {H * (r + rope), 0}, {H * r, 0}};
}

// The three matrices of a routed expert (the gate, up and down stacks).
template <class F>
void for_each_expert_stack(const LayerWeights &w, F &&f) {
    for (const MatrixStack *st : {&w.ffn_gate_exps, &w.ffn_up_exps, &w.ffn_down_exps}) f(*st);
}

}  // namespace

std::string CudaDevice::unsupported(const Model &model, int layers, const HeldExperts &experts) {
    const HParams &hp = model.hparams();
    static const char *const kArchs[] = {"llama",     "qwen2",  "qwen3", "qwen2moe", "qwen3moe",
                                         "deepseek2", "gemma3", "bitnet"};
    if (std::find_if(std::begin(kArchs), std::end(kArchs), [&](const char *a) { return hp.arch == a; }) ==
        std::end(kArchs))
        return "architecture '" + hp.arch + "' has no CUDA device path yet (llama, qwen2, qwen3, qwen2moe, qwen3moe, "
               "Mixtral, deepseek2, gemma3, bitnet have)";
    if (hp.is_mla()) {
        // The latent cache rows are the keys (r + rope) and their first r the values.
        const MlaParams &m = hp.mla;
        if (m.kv_lora_rank + m.qk_rope_head_dim > 1024)
            return "MLA cache rows of " + std::to_string(m.kv_lora_rank + m.qk_rope_head_dim) + " > 1024 values";
        if (m.v_head_dim > m.kv_lora_rank) return "MLA v_head_dim larger than kv_lora_rank";
        if (hp.rope.n_rot != m.qk_rope_head_dim || hp.rope.n_rot > 512) return "MLA rope dims unlike the rope's n_rot";
    } else {
        if (hp.head_dim_k != hp.head_dim_v) return "K and V heads of different sizes have no CUDA device path yet";
        if (hp.head_dim_k > 256 || hp.head_dim_k <= 0) return "head_dim " + std::to_string(hp.head_dim_k) + " > 256";
        for (const RopeParams *rp : {&hp.rope, &hp.rope_swa})
            if (rp->n_rot > hp.head_dim_k || rp->n_rot > 512) return "rope n_rot larger than the head";
    }
    const std::span<const LayerWeights> on_device = device_layers(model, layers);
    for (size_t il = 0; il < on_device.size(); ++il) {
        const LayerWeights &w = on_device[il];
        std::string bad;
        auto typed = [&](const GGUFTensorInfo *info) {
            if (bad.empty() && !kernel_type(info->type))
                bad = std::string(info->name) + " is " + std::string(ggml_type_name(info->type)) +
                      ", which has no CUDA kernel (F32, F16, BF16, " + bm::kBlockTypeNames + ")";
        };
        for_each_device_matrix(w, [&](const Matrix &m) { typed(m.info); });
        for_each_device_stack(w, [&](const MatrixStack &st) { typed(st.info); });
        if (il < experts.size() && !experts[il].empty())
            for_each_expert_stack(w, [&](const MatrixStack &st) { typed(st.info); });
        if (!bad.empty()) return bad;
    }
    return "";
}

CudaDevicePlan CudaDevice::plan(const BackendSetup &setup, int layers, const HeldExperts &experts) {
    const Model &model = setup.model;
    const HParams &hp = model.hparams();
    const std::span<const LayerWeights> on_device = device_layers(model, layers);
    CudaDevicePlan p;
    const auto masks = held_expert_masks(model, experts, layers);
    for (size_t il = 0; il < on_device.size(); ++il)
        for (size_t e = 0; e < masks[il].size(); ++e)
            if (masks[il][e])
                for_each_expert_stack(on_device[il], [&](const MatrixStack &st) {
                    p.weights += aligned(st.info->nbytes / uint64_t(st.info->ne[2]));
                });
    for (const LayerWeights &w : on_device) {
        for_each_device_matrix(w, [&](const Matrix &m) { p.weights += aligned(m.info->nbytes); });
        for_each_device_stack(w, [&](const MatrixStack &st) { p.weights += aligned(st.info->nbytes); });
        for_each_device_vector(w, [&](const std::vector<float> &v) { p.weights += aligned(v.size() * 4); });
    }
    if (!model.weights().rope_freqs.empty()) p.weights += aligned(model.weights().rope_freqs.size() * 4);
    const uint64_t rows = uint64_t(setup.n_seq_max) * uint64_t(setup.n_ctx);
    p.kv_cache = uint64_t(on_device.size()) * (aligned(rows * uint64_t(hp.n_embd_k_cache()) * 2) +
                                         aligned(rows * uint64_t(hp.n_embd_v_cache()) * 2));
    const uint64_t nb = uint64_t(setup.n_batch), E = uint64_t(hp.n_embd);
    const uint64_t attn_w = uint64_t(hp.n_head) * uint64_t(hp.head_dim_v), ff = uint64_t(max_ff(model));
    // MLA: no q, k, v buffers of the GQA path; its own (mla_widths) instead.
    const bool mla = hp.is_mla();
    for (uint64_t width : {E, E, attn_w, std::max(E, attn_w), mla ? 0 : uint64_t(hp.n_embd_q()),
                           mla ? 0 : uint64_t(hp.n_embd_k_gqa()), mla ? 0 : uint64_t(hp.n_embd_v_gqa()), ff, ff, E,
                           uint64_t(1)})
        p.activations += aligned(nb * width * 4);  // x xn attn tmp q k v g u y gsh
    if (mla)
        for (const auto &[width, pad] : mla_widths(hp)) p.activations += aligned((nb * uint64_t(width) + uint64_t(pad)) * 4);
    p.activations += aligned(nb * uint64_t(max_k(model)) / 32 * KTD_CUDA_ACT_BLOCK_BYTES);
    p.activations += 2 * aligned(nb * 4) + 2 * aligned(nb * 8);  // pos, n_kv, kv rows, kv first
    if (hp.n_swa > 0) p.activations += aligned(nb * 4) + aligned(nb * 8);  // the window's n_kv, kv first
    if (any_held(masks)) p.activations += held_scratch_bytes(model, setup.n_batch);
    return p;
}

void CudaDevice::check(int rc, const char *what) const {
    if (rc == 0) return;
    const std::string m = std::string("CUDA device (") + api_.name + "): " + what + ": " + api_.ctx_error(c_);
    if (rc == KTD_CUDA_E_BUDGET) throw DeviceMemoryError(m);
    throw DeviceError(m);
}

void *CudaDevice::dalloc(uint64_t bytes) {
    void *p = nullptr;
    check(api_.alloc(c_, &p, aligned(bytes)), "alloc");
    used_ += aligned(bytes);
    return p;
}

CudaDevice::CudaDevice(const BackendSetup &setup, const CudaApi &api, int device, uint64_t vram_budget, int layers,
                       const HeldExperts &experts)
    : model_(setup.model), api_(api), n_ctx_(setup.n_ctx), E_(setup.model.hparams().n_embd),
      n_batch_(setup.n_batch) {
    held_ = held_expert_masks(model_, experts, layers);
    if (const std::string why = unsupported(model_, layers, experts); !why.empty())
        throw DeviceError("CUDA device: " + why);
    const CudaDevicePlan p = plan(setup, layers, experts);
    const std::string what = layers == 0 || layers == model_.hparams().n_layer
                                 ? std::string("the model")
                                 : "the first " + std::to_string(layers) + " layers";
    if (vram_budget && p.total() > vram_budget)
        throw DeviceMemoryError("CUDA device: " + what + " needs " + mib(p.total()) + " (" + std::to_string(p.total()) +
                                " bytes: weights " + std::to_string(p.weights) + ", KV cache " +
                                std::to_string(p.kv_cache) + " for n_ctx " + std::to_string(setup.n_ctx) + " x " +
                                std::to_string(setup.n_seq_max) + " sequences, activations " +
                                std::to_string(p.activations) + ") on the device, over the VRAM budget of " +
                                mib(vram_budget) + " (" + std::to_string(vram_budget) + " bytes)");
    char msg[512] = {0};
    if (const int rc = api_.ctx_create(device, vram_budget, &c_, msg, sizeof msg); rc != 0 || !c_)
        throw DeviceError(std::string("CUDA device (") + api_.name + "): cannot use device " + std::to_string(device) +
                          ": " + msg);
    try {
        if (vram_budget == 0) {
            uint64_t dfree = 0, dtotal = 0;
            check(api_.mem_info(c_, nullptr, nullptr, &dfree, &dtotal), "mem_info");
            if (dtotal && p.total() > dfree)
                throw DeviceMemoryError("CUDA device: " + what + " needs " + mib(p.total()) + " on the device, " +
                                        mib(dfree) + " of " + mib(dtotal) + " are free");
        }
        check(api_.event_create(c_, &ev_), "event_create");
        const HParams &hp = model_.hparams();
        const int64_t nb = n_batch_, E = E_;
        const int64_t attn_w = int64_t(hp.n_head) * hp.head_dim_v, ff = max_ff(model_);
        x_ = static_cast<float *>(dalloc(uint64_t(nb * E) * 4));
        xn_ = static_cast<float *>(dalloc(uint64_t(nb * E) * 4));
        attn_ = static_cast<float *>(dalloc(uint64_t(nb * attn_w) * 4));
        tmp_ = static_cast<float *>(dalloc(uint64_t(nb * std::max(E, attn_w)) * 4));
        if (hp.is_mla()) {
            float **bufs[] = {&mqa_, &mq_, &mkv_, &mlat_, &mqm_, &mout_};
            const auto widths = mla_widths(hp);
            for (size_t i = 0; i < widths.size(); ++i)
                *bufs[i] = static_cast<float *>(dalloc(uint64_t(nb * widths[i].first + widths[i].second) * 4));
        } else {
            q_ = static_cast<float *>(dalloc(uint64_t(nb * hp.n_embd_q()) * 4));
            k_ = static_cast<float *>(dalloc(uint64_t(nb * hp.n_embd_k_gqa()) * 4));
            v_ = static_cast<float *>(dalloc(uint64_t(nb * hp.n_embd_v_gqa()) * 4));
        }
        g_ = static_cast<float *>(dalloc(uint64_t(nb * ff) * 4));
        u_ = static_cast<float *>(dalloc(uint64_t(nb * ff) * 4));
        y_ = static_cast<float *>(dalloc(uint64_t(nb * E) * 4));
        gsh_ = static_cast<float *>(dalloc(uint64_t(nb) * 4));
        act_ = dalloc(uint64_t(nb * max_k(model_) / 32) * KTD_CUDA_ACT_BLOCK_BYTES);
        pos_ = static_cast<int32_t *>(dalloc(uint64_t(nb) * 4));
        nkv_ = static_cast<int32_t *>(dalloc(uint64_t(nb) * 4));
        kv_rows_ = static_cast<int64_t *>(dalloc(uint64_t(nb) * 8));
        kv_first_ = static_cast<int64_t *>(dalloc(uint64_t(nb) * 8));
        if (hp.n_swa > 0) {
            nkv_swa_ = static_cast<int32_t *>(dalloc(uint64_t(nb) * 4));
            kv_first_swa_ = static_cast<int64_t *>(dalloc(uint64_t(nb) * 8));
        }
        if (any_held(held_)) {
            xg_ = static_cast<float *>(dalloc(uint64_t(nb * E) * 4));
            sel_cap_ = int64_t(held_pairs(model_, nb));
            d_sel_ = static_cast<int32_t *>(dalloc(uint64_t(sel_cap_) * 8));
            void *hs = nullptr;
            check(api_.host_alloc(c_, &hs, uint64_t(sel_cap_) * 8), "host_alloc");
            h_sel_ = static_cast<int32_t *>(hs);
        }
        void *h = nullptr;  // rows, first, first_swa (int64); pos, n_kv, n_kv_swa (int32)
        check(api_.host_alloc(c_, &h, uint64_t(nb) * (3 * 8 + 3 * 4)), "host_alloc");
        h_rows_ = static_cast<int64_t *>(h);
        h_first_ = h_rows_ + nb;
        h_first_swa_ = h_first_ + nb;
        h_pos_ = reinterpret_cast<int32_t *>(h_first_swa_ + nb);
        h_nkv_ = h_pos_ + nb;
        h_nkv_swa_ = h_nkv_ + nb;
        const uint64_t rows = uint64_t(setup.n_seq_max) * uint64_t(n_ctx_);
        layers_.resize(device_layers(model_, layers).size());
        for (DLayer &l : layers_) {
            l.k_cache = static_cast<uint16_t *>(dalloc(rows * uint64_t(hp.n_embd_k_cache()) * 2));
            if (hp.n_embd_v_cache() > 0)  // none with MLA: the values are the latent K rows
                l.v_cache = static_cast<uint16_t *>(dalloc(rows * uint64_t(hp.n_embd_v_cache()) * 2));
            memory_.push_back(std::make_unique<KvMemory>(*this, l));
        }
        upload_weights();
        check(api_.sync(c_), "upload");
    } catch (...) {
        api_.ctx_destroy(c_);  // frees everything allocated through it
        throw;
    }
}

CudaDevice::~CudaDevice() {
    if (c_) api_.ctx_destroy(c_);
}

void CudaDevice::upload_weights() {
    const Model &model = model_;
    // A mapping of our own: the model's may be detached once its arenas hold the (repacked) weights.
    GGUFOpenOptions o;
    o.willneed = false;
    const GGUFFile file = GGUFFile::open(model.file().path(), o);
    auto upload = [&](const void *src, uint64_t bytes) {
        void *d = dalloc(bytes);
        check(api_.copy(c_, d, src, bytes, KTD_CUDA_H2D), "upload");
        return d;
    };
    // A tensor of the load (null: an absent optional one) as stored, its first matrix's shape, and
    // the number of matrices of a stack (a 3-D tensor).
    // The load's tensor in our mapping, checked unchanged (a stack: 3-D).
    auto find = [&](const GGUFTensorInfo *info, bool stack) {
        const GGUFTensorInfo *t = file.find_tensor(info->name);
        if (!t || t->nbytes != info->nbytes || (stack && t->n_dims != 3))
            throw DeviceError("CUDA device: tensor " + std::string(info->name) + " changed in " + file.path() +
                              " since the load");
        return t;
    };
    // `bytes` of t from `offset` uploaded as one matrix of t's row shape. The copy reads the
    // mapping when the stream runs it: wait before the mapping goes.
    auto upload_mat = [&](const GGUFTensorInfo *t, uint64_t offset, uint64_t bytes) {
        return DMat{upload(static_cast<const uint8_t *>(file.tensor_data(*t)) + offset, bytes), int(t->type),
                    int64_t(t->ne[1]), int64_t(t->ne[0])};
    };
    auto tensor = [&](const GGUFTensorInfo *info, bool stack) {
        if (!info) return std::pair{DMat{}, int64_t(0)};
        const GGUFTensorInfo *t = find(info, stack);
        return std::pair{upload_mat(t, 0, t->nbytes), stack ? int64_t(t->ne[2]) : int64_t(1)};
    };
    auto mat = [&](const Matrix &m) { return tensor(m.info, false).first; };
    auto stack = [&](const MatrixStack &st) {
        const auto [m, n] = tensor(st.info, true);
        return DStack{m, n, n ? st.info->nbytes / uint64_t(n) : 0};
    };
    const ModelWeights &w = model.weights();
    for (size_t il = 0; il < layers_.size(); ++il) {
        const LayerWeights &lw = w.layers[il];
        DLayer &l = layers_[il];
        l.wq = mat(lw.wq), l.wk = mat(lw.wk), l.wv = mat(lw.wv), l.wo = mat(lw.wo);
        l.gate = mat(lw.ffn_gate), l.up = mat(lw.ffn_up), l.down = mat(lw.ffn_down);
        l.gate_sh = mat(lw.ffn_gate_shexp), l.up_sh = mat(lw.ffn_up_shexp), l.down_sh = mat(lw.ffn_down_shexp);
        l.wq_a = mat(lw.wq_a), l.wq_b = mat(lw.wq_b), l.wkv_a = mat(lw.wkv_a_mqa);
        l.wk_b = stack(lw.wk_b), l.wv_b = stack(lw.wv_b);
        if (!held_[il].empty()) {
            // A held expert e: matrix e of each stack (gate, up, down), its bytes uploaded alone.
            l.experts.resize(held_[il].size());
            for (size_t e = 0; e < held_[il].size(); ++e) {
                if (!held_[il][e]) continue;
                int m = 0;
                for_each_expert_stack(lw, [&](const MatrixStack &st) {
                    const GGUFTensorInfo *t = find(st.info, true);
                    const uint64_t bytes = t->nbytes / uint64_t(t->ne[2]);
                    l.experts[e][size_t(m++)] = upload_mat(t, e * bytes, bytes);
                });
            }
        }
        for_each_device_vector(lw, [&](const std::vector<float> &v) {
            vecs_[v.data()] = static_cast<const float *>(upload(v.data(), v.size() * 4));
        });
        if (!lw.ffn_gate_inp_shexp.empty())
            l.shexp_gate = DMat{vecs_[lw.ffn_gate_inp_shexp.data()], int(GGMLType::F32), 1, E_};
    }
    if (!w.rope_freqs.empty()) rope_ff_ = static_cast<const float *>(upload(w.rope_freqs.data(), w.rope_freqs.size() * 4));
    check(api_.sync(c_), "upload");  // before `file` is unmapped
}

const float *CudaDevice::dvec(const std::vector<float> &v) const {
    if (v.empty()) return nullptr;
    auto it = vecs_.find(v.data());
    if (it == vecs_.end()) throw std::logic_error("CudaDevice: a weight vector that was not uploaded");
    return it->second;
}

float *CudaDevice::buf(Act a) const {
    switch (a) {
        case Act::X: return x_;
        case Act::XN: return xn_;
        case Act::Attn: return attn_;
        case Act::Tmp: return tmp_;
    }
    return nullptr;
}

float *CudaDevice::host_buffer(int slot, size_t floats) {
    if (slot < 0 || slot > 1) return nullptr;
    if (!h_buf_[slot]) {
        void *p = nullptr;
        check(api_.host_alloc(c_, &p, floats * 4), "host_alloc");
        h_buf_[slot] = static_cast<float *>(p);
    }
    return h_buf_[slot];
}

void CudaDevice::gemv(const DMat &m, const float *x, int64_t n, float *y, float scale) {
    check(api_.gemv(c_, m.type, m.w, m.rows, m.k, x, n, y, act_), "gemv");
    if (scale != 1.0f) check(api_.scale(c_, y, n * m.rows, scale), "tensor scale");
}

void CudaDevice::begin_chunk(float *x, const int32_t *positions, const int32_t *seq_ids, int64_t n) {
    if (n > n_batch_) throw std::logic_error("CudaDevice: chunk larger than n_batch");
    n_ = n;
    host_x_ = x;
    const int64_t n_ctx = n_ctx_;
    for (int64_t i = 0; i < n; ++i) {
        h_pos_[i] = positions[i];
        h_first_[i] = int64_t(seq_ids[i]) * n_ctx;
        h_rows_[i] = h_first_[i] + positions[i];
        h_nkv_[i] = positions[i] + 1;  // causal: row i sees its sequence's positions [0, pos]
    }
    // Sliding-window layers: row i sees [max(0, pos - n_swa + 1), pos] (as plan_key_ranges).
    if (const int64_t n_swa = model_.hparams().n_swa; n_swa > 0) {
        for (int64_t i = 0; i < n; ++i) {
            const int64_t lo = std::max<int64_t>(0, positions[i] - n_swa + 1);
            h_first_swa_[i] = h_first_[i] + lo;
            h_nkv_swa_[i] = int32_t(positions[i] + 1 - lo);
        }
        check(api_.copy(c_, nkv_swa_, h_nkv_swa_, uint64_t(n) * 4, KTD_CUDA_H2D), "copy positions");
        check(api_.copy(c_, kv_first_swa_, h_first_swa_, uint64_t(n) * 8, KTD_CUDA_H2D), "copy positions");
    }
    check(api_.copy(c_, pos_, h_pos_, uint64_t(n) * 4, KTD_CUDA_H2D), "copy positions");
    check(api_.copy(c_, nkv_, h_nkv_, uint64_t(n) * 4, KTD_CUDA_H2D), "copy positions");
    check(api_.copy(c_, kv_rows_, h_rows_, uint64_t(n) * 8, KTD_CUDA_H2D), "copy positions");
    check(api_.copy(c_, kv_first_, h_first_, uint64_t(n) * 8, KTD_CUDA_H2D), "copy positions");
    // The embeddings (the context dequantized them into x).
    check(api_.copy(c_, x_, x, uint64_t(n * E_) * 4, KTD_CUDA_H2D), "copy embeddings");
}

void CudaDevice::end_chunk() {
    check(api_.copy(c_, host_x_, x_, uint64_t(n_ * E_) * 4, KTD_CUDA_D2H), "copy residual");
    check(api_.sync(c_), "forward");  // also: the staging above may be rewritten by the next chunk
}

void CudaDevice::norm(const std::vector<float> &w, Act in, Act out) {
    check(api_.rmsnorm(c_, buf(in), dvec(w), buf(out), n_, int64_t(w.size()), model_.hparams().norm_eps),
          "rmsnorm");
}

void CudaDevice::residual_add(Act t) { check(api_.add(c_, x_, buf(t), n_ * E_), "residual add"); }

void CudaDevice::attention_in(const LayerWeights &w, int il) {
    const HParams &hp = model_.hparams();
    const DLayer &l = layers_[size_t(il)];
    const int64_t hd = hp.head_dim_k;
    gemv(l.wq, xn_, n_, q_, w.wq_scale);
    gemv(l.wk, xn_, n_, k_, w.wk_scale);
    gemv(l.wv, xn_, n_, v_, w.wv_scale);
    if (!w.bq.empty()) check(api_.add_rows(c_, q_, dvec(w.bq), n_, hp.n_embd_q()), "bias");
    if (!w.bk.empty()) check(api_.add_rows(c_, k_, dvec(w.bk), n_, hp.n_embd_k_gqa()), "bias");
    if (!w.bv.empty()) check(api_.add_rows(c_, v_, dvec(w.bv), n_, hp.n_embd_v_gqa()), "bias");
    if (!w.attn_q_norm.empty())
        check(api_.rmsnorm(c_, q_, dvec(w.attn_q_norm), q_, n_ * hp.n_head, hd, hp.norm_eps), "q norm");
    if (!w.attn_k_norm.empty())
        check(api_.rmsnorm(c_, k_, dvec(w.attn_k_norm), k_, n_ * hp.n_head_kv, hd, hp.norm_eps), "k norm");
    const KtdRope rp = ktd_rope(hp.layer_swa[size_t(il)] ? hp.rope_swa : hp.rope);
    check(api_.rope(c_, &rp, rope_ff_, pos_, q_, n_, hp.n_head, hd), "rope q");
    check(api_.rope(c_, &rp, rope_ff_, pos_, k_, n_, hp.n_head_kv, hd), "rope k");
    // q's attn_scale is applied by the attention kernel (scale · q·k).
}

void CudaDevice::attention(int il) {
    const HParams &hp = model_.hparams();
    const DLayer &l = layers_[size_t(il)];
    check(api_.kv_write(c_, k_, n_, hp.n_embd_k_gqa(), l.k_cache, kv_rows_), "kv write");
    check(api_.kv_write(c_, v_, n_, hp.n_embd_v_gqa(), l.v_cache, kv_rows_), "kv write");
    const bool swa = hp.layer_swa[size_t(il)];
    check(api_.attention(c_, q_, l.k_cache, l.v_cache, attn_, n_, hp.n_head, hp.n_head_kv, hp.head_dim_k,
                         swa ? kv_first_swa_ : kv_first_, swa ? nkv_swa_ : nkv_, hp.attn_scale),
          "attention");
}

void CudaDevice::attention_out(const LayerWeights &w) {
    const DLayer &l = layers_[size_t(&w - model_.weights().layers.data())];
    gemv(l.wo, attn_, n_, tmp_, w.wo_scale);
    if (!w.bo.empty()) check(api_.add_rows(c_, tmp_, dvec(w.bo), n_, E_), "bias");
}

void CudaDevice::copy2d(float *dst, int64_t dpitch, const float *src, int64_t spitch, int64_t width, int64_t rows) {
    check(api_.copy2d(c_, dst, uint64_t(dpitch) * 4, src, uint64_t(spitch) * 4, uint64_t(width) * 4, uint64_t(rows),
                      KTD_CUDA_D2D),
          "copy2d");
}

void CudaDevice::per_head_gemv(const DStack &st, const float *x, int64_t x_head, int64_t x_pitch, float *y,
                               int64_t y_head, int64_t y_pitch) {
    check(api_.gemv_batched(c_, st.m.type, st.m.w, st.stride, st.n, st.m.rows, st.m.k, x, x_head, x_pitch, n_, y,
                            y_head, y_pitch, act_),
          "gemv_batched");
}

// deepseek2's attention in the absorbed form, as the CPU backend's (model/mla.cpp), over the
// device's latent cache: the projections, the latent's norm, RoPE on k_pe and q_pe, the cache
// write, each head's q_nope taken into the latent space (wk_b), multi-query attention over the
// cache rows, and each head's output decompressed (wv_b) into Attn [n][H·v_head_dim].
void CudaDevice::mla_attention(const LayerWeights &w, int il) {
    const HParams &hp = model_.hparams();
    const MlaParams &m = hp.mla;
    const DLayer &l = layers_[size_t(il)];
    const int64_t n = n_, H = hp.n_head, nope = m.qk_nope_head_dim, rope = m.qk_rope_head_dim, r = m.kv_lora_rank;
    const int64_t hq = nope + rope, hk = r + rope, dv = m.v_head_dim;
    if (l.wq_a) {
        gemv(l.wq_a, xn_, n, mqa_);
        check(api_.rmsnorm(c_, mqa_, dvec(w.attn_q_a_norm), mqa_, n, m.q_lora_rank, hp.norm_eps), "q_a norm");
        gemv(l.wq_b, mqa_, n, mq_);  // q [n][H][hq]
    } else {
        gemv(l.wq, xn_, n, mq_);
    }
    gemv(l.wkv_a, xn_, n, mkv_);  // [c; k_pe] [n][hk]
    // c = rms(c) · attn_kv_a_norm on the first r of each row, through a contiguous copy.
    copy2d(mlat_, r, mkv_, hk, r, n);
    check(api_.rmsnorm(c_, mlat_, dvec(w.attn_kv_a_norm), mlat_, n, r, hp.norm_eps), "kv_a norm");
    copy2d(mkv_, hk, mlat_, r, r, n);
    // k_pe and every head's q_pe roped: "heads" of hk (hq) floats from r (nope) on, n_rot = rope.
    const KtdRope rp = ktd_rope(hp.rope);
    check(api_.rope(c_, &rp, rope_ff_, pos_, mkv_ + r, n, 1, hk), "rope k_pe");
    check(api_.rope(c_, &rp, rope_ff_, pos_, mq_ + nope, n, int(H), hq), "rope q_pe");
    check(api_.kv_write(c_, mkv_, n, hk, l.k_cache, kv_rows_), "kv write");
    // The MQA query [n][H][r + rope]: q_lat_h = wk_b_h · q_nope_h, then q_pe_h beside it.
    per_head_gemv(l.wk_b, mq_, hq, H * hq, mqm_, hk, H * hk);
    copy2d(mqm_ + r, hk, mq_ + nope, hq, rope, n * H);
    // attn_scale is applied to the scores (the CPU scales the query: the same products).
    check(api_.attention_mla(c_, mqm_, l.k_cache, mout_, n, int(H), hk, r, kv_first_, nkv_, hp.attn_scale),
          "attention");
    per_head_gemv(l.wv_b, mout_, r, H * r, attn_, dv, H * dv);
}

void CudaDevice::glu_ffn(const LayerWeights &w, Glu act) {
    const DLayer &l = layers_[size_t(&w - model_.weights().layers.data())];
    gemv(l.gate, xn_, n_, g_, w.gate_scale);
    gemv(l.up, xn_, n_, u_, w.up_scale);
    check(api_.glu(c_, glu_code(act), g_, u_, n_ * l.gate.rows), "glu");
    if (!w.ffn_sub_norm.empty())  // bitnet: an RMSNorm over the GLU's rows before the down projection
        check(api_.rmsnorm(c_, g_, dvec(w.ffn_sub_norm), g_, n_, l.gate.rows, model_.hparams().norm_eps),
              "ffn sub-norm");
    gemv(l.down, g_, n_, tmp_, w.down_scale);
}

void CudaDevice::moe_ffn(const LayerWeights &, int) {
    throw std::logic_error("CudaDevice::moe_ffn: routed experts run on the host (HybridBackend)");
}

void CudaDevice::shared_expert_async(const LayerWeights &w, Act in, Act out) {
    const DLayer &l = layers_[size_t(&w - model_.weights().layers.data())];
    float *x = buf(in), *y = buf(out);
    if (!l.gate_sh) {
        check(api_.memset0(c_, y, uint64_t(n_ * E_) * 4), "memset");
        return;
    }
    gemv(l.gate_sh, x, n_, g_);
    gemv(l.up_sh, x, n_, u_);
    check(api_.glu(c_, 0, g_, u_, n_ * l.gate_sh.rows), "glu");
    gemv(l.down_sh, g_, n_, y);
    if (l.shexp_gate) {
        gemv(l.shexp_gate, x, n_, gsh_);
        check(api_.gate_rows(c_, y, gsh_, n_, E_), "shared expert gate");
    }
}

// The pairs grouped by expert (a counting sort, stable: an expert's tokens ascending), uploaded as
// one list of tokens and one of weights; then per held expert with tokens: their rows gathered (a
// single token's row is read in place), gate and up as one GEMV over those rows each, SwiGLU, down,
// and every output row added to its token's row times its weight (an expert's tokens are distinct,
// so that is one kernel with no atomics). A chunk of n tokens thus costs a few launches per held
// expert instead of five per pair; a token's held experts are summed in expert order.
// The staging h_sel_ is rewritten by the next call, which comes after the sync of this one.
void CudaDevice::experts_async(const LayerWeights &, int il, const std::vector<MoeSelection> &sel, Act in, Act out) {
    const DLayer &l = layers_[size_t(il)];
    const float *x = buf(in);
    float *y = buf(out);
    const int64_t P = int64_t(sel.size());
    if (P == 0) return;
    if (P > sel_cap_) throw std::logic_error("CudaDevice::experts_async: more pairs than the chunk can route");
    const size_t ne = l.experts.size();
    group_.assign(ne + 1, 0);
    for (const MoeSelection &s : sel) {
        if (size_t(s.expert) >= ne || !l.experts[size_t(s.expert)][0])
            throw std::logic_error("CudaDevice::experts_async: expert " + std::to_string(s.expert) + " of layer " +
                                   std::to_string(il) + " is not held");
        ++group_[size_t(s.expert) + 1];
    }
    for (size_t e = 0; e < ne; ++e) group_[e + 1] += group_[e];
    fill_.assign(group_.begin(), group_.end() - 1);
    int32_t *tok = h_sel_;
    float *wt = reinterpret_cast<float *>(h_sel_ + sel_cap_);
    for (const MoeSelection &s : sel) {
        const int64_t at = fill_[size_t(s.expert)]++;
        tok[at] = s.token;
        wt[at] = s.weight;
    }
    int32_t *d_tok = d_sel_;
    float *d_wt = reinterpret_cast<float *>(d_sel_ + sel_cap_);
    check(api_.copy(c_, d_tok, tok, uint64_t(P) * 4, KTD_CUDA_H2D), "copy expert pairs");
    check(api_.copy(c_, d_wt, wt, uint64_t(P) * 4, KTD_CUDA_H2D), "copy expert pairs");
    for (size_t e = 0; e < ne; ++e) {
        const int64_t p0 = group_[e], cnt = group_[e + 1] - p0;
        if (cnt == 0) continue;
        const std::array<DMat, 3> &ex = l.experts[e];
        const float *xin = x + int64_t(tok[p0]) * E_;
        if (cnt > 1) {
            check(api_.gather_rows(c_, xg_, x, d_tok + p0, cnt, E_), "gather expert rows");
            xin = xg_;
        }
        gemv(ex[0], xin, cnt, g_);
        gemv(ex[1], xin, cnt, u_);
        check(api_.glu(c_, 0, g_, u_, cnt * ex[0].rows), "glu");
        gemv(ex[2], g_, cnt, y_);
        check(api_.scatter_add_rows(c_, y, y_, d_tok + p0, d_wt + p0, cnt, E_), "add expert rows");
    }
}

void CudaDevice::to_host(Act a, float *dst) {
    check(api_.copy(c_, dst, buf(a), uint64_t(n_ * E_) * 4, KTD_CUDA_D2H), "copy to host");
    check(api_.event_record(c_, ev_), "event");
    check(api_.event_wait(c_, ev_), "copy to host");
}

void CudaDevice::add_from_host(Act a, const float *src) {
    check(api_.copy(c_, y_, src, uint64_t(n_ * E_) * 4, KTD_CUDA_H2D), "copy to device");
    check(api_.add(c_, buf(a), y_, n_ * E_), "add");
}

void CudaDevice::sync() { check(api_.sync(c_), "sync"); }

CudaDevice::KvMemory::KvMemory(CudaDevice &dev, const DLayer &l) : dev_(dev), k_(l.k_cache), v_(l.v_cache) {
    const HParams &hp = dev.model_.hparams();
    k_width_ = hp.n_embd_k_cache();
    v_width_ = hp.n_embd_v_cache();
}

int64_t CudaDevice::KvMemory::bytes_per_token() const { return (k_width_ + v_width_) * int64_t(sizeof(uint16_t)); }

void CudaDevice::KvMemory::copy_seq(int src, int dst, int64_t n_tokens) {
    const uint64_t n_ctx = uint64_t(dev_.n_ctx_);
    for (auto [cache, width] : {std::pair{k_, k_width_}, std::pair{v_, v_width_}}) {
        if (!cache) continue;  // no V cache with MLA
        dev_.check(dev_.api_.copy(dev_.c_, cache + uint64_t(dst) * n_ctx * uint64_t(width),
                                  cache + uint64_t(src) * n_ctx * uint64_t(width),
                                  uint64_t(n_tokens) * uint64_t(width) * 2, KTD_CUDA_D2D),
                   "copy_seq");
    }
    dev_.check(dev_.api_.sync(dev_.c_), "copy_seq");
}

std::vector<LayerMemory *> CudaDevice::memory() {
    std::vector<LayerMemory *> out;
    for (const auto &m : memory_) out.push_back(m.get());
    return out;
}

std::unique_ptr<DeviceBackend> make_cuda_device(const BackendSetup &setup, const std::string &name, int device,
                                                uint64_t vram_budget, int layers, const HeldExperts &experts) {
    if (name == "cuda-emulated")
        return std::make_unique<CudaDevice>(setup, cuda_api_emulated(), device, vram_budget, layers, experts);
    std::string reason;
    const CudaApi *api = cuda_api_library(&reason);
    if (!api) throw DeviceError("CUDA device: " + reason);
    return std::make_unique<CudaDevice>(setup, *api, device, vram_budget, layers, experts);
}

}  // namespace ktd
