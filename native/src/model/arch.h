// Architecture facts as data. An architecture is
//   - a tensor table built from the hyperparameters (llama.cpp's create_tensor(name, {shape},
//     flags)): GGUF name, concrete expected shape, required or optional, which layers carry it,
//     its placement class, and where the loader puts it;
//   - a tune function for the hyperparameters GGUF does not spell out (rope layout, scales);
//   - a layer function: a short composition of the blocks of backend.h.
// Each architecture file registers itself (KTD_REGISTER_ARCH), as the kernels do; Model::open finds
// it by general.architecture, checks every tensor of the table against the file and names the
// tensor on a mismatch.
#pragma once
#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <variant>
#include <vector>

#include "model/hparams.h"

namespace ktd {

class Blocks;
class GGUFFile;
struct LayerWeights;
struct Matrix;
struct MatrixStack;
struct ModelWeights;

// Which part of the model a tensor belongs to. It decides placement: routed experts are sharded
// over NUMA nodes (and, with a GPU, stay on the CPU while the rest goes to VRAM); embedding rows
// are read by lookup, not streamed; `ktd inspect` counts bytes per token by it.
enum class TensorClass { Embedding, Output, Dense, Router, RoutedExpert, SharedExpert };
const char *tensor_class_name(TensorClass c);  // "embedding", "output", "dense", ...

// Which layers a per-layer tensor belongs to. Dense: layers with a dense FFN (every layer of a
// model without experts; deepseek2's leading layers); Moe: the layers with routed experts. A tensor
// outside its layers must be absent.
enum class LayerSet { All, Dense, Moe };
bool layer_in_set(LayerSet set, const HParams &hp, int il);

// Where the loader puts a tensor: a per-layer matrix, stack of matrices (ne2 > 1), vector or scalar,
// or a model-level matrix or vector; monostate: only checked (token_embd, read row by row).
using TensorDest = std::variant<std::monostate, Matrix LayerWeights::*, MatrixStack LayerWeights::*,
                                std::vector<float> LayerWeights::*, float LayerWeights::*, Matrix ModelWeights::*,
                                std::vector<float> ModelWeights::*>;

// An expected shape in GGML order, unused dimensions 1: {n_embd}, {n_embd, n_ff}, {k, rows, n_expert}.
struct Shape {
    std::array<int64_t, 3> ne{1, 1, 1};
    Shape(std::initializer_list<int64_t> dims) {
        size_t i = 0;
        for (int64_t d : dims)
            if (i < ne.size()) ne[i++] = d;
    }
};

struct TensorSpec {
    std::string name;                    // GGUF name; "%d" = layer index
    std::array<int64_t, 3> ne{1, 1, 1};  // expected shape, GGML order (ne[0] = row length)
    TensorDest dest;
    bool required = true;
    TensorClass cls = TensorClass::Dense;
    LayerSet layers = LayerSet::All;

    bool per_layer() const { return dest.index() >= 1 && dest.index() <= 4; }
    // Modifiers, for table rows that read like llama.cpp's create_tensor flags.
    TensorSpec &optional(bool opt = true) { required = !opt; return *this; }
    TensorSpec &as(TensorClass c) { cls = c; return *this; }
    TensorSpec &in(LayerSet s) { layers = s; return *this; }
};

// The table of one model, built by its architecture from the hyperparameters.
struct TensorTable {
    std::vector<TensorSpec> specs;
    TensorSpec &add(std::string name, Shape shape, TensorDest dest) {
        return specs.emplace_back(TensorSpec{std::move(name), shape.ne, dest});
    }
};

// Table pieces shared by the architectures (arch.cpp).
// token_embd (checked; the output head when output.weight is absent), output_norm, output.
void add_io_tensors(TensorTable &t, const HParams &hp);
// The llama-style attention: attn_norm, attn_q/k/v/output [+ biases] [+ per-head q/k norms].
struct AttentionTensors {
    bool qkv_bias = false;  // required attn_q/k/v.bias (optional otherwise)
    bool qk_norm = false;   // required per-head attn_q_norm/attn_k_norm
};
void add_attention_tensors(TensorTable &t, const HParams &hp, AttentionTensors a);
// ffn_norm and the dense gated FFN (gate, up, down) in `layers`.
void add_glu_ffn_tensors(TensorTable &t, const HParams &hp, LayerSet layers);
// The routed experts of the MoE layers: router [+ selection bias] and gate/up/down stacks.
void add_moe_tensors(TensorTable &t, const HParams &hp, bool selection_bias);
// Shared expert(s) of the MoE layers (width n_ff_shexp) [+ qwen2moe's sigmoid gate].
void add_shared_expert_tensors(TensorTable &t, const HParams &hp, bool gated);

struct ArchSpec {
    const char *name;  // general.architecture
    // Arch-specific hparams beyond read_hparams (rope type, swa layout, scales); GGUFError on bad
    // metadata.
    void (*tune)(HParams &hp, const GGUFFile &f);
    void (*tensors)(TensorTable &t, const HParams &hp);
    // One layer of the chunk the backend holds: x → x, as a composition of blocks.
    void (*layer)(Blocks &b, const HParams &hp, const LayerWeights &w, int il);
};

void register_arch(const ArchSpec &spec);
const ArchSpec *find_arch(const std::string &name);
std::vector<const ArchSpec *> all_archs();  // by name

}  // namespace ktd

// Registers an ArchSpec when the module loads; once per architecture, at namespace scope in its file.
#define KTD_ARCH_CONCAT_(a, b) a##b
#define KTD_ARCH_CONCAT(a, b) KTD_ARCH_CONCAT_(a, b)
#define KTD_REGISTER_ARCH(...)                                              \
    static const bool KTD_ARCH_CONCAT(ktd_arch_registered_, __LINE__) = [] { \
        ::ktd::register_arch(::ktd::ArchSpec{__VA_ARGS__});                 \
        return true;                                                        \
    }()
