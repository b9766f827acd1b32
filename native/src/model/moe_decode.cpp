// The decode path of moe_ffn: one token, experts not sharded (plan and maths: moe.h).
#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>

#include "cpu/thread_pool.h"
#include "kernels/tile.h"
#include "model/backend_setup.h"
#include "model/blocks.h"
#include "model/model.h"
#include "model/moe_parts.h"
#include "model/profile.h"

namespace ktd::moe_parts {

namespace {

// Work items per thread and phase. Small items keep the wait at the two barriers short (the last
// item of the slowest worker). A worker's items are consecutive (RangeList), so its weight stream
// runs on from item to item (8 items per thread instead of 32 measured no different).
constexpr int64_t kDecodeItemsPerThread = 32;

// Rows [r0, r1) of `rows` that worker tid of nth takes in a static split (kRowBlock blocks).
void row_range(int64_t rows, int tid, int nth, int64_t &r0, int64_t &r1) {
    const int64_t groups = (rows + kRowBlock - 1) / kRowBlock;
    r0 = std::min(rows, groups * tid / nth * kRowBlock);
    r1 = std::min(rows, groups * (tid + 1) / nth * kRowBlock);
}

// Rows per work item so that `rows` make about n_items items: a multiple of kRowBlock, >= kRowBlock.
int64_t block_rows(int64_t rows, int64_t n_items) {
    const int64_t per = (rows + n_items - 1) / std::max<int64_t>(n_items, 1);
    return std::max(kRowBlock, (per + kRowBlock - 1) / kRowBlock * kRowBlock);
}

// One token (decode). One parallel region:
//   1. the router rows split statically over the workers; barrier;
//   2. every worker routes the token and quantizes xn itself (a few microseconds, cheaper than a
//      barrier) and lays out the same job list (decode_jobs);
//   3. gate and up of all selected experts and the shared expert as one list of row blocks in
//      memory order (job by job: its gate blocks, then its up blocks); the worker that finishes a
//      job's last block takes its swiglu and quantizes the hidden row for down; barrier;
//   4. down as one list of (job, output-row block) items, job by job, into per-job outputs; the
//      worker that finishes the last job of a row block sums that block's rows over all jobs in
//      selection order (shared last): y = Σ weight · down rows, with no third barrier.
// Both lists are RangeLists: each worker takes a contiguous run of items (whole matrices, a few
// experts each), stealing from the back of the others' at the end. Its weights then arrive as a
// few long streams, not a new ~100-400 KiB stretch per item as when the items were dealt out one
// at a time (in the (row block, all jobs) order before that, ~14 KiB per stretch). Measured at 2
// threads on a Zen 4 (in one process, alternating the two orders call by call): the gate/up phase
// 5-14% and the down phase 4-18% faster on the qwen3moe and deepseek2 bench files, AVX2 and
// AVX-512 kernels (of the 18 phase pairs, one deepseek2 down even, one gate/up 6% slower).
// The sums are in the same order as moe_ffn's general path, so both give the same bits.
// Selected experts another device holds (MoeDeviceExperts) keep their place in the job list with
// no rows: no gate/up items, their down items only count the block done, the sum skips them.

// One call of the decode path: the layer, its sizes, the activation formats of xn (router, routed
// gate/up, shared gate/up) back to back in each worker's xq, and the item sizes: gate/up rows of
// all jobs, and the E down rows of every job, each cut into about kDecodeItemsPerThread · nth
// blocks in all (one block per job on a single thread).
struct DecodeCall {
    DecodeCall(const MoeRun &run, const LayerWeights &w, int il, const float *xn, float *y, MoePart part,
               const MoeDeviceExperts *dev);
    const LayerWeights &w;
    const MoeParams &mp;
    ThreadPool &pool;
    MoeScratch &s;
    const float *xn;  // [E]
    float *y;         // [E]
    int64_t E, ff, ff_sh;
    int ne, k, nth, n_jobs;
    bool shared;
    ActFormat fmts[5];
    size_t fmt_off[5] = {};  // of each format in a worker's xq
    size_t xq_bytes = 0;
    int n_fmt = 0, f_router = -1, f_gate = -1, f_up = -1, f_sgate = -1, f_sup = -1;
    size_t hq_row = 0, sq_row = 0;
    int64_t up_block = 0, down_block = 0, n_up_items = 0, n_down_items = 0, down_per_job = 0;
    uint64_t *counts = nullptr;
    const float *probs_b = nullptr, *sh_gate_w = nullptr;
    ForwardProfile *prof = nullptr;  // times the three phases on tid 0 while profiling (profile.h)
    const MoeDeviceExperts *dev = nullptr;
};

DecodeCall::DecodeCall(const MoeRun &run, const LayerWeights &w_, int il, const float *xn_, float *y_, MoePart part,
                       const MoeDeviceExperts *dev_)
    : w(w_), mp(run.model.hparams().moe), pool(run.model.pool()), s(run.s), xn(xn_), y(y_),
      E(run.model.hparams().n_embd), ff(mp.n_ff_exp), ff_sh(w_.ffn_gate_shexp && part == MoePart::All ? w_.ffn_gate_shexp.pw.rows : 0),
      ne(mp.n_expert), k(mp.n_expert_used), nth(pool.size()),
      n_jobs(k + (w_.ffn_gate_shexp && part == MoePart::All ? 1 : 0)),
      shared(bool(w_.ffn_gate_shexp) && part == MoePart::All) {
    f_router = format_index(fmts, n_fmt, *w.ffn_gate_inp.pw.tk, E);
    f_gate = format_index(fmts, n_fmt, *w.ffn_gate_exps.mats[0].tk, E);
    f_up = format_index(fmts, n_fmt, *w.ffn_up_exps.mats[0].tk, E);
    if (shared) {
        f_sgate = format_index(fmts, n_fmt, *w.ffn_gate_shexp.pw.tk, E);
        f_sup = format_index(fmts, n_fmt, *w.ffn_up_shexp.pw.tk, E);
        sq_row = act_row_size(*w.ffn_down_shexp.pw.tk, ff_sh);
    }
    for (int f = 0; f < n_fmt; ++f) {
        fmt_off[f] = xq_bytes;
        xq_bytes += fmts[f].row;
    }
    hq_row = act_row_size(*w.ffn_down_exps.mats[0].tk, ff);
    const int64_t up_rows = int64_t(k) * ff + ff_sh;
    up_block = nth > 1 ? block_rows(up_rows, kDecodeItemsPerThread * nth) : std::max(ff, ff_sh);
    // Every job's down has E rows: the same blocks for all, so a row block's count of finished
    // jobs tells when its sum can be taken.
    down_block = nth > 1 ? block_rows(E, (kDecodeItemsPerThread * nth + n_jobs - 1) / n_jobs) : E;
    down_per_job = (E + down_block - 1) / down_block;
    // Every routed expert has ff rows, so the item count does not depend on the routing. Gate and
    // up are separate items.
    n_up_items = 2 * (int64_t(k) * ((ff + up_block - 1) / up_block) + (shared ? (ff_sh + up_block - 1) / up_block : 0));
    n_down_items = int64_t(n_jobs) * down_per_job;
    counts = run.taps.layer_expert_counts(il, mp.n_expert);
    probs_b = w.exp_probs_b.empty() ? nullptr : w.exp_probs_b.data();
    sh_gate_w = w.ffn_gate_inp_shexp.empty() ? nullptr : w.ffn_gate_inp_shexp.data();
    prof = run.taps.profile;
    dev = dev_;
}

// Scratch for the call, the jobs' completion counters and the two work lists, before the region.
void decode_prepare(const DecodeCall &c) {
    MoeScratch &s = c.s;
    if (s.dec.size() < size_t(c.nth)) s.dec.resize(size_t(c.nth));
    for (MoeScratch::DecodeWorker &dw : s.dec) {
        grow(dw.logits, size_t(c.ne));
        grow(dw.select, size_t(c.ne));
        grow(dw.ids, size_t(c.k));
        grow(dw.weights, size_t(c.k));
        grow(dw.xq, c.xq_bytes);
        dw.jobs.reserve(size_t(c.n_jobs));
    }
    grow(s.logits, size_t(c.ne));
    grow(s.hg, size_t(c.k) * size_t(c.ff));
    grow(s.hu, size_t(c.k) * size_t(c.ff));
    grow(s.hq, size_t(c.k) * c.hq_row);
    grow(s.yd, size_t(c.n_jobs) * size_t(c.E));
    if (c.shared) {
        grow(s.sg, size_t(c.ff_sh));
        grow(s.su, size_t(c.ff_sh));
        grow(s.sq, c.sq_row);
    }
    // Counters: gate/up rows finished per job, then jobs finished per down row block.
    const size_t n_done = size_t(c.n_jobs) + size_t(c.down_per_job);
    if (s.dec_done_size < n_done) {
        s.dec_done = std::make_unique<std::atomic<int64_t>[]>(n_done);
        s.dec_done_size = n_done;
    }
    for (size_t j = 0; j < n_done; ++j) s.dec_done[j].store(0, std::memory_order_relaxed);
    s.dec_up_list.reset(size_t(c.n_up_items), c.nth);
    s.dec_down_list.reset(size_t(c.n_down_items), c.nth);
}

// The decode job list of one worker: the selected experts in selection order, then the shared
// expert (weight: its sigmoid gate); gate/up items numbered consecutively over the jobs, a job's
// gate blocks and then its up blocks (up_block rows each, the last of each matrix shorter).
void decode_jobs(const DecodeCall &c, MoeScratch::DecodeWorker &dw, float shexp_weight) {
    MoeScratch &s = c.s;
    const LayerWeights &w = c.w;
    dw.jobs.clear();
    int64_t item = 0;
    auto add = [&](const PreparedWeights *gate, const PreparedWeights *up, const PreparedWeights *down,
                   int64_t n_ff, float weight, float *hg, float *hu, uint8_t *hq, size_t hq_row_bytes, int32_t fg,
                   int32_t fu) {
        const int64_t blocks = (n_ff + c.up_block - 1) / c.up_block;
        dw.jobs.push_back({gate, up, down, n_ff, weight, item, blocks, hg, hu, hq, hq_row_bytes, fg, fu});
        item += 2 * blocks;
    };
    for (int j = 0; j < c.k; ++j) {
        const size_t e = size_t(dw.ids[size_t(j)]);
        const bool elsewhere = c.dev && c.dev->on_device[e];
        add(&w.ffn_gate_exps.mats[e], &w.ffn_up_exps.mats[e], &w.ffn_down_exps.mats[e], elsewhere ? 0 : c.ff,
            dw.weights[size_t(j)],
            s.hg.data() + size_t(j) * size_t(c.ff), s.hu.data() + size_t(j) * size_t(c.ff),
            s.hq.data() + size_t(j) * c.hq_row, c.hq_row, c.f_gate, c.f_up);
    }
    if (c.shared)
        add(&w.ffn_gate_shexp.pw, &w.ffn_up_shexp.pw, &w.ffn_down_shexp.pw, c.ff_sh, shexp_weight, s.sg.data(),
            s.su.data(), s.sq.data(), c.sq_row, c.f_sgate, c.f_sup);
    dw.up_items = item;
}

// 1. xn in every activation format into this worker's xq, and its rows of the router logits.
void decode_router_rows(const DecodeCall &c, MoeScratch::DecodeWorker &dw, int tid, int nt) {
    uint8_t *xq = dw.xq.data();
    for (int f = 0; f < c.n_fmt; ++f) c.fmts[f].tk->quantize_act_row(c.xn, xq + c.fmt_off[f], c.E);
    const PreparedWeights &router = c.w.ffn_gate_inp.pw;
    int64_t r0, r1;
    row_range(router.rows, tid, nt, r0, r1);
    if (r0 < r1)
        matmul_tile(router, r0, r1, xq + c.fmt_off[c.f_router], c.fmts[c.f_router].row, c.s.logits.data() + r0, 1,
                    1, tid);
}

// 2. Routing, shared-expert gate and job list, the same on every worker (worker 0 counts).
void decode_route(const DecodeCall &c, MoeScratch::DecodeWorker &dw, int tid) {
    std::copy(c.s.logits.data(), c.s.logits.data() + c.ne, dw.logits.data());
    moe_route(c.mp, dw.logits.data(), c.probs_b, 1, dw.ids.data(), dw.weights.data(), dw.select.data());
    if (tid == 0)
        for (int j = 0; j < c.k; ++j) {
            const int32_t e = dw.ids[size_t(j)];
            ++c.counts[e];
            if (c.dev && c.dev->on_device[e]) c.dev->selected->push_back({0, e, dw.weights[size_t(j)]});
        }
    decode_jobs(c, dw, c.sh_gate_w ? shexp_gate(c.sh_gate_w, c.xn, c.E) : 1.0f);
}

// 3. One gate or up block; the worker finishing a job's last block (of both matrices) takes the
// job's swiglu and quantizes its hidden row.
void decode_up_item(const DecodeCall &c, const MoeScratch::DecodeWorker &dw, int64_t it, int tid) {
    if (it >= dw.up_items) return;  // planned for k experts, some of which another device computes
    // The job holding item `it`: the last one starting at or before it (at most a few jobs).
    const auto next = std::upper_bound(dw.jobs.begin(), dw.jobs.end(), it,
                                       [](int64_t i, const MoeScratch::DecodeJob &j) { return i < j.up_item0; });
    const size_t ji = size_t(next - dw.jobs.begin()) - 1;
    const MoeScratch::DecodeJob &j = dw.jobs[ji];
    const int64_t local = it - j.up_item0;
    const bool up = local >= j.up_blocks;
    const int64_t b0 = (up ? local - j.up_blocks : local) * c.up_block, b1 = std::min(j.n_ff, b0 + c.up_block);
    const uint8_t *xq = dw.xq.data();
    if (up)
        matmul_tile(*j.up, b0, b1, xq + c.fmt_off[j.fmt_up], c.fmts[j.fmt_up].row, j.hu + b0, 1, 1, tid);
    else
        matmul_tile(*j.gate, b0, b1, xq + c.fmt_off[j.fmt_gate], c.fmts[j.fmt_gate].row, j.hg + b0, 1, 1, tid);
    if (c.s.dec_done[ji].fetch_add(b1 - b0, std::memory_order_acq_rel) + (b1 - b0) == 2 * j.n_ff) {
        swiglu(j.hg, j.hu, j.n_ff);
        j.down->tk->quantize_act_row(j.hg, j.hq, j.n_ff);
    }
}

// 4. Output rows [d0, d1) of one job into its row of yd; the worker finishing the block's last job
// sums the block: y = Σ_j weight_j · down_j (selection order), + gate · shared.
void decode_down_item(const DecodeCall &c, const MoeScratch::DecodeWorker &dw, int64_t it, int tid) {
    const int64_t jj = it / c.down_per_job, b = it % c.down_per_job;
    const int64_t d0 = b * c.down_block, d1 = std::min(c.E, d0 + c.down_block);
    const MoeScratch::DecodeJob &job = dw.jobs[size_t(jj)];
    float *yd = c.s.yd.data();
    if (job.n_ff > 0)  // (0: another device's expert)
        matmul_tile(*job.down, d0, d1, job.hq, job.hq_row, yd + size_t(jj) * size_t(c.E) + d0, 1, 1, tid);
    if (c.s.dec_done[size_t(c.n_jobs + b)].fetch_add(1, std::memory_order_acq_rel) + 1 != c.n_jobs) return;
    bool first = true;
    for (int j = 0; j < c.n_jobs; ++j) {
        if (dw.jobs[size_t(j)].n_ff == 0) continue;
        const float wt = dw.jobs[size_t(j)].weight;
        const float *t = yd + size_t(j) * size_t(c.E);
        if (first)
            for (int64_t d = d0; d < d1; ++d) c.y[d] = wt * t[d];
        else
            for (int64_t d = d0; d < d1; ++d) c.y[d] += wt * t[d];
        first = false;
    }
    if (first) std::fill(c.y + d0, c.y + d1, 0.0f);  // every selected expert on the other device
}

void decode_region(const DecodeCall &c, int tid, int nt) {
    MoeScratch::DecodeWorker &dw = c.s.dec[size_t(tid)];
    // Each emplace ends the previous phase's timer (no-ops unless tid 0 is profiling).
    ForwardProfile *prof = tid == 0 ? c.prof : nullptr;
    std::optional<OpTimer> phase(std::in_place, prof, ForwardOp::MoeRouter);
    decode_router_rows(c, dw, tid, nt);
    if (nt > 1) c.pool.barrier(tid);
    decode_route(c, dw, tid);
    if (tid == 0 && c.dev && c.dev->routed) c.dev->routed();  // the device's experts start now
    phase.emplace(prof, ForwardOp::MoeGateUp);
    c.s.dec_up_list.drain(tid, [&](size_t it) { decode_up_item(c, dw, int64_t(it), tid); });
    if (nt > 1) c.pool.barrier(tid);
    phase.emplace(prof, ForwardOp::MoeDown);
    c.s.dec_down_list.drain(tid, [&](size_t it) { decode_down_item(c, dw, int64_t(it), tid); });
}

}  // namespace

void moe_ffn_decode(const MoeRun &run, const LayerWeights &w, int il, const float *xn, float *y, MoePart part,
                    const MoeDeviceExperts *dev) {
    const DecodeCall c(run, w, il, xn, y, part, dev);
    decode_prepare(c);
    if (c.nth > 1)
        c.pool.run([&](int tid, int nt) { decode_region(c, tid, nt); });
    else
        decode_region(c, 0, 1);
}

}  // namespace ktd::moe_parts
