// What a context hands every backend it builds: the model, the context's shape, and the taps the
// backends' blocks report into. A backend keeps these and never calls back into the context.
#pragma once
#include <cstdint>
#include <vector>

namespace ktd {

class Model;
struct ForwardProfile;

// What a forward reports besides its outputs, owned by the context (which reads them out to
// Python) and written by its backends' blocks.
struct ForwardTaps {
    // While profiling is on, the per-block sums (model/profile.h) the blocks' inner parts add to
    // (moe_ffn's, mla_attention's); null: off, nothing is timed.
    ForwardProfile *profile = nullptr;
    // [n_layer][n_expert]: tokens routed to each expert (moe_ffn), since creation or the last reset.
    std::vector<uint64_t> expert_counts;
    // Bench/test hook (Context._record_states): when non-empty, [n_layer][2][n_embd] residual of
    // the last row of the latest batch before and after each MoE layer's FFN (moe_record_state).
    std::vector<float> moe_states;

    uint64_t *layer_expert_counts(int il, int n_expert) {
        return expert_counts.data() + size_t(il) * size_t(n_expert);
    }
};

struct BackendSetup {
    const Model &model;
    int64_t n_ctx;   // positions per sequence
    int n_seq_max;   // sequence slots
    int64_t n_batch; // rows per chunk at most
    ForwardTaps &taps;
};

// The routed experts a device holds: experts[il] lists layer il's (missing or empty: none).
using HeldExperts = std::vector<std::vector<int32_t>>;

}  // namespace ktd
