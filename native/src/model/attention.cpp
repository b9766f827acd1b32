// CpuBackend::attention: plans a chunk's jobs (plan_attention, see model/attention.h), writes the
// chunk's K/V into the layer's KvCache, runs the attention kernel over the jobs on the pool and
// merges the split key ranges.
#include "model/attention.h"

#include <algorithm>

#include "common/float16.h"
#include "cpu/thread_pool.h"
#include "kernels/attention.h"
#include "model/blocks.h"
#include "model/cpu_backend.h"
#include "model/kv_cache.h"

namespace ktd {

// Query rows per attention block: about 64 queries (rows × the GQA group's heads) share each K/V
// tile, and the block's scratch (scores and accumulators, 64 queries × (64 + head_dim_v) floats)
// stays in L2.
int attn_rows_per_block(const HParams &hp) { return std::max(1, 64 / (hp.n_head / hp.n_head_kv)); }

namespace {

// Decode over a long context: a row's keys are split into ranges of kAttnSplitKeys (at multiples of
// it) when the batch has fewer than kAttnSplitMinJobs rows × KV heads, so that threads share one
// head group's keys.
constexpr int64_t kAttnSplitKeys = 4 * kAttnTile;
constexpr int64_t kAttnSplitMinJobs = 32;

// Row i attends keys [lo, pos] of its sequence (lo > 0 only in a sliding-window layer).
void plan_key_ranges(const HParams &hp, int il, const int32_t *positions, int64_t n, AttnPlan &p) {
    const bool swa = hp.layer_swa[size_t(il)];
    p.lo.resize(size_t(n));
    p.hi.resize(size_t(n));
    for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = positions[i];
        p.lo[size_t(i)] = swa ? std::max<int64_t>(0, pos - hp.n_swa + 1) : 0;
        p.hi[size_t(i)] = pos + 1;
    }
}

// Row blocks of one sequence each; in a decode-sized batch one row per block, its keys split
// into parts (part (KV head h, range c) of a row at first_part + h·n_chunks + c).
void plan_ranges(const HParams &hp, const int32_t *seq_ids, int64_t n, AttnPlan &p) {
    const bool split_keys = n * hp.n_head_kv < kAttnSplitMinJobs;
    const int rows_max = split_keys ? 1 : attn_rows_per_block(hp);
    p.ranges.clear();
    p.splits.clear();
    p.part_lo.clear();
    p.part_hi.clear();
    for (int64_t i = 0; i < n;) {
        int64_t e = i + 1;
        while (e < n && e - i < rows_max && seq_ids[e] == seq_ids[i]) ++e;
        const int64_t lo = p.lo[size_t(i)], hi = p.hi[size_t(i)];
        const int64_t c0 = lo / kAttnSplitKeys, c1 = (hi + kAttnSplitKeys - 1) / kAttnSplitKeys;
        if (!split_keys || c1 - c0 < 2) {
            p.ranges.push_back({i, e, -1, 1});
        } else {
            const int64_t first = int64_t(p.part_lo.size());
            p.ranges.push_back({i, e, first, c1 - c0});
            for (int h = 0; h < hp.n_head_kv; ++h) {
                p.splits.push_back({i, first + h * (c1 - c0), c1 - c0, h});
                for (int64_t c = c0; c < c1; ++c) {
                    p.part_lo.push_back(std::max(lo, c * kAttnSplitKeys));
                    p.part_hi.push_back(std::min(hi, (c + 1) * kAttnSplitKeys));
                }
            }
        }
        i = e;
    }
}

// One job per (range, KV head, key part, head part); fewer (range, KV head, part) jobs than threads
// (few KV heads, short rows): each group's query heads cut into head parts. Longest first, as the
// workers claim them one at a time: causal prefill blocks differ in cost by up to the context
// length, so fixed contiguous shares would leave threads idle.
void plan_jobs(const HParams &hp, int pool_size, AttnPlan &p) {
    const int group = p.group;
    int64_t n_kv_jobs = 0;
    for (const AttnPlan::Range &rg : p.ranges) n_kv_jobs += rg.n_chunks * hp.n_head_kv;
    const int head_parts =
        n_kv_jobs >= pool_size ? 1 : int(std::min<int64_t>(group, (pool_size + n_kv_jobs - 1) / n_kv_jobs));
    p.jobs.clear();
    for (const AttnPlan::Range &rg : p.ranges)
        for (int h = 0; h < hp.n_head_kv; ++h)
            for (int64_t c = 0; c < rg.n_chunks; ++c) {
                const int64_t pi = rg.first_part < 0 ? -1 : rg.first_part + h * rg.n_chunks + c;
                int64_t cost = 0;
                if (pi < 0) {
                    for (int64_t r = rg.i; r < rg.e; ++r) cost += p.hi[size_t(r)] - p.lo[size_t(r)];
                } else {
                    cost = p.part_hi[size_t(pi)] - p.part_lo[size_t(pi)];
                }
                for (int hpart = 0; hpart < head_parts; ++hpart) {
                    const int g0 = group * hpart / head_parts, g1 = group * (hpart + 1) / head_parts;
                    p.jobs.push_back({rg.i, cost * (g1 - g0), int(rg.e - rg.i), h, g0, g1 - g0, pi});
                }
            }
    std::stable_sort(p.jobs.begin(), p.jobs.end(), [](const auto &a, const auto &b) { return a.cost > b.cost; });
}

// What a chunk's attention reads and writes. Cache: K [n_seq][n_kv][n_ctx][hd_k], V [..][hd_v]
// (F16), each KV head's rows of a sequence contiguous.
struct AttnBuffers {
    const float *q;      // [n][n_embd_q]
    int64_t n_embd_q;
    uint16_t *kc, *vc;   // vc = nullptr without a V cache (MLA: the latent K rows are the values)
    int64_t n_kv, hd_k, hd_v;
    int64_t n_ctx;
    float *attn;         // [n][n_head·hd_v]
    float *part;         // [n_part][part_stride]

    // The first cached row of (sequence, KV head) in a cache of head dim hd.
    size_t head_rows(int32_t seq, int64_t h, int64_t hd) const { return kv_head_offset(seq, h, n_kv, n_ctx, hd); }
};

// This chunk's K [n][n_kv·hd_k] and V [n][n_kv·hd_v] (when there is a V cache) stored as F16 at
// (seq, head, pos).
void store_kv(const AttnBuffers &b, const float *k, const float *v, const int32_t *positions, const int32_t *seq_ids,
              int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < b.n_kv; ++h) {
            uint16_t *kd = b.kc + b.head_rows(seq_ids[i], h, b.hd_k) + size_t(positions[i]) * size_t(b.hd_k);
            const float *ks = k + (i * b.n_kv + h) * b.hd_k;
            for (int64_t d = 0; d < b.hd_k; ++d) kd[d] = fp32_to_fp16(ks[d]);
            if (!b.vc) continue;
            uint16_t *vd = b.vc + b.head_rows(seq_ids[i], h, b.hd_v) + size_t(positions[i]) * size_t(b.hd_v);
            const float *vs = v + (i * b.n_kv + h) * b.hd_v;
            for (int64_t d = 0; d < b.hd_v; ++d) vd[d] = fp32_to_fp16(vs[d]);
        }
}

// The kernel's view of one job: its queries, its sequence's K/V of one head, and where it writes
// (the attention rows, or its part's o, m, l).
AttnBlock job_block(const HParams &hp, const AttnPlan &p, const AttnBuffers &b, const int32_t *seq_ids,
                    const AttnPlan::Job &job) {
    const int64_t hd_k = hp.head_dim_k, hd_v = hp.head_dim_v;
    const int64_t head = int64_t(job.head_kv) * p.group + job.head0;  // first query head
    AttnBlock blk;
    blk.q = b.q + job.row0 * b.n_embd_q + head * hd_k;
    blk.q_row_stride = size_t(b.n_embd_q);
    blk.n_rows = job.n_rows;
    blk.n_group = job.n_heads;
    const int32_t seq = seq_ids[job.row0];
    blk.k = b.kc + b.head_rows(seq, job.head_kv, hd_k);
    blk.k_stride = size_t(hd_k);
    // Without a V cache the values are the leading entries of the key rows.
    blk.v = b.vc ? b.vc + b.head_rows(seq, job.head_kv, hd_v) : blk.k;
    blk.v_stride = b.vc ? size_t(hd_v) : blk.k_stride;
    blk.head_dim_k = hd_k;
    blk.head_dim_v = hd_v;
    if (job.part < 0) {
        const int64_t attn_row = int64_t(hp.n_head) * hd_v;
        blk.lo = p.lo.data() + job.row0;
        blk.hi = p.hi.data() + job.row0;
        blk.out = b.attn + job.row0 * attn_row + head * hd_v;
        blk.out_row_stride = size_t(attn_row);
    } else {
        float *o = b.part + size_t(job.part) * p.part_stride;
        blk.lo = p.part_lo.data() + job.part;
        blk.hi = p.part_hi.data() + job.part;
        blk.out = o + size_t(job.head0) * size_t(hd_v);
        blk.out_row_stride = 0;  // one row
        blk.m_out = o + size_t(p.group) * size_t(hd_v) + job.head0;
        blk.l_out = blk.m_out + p.group;
    }
    return blk;
}

// Split rows: per (row, KV head, query head), its parts merged in part order; a decode step's few
// merges stay on this thread (a pool hand-over would cost more).
void merge_splits(ThreadPool &pool, const HParams &hp, const AttnPlan &p, const AttnBuffers &b) {
    const int group = p.group;
    const int64_t hd_v = hp.head_dim_v, attn_row = int64_t(hp.n_head) * hd_v;
    const size_t ml = size_t(group) * size_t(hd_v);  // offset of m in a part
    for_each_row(pool, int64_t(p.splits.size()) * group, 64, [&](int64_t job) {
        const AttnPlan::Split &sp = p.splits[size_t(job / group)];
        const int g = int(job % group);
        const float *o = b.part + size_t(sp.first_part) * p.part_stride;
        attn_merge(int(sp.n_parts), o + ml + g, o + ml + group + g, p.part_stride, o + size_t(g) * size_t(hd_v),
                   p.part_stride, hd_v, b.attn + sp.row * attn_row + (int64_t(sp.hkv) * group + g) * hd_v);
    });
}

}  // namespace

void plan_attention(const HParams &hp, int il, const int32_t *positions, const int32_t *seq_ids, int64_t n,
                    int pool_size, AttnPlan &plan) {
    plan.group = hp.n_head / hp.n_head_kv;
    plan.part_stride = size_t(plan.group) * size_t(hp.head_dim_v + 2);
    plan_key_ranges(hp, il, positions, n, plan);
    plan_ranges(hp, seq_ids, n, plan);
    plan_jobs(hp, pool_size, plan);
}

void CpuBackend::attention(int il) {
    const HParams &hp = hp_;
    AttnPlan &plan = s_.attn_plan;
    const int32_t *positions = positions_, *seq_ids = seq_ids_;
    plan_attention(hp, il, positions, seq_ids, n_, pool_.size(), plan);
    if (s_.attn_part.size() < plan.part_lo.size() * plan.part_stride)
        s_.attn_part.resize(plan.part_lo.size() * plan.part_stride);
    const KvCache &kv = cache(il);
    const AttnBuffers b{s_.q.data(), hp.n_embd_q(), kv.k(), kv.v(), hp.n_head_kv, hp.head_dim_k, hp.head_dim_v,
                        kv.n_ctx(), s_.attn.data(), s_.attn_part.data()};
    store_kv(b, s_.k.data(), s_.v.data(), positions, seq_ids, n_);
    // Each job's result does not depend on which worker claims it.
    const AttnKernel kernel = attention_kernel();
    pool_.for_each_item(plan.jobs.size(), [&](size_t j, int tid) {
        kernel(job_block(hp, plan, b, seq_ids, plan.jobs[j]), s_.attn_tmp.data() + size_t(tid) * s_.attn_tmp_stride);
    });
    if (!plan.splits.empty()) merge_splits(pool_, hp, plan, b);
}

}  // namespace ktd
