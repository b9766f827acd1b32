// Context::attention: writes a chunk's K/V into the cache and runs the attention kernel over
// (row block × KV head × key range) jobs on the pool, merging split key ranges afterwards.
#include <algorithm>
#include <atomic>

#include "common/float16.h"
#include "kernels/attention.h"
#include "model/blocks.h"
#include "model/model.h"

namespace ktd {

// Query rows per attention block: about 64 queries (rows × the GQA group's heads) share each K/V
// tile, and the block's scratch (scores and accumulators, 64 queries × (64 + head_dim_v) floats)
// stays in L2.
int attn_rows_per_block(const HParams &hp) { return std::max(1, 64 / (hp.n_head / hp.n_head_kv)); }

namespace {
// Decode over a long context: a row's keys are split into ranges of kAttnSplitKeys (at multiples of
// it) when the batch has fewer than kAttnSplitMinJobs rows × KV heads, so that threads share one
// head group's keys (Context::attention).
constexpr int64_t kAttnSplitKeys = 4 * kAttnTile;
constexpr int64_t kAttnSplitMinJobs = 32;
}  // namespace

void Context::attention(int il, const int32_t *positions, const int32_t *seq_ids, int64_t n) {
    const HParams &hp = model_.hparams();
    const int64_t dk = hp.n_embd_k_cache(), dv_cache = hp.n_embd_v_cache();
    uint16_t *kc = k_cache_[size_t(il)].get();
    // Without a V cache the values are read from the K rows (MLA: the latent is both).
    uint16_t *vc = dv_cache > 0 ? v_cache_[size_t(il)].get() : kc;
    const int64_t dv = dv_cache > 0 ? dv_cache : dk;  // V row stride
    // Store this chunk's K/V as F16 at (seq, pos).
    for (int64_t i = 0; i < n; ++i) {
        const size_t slot = size_t(seq_ids[i]) * size_t(n_ctx_) + size_t(positions[i]);
        for (int64_t d = 0; d < dk; ++d) kc[slot * size_t(dk) + size_t(d)] = fp32_to_fp16(s_.k[size_t(i * dk + d)]);
        for (int64_t d = 0; d < dv_cache; ++d)
            vc[slot * size_t(dv) + size_t(d)] = fp32_to_fp16(s_.v[size_t(i * dv_cache + d)]);
    }
    // Row i attends keys [lo, pos] of its sequence (lo > 0 only in a sliding-window layer).
    const bool swa = hp.layer_swa[size_t(il)];
    for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = positions[i];
        s_.attn_lo[size_t(i)] = swa ? std::max<int64_t>(0, pos - hp.n_swa + 1) : 0;
        s_.attn_hi[size_t(i)] = pos + 1;
    }
    // Jobs: blocks of up to R consecutive rows of one sequence (consecutive positions) × one KV
    // head, so a block's K/V tiles are converted once for its R rows × the group's query heads
    // (MLA: one latent head, all query heads). A query's result does not depend on the block or
    // the heads it is computed with.
    const int group = hp.n_head / hp.n_head_kv;
    // Too few rows to share out (decode; few KV heads): every row on its own, its keys split into
    // ranges of kAttnSplitKeys at fixed positions, computed apart and merged (attn_merge). The
    // split depends on the batch only, never on the thread count.
    const bool split_keys = n * hp.n_head_kv < kAttnSplitMinJobs;
    const int rows_max = split_keys ? 1 : attn_rows_per_block(hp);
    std::vector<ForwardScratch::AttnJob> &jobs = s_.attn_jobs;
    std::vector<ForwardScratch::AttnRange> &ranges = s_.attn_ranges;
    std::vector<ForwardScratch::AttnSplit> &splits = s_.attn_splits;
    jobs.clear();
    ranges.clear();
    splits.clear();
    s_.attn_part_lo.clear();
    s_.attn_part_hi.clear();
    for (int64_t i = 0; i < n;) {
        int64_t e = i + 1;
        while (e < n && e - i < rows_max && seq_ids[e] == seq_ids[i]) ++e;
        const int64_t lo = s_.attn_lo[size_t(i)], hi = s_.attn_hi[size_t(i)];
        const int64_t c0 = lo / kAttnSplitKeys, c1 = (hi + kAttnSplitKeys - 1) / kAttnSplitKeys;
        if (!split_keys || c1 - c0 < 2) {
            ranges.push_back({i, e, -1, 1});
        } else {  // part (kv head h, range c) at first_part + h·n_chunks + c
            const int64_t first = int64_t(s_.attn_part_lo.size());
            ranges.push_back({i, e, first, c1 - c0});
            for (int h = 0; h < hp.n_head_kv; ++h) {
                splits.push_back({i, first + h * (c1 - c0), c1 - c0, h});
                for (int64_t c = c0; c < c1; ++c) {
                    s_.attn_part_lo.push_back(std::max(lo, c * kAttnSplitKeys));
                    s_.attn_part_hi.push_back(std::min(hi, (c + 1) * kAttnSplitKeys));
                }
            }
        }
        i = e;
    }
    // Fewer jobs than threads (few KV heads, short rows): split each group's query heads into parts.
    const int pool_size = model_.pool().size();
    int64_t n_kv_jobs = 0;
    for (const ForwardScratch::AttnRange &rg : ranges) n_kv_jobs += rg.n_chunks * hp.n_head_kv;
    const int head_parts = n_kv_jobs >= pool_size ? 1 : int(std::min<int64_t>(group, (pool_size + n_kv_jobs - 1) / n_kv_jobs));
    const size_t part_stride = size_t(group) * size_t(hp.head_dim_v + 2);  // o [group][hd_v], m [group], l [group]
    for (const ForwardScratch::AttnRange &rg : ranges)
        for (int h = 0; h < hp.n_head_kv; ++h)
            for (int64_t c = 0; c < rg.n_chunks; ++c) {
                const int64_t pi = rg.first_part < 0 ? -1 : rg.first_part + h * rg.n_chunks + c;
                int64_t cost = 0;
                if (pi < 0) {
                    for (int64_t r = rg.i; r < rg.e; ++r) cost += s_.attn_hi[size_t(r)] - s_.attn_lo[size_t(r)];
                } else {
                    cost = s_.attn_part_hi[size_t(pi)] - s_.attn_part_lo[size_t(pi)];
                }
                for (int hpart = 0; hpart < head_parts; ++hpart) {
                    const int g0 = group * hpart / head_parts, g1 = group * (hpart + 1) / head_parts;
                    jobs.push_back({rg.i, cost * (g1 - g0), int(rg.e - rg.i), h, g0, g1 - g0, pi});
                }
            }
    if (s_.attn_part.size() < s_.attn_part_lo.size() * part_stride) s_.attn_part.resize(s_.attn_part_lo.size() * part_stride);
    // Longest first, handed out one at a time: causal prefill blocks differ in cost by up to the
    // context length, so fixed contiguous shares would leave threads idle. Each job's result does
    // not depend on which thread runs it.
    std::stable_sort(jobs.begin(), jobs.end(), [](const auto &a, const auto &b) { return a.cost > b.cost; });
    const AttnKernel kernel = attention_kernel();
    const int64_t hd_k = hp.head_dim_k, hd_v = hp.head_dim_v, n_embd_q = hp.n_embd_q();
    const int64_t attn_row = int64_t(hp.n_head) * hd_v;
    std::atomic<size_t> next{0};
    model_.pool().run([&](int tid, int) {
        float *scratch = s_.attn_tmp.data() + size_t(tid) * s_.attn_tmp_stride;
        for (size_t j = next.fetch_add(1, std::memory_order_relaxed); j < jobs.size();
             j = next.fetch_add(1, std::memory_order_relaxed)) {
            const ForwardScratch::AttnJob &job = jobs[j];
            const size_t base = size_t(seq_ids[job.row0]) * size_t(n_ctx_);
            AttnBlock blk;
            const int64_t head = int64_t(job.head_kv) * group + job.head0;  // first query head
            blk.q = s_.q.data() + job.row0 * n_embd_q + head * hd_k;
            blk.q_row_stride = size_t(n_embd_q);
            blk.n_rows = job.n_rows;
            blk.n_group = job.n_heads;
            blk.k = kc + base * size_t(dk) + size_t(job.head_kv * hd_k);
            blk.v = vc + base * size_t(dv) + size_t(job.head_kv * hd_v);
            blk.k_stride = size_t(dk);
            blk.v_stride = size_t(dv);
            blk.head_dim_k = hd_k;
            blk.head_dim_v = hd_v;
            if (job.part < 0) {
                blk.lo = s_.attn_lo.data() + job.row0;
                blk.hi = s_.attn_hi.data() + job.row0;
                blk.out = s_.attn.data() + job.row0 * attn_row + head * hd_v;
                blk.out_row_stride = size_t(attn_row);
            } else {
                float *p = s_.attn_part.data() + size_t(job.part) * part_stride;
                blk.lo = s_.attn_part_lo.data() + job.part;
                blk.hi = s_.attn_part_hi.data() + job.part;
                blk.out = p + size_t(job.head0) * size_t(hd_v);
                blk.out_row_stride = 0;  // one row
                blk.m_out = p + size_t(group) * size_t(hd_v) + job.head0;
                blk.l_out = blk.m_out + group;
            }
            kernel(blk, scratch);
        }
    });
    if (splits.empty()) return;
    // Merged per (row, KV head, query head), in part order; a decode step's few merges stay on
    // this thread (a pool hand-over would cost more).
    const size_t ml = size_t(group) * size_t(hd_v);  // offset of m in a part
    for_each_row(model_.pool(), int64_t(splits.size()) * group, 64, [&](int64_t job) {
        const ForwardScratch::AttnSplit &sp = splits[size_t(job / group)];
        const int g = int(job % group);
        const float *p = s_.attn_part.data() + size_t(sp.first_part) * part_stride;
        attn_merge(int(sp.n_parts), p + ml + g, p + ml + group + g, part_stride, p + size_t(g) * size_t(hd_v), part_stride,
                   hd_v, s_.attn.data() + sp.row * attn_row + (int64_t(sp.hkv) * group + g) * hd_v);
    });
}

}  // namespace ktd
