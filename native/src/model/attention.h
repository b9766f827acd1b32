// The plan of one chunk's attention (CpuBackend::attention in attention.cpp executes it): which rows,
// KV heads, query heads and key ranges each job covers. A pure function of the batch's positions
// and sequences, the hparams and the pool size: it reads no cache and no activations, so it can be
// built, printed and checked on its own.
//
// Jobs: blocks of up to attn_rows_per_block consecutive rows of one sequence (consecutive
// positions) × one KV head, so a block's K/V tiles are converted once for its rows × the group's
// query heads (MLA: one latent head, all query heads). A query's result does not depend on the
// block or the heads it is computed with.
// Decode over a long context (fewer than kAttnSplitMinJobs rows × KV heads): every row on its own,
// its keys split into ranges ("parts") of kAttnSplitKeys at fixed positions, computed apart and
// merged (attn_merge). The split depends on the batch only, never on the thread count.
// Fewer jobs than threads: each job's query heads are cut into head parts.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "model/hparams.h"

namespace ktd {

struct AttnPlan {
    struct Job {
        int64_t row0, cost;  // first batch row; keys read by the job (for longest-first order)
        int n_rows, head_kv;
        int head0, n_heads;  // the group's query heads [head0, head0 + n_heads) of head_kv
        int64_t part;        // -1: the rows' whole key ranges; else one row's key range part_lo/hi[part]
    };
    // A block of rows with its key ranges.
    struct Range {
        int64_t i, e;                  // the block's rows [i, e)
        int64_t first_part, n_chunks;  // -1, 1: whole rows; else one row's parts (all KV heads)
    };
    // A row whose keys are split: its parts of KV head hkv are [first_part, first_part + n_parts).
    struct Split {
        int64_t row, first_part, n_parts;
        int hkv;
    };
    std::vector<int64_t> lo, hi;           // [n] row i attends keys [lo[i], hi[i]) of its sequence
    std::vector<Range> ranges;
    std::vector<Split> splits;
    std::vector<int64_t> part_lo, part_hi;  // [n_part] key range of each part
    std::vector<Job> jobs;                  // longest first
    int group = 1;                          // query heads per KV head
    size_t part_stride = 0;                 // floats of one part's result: o [group][hd_v], m [group], l [group]
};

// Query rows per attention block (attention.cpp): sizes each worker's attention scratch.
int attn_rows_per_block(const HParams &hp);

// The plan of n rows of layer il (row i at positions[i] of sequence seq_ids[i]) for a pool of
// pool_size workers, into `plan` (its vectors keep their capacity: no allocation once warm).
void plan_attention(const HParams &hp, int il, const int32_t *positions, const int32_t *seq_ids, int64_t n,
                    int pool_size, AttnPlan &plan);

}  // namespace ktd
