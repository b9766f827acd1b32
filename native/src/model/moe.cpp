// The routed-expert FFN (see moe.h for the maths and the execution plan).
//
// Buffers (MoeScratch), P = n·n_expert_used (token, slot) pairs sorted by expert:
//   logits [n][n_expert]   ids/weights [n][n_expert_used]   pair_tok/pair_pos [P]
//   xq[f] [n][act row of format f]   xg [P][act row] (only the rows of experts with > 1 token)
//   hg/hu [P][n_ff_exp] → swiglu in hg → hq [P][act row of down_exps] → yd [P][n_embd]
//   shared expert: sg/su [n][n_ff_shexp] → sq → ys [n][n_embd]
#include "model/moe.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "cpu/thread_pool.h"
#include "kernels/kernels.h"
#include "kernels/tile.h"
#include "model/backend_setup.h"
#include "model/blocks.h"
#include "model/model.h"
#include "model/moe_parts.h"

namespace ktd {

using namespace moe_parts;

namespace {

// Work items per thread and phase: enough to even out experts of different token counts.
constexpr int64_t kItemsPerThread = 4;
// llama.cpp clamps the renormalisation sum to F16's smallest normal number.
constexpr float kWeightsSumMin = 6.103515625e-5f;
constexpr int kMaxExpertWords = 4096 / 64;  // hparams.cpp caps n_expert at 4096

// matmul_tile for an item: its rows lie in parts[item.part], which starts at row item.part_r0.
void item_tile(const PreparedWeights *parts, const MoeScratch::Item &item, const uint8_t *xq, size_t x_stride,
               float *y, size_t ldy, int nc, int tid) {
    matmul_tile(parts[item.part], item.r0 - item.part_r0, item.r1 - item.part_r0, xq, x_stride, y, ldy, nc, tid);
}

// Cuts the rows of NUMA slice `slice` of a matrix of `rows` rows (all of them on one node) into
// blocks (multiples of kRowBlock) so that this job gets its share, by cost, of n_target items.
void add_items(std::vector<MoeScratch::Item> &items, int32_t job, int64_t rows, bool sharded, int n_slice,
               int slice, double cost, double total_cost, int64_t n_target) {
    const auto [a, b] = numa_slice_rows(rows, n_slice, slice);
    if (a >= b) return;
    const int32_t part = sharded ? slice : 0, part_r0 = sharded ? int32_t(a) : 0;
    const int64_t max_blocks = (b - a + kRowBlock - 1) / kRowBlock;
    const int64_t want = int64_t(std::ceil(double(n_target) * cost / total_cost));
    const int64_t n_blocks = std::clamp<int64_t>(want, 1, max_blocks);
    const int64_t blk = ((b - a) / n_blocks + kRowBlock - 1) / kRowBlock * kRowBlock;
    for (int64_t r0 = a; r0 < b; r0 += blk)
        items.push_back({job, int32_t(r0), int32_t(std::min(b, r0 + blk)), part, part_r0});
}

// Group-limited selection (n_group > 1): a group scores the sum of its two best selection
// scores; the experts outside the n_group_used best groups get -inf.
void limit_groups(const MoeParams &mp, float *select) {
    const int gsize = mp.n_expert / mp.n_group;
    float gscore[kMaxExpertWords * 64 / 2];
    for (int g = 0; g < mp.n_group; ++g) {
        const float *sg = select + g * gsize;
        int b1 = 0;
        for (int e = 1; e < gsize; ++e)
            if (sg[e] > sg[b1]) b1 = e;
        int b2 = b1 == 0 ? 1 : 0;
        for (int e = 0; e < gsize; ++e)
            if (e != b1 && sg[e] > sg[b2]) b2 = e;
        gscore[g] = sg[b1] + sg[b2];
    }
    uint64_t kept[kMaxExpertWords] = {};
    for (int j = 0; j < mp.n_group_used; ++j) {
        int best = -1;
        for (int g = 0; g < mp.n_group; ++g)
            if (!(kept[g / 64] >> (g % 64) & 1) && (best < 0 || gscore[g] > gscore[best])) best = g;
        kept[best / 64] |= uint64_t(1) << (best % 64);
    }
    for (int g = 0; g < mp.n_group; ++g)
        if (!(kept[g / 64] >> (g % 64) & 1))
            for (int e = 0; e < gsize; ++e) select[g * gsize + e] = -INFINITY;
}

}  // namespace

void moe_route(const MoeParams &mp, float *logits, const float *exp_probs_b, int64_t n, int32_t *ids,
               float *weights, float *select) {
    const int ne = mp.n_expert, k = mp.n_expert_used;
    for (int64_t i = 0; i < n; ++i) {
        float *p = logits + i * ne;
        if (mp.gating == ExpertGating::Softmax) {
            float mx = -INFINITY;
            for (int e = 0; e < ne; ++e) mx = std::max(mx, p[e]);
            double sum = 0.0;
            for (int e = 0; e < ne; ++e) {
                p[e] = std::exp(p[e] - mx);
                sum += p[e];
            }
            const float inv = float(1.0 / sum);
            for (int e = 0; e < ne; ++e) p[e] *= inv;
        } else {
            for (int e = 0; e < ne; ++e) p[e] = 1.0f / (1.0f + std::exp(-p[e]));
        }
        for (int e = 0; e < ne; ++e) select[e] = exp_probs_b ? p[e] + exp_probs_b[e] : p[e];
        if (mp.n_group > 1) limit_groups(mp, select);

        // Top-k, best first; strict > keeps the lowest index among equals (and picks something
        // even from NaN scores, so the ids are always k distinct experts).
        uint64_t taken[kMaxExpertWords] = {};
        int32_t *id = ids + i * k;
        float *wt = weights + i * k;
        for (int j = 0; j < k; ++j) {
            int best = -1;
            for (int e = 0; e < ne; ++e)
                if (!(taken[e / 64] >> (e % 64) & 1) && (best < 0 || select[e] > select[best])) best = e;
            taken[best / 64] |= uint64_t(1) << (best % 64);
            id[j] = best;
            wt[j] = p[best];
        }
        if (mp.weights_norm) {
            float sum = 0.0f;
            for (int j = 0; j < k; ++j) sum += wt[j];
            sum = std::max(sum, kWeightsSumMin);
            for (int j = 0; j < k; ++j) wt[j] /= sum;
        }
        if (mp.weights_scale != 1.0f)
            for (int j = 0; j < k; ++j) wt[j] *= mp.weights_scale;
    }
}

void moe_record_state(ForwardTaps &taps, int64_t E, int il, int after, const float *x_row) {
    std::vector<float> &st = taps.moe_states;
    if (st.empty()) return;
    std::copy(x_row, x_row + E, st.data() + (size_t(il) * 2 + size_t(after)) * size_t(E));
}

namespace {

// One call of the general path (n tokens): the layer, its sizes and activation formats (routed
// gate/up, shared gate/up; shared when the quantizer is), and the scratch it runs in. Built before
// the parallel region; only `gather` changes inside it (set by the plan, read after a barrier).
struct MoeCall {
    MoeCall(const MoeRun &run, const LayerWeights &w, int il, const float *xn, int64_t n, float *y, MoePart part,
            const MoeDeviceExperts *dev);
    const Model &model;
    const LayerWeights &w;
    const MoeParams &mp;
    MoeScratch &s;
    const float *xn;  // [n][E]
    float *y;         // [n][E]
    int64_t n, E, ff, P, ff_sh;
    int ne, k, nth, n_slice;
    bool shared;
    ActFormat fmts[4];
    int n_fmt, f_gate, f_up, f_sgate, f_sup;
    size_t hq_row, sq_row;  // bytes of a quantized hidden row for down_exps / down_shexp
    uint64_t *counts;       // [n_expert] the layer's expert statistics
    const float *probs_b, *sh_gate_w;
    bool gather = false;    // some expert has several tokens: their xq rows are gathered
    const MoeDeviceExperts *dev;  // the experts another device computes (null: none)
    bool on_device(int32_t e) const { return dev && dev->on_device[e]; }
};

MoeCall::MoeCall(const MoeRun &run, const LayerWeights &w_, int il, const float *xn_, int64_t n_, float *y_,
                 MoePart part, const MoeDeviceExperts *dev_)
    : model(run.model), w(w_), mp(model.hparams().moe), s(run.s), xn(xn_), y(y_), n(n_),
      E(model.hparams().n_embd), ff(mp.n_ff_exp), P(n_ * mp.n_expert_used),
      ff_sh(w_.ffn_gate_shexp ? w_.ffn_gate_shexp.pw.rows : 0), ne(mp.n_expert), k(mp.n_expert_used),
      nth(model.pool().size()), n_slice(model.n_slices()),
      shared(bool(w_.ffn_gate_shexp) && part == MoePart::All), n_fmt(0), dev(dev_) {
    f_gate = format_index(fmts, n_fmt, *w.ffn_gate_exps.parts(0)->tk, E);
    f_up = format_index(fmts, n_fmt, *w.ffn_up_exps.parts(0)->tk, E);
    f_sgate = shared ? format_index(fmts, n_fmt, *w.ffn_gate_shexp.pw.tk, E) : -1;
    f_sup = shared ? format_index(fmts, n_fmt, *w.ffn_up_shexp.pw.tk, E) : -1;
    hq_row = act_row_size(*w.ffn_down_exps.parts(0)->tk, ff);
    sq_row = shared ? act_row_size(*w.ffn_down_shexp.pw.tk, ff_sh) : 0;
    counts = run.taps.layer_expert_counts(il, mp.n_expert);
    probs_b = w.exp_probs_b.empty() ? nullptr : w.exp_probs_b.data();
    sh_gate_w = w.ffn_gate_inp_shexp.empty() ? nullptr : w.ffn_gate_inp_shexp.data();
}

// The scratch of the call, grown only when too small (no allocation once warm).
void grow_scratch(const MoeCall &c) {
    MoeScratch &s = c.s;
    const size_t n = size_t(c.n), P = size_t(c.P), ne = size_t(c.ne);
    for (int f = 0; f < c.n_fmt; ++f) grow(s.xq[f], n * c.fmts[f].row);
    grow(s.xg[0], P * c.fmts[c.f_gate].row);
    if (c.f_up != c.f_gate) grow(s.xg[1], P * c.fmts[c.f_up].row);
    grow(s.logits, n * ne);
    grow(s.select, size_t(c.nth) * ne);
    grow(s.ids, P);
    grow(s.weights, P);
    grow(s.shexp_gate, n);
    grow(s.expert_start, ne + 1);
    grow(s.pair_tok, P);
    grow(s.pair_pos, P);
    grow(s.hg, P * size_t(c.ff));
    grow(s.hu, P * size_t(c.ff));
    grow(s.hq, P * c.hq_row);
    grow(s.yd, P * size_t(c.E));
    if (c.shared) {
        grow(s.sg, n * size_t(c.ff_sh));
        grow(s.su, n * size_t(c.ff_sh));
        grow(s.sq, n * c.sq_row);
        grow(s.ys, n * size_t(c.E));
    }
}

// 1. Token i: routing, shared-expert gate, xn quantized once per activation format.
void route_token(const MoeCall &c, int64_t i, int tid) {
    MoeScratch &s = c.s;
    moe_route(c.mp, s.logits.data() + i * c.ne, c.probs_b, 1, s.ids.data() + i * c.k, s.weights.data() + i * c.k,
              s.select.data() + size_t(tid) * size_t(c.ne));
    if (c.sh_gate_w) s.shexp_gate[size_t(i)] = shexp_gate(c.sh_gate_w, c.xn + i * c.E, c.E);
    for (int f = 0; f < c.n_fmt; ++f)
        c.fmts[f].tk->quantize_act_row(c.xn + i * c.E, s.xq[size_t(f)].data() + size_t(i) * c.fmts[f].row, c.E);
}

// Plan, step 1: the P pairs grouped by expert (counting sort, stable: tokens ascending per
// expert) into expert_start, pair_tok, pair_pos; the routing counted into the statistics.
void group_by_expert(const MoeCall &c) {
    MoeScratch &s = c.s;
    int32_t *start = s.expert_start.data();
    std::fill(start, start + c.ne + 1, 0);
    for (int64_t p = 0; p < c.P; ++p) ++start[s.ids[size_t(p)] + 1];
    for (int e = 0; e < c.ne; ++e) {
        c.counts[e] += uint64_t(start[e + 1]);
        start[e + 1] += start[e];
    }
    for (int64_t p = 0; p < c.P; ++p) {
        const int32_t pos = start[s.ids[size_t(p)]]++;
        s.pair_tok[size_t(pos)] = int32_t(p / c.k);
        s.pair_pos[size_t(p)] = pos;
    }
    for (int e = c.ne; e > 0; --e) start[e] = start[e - 1];
    start[0] = 0;
    if (c.dev)
        for (int64_t p = 0; p < c.P; ++p)
            if (c.on_device(s.ids[size_t(p)]))
                c.dev->selected->push_back({int32_t(p / c.k), s.ids[size_t(p)], s.weights[size_t(p)]});
}

// Plan, step 2: one job per expert with tokens (expert order) after the shared expert's (all
// tokens). An expert's single token reads its xq row in place; several read gathered rows.
void plan_jobs(MoeCall &c) {
    MoeScratch &s = c.s;
    const LayerWeights &w = c.w;
    const size_t rg = c.fmts[c.f_gate].row, ru = c.fmts[c.f_up].row;
    s.jobs.clear();
    if (c.shared) {
        const MoeScratch::Job j{&w.ffn_gate_shexp.pw, &w.ffn_up_shexp.pw, &w.ffn_down_shexp.pw, false, c.ff_sh,
                                int(c.n), s.xq[size_t(c.f_sgate)].data(), s.xq[size_t(c.f_sup)].data(),
                                c.fmts[c.f_sgate].row, c.fmts[c.f_sup].row, s.sg.data(), s.su.data(),
                                s.sq.data(), c.sq_row, s.ys.data()};
        s.jobs.push_back(j);
    }
    c.gather = false;
    const int32_t *start = s.expert_start.data();
    for (int e = 0; e < c.ne; ++e) {
        const int32_t p0 = start[e], ntok = start[e + 1] - p0;
        if (ntok == 0 || c.on_device(e)) continue;
        const uint8_t *x_gate, *x_up;
        if (ntok == 1) {
            const size_t t = size_t(s.pair_tok[size_t(p0)]);
            x_gate = s.xq[size_t(c.f_gate)].data() + t * rg;
            x_up = s.xq[size_t(c.f_up)].data() + t * ru;
        } else {
            c.gather = true;
            x_gate = s.xg[0].data() + size_t(p0) * rg;
            x_up = (c.f_up == c.f_gate ? s.xg[0] : s.xg[1]).data() + size_t(p0) * ru;
        }
        s.jobs.push_back({w.ffn_gate_exps.parts(size_t(e)), w.ffn_up_exps.parts(size_t(e)),
                          w.ffn_down_exps.parts(size_t(e)), w.ffn_gate_exps.sharded(), c.ff, ntok, x_gate, x_up, rg,
                          ru, s.hg.data() + size_t(p0) * size_t(c.ff), s.hu.data() + size_t(p0) * size_t(c.ff),
                          s.hq.data() + size_t(p0) * c.hq_row, c.hq_row, s.yd.data() + size_t(p0) * size_t(c.E)});
    }
}

// Plan, step 3: the gate/up and down items of every job within each NUMA slice, each job's share
// of a slice's items by cost (weight bytes streamed + the tokens' dot products: rows · (1 + ntok)),
// and the two work lists over them.
void plan_items(const MoeCall &c) {
    MoeScratch &s = c.s;
    double cost_up = 0, cost_down = 0;
    for (const MoeScratch::Job &j : s.jobs) {
        cost_up += double(j.n_ff) * (1 + j.ntok);
        cost_down += double(c.E) * (1 + j.ntok);
    }
    s.up_items.clear();
    s.down_items.clear();
    s.up_start.assign(1, 0);
    s.down_start.assign(1, 0);
    for (int sl = 0; sl < c.n_slice; ++sl) {
        const int nth_sl = c.model.memory().nodes[size_t(sl)].n_threads;
        const int64_t n_target = c.nth > 1 ? kItemsPerThread * nth_sl : 1;
        for (size_t ji = 0; ji < s.jobs.size(); ++ji) {
            const MoeScratch::Job &j = s.jobs[ji];
            add_items(s.up_items, int32_t(ji), j.n_ff, j.sharded, c.n_slice, sl, double(j.n_ff) * (1 + j.ntok),
                      cost_up, n_target);
            add_items(s.down_items, int32_t(ji), c.E, j.sharded, c.n_slice, sl, double(c.E) * (1 + j.ntok),
                      cost_down, n_target);
        }
        s.up_start.push_back(s.up_items.size());
        s.down_start.push_back(s.down_items.size());
    }
    s.up_list.reset(s.up_start.data(), c.n_slice);
    s.down_list.reset(s.down_start.data(), c.n_slice);
}

// 2. The xq rows of experts with several tokens gathered contiguous (one GEMM per expert).
void gather_rows(const MoeCall &c, int tid, int nt) {
    MoeScratch &s = c.s;
    const size_t rg = c.fmts[c.f_gate].row, ru = c.fmts[c.f_up].row;
    const int32_t *start = s.expert_start.data();
    for (int e = 0; e < c.ne; ++e) {
        const int32_t p0 = start[e], p1 = start[e + 1];
        if (p1 - p0 < 2 || c.on_device(e)) continue;
        for (int32_t p = p0 + tid; p < p1; p += nt) {
            const size_t t = size_t(s.pair_tok[size_t(p)]);
            std::memcpy(s.xg[0].data() + size_t(p) * rg, s.xq[size_t(c.f_gate)].data() + t * rg, rg);
            if (c.f_up != c.f_gate)
                std::memcpy(s.xg[1].data() + size_t(p) * ru, s.xq[size_t(c.f_up)].data() + t * ru, ru);
        }
    }
}

// 3. gate and up of one row block of one expert, then swiglu on that block.
void up_item(const MoeCall &c, size_t it, int tid) {
    const MoeScratch::Item &item = c.s.up_items[it];
    const MoeScratch::Job &j = c.s.jobs[size_t(item.job)];
    item_tile(j.gate, item, j.x_gate, j.x_stride_gate, j.hg + item.r0, size_t(j.n_ff), j.ntok, tid);
    item_tile(j.up, item, j.x_up, j.x_stride_up, j.hu + item.r0, size_t(j.n_ff), j.ntok, tid);
    for (int t = 0; t < j.ntok; ++t)
        swiglu(j.hg + t * j.n_ff + item.r0, j.hu + t * j.n_ff + item.r0, item.r1 - item.r0);
}

// 4. Each hidden row quantized once for its down matrix.
void quantize_hidden(const MoeCall &c, int tid, int nt) {
    MoeScratch &s = c.s;
    const TypeKernels &down = *c.w.ffn_down_exps.parts(0)->tk;
    for (int64_t r = tid; r < c.P + (c.shared ? c.n : 0); r += nt) {
        if (r < c.P)
            down.quantize_act_row(s.hg.data() + r * c.ff, s.hq.data() + size_t(r) * c.hq_row, c.ff);
        else
            c.w.ffn_down_shexp.pw.tk->quantize_act_row(s.sg.data() + (r - c.P) * c.ff_sh,
                                                       s.sq.data() + size_t(r - c.P) * c.sq_row, c.ff_sh);
    }
}

// 5. down of one row block of one expert.
void down_item(const MoeCall &c, size_t it, int tid) {
    const MoeScratch::Item &item = c.s.down_items[it];
    const MoeScratch::Job &j = c.s.jobs[size_t(item.job)];
    item_tile(j.down, item, j.hq, j.hq_stride, j.yd + item.r0, size_t(c.E), j.ntok, tid);
}

// 6. y = Σ_j weight_j · expert_j (selection order) + gate · shared, split by elements.
void combine(const MoeCall &c, int tid, int nt) {
    const MoeScratch &s = c.s;
    const int64_t E = c.E, k = c.k;
    const int64_t total = c.n * E, q0 = total * tid / nt, q1 = total * (tid + 1) / nt;
    for (int64_t q = q0; q < q1;) {
        const int64_t i = q / E, d0 = q % E, d1 = std::min(E, d0 + (q1 - q));
        float *out = c.y + i * E;
        bool first = true;
        for (int64_t j = 0; j < k; ++j) {
            if (c.on_device(s.ids[size_t(i * k + j)])) continue;
            const float wt = s.weights[size_t(i * k + j)];
            const float *src = s.yd.data() + size_t(s.pair_pos[size_t(i * k + j)]) * size_t(E);
            if (first)
                for (int64_t d = d0; d < d1; ++d) out[d] = wt * src[d];
            else
                for (int64_t d = d0; d < d1; ++d) out[d] += wt * src[d];
            first = false;
        }
        if (first) std::fill(out + d0, out + d1, 0.0f);  // every expert of the token on the device
        if (c.shared) {
            const float g = c.sh_gate_w ? s.shexp_gate[size_t(i)] : 1.0f;
            const float *src = s.ys.data() + i * E;
            for (int64_t d = d0; d < d1; ++d) out[d] += g * src[d];
        }
        q += d1 - d0;
    }
}

// The parallel region of the general path: steps 1-6 between barriers, the plan on worker 0.
// A worker claims only items of its NUMA slice, which read only rows that slice holds.
void moe_region(MoeCall &c, int tid, int nt) {
    auto sync = [&] {
        if (nt > 1) c.model.pool().barrier(tid);
    };
    for (int64_t i = tid; i < c.n; i += nt) route_token(c, i, tid);
    sync();
    if (tid == 0) {
        group_by_expert(c);
        plan_jobs(c);
        plan_items(c);
    }
    sync();
    if (tid == 0 && c.dev && c.dev->routed) c.dev->routed();  // the device's experts start now
    if (c.gather) {
        gather_rows(c, tid, nt);
        sync();
    }
    const int sl = c.model.slice_of(tid);
    c.s.up_list.drain(sl, [&](size_t it) { up_item(c, it, tid); });
    sync();
    quantize_hidden(c, tid, nt);
    sync();
    c.s.down_list.drain(sl, [&](size_t it) { down_item(c, it, tid); });
    sync();
    combine(c, tid, nt);
}

}  // namespace

void moe_ffn(const MoeRun &run, const LayerWeights &w, int il, const float *xn, int64_t n, float *y, MoePart part,
             const MoeDeviceExperts *dev) {
    if (n <= 0) return;
    // Sharded experts (several NUMA nodes) take the general path, whose work items follow the
    // node slices; the decode path's job list assumes one matrix per expert.
    if (n == 1 && !w.ffn_gate_exps.sharded()) return moe_ffn_decode(run, w, il, xn, y, part, dev);
    MoeCall c(run, w, il, xn, n, y, part, dev);
    grow_scratch(c);
    // Router logits [n][n_expert] (a matmul of its own on all threads).
    ThreadPool &pool = c.model.pool();
    matmul(&pool, w.ffn_gate_inp.pw, xn, n, c.s.logits.data(), run.mm);
    if (c.nth > 1)
        pool.run([&](int tid, int nt) { moe_region(c, tid, nt); });
    else
        moe_region(c, 0, 1);
}

void moe_shared_ffn(const LayerWeights &w, const float *xn, int64_t n, int64_t E, float *y, ThreadPool *pool,
                    MoeSharedScratch &s) {
    if (n <= 0) return;
    if (!w.ffn_gate_shexp) {
        std::fill(y, y + n * E, 0.0f);
        return;
    }
    const int64_t ff = w.ffn_gate_shexp.pw.rows;
    grow(s.g, size_t(n * ff));
    grow(s.u, size_t(n * ff));
    grow(s.gate, size_t(n));
    // The same steps as the shared job of moe_ffn: gate and up, swiglu, down, times the gate.
    matmul(pool, w.ffn_gate_shexp.pw, xn, n, s.g.data(), s.mm);
    matmul(pool, w.ffn_up_shexp.pw, xn, n, s.u.data(), s.mm);
    for (int64_t i = 0; i < n; ++i) swiglu(s.g.data() + i * ff, s.u.data() + i * ff, ff);
    matmul(pool, w.ffn_down_shexp.pw, s.g.data(), n, y, s.mm);
    const float *sh_gate_w = w.ffn_gate_inp_shexp.empty() ? nullptr : w.ffn_gate_inp_shexp.data();
    for (int64_t i = 0; i < n; ++i) {
        const float g = sh_gate_w ? shexp_gate(sh_gate_w, xn + i * E, E) : 1.0f;
        for (int64_t d = 0; d < E; ++d) y[i * E + d] = g * y[i * E + d];
    }
}

}  // namespace ktd
