// Mixture-of-experts FFN of one layer (qwen2moe, qwen3moe, Mixtral, deepseek2), routed exactly as
// llama.cpp's build_moe_ffn:
//
//   logits [n][n_expert] = ffn_gate_inp · xn
//   p = softmax(logits) or sigmoid(logits)                       (MoeParams::gating)
//   selection: top-n_expert_used of s = p + exp_probs_b (bias for the choice only, when present);
//     group-limited when n_group > 1: a group scores the sum of its two best s, the n_group_used
//     best groups compete, the others are out; ties go to the lowest index
//   weights = the selected p, divided by their sum (clamped to >= 2^-14) when weights_norm,
//     times weights_scale
//   y_i = Σ_j weight_ij · down_e(silu(gate_e · xn_i) ⊙ up_e · xn_i)   (e = j-th selected expert,
//         summed in selection order)
//       + shared expert(s) down_sh(silu(gate_sh · xn_i) ⊙ up_sh · xn_i)   (fused into one FFN of
//         width n_ff_shexp), times sigmoid(ffn_gate_inp_shexp · xn_i) when that gate exists (qwen2moe)
//
// Execution (one parallel region per layer; every output element is computed by exactly one work
// item, and items are summed in a fixed order, so the result does not depend on the thread count):
// the tokens are grouped by expert (counting sort); each active expert — and the shared expert, as
// one more job over all tokens — is one GEMM over its tokens, cut into row blocks. Work items =
// (expert, block of gate/up rows), gate and up fused, then (expert, block of down rows), taken
// dynamically by all threads. Decode (n = 1) thus spreads the selected experts over every thread;
// prefill runs one GEMM per expert over its tokens; experts that receive no token cost nothing.
// xn is quantized once per activation format, each expert's hidden rows once for its down matrix.
// Several NUMA nodes: the row blocks are cut within each node's row slice (numa_slice_rows, the
// slices the sharded experts are stored in) and a worker takes only its node's items, so it
// streams only its node's memory; the items cover the same rows, so the result is unchanged.
// One token (decode, moe_ffn_decode in moe_decode.cpp) takes a leaner plan: the router joins the same
// parallel region, gate and up of all selected experts and the shared expert are one list of small
// row blocks, and down is one list of output-row blocks over all experts that sums the weighted rows
// itself (two barriers per layer instead of six and a second region); each worker takes a
// contiguous run of those items (RangeList), so it streams long stretches of weights.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "cpu/thread_pool.h"
#include "kernels/kernels.h"
#include "model/hparams.h"

namespace ktd {

class Model;
struct ForwardTaps;
struct LayerWeights;
struct PreparedWeights;

// Routing of n tokens: logits [n][n_expert] (overwritten with the gating probabilities p) →
// ids [n][n_expert_used] (best first) and weights [n][n_expert_used]. exp_probs_b: [n_expert] or
// null. select: scratch [n_expert] floats.
void moe_route(const MoeParams &mp, float *logits, const float *exp_probs_b, int64_t n, int32_t *ids,
               float *weights, float *select);

// Scratch of moe_ffn, grown on first use of a larger chunk (no allocation once warm).
struct MoeScratch {
    std::vector<float> logits;          // [n][n_expert] router logits, then probabilities
    std::vector<float> select;          // [n_threads][n_expert] selection scores
    std::vector<int32_t> ids;           // [n][n_expert_used] selected experts
    std::vector<float> weights;         // [n][n_expert_used] their weights
    std::vector<float> shexp_gate;      // [n] sigmoid gate of the shared expert (qwen2moe)
    std::vector<int32_t> expert_start;  // [n_expert + 1] first sorted pair of each expert
    std::vector<int32_t> pair_tok;      // [n·n_expert_used] token of each pair, sorted by expert
    std::vector<int32_t> pair_pos;      // [n·n_expert_used] sorted position of pair (token i, slot j)
    std::vector<uint8_t> xq[4];         // [n][act row] xn quantized, one per distinct activation format
    std::vector<uint8_t> xg[2];         // [pairs][act row] gathered per expert (routed gate, up formats)
    std::vector<float> hg, hu;          // [pairs][n_ff_exp] routed gate/up → swiglu
    std::vector<float> sg, su;          // [n][n_ff_shexp] shared gate/up → swiglu
    std::vector<uint8_t> hq, sq;        // quantized swiglu rows for down_exps / down_shexp
    std::vector<float> yd, ys;          // [pairs][n_embd] routed down outputs (decode: [jobs][n_embd]), [n][n_embd] shared
    // One expert's work over its ntok tokens: gate/up GEMMs into hg/hu (row stride n_ff), swiglu,
    // then the down GEMM from the quantized rows hq into yd (row stride n_embd).
    struct Job {
        // The matrices as parts (MatrixStack::parts): one for a whole matrix, one per NUMA slice
        // when sharded (then part p holds the rows numa_slice_rows gives slice p).
        const PreparedWeights *gate, *up, *down;
        bool sharded;
        int64_t n_ff;
        int ntok;
        const uint8_t *x_gate, *x_up;   // activation rows, x_stride_* bytes apart
        size_t x_stride_gate, x_stride_up;
        float *hg, *hu;
        uint8_t *hq;
        size_t hq_stride;
        float *yd;
    };
    struct Item {
        int32_t job;
        int32_t r0, r1;  // rows [r0, r1) of the job's gate/up (up items) or down (down items)
        int32_t part, part_r0;  // the part holding those rows, and its first row
    };
    std::vector<Job> jobs;
    // Items grouped by NUMA slice: the workers of slice s take items [start[s], start[s + 1]),
    // which read only rows of that slice (one slice: every item, every worker).
    std::vector<Item> up_items, down_items;
    std::vector<size_t> up_start, down_start;  // [n_slice + 1]
    // The gate/up and down items as claimed by the workers.
    WorkList up_list, down_list;

    // Decode (n = 1, moe_ffn_decode): every worker routes the token itself and keeps its own copy
    // of the quantized xn and of the job list (identical on all workers), so the only barriers
    // are after the router and before the down projection.
    struct DecodeJob {
        const PreparedWeights *gate, *up, *down;
        int64_t n_ff;
        float weight;        // routing weight (the shared expert's sigmoid gate, or 1)
        int64_t up_item0;    // first gate/up item of this job in the combined list, from which
        int64_t up_blocks;   // come up_blocks gate blocks, then as many up blocks
        float *hg, *hu;      // [n_ff] gate/up rows → swiglu in hg
        uint8_t *hq;         // hg quantized for down (written by the worker finishing the job)
        size_t hq_row;       // its bytes
        int32_t fmt_gate, fmt_up;  // activation formats of xn for gate and up
    };
    struct DecodeWorker {
        std::vector<float> logits, select;  // [n_expert]
        std::vector<int32_t> ids;           // [n_expert_used]
        std::vector<float> weights;         // [n_expert_used]
        std::vector<uint8_t> xq;            // xn in each activation format, back to back
        std::vector<DecodeJob> jobs;        // selection order, then the shared expert
        int64_t up_items = 0;               // gate/up items of these jobs (fewer than planned when some
                                            // selected experts are another device's: n_ff 0, no items)
    };
    std::vector<DecodeWorker> dec;                    // [n_threads]
    // [jobs] gate/up rows finished per job, then [down row blocks] jobs finished per block
    std::unique_ptr<std::atomic<int64_t>[]> dec_done;
    size_t dec_done_size = 0;
    RangeList dec_up_list, dec_down_list;  // the decode's gate/up and down items
};

// Bench/test hook: copies x_row [n_embd] into the recorded states (ForwardTaps::moe_states) of
// layer il, slot `after` (0: residual before the FFN, 1: after), when recording is on.
void moe_record_state(ForwardTaps &taps, int64_t n_embd, int il, int after, const float *x_row);

// What a moe_ffn call runs with: the model (sizes, weights, pool, NUMA slices), the scratch it
// grows, and the taps it reports into (the expert statistics; the decode path's part times).
struct MoeRun {
    const Model &model;
    MoeScratch &s;
    MatmulScratch &mm;  // the router's matmul on the general path
    ForwardTaps &taps;
};

// Which experts a call computes: all (routed + shared, the CPU forward), or the routed ones only
// (the hybrid split: the shared expert runs beside them on the accelerator, moe_shared_ffn).
enum class MoePart { All, Routed };

// One routed (token, expert) pair and its routing weight.
struct MoeSelection {
    int32_t token, expert;
    float weight;
};

// The hybrid's hot experts (gpu.experts): the experts with on_device[e] != 0 are computed by the
// device, not here; their selections are appended to *selected (token order, then selection order).
// `routed`, when set, is called once per call on the calling thread (the pool's tid 0) as soon as
// *selected is complete — after the routing, before this thread takes its first expert work item —
// so the device starts its experts beside the host's instead of after them. It must not throw (the
// pool's other workers are in the same region) and must leave *selected as it is.
struct MoeDeviceExperts {
    const uint8_t *on_device = nullptr;  // [n_expert]
    std::vector<MoeSelection> *selected = nullptr;
    std::function<void()> routed;
};

// xn [n][n_embd] (normed input) → y [n][n_embd] (overwritten). Counts the routing of layer il into
// the taps' expert statistics (the device experts' selections too). With `dev`, y leaves out the
// device experts (a token whose every selected expert is on the device gets 0, + the shared expert
// with MoePart::All).
void moe_ffn(const MoeRun &run, const LayerWeights &w, int il, const float *xn, int64_t n, float *y,
             MoePart part = MoePart::All, const MoeDeviceExperts *dev = nullptr);

// The shared expert alone: y [n][n_embd] = gate · down(silu(gate_sh · xn) ⊙ up_sh · xn) (the
// sigmoid gate where the layer has one, else 1; zeros without a shared expert), on `pool` (null:
// the calling thread) with its own scratch. Added to moe_ffn(..., Routed)'s y (y_routed + y_shared,
// in that order) it gives the bits of moe_ffn(..., All).
struct MoeSharedScratch {
    std::vector<float> g, u, gate;
    MatmulScratch mm;
};
void moe_shared_ffn(const LayerWeights &w, const float *xn, int64_t n, int64_t n_embd, float *y, ThreadPool *pool,
                    MoeSharedScratch &s);

}  // namespace ktd
