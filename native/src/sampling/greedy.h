// The greedy token of a logits row, taken piece by piece in any order: the sampler's choice at
// temperature 0 (sampler.cpp: the logits are rejected when they hold NaN or +inf or nothing finite,
// else the first id of the maximum), for an epilogue that sees the row as the output head writes it
// (the matmul row hook, kernels.h), a few hundred logits at a time, on several workers at once.
#pragma once
#include <cstdint>
#include <limits>

namespace ktd::sampling {

// Greedy outcomes that are not a token (the sampler raises for these logits).
constexpr int32_t kGreedyNaN = -1;        // the logits contain NaN
constexpr int32_t kGreedyPosInf = -2;     // the logits contain +inf
constexpr int32_t kGreedyNoFinite = -3;   // no logit is finite (all -inf)

// The message the sampler gives for a code above (nullptr for a token id).
const char *greedy_error(int32_t code);

// One worker's view of one row; a cache line of its own, as workers update theirs concurrently.
struct alignas(64) GreedyBest {
    float max = -std::numeric_limits<float>::infinity();
    int64_t id = std::numeric_limits<int64_t>::max();  // the first id of max among those seen
    bool nan = false;

    // The piece x[0, n) of the row, ids id0 .. id0 + n.
    void add(const float *x, int64_t id0, int64_t n);
    // Folds in another view of the same row (disjoint pieces).
    void merge(const GreedyBest &o);
    // The token id, or a kGreedy* code, once every piece of the row was added (or merged).
    int32_t result() const;
};

}  // namespace ktd::sampling
