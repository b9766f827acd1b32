// Token sampling for one row of logits: penalties, temperature, top-k, top-p, min-p and a seeded
// draw, as daemon/ktd/text/sampling.py documents them (the definitions are the contract; the Python
// side owns the parameters, the random stream and the stop logic).
//
//   penalties over the window → temperature (0: argmax of the penalised logits, first of equals)
//   → top-k: the first k in the order (decreasing penalised logit, then increasing id)
//   → weights w = e^(x·(1/T) − max) in float32 over the whole vocabulary (no top-k), or
//     float32(e^(x/T − max)) computed in float64 over the top-k tokens; the best token has w = 1
//   → top-p: the shortest prefix of the order (decreasing w, then increasing id) whose float64
//     running sum reaches top_p · Σw (all of them if none does)
//   → min-p: w >= float32(min_p · max w)
//   → draw: the kept tokens in increasing id order; the first whose cumulative weight exceeds
//     u · (their total), u uniform in [0, 1) from the caller.
//
// Nothing sorts the vocabulary in the common cases. The kept set of the top-p and min-p filters is
// always a threshold set over the weights: {w > v} plus the ties w == v below an id (the lowest
// ids of a tie go first). v is found by a radix select on the float bits with bucket masses
// (three histogram levels: 13, 12 and 7 bits) over a band of the weights that vector passes
// locate (sampler.cpp, top_p_cut), and the draw sums the kept weights per block of 1024 tokens,
// then scans one block. The sums differ from the sorted running sum only by rounding;
// where the target lies within that rounding of a boundary the cut is recomputed exactly by a full
// sort (rare: a target within ~1e-10 of the mass of a boundary).
#pragma once
#include <cstdint>
#include <vector>

namespace ktd {
struct SamplingKernels;
}

namespace ktd::sampling {

struct Params {
    double temperature = 0.8;  // 0: greedy
    int64_t top_k = 40;        // 0 (or >= n_vocab): off
    double top_p = 0.95;       // 1: off
    double min_p = 0.05;       // 0: off
    double repeat_penalty = 1.0, presence_penalty = 0.0, frequency_penalty = 0.0;
};

// The tokens that may be drawn (weight > 0), ids ascending, with their weights.
struct Candidates {
    std::vector<int32_t> ids;
    std::vector<float> weights;
    // How the top-p cut was found (sampler.cpp, top_p_cut): "" (no top-p), "heavy" (among the
    // weights >= 2^-8 of the largest), "middle" (among those in [2^-16, 2^-8)), "tail" (below, or
    // the target sat on a list's edge: all weights), "sort" (the full sort: the target sat within
    // rounding of a boundary).
    const char *top_p_path = "";
};

// The tokens a grammar allows at this step: bit (i % 32) of word i / 32 set = token i may be drawn
// (llguidance's bitmask layout); words [ceil(n_vocab / 32)]. A masked token's logit is -inf before
// any other step (penalties, temperature, top-k ...), so no setting can draw it.
struct Mask {
    const uint32_t *words = nullptr;  // null: every token allowed
};

// Log-probabilities of the model's distribution at this step: log_softmax of the logits as given
// (before penalties, the mask and the temperature), float64 from float32 weights.
constexpr int kMaxTopLogprobs = 20;
struct Logprobs {
    int n_top = 0;                  // in: alternatives wanted, [0, kMaxTopLogprobs]
    double token = 0.0;             // out: the drawn token's log-probability
    std::vector<int32_t> top_ids;   // out: the n_top most likely tokens (decreasing, ties by id)
    std::vector<double> top;        // out: their log-probabilities
};

// One token id. logits [n_vocab] float32 (not modified); window: the recent token ids the penalties
// look at (ids outside [0, n_vocab) are ignored); u in [0, 1) (unused when greedy).
// std::invalid_argument on NaN or +inf logits, or when no logit is finite (also: the mask allows
// no finite one). kernels: the vector passes to use (null: sampling_kernels(), the active ISA's;
// every ISA gives the same result). mask: the grammar's allowed tokens; lp (not null): the
// log-probabilities are computed into it.
int32_t sample(const float *logits, int64_t n_vocab, const int64_t *window, int64_t n_window, const Params &p,
               double u, const SamplingKernels *kernels = nullptr, Mask mask = {}, Logprobs *lp = nullptr);
// What sample() draws from (temperature > 0).
Candidates candidates(const float *logits, int64_t n_vocab, const int64_t *window, int64_t n_window,
                      const Params &p, const SamplingKernels *kernels = nullptr, Mask mask = {});
// Position j drawn from weights w [n] (>= 0, not all 0) at u: the first whose cumulative weight
// exceeds u · Σw, summed per block as sample() does.
int64_t draw(const float *w, int64_t n, double u, const SamplingKernels *kernels = nullptr);

}  // namespace ktd::sampling
