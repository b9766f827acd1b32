// The routed-expert FFN (see moe.h for the maths and the execution plan).
//
// Buffers (MoeScratch), P = n·n_expert_used (token, slot) pairs sorted by expert:
//   logits [n][n_expert]   ids/weights [n][n_expert_used]   pair_tok/pair_pos [P]
//   xq[f] [n][act row of format f]   xg [P][act row] (only the rows of experts with > 1 token)
//   hg/hu [P][n_ff_exp] → swiglu in hg → hq [P][act row of down_exps] → yd [P][n_embd]
//   shared expert: sg/su [n][n_ff_shexp] → sq → ys [n][n_embd]
#include "model/moe.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>

#include "cpu/thread_pool.h"
#include "kernels/kernels.h"
#include "model/blocks.h"
#include "model/model.h"

namespace ktd {

namespace {

// Row blocks start on multiples of this, so repacked row groups (R divides 16) never straddle items.
constexpr int64_t kRowAlign = 16;
// Work items per thread and phase: enough to even out experts of different token counts.
constexpr int64_t kItemsPerThread = 4;
// Decode: work items per thread and phase. Small items keep the wait at the two barriers short
// (the last item of the slowest worker); each is still tens of KiB of contiguous weights.
constexpr int64_t kDecodeItemsPerThread = 32;
// llama.cpp clamps the renormalisation sum to F16's smallest normal number.
constexpr float kWeightsSumMin = 6.103515625e-5f;
constexpr int kMaxExpertWords = 4096 / 64;  // hparams.cpp caps n_expert at 4096

template <class T>
T *grow(std::vector<T> &v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
}

// y[c·ldy + (r - r0)] = W row r · activation row c for r in [r0, r1), c < nc; r0 % kRowAlign == 0;
// worker tid reads its own node's copy of replicated weights.
void tile(const PreparedWeights &w, int64_t r0, int64_t r1, const uint8_t *xq, size_t x_stride, float *y,
          size_t ldy, int nc, int tid) {
    const PreparedWeights &pw = w.for_worker(tid);
    const TypeKernels &tk = *pw.tk;
    const char *wb = static_cast<const char *>(pw.data);
    if (pw.repacked) {
        const size_t group_bytes = tk.repacked_group_bytes(pw.k);
        tk.gemm_repacked(pw.k, wb + size_t(r0 / tk.repack_rows) * group_bytes, group_bytes, xq, x_stride, y, ldy,
                         int(r1 - r0), nc);
    } else {
        tk.gemm(pw.k, wb + size_t(r0) * pw.row_bytes, pw.row_bytes, xq, x_stride, y, ldy, int(r1 - r0), nc);
    }
}

// The same for an item: its rows lie in parts[item.part], which starts at row item.part_r0.
void tile(const PreparedWeights *parts, const MoeScratch::Item &item, const uint8_t *xq, size_t x_stride, float *y,
          size_t ldy, int nc, int tid) {
    tile(parts[item.part], item.r0 - item.part_r0, item.r1 - item.part_r0, xq, x_stride, y, ldy, nc, tid);
}

// Cuts the rows of NUMA slice `slice` of a matrix of `rows` rows (all of them on one node) into
// blocks (multiples of kRowAlign) so that this job gets its share, by cost, of n_target items.
void add_items(std::vector<MoeScratch::Item> &items, int32_t job, int64_t rows, bool sharded, int n_slice,
               int slice, double cost, double total_cost, int64_t n_target) {
    const auto [a, b] = numa_slice_rows(rows, n_slice, slice);
    if (a >= b) return;
    const int32_t part = sharded ? slice : 0, part_r0 = sharded ? int32_t(a) : 0;
    const int64_t max_blocks = (b - a + kRowAlign - 1) / kRowAlign;
    const int64_t want = int64_t(std::ceil(double(n_target) * cost / total_cost));
    const int64_t n_blocks = std::clamp<int64_t>(want, 1, max_blocks);
    const int64_t blk = ((b - a) / n_blocks + kRowAlign - 1) / kRowAlign * kRowAlign;
    for (int64_t r0 = a; r0 < b; r0 += blk)
        items.push_back({job, int32_t(r0), int32_t(std::min(b, r0 + blk)), part, part_r0});
}

// One activation format: the quantizer of a weight type and its row size for k = n_embd.
struct ActFormat {
    const TypeKernels *tk = nullptr;
    size_t row = 0;
};

// Rows [r0, r1) of `rows` that worker tid of nth takes in a static split (kRowAlign blocks), as
// matmul() splits them.
void row_range(int64_t rows, int tid, int nth, int64_t &r0, int64_t &r1) {
    const int64_t groups = (rows + kRowAlign - 1) / kRowAlign;
    r0 = std::min(rows, groups * tid / nth * kRowAlign);
    r1 = std::min(rows, groups * (tid + 1) / nth * kRowAlign);
}

// Rows per work item so that `rows` make about n_items items: a multiple of kRowAlign, >= kRowAlign.
int64_t block_rows(int64_t rows, int64_t n_items) {
    const int64_t per = (rows + n_items - 1) / std::max<int64_t>(n_items, 1);
    return std::max(kRowAlign, (per + kRowAlign - 1) / kRowAlign * kRowAlign);
}

int format_index(ActFormat *fmts, int &n_fmt, const TypeKernels &tk, int64_t k) {
    for (int i = 0; i < n_fmt; ++i)
        if (fmts[i].tk->act_type == tk.act_type && fmts[i].tk->quantize_act_row == tk.quantize_act_row) return i;
    fmts[n_fmt] = {&tk, act_row_size(tk, k)};
    return n_fmt++;
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

        if (mp.n_group > 1) {
            // Group score: the sum of its two best selection scores; keep the n_group_used best groups.
            const int gsize = ne / mp.n_group;
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

// One token (decode). One parallel region:
//   1. the router rows split statically over the workers (as matmul splits them); barrier;
//   2. every worker routes the token and quantizes xn itself (a few microseconds, cheaper than a
//      barrier) and lays out the same job list (decode_jobs);
//   3. gate+up of all selected experts and the shared expert as one list of row blocks taken
//      dynamically, swiglu per block; the worker that finishes a job's last block quantizes its
//      hidden row for down; barrier;
//   4. down as one list of output-row blocks, each over all jobs in selection order (shared last),
//      summing weight · down rows as it goes: no per-expert outputs, no serial weighted sum.
// The sums are in the same order as moe_ffn's general path, so both give the same bits.
namespace {
void moe_ffn_decode(Context &ctx, const LayerWeights &w, int il, const float *xn, float *y);
}  // namespace

void moe_record_state(Context &ctx, int il, int after, const float *x_row) {
    std::vector<float> &st = ctx.scratch().moe_states;
    if (st.empty()) return;
    const int64_t E = ctx.model().hparams().n_embd;
    std::copy(x_row, x_row + E, st.data() + (size_t(il) * 2 + size_t(after)) * size_t(E));
}

void moe_ffn(Context &ctx, const LayerWeights &w, int il, const float *xn, int64_t n, float *y) {
    if (n <= 0) return;
    // Sharded experts (several NUMA nodes) take the general path, whose work items follow the
    // node slices; the decode path's job list assumes one matrix per expert.
    if (n == 1 && !w.ffn_gate_exps.sharded()) return moe_ffn_decode(ctx, w, il, xn, y);
    const Model &model = ctx.model();
    const HParams &hp = model.hparams();
    const MoeParams &mp = hp.moe;
    ThreadPool &pool = model.pool();
    ForwardScratch &fs = ctx.scratch();
    MoeScratch &s = fs.moe;
    const int64_t E = hp.n_embd, ff = mp.n_ff_exp;
    const int ne = mp.n_expert, k = mp.n_expert_used;
    const int64_t P = n * k;
    const int nth = pool.size();
    const bool shared = bool(w.ffn_gate_shexp);
    const int64_t ff_sh = shared ? w.ffn_gate_shexp.pw.rows : 0;
    const PreparedWeights &gate0 = *w.ffn_gate_exps.parts(0), &up0 = *w.ffn_up_exps.parts(0);
    const PreparedWeights &down0 = *w.ffn_down_exps.parts(0);
    const int n_slice = model.n_slices();
    if (s.n_next < 2 * n_slice) {
        s.next_item.reset(new std::atomic<int64_t>[size_t(2 * n_slice)]);
        s.n_next = 2 * n_slice;
    }
    for (int i = 0; i < 2 * n_slice; ++i) s.next_item[size_t(i)].store(0, std::memory_order_relaxed);

    // Router logits [n][n_expert] (a matmul of its own on all threads).
    float *logits = grow(s.logits, size_t(n * ne));
    matmul(&pool, w.ffn_gate_inp.pw, xn, n, logits, fs.mm);

    // Activation formats of xn: routed gate/up, shared gate/up (shared when the quantizer is).
    ActFormat fmts[4];
    int n_fmt = 0;
    const int f_gate = format_index(fmts, n_fmt, *gate0.tk, E), f_up = format_index(fmts, n_fmt, *up0.tk, E);
    const int f_sgate = shared ? format_index(fmts, n_fmt, *w.ffn_gate_shexp.pw.tk, E) : -1;
    const int f_sup = shared ? format_index(fmts, n_fmt, *w.ffn_up_shexp.pw.tk, E) : -1;
    for (int f = 0; f < n_fmt; ++f) grow(s.xq[f], size_t(n) * fmts[f].row);
    grow(s.xg[0], size_t(P) * fmts[f_gate].row);
    if (f_up != f_gate) grow(s.xg[1], size_t(P) * fmts[f_up].row);
    const size_t hq_row = act_row_size(*down0.tk, ff);
    grow(s.select, size_t(nth) * size_t(ne));
    grow(s.ids, size_t(P));
    grow(s.weights, size_t(P));
    grow(s.shexp_gate, size_t(n));
    grow(s.expert_start, size_t(ne) + 1);
    grow(s.pair_tok, size_t(P));
    grow(s.pair_pos, size_t(P));
    grow(s.hg, size_t(P * ff));
    grow(s.hu, size_t(P * ff));
    grow(s.hq, size_t(P) * hq_row);
    grow(s.yd, size_t(P * E));
    size_t sq_row = 0;
    if (shared) {
        sq_row = act_row_size(*w.ffn_down_shexp.pw.tk, ff_sh);
        grow(s.sg, size_t(n * ff_sh));
        grow(s.su, size_t(n * ff_sh));
        grow(s.sq, size_t(n) * sq_row);
        grow(s.ys, size_t(n * E));
    }
    uint64_t *counts = ctx.layer_expert_counts(il);
    const float *probs_b = w.exp_probs_b.empty() ? nullptr : w.exp_probs_b.data();
    const float *sh_gate_w = w.ffn_gate_inp_shexp.empty() ? nullptr : w.ffn_gate_inp_shexp.data();
    bool gather = false;

    // Serial between two barriers: group the pairs by expert and lay out the jobs and items.
    auto plan = [&] {
        int32_t *start = s.expert_start.data();
        std::fill(start, start + ne + 1, 0);
        for (int64_t p = 0; p < P; ++p) ++start[s.ids[size_t(p)] + 1];
        for (int e = 0; e < ne; ++e) {
            counts[e] += uint64_t(start[e + 1]);
            start[e + 1] += start[e];
        }
        for (int64_t p = 0; p < P; ++p) {  // counting sort, stable: tokens ascending per expert
            const int32_t pos = start[s.ids[size_t(p)]]++;
            s.pair_tok[size_t(pos)] = int32_t(p / k);
            s.pair_pos[size_t(p)] = pos;
        }
        for (int e = ne; e > 0; --e) start[e] = start[e - 1];
        start[0] = 0;

        s.jobs.clear();
        double cost_up = 0, cost_down = 0;
        if (shared) {
            MoeScratch::Job j{};
            j.gate = &w.ffn_gate_shexp.pw;
            j.up = &w.ffn_up_shexp.pw;
            j.down = &w.ffn_down_shexp.pw;
            j.sharded = false;
            j.n_ff = ff_sh;
            j.ntok = int(n);
            j.x_gate = s.xq[size_t(f_sgate)].data();
            j.x_stride_gate = fmts[f_sgate].row;
            j.x_up = s.xq[size_t(f_sup)].data();
            j.x_stride_up = fmts[f_sup].row;
            j.hg = s.sg.data();
            j.hu = s.su.data();
            j.hq = s.sq.data();
            j.hq_stride = sq_row;
            j.yd = s.ys.data();
            s.jobs.push_back(j);
        }
        gather = false;
        for (int e = 0; e < ne; ++e) {
            const int32_t p0 = start[e], ntok = start[e + 1] - p0;
            if (ntok == 0) continue;
            MoeScratch::Job j{};
            j.gate = w.ffn_gate_exps.parts(size_t(e));
            j.up = w.ffn_up_exps.parts(size_t(e));
            j.down = w.ffn_down_exps.parts(size_t(e));
            j.sharded = w.ffn_gate_exps.sharded();
            j.n_ff = ff;
            j.ntok = ntok;
            if (ntok == 1) {  // its token's row of xq directly
                const size_t t = size_t(s.pair_tok[size_t(p0)]);
                j.x_gate = s.xq[size_t(f_gate)].data() + t * fmts[f_gate].row;
                j.x_up = s.xq[size_t(f_up)].data() + t * fmts[f_up].row;
            } else {
                gather = true;
                j.x_gate = s.xg[0].data() + size_t(p0) * fmts[f_gate].row;
                j.x_up = (f_up == f_gate ? s.xg[0] : s.xg[1]).data() + size_t(p0) * fmts[f_up].row;
            }
            j.x_stride_gate = fmts[f_gate].row;
            j.x_stride_up = fmts[f_up].row;
            j.hg = s.hg.data() + size_t(p0) * size_t(ff);
            j.hu = s.hu.data() + size_t(p0) * size_t(ff);
            j.hq = s.hq.data() + size_t(p0) * hq_row;
            j.hq_stride = hq_row;
            j.yd = s.yd.data() + size_t(p0) * size_t(E);
            s.jobs.push_back(j);
        }
        // Cost ~ weight bytes streamed + the tokens' dot products: rows · (1 + ntok) per phase.
        for (const MoeScratch::Job &j : s.jobs) {
            cost_up += double(j.n_ff) * (1 + j.ntok);
            cost_down += double(E) * (1 + j.ntok);
        }
        s.up_items.clear();
        s.down_items.clear();
        s.up_start.assign(1, 0);
        s.down_start.assign(1, 0);
        for (int sl = 0; sl < n_slice; ++sl) {
            const int nth_sl = model.memory().nodes[size_t(sl)].n_threads;
            const int64_t n_target = nth > 1 ? kItemsPerThread * nth_sl : 1;
            for (size_t ji = 0; ji < s.jobs.size(); ++ji) {
                const MoeScratch::Job &j = s.jobs[ji];
                add_items(s.up_items, int32_t(ji), j.n_ff, j.sharded, n_slice, sl, double(j.n_ff) * (1 + j.ntok),
                          cost_up, n_target);
                add_items(s.down_items, int32_t(ji), E, j.sharded, n_slice, sl, double(E) * (1 + j.ntok), cost_down,
                          n_target);
            }
            s.up_start.push_back(int32_t(s.up_items.size()));
            s.down_start.push_back(int32_t(s.down_items.size()));
        }
    };

    auto body = [&](int tid, int nt) {
        auto sync = [&] {
            if (nt > 1) pool.barrier(tid);
        };
        // 1. Per token: route, shared-expert gate, xn quantized once per activation format.
        for (int64_t i = tid; i < n; i += nt) {
            moe_route(mp, logits + i * ne, probs_b, 1, s.ids.data() + i * k, s.weights.data() + i * k,
                      s.select.data() + size_t(tid) * size_t(ne));
            if (sh_gate_w) {
                float dot = 0.0f;
                for (int64_t d = 0; d < E; ++d) dot += sh_gate_w[d] * xn[i * E + d];
                s.shexp_gate[size_t(i)] = 1.0f / (1.0f + std::exp(-dot));
            }
            for (int f = 0; f < n_fmt; ++f)
                fmts[f].tk->quantize_act_row(xn + i * E, s.xq[size_t(f)].data() + size_t(i) * fmts[f].row, E);
        }
        sync();
        if (tid == 0) plan();
        sync();
        // 2. Rows of experts with several tokens gathered contiguous (one GEMM per expert).
        if (gather) {
            const int32_t *start = s.expert_start.data();
            for (int e = 0; e < ne; ++e) {
                const int32_t p0 = start[e], p1 = start[e + 1];
                if (p1 - p0 < 2) continue;
                for (int32_t p = p0 + tid; p < p1; p += nt) {
                    const size_t t = size_t(s.pair_tok[size_t(p)]);
                    std::memcpy(s.xg[0].data() + size_t(p) * fmts[f_gate].row,
                                s.xq[size_t(f_gate)].data() + t * fmts[f_gate].row, fmts[f_gate].row);
                    if (f_up != f_gate)
                        std::memcpy(s.xg[1].data() + size_t(p) * fmts[f_up].row,
                                    s.xq[size_t(f_up)].data() + t * fmts[f_up].row, fmts[f_up].row);
                }
            }
            sync();
        }
        // 3. gate and up of one row block of one expert, then swiglu on that block. A worker takes
        // the items of its NUMA slice only.
        const int sl = model.slice_of(tid);
        for (int64_t it; (it = s.up_start[size_t(sl)] + s.next_item[size_t(2 * sl)].fetch_add(
                              1, std::memory_order_relaxed)) < s.up_start[size_t(sl) + 1];) {
            const MoeScratch::Item &item = s.up_items[size_t(it)];
            const MoeScratch::Job &j = s.jobs[size_t(item.job)];
            tile(j.gate, item, j.x_gate, j.x_stride_gate, j.hg + item.r0, size_t(j.n_ff), j.ntok, tid);
            tile(j.up, item, j.x_up, j.x_stride_up, j.hu + item.r0, size_t(j.n_ff), j.ntok, tid);
            for (int c = 0; c < j.ntok; ++c)
                swiglu(j.hg + c * j.n_ff + item.r0, j.hu + c * j.n_ff + item.r0, item.r1 - item.r0);
        }
        sync();
        // 4. Each hidden row quantized once for its down matrix.
        for (int64_t r = tid; r < P + (shared ? n : 0); r += nt) {
            if (r < P)
                down0.tk->quantize_act_row(s.hg.data() + r * ff, s.hq.data() + size_t(r) * hq_row, ff);
            else
                w.ffn_down_shexp.pw.tk->quantize_act_row(s.sg.data() + (r - P) * ff_sh,
                                                         s.sq.data() + size_t(r - P) * sq_row, ff_sh);
        }
        sync();
        // 5. down of one row block of one expert.
        for (int64_t it; (it = s.down_start[size_t(sl)] + s.next_item[size_t(2 * sl + 1)].fetch_add(
                              1, std::memory_order_relaxed)) < s.down_start[size_t(sl) + 1];) {
            const MoeScratch::Item &item = s.down_items[size_t(it)];
            const MoeScratch::Job &j = s.jobs[size_t(item.job)];
            tile(j.down, item, j.hq, j.hq_stride, j.yd + item.r0, size_t(E), j.ntok, tid);
        }
        sync();
        // 6. y = Σ_j weight_j · expert_j (selection order) + gate · shared, split by elements.
        const int64_t total = n * E, q0 = total * tid / nt, q1 = total * (tid + 1) / nt;
        for (int64_t q = q0; q < q1;) {
            const int64_t i = q / E, d0 = q % E, d1 = std::min(E, d0 + (q1 - q));
            float *out = y + i * E;
            for (int j = 0; j < k; ++j) {
                const float wt = s.weights[size_t(i * k + j)];
                const float *src = s.yd.data() + size_t(s.pair_pos[size_t(i * k + j)]) * size_t(E);
                if (j == 0)
                    for (int64_t d = d0; d < d1; ++d) out[d] = wt * src[d];
                else
                    for (int64_t d = d0; d < d1; ++d) out[d] += wt * src[d];
            }
            if (shared) {
                const float g = sh_gate_w ? s.shexp_gate[size_t(i)] : 1.0f;
                const float *src = s.ys.data() + i * E;
                for (int64_t d = d0; d < d1; ++d) out[d] += g * src[d];
            }
            q += d1 - d0;
        }
    };
    if (nth > 1)
        pool.run(std::ref(body));
    else
        body(0, 1);
}

namespace {

// The decode job list of one worker: the selected experts in selection order, then the shared
// expert; gate/up items numbered consecutively over the jobs (up_block rows each, a job's last
// one shorter). Returns the number of gate/up items.
int64_t decode_jobs(const LayerWeights &w, const MoeParams &mp, MoeScratch &s, MoeScratch::DecodeWorker &dw,
                    int64_t ff_sh, float shexp_gate, int32_t f_gate, int32_t f_up, int32_t f_sgate,
                    int32_t f_sup, size_t hq_row, size_t sq_row, int64_t up_block) {
    const int64_t ff = mp.n_ff_exp;
    dw.jobs.clear();
    int64_t item = 0;
    auto add = [&](const PreparedWeights *gate, const PreparedWeights *up, const PreparedWeights *down,
                   int64_t n_ff, float weight, float *hg, float *hu, uint8_t *hq, size_t hq_row_bytes, int32_t fg,
                   int32_t fu) {
        dw.jobs.push_back({gate, up, down, n_ff, weight, item, hg, hu, hq, hq_row_bytes, fg, fu});
        item += (n_ff + up_block - 1) / up_block;
    };
    for (int j = 0; j < mp.n_expert_used; ++j) {
        const size_t e = size_t(dw.ids[size_t(j)]);
        add(&w.ffn_gate_exps.mats[e], &w.ffn_up_exps.mats[e], &w.ffn_down_exps.mats[e], ff, dw.weights[size_t(j)],
            s.hg.data() + size_t(j) * size_t(ff), s.hu.data() + size_t(j) * size_t(ff),
            s.hq.data() + size_t(j) * hq_row, hq_row, f_gate, f_up);
    }
    if (ff_sh > 0) {
        add(&w.ffn_gate_shexp.pw, &w.ffn_up_shexp.pw, &w.ffn_down_shexp.pw, ff_sh, shexp_gate, s.sg.data(),
            s.su.data(), s.sq.data(), sq_row, f_sgate, f_sup);
    }
    return item;
}

void moe_ffn_decode(Context &ctx, const LayerWeights &w, int il, const float *xn, float *y) {
    const Model &model = ctx.model();
    const HParams &hp = model.hparams();
    const MoeParams &mp = hp.moe;
    ThreadPool &pool = model.pool();
    MoeScratch &s = ctx.scratch().moe;
    const int64_t E = hp.n_embd, ff = mp.n_ff_exp;
    const int ne = mp.n_expert, k = mp.n_expert_used;
    const int nth = pool.size();
    const bool shared = bool(w.ffn_gate_shexp);
    const int64_t ff_sh = shared ? w.ffn_gate_shexp.pw.rows : 0;
    const PreparedWeights &router = w.ffn_gate_inp.pw;
    const PreparedWeights &gate0 = w.ffn_gate_exps.mats[0], &up0 = w.ffn_up_exps.mats[0];
    const PreparedWeights &down0 = w.ffn_down_exps.mats[0];

    // Activation formats of xn (router, routed gate/up, shared gate/up) back to back in each
    // worker's xq.
    ActFormat fmts[5];
    int n_fmt = 0;
    const int f_router = format_index(fmts, n_fmt, *router.tk, E);
    const int f_gate = format_index(fmts, n_fmt, *gate0.tk, E), f_up = format_index(fmts, n_fmt, *up0.tk, E);
    const int f_sgate = shared ? format_index(fmts, n_fmt, *w.ffn_gate_shexp.pw.tk, E) : -1;
    const int f_sup = shared ? format_index(fmts, n_fmt, *w.ffn_up_shexp.pw.tk, E) : -1;
    size_t fmt_off[5], xq_bytes = 0;
    for (int f = 0; f < n_fmt; ++f) {
        fmt_off[f] = xq_bytes;
        xq_bytes += fmts[f].row;
    }
    const size_t hq_row = act_row_size(*down0.tk, ff);
    const size_t sq_row = shared ? act_row_size(*w.ffn_down_shexp.pw.tk, ff_sh) : 0;
    const int n_jobs = k + (shared ? 1 : 0);

    // Item sizes: gate/up rows of all jobs, down rows of E, each cut into about
    // kDecodeItemsPerThread · nth blocks (one block per job / one in all on a single thread).
    const int64_t up_rows = int64_t(k) * ff + ff_sh;
    const int64_t up_block = nth > 1 ? block_rows(up_rows, kDecodeItemsPerThread * nth) : std::max(ff, ff_sh);
    const int64_t down_block = nth > 1 ? block_rows(E, kDecodeItemsPerThread * nth) : E;
    const int64_t n_down_items = (E + down_block - 1) / down_block;

    if (s.dec.size() < size_t(nth)) s.dec.resize(size_t(nth));
    for (MoeScratch::DecodeWorker &dw : s.dec) {
        grow(dw.logits, size_t(ne));
        grow(dw.select, size_t(ne));
        grow(dw.ids, size_t(k));
        grow(dw.weights, size_t(k));
        grow(dw.xq, xq_bytes);
        grow(dw.tmp, size_t(down_block));
        dw.jobs.reserve(size_t(n_jobs));
    }
    grow(s.logits, size_t(ne));
    grow(s.hg, size_t(k) * size_t(ff));
    grow(s.hu, size_t(k) * size_t(ff));
    grow(s.hq, size_t(k) * hq_row);
    if (shared) {
        grow(s.sg, size_t(ff_sh));
        grow(s.su, size_t(ff_sh));
        grow(s.sq, sq_row);
    }
    if (s.dec_done_size < size_t(n_jobs)) {
        s.dec_done = std::make_unique<std::atomic<int64_t>[]>(size_t(n_jobs));
        s.dec_done_size = size_t(n_jobs);
    }
    for (int j = 0; j < n_jobs; ++j) s.dec_done[size_t(j)].store(0, std::memory_order_relaxed);
    uint64_t *counts = ctx.layer_expert_counts(il);
    const float *probs_b = w.exp_probs_b.empty() ? nullptr : w.exp_probs_b.data();
    const float *sh_gate_w = w.ffn_gate_inp_shexp.empty() ? nullptr : w.ffn_gate_inp_shexp.data();
    std::atomic<int64_t> next_up{0}, next_down{0};

    auto body = [&](int tid, int nt) {
        MoeScratch::DecodeWorker &dw = s.dec[size_t(tid)];
        uint8_t *xq = dw.xq.data();
        for (int f = 0; f < n_fmt; ++f) fmts[f].tk->quantize_act_row(xn, xq + fmt_off[f], E);
        // 1. This worker's rows of the router logits.
        int64_t r0, r1;
        row_range(router.rows, tid, nt, r0, r1);
        if (r0 < r1) tile(router, r0, r1, xq + fmt_off[f_router], fmts[f_router].row, s.logits.data() + r0, 1, 1, tid);
        if (nt > 1) pool.barrier(tid);
        // 2. Routing, shared-expert gate and job list, the same on every worker.
        std::copy(s.logits.data(), s.logits.data() + ne, dw.logits.data());
        moe_route(mp, dw.logits.data(), probs_b, 1, dw.ids.data(), dw.weights.data(), dw.select.data());
        if (tid == 0)
            for (int j = 0; j < k; ++j) ++counts[dw.ids[size_t(j)]];
        float shexp_gate = 1.0f;
        if (sh_gate_w) {
            float dot = 0.0f;
            for (int64_t d = 0; d < E; ++d) dot += sh_gate_w[d] * xn[d];
            shexp_gate = 1.0f / (1.0f + std::exp(-dot));
        }
        const int64_t n_up_items = decode_jobs(w, mp, s, dw, ff_sh, shexp_gate, f_gate, f_up, f_sgate, f_sup,
                                               hq_row, sq_row, up_block);
        // 3. gate/up blocks of all jobs; the last block of a job quantizes its hidden row.
        size_t ji = 0;
        for (int64_t it; (it = next_up.fetch_add(1, std::memory_order_relaxed)) < n_up_items;) {
            // A worker gets increasing item numbers, so it finds an item's job by walking forward.
            while (ji + 1 < dw.jobs.size() && dw.jobs[ji + 1].up_item0 <= it) ++ji;
            const MoeScratch::DecodeJob &j = dw.jobs[ji];
            const int64_t b0 = (it - j.up_item0) * up_block, b1 = std::min(j.n_ff, b0 + up_block);
            tile(*j.gate, b0, b1, xq + fmt_off[j.fmt_gate], fmts[j.fmt_gate].row, j.hg + b0, 1, 1, tid);
            tile(*j.up, b0, b1, xq + fmt_off[j.fmt_up], fmts[j.fmt_up].row, j.hu + b0, 1, 1, tid);
            swiglu(j.hg + b0, j.hu + b0, b1 - b0);
            if (s.dec_done[ji].fetch_add(b1 - b0, std::memory_order_acq_rel) + (b1 - b0) == j.n_ff)
                j.down->tk->quantize_act_row(j.hg, j.hq, j.n_ff);
        }
        if (nt > 1) pool.barrier(tid);
        // 4. Output rows [d0, d1) over all jobs: y = Σ_j weight_j · down_j (selection order),
        //    + gate · shared.
        float *t = dw.tmp.data();
        for (int64_t it; (it = next_down.fetch_add(1, std::memory_order_relaxed)) < n_down_items;) {
            const int64_t d0 = it * down_block, d1 = std::min(E, d0 + down_block);
            for (size_t jj = 0; jj < dw.jobs.size(); ++jj) {
                const MoeScratch::DecodeJob &j = dw.jobs[jj];
                tile(*j.down, d0, d1, j.hq, j.hq_row, t, 1, 1, tid);
                const float wt = j.weight;
                if (jj == 0)
                    for (int64_t d = d0; d < d1; ++d) y[d] = wt * t[d - d0];
                else
                    for (int64_t d = d0; d < d1; ++d) y[d] += wt * t[d - d0];
            }
        }
    };
    if (nth > 1)
        pool.run(std::ref(body));
    else
        body(0, 1);
}

}  // namespace

}  // namespace ktd
