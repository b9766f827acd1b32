#include "sampling/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "kernels/sampling.h"

namespace ktd::sampling {

namespace {

constexpr int64_t kDrawBlock = 1024;        // tokens per block sum of the draw
constexpr int64_t kTopkSampleMinN = 16384;  // top-k through a sampled threshold from this n_vocab on
constexpr int64_t kTopkStride = 37;         // prime: the sample does not align with structure in ids
// Radix select levels over the bits of a weight in [0, 1] (at most 0x3F800000): bits 31..19, 18..7
// and 6..0. The last level's buckets are single float values.
constexpr int kShift1 = 19, kBuckets1 = (0x3F800000 >> kShift1) + 1;
constexpr int kShift2 = 7, kBuckets2 = 1 << (kShift1 - kShift2);
constexpr int kBuckets3 = 1 << kShift2;

// Per-thread buffers, grown to the vocabulary once and reused: no allocation per token.
struct Workspace {
    std::vector<float> x;        // penalised logits
    std::vector<float> w;        // weights of the whole vocabulary
    std::vector<float> wk;       // weights of the top-k tokens
    std::vector<int32_t> ids;    // top-k ids; argmax candidates
    std::vector<float> sample;   // the strided sample of top-k
    std::vector<int64_t> window; // the penalty window, sorted
    std::vector<uint32_t> band[5];  // top-p: the first pass's two lists, then the bands of find_cut
    std::vector<double> sums;    // block sums of the draw
    std::vector<int32_t> order;  // the exact top-p cut's sort
};
thread_local Workspace t_ws;

template <class T>
T *grow(std::vector<T> &v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
}

// The tokens kept by the filters: position i of w [n] (token ids[i], or i when ids is null) is kept
// when w[i] > v, or w[i] == v > 0 and i < tie_end. Zero weights are never kept.
struct Kept {
    const float *w = nullptr;
    int64_t n = 0;
    const int32_t *ids = nullptr;
    float v = 0.0f;
    int64_t tie_end = 0;
    const char *top_p_path = "";

    int32_t id(int64_t i) const { return ids ? ids[i] : int32_t(i); }
    bool keeps(int64_t i) const { return w[i] > v || (w[i] == v && v > 0.0f && i < tie_end); }
};

const float *penalise(const float *logits, int64_t n, const int64_t *window, int64_t n_window, const Params &p,
                      Workspace &ws) {
    if (n_window == 0 || (p.repeat_penalty == 1.0 && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0))
        return logits;
    int64_t *win = grow(ws.window, size_t(n_window));
    std::copy(window, window + n_window, win);
    std::sort(win, win + n_window);
    float *x = grow(ws.x, size_t(n));
    std::memcpy(x, logits, size_t(n) * sizeof(float));
    for (int64_t a = 0; a < n_window;) {
        int64_t b = a;
        while (b < n_window && win[b] == win[a]) ++b;
        const int64_t id = win[a], count = b - a;
        a = b;
        if (id < 0 || id >= n) continue;
        float v = x[id];
        if (p.repeat_penalty != 1.0) {  // in float32, as llama.cpp: shrink positive logits, grow negative ones
            const float rp = float(p.repeat_penalty);
            v = v > 0.0f ? v / rp : v * rp;
        }
        x[id] = float(double(v) - double(count) * p.frequency_penalty - p.presence_penalty);
    }
    return x;
}

// The largest logit, rejecting logits no distribution can be made of.
float checked_max(const SamplingKernels &K, const float *x, int64_t n) {
    bool nan = false;
    const float m = K.max(x, n, &nan);
    if (nan) throw std::invalid_argument("sampling: the logits contain NaN");
    if (m == std::numeric_limits<float>::infinity()) throw std::invalid_argument("sampling: the logits contain +inf");
    if (m == -std::numeric_limits<float>::infinity())
        throw std::invalid_argument("sampling: no logit is finite");
    return m;
}

int32_t first_of_max(const SamplingKernels &K, const float *x, int64_t n, float m, Workspace &ws) {
    int32_t *ids = grow(ws.ids, size_t(n));
    K.select_ge(x, n, m, ids);  // at least the maximum itself
    return ids[0];
}

// Ids of the k largest logits, ascending, into ws.ids (equal logits: the lower ids first). A
// partition of the whole vocabulary costs about a millisecond; instead a threshold from a strided
// sample that ~4k entries reach, one comparison pass, and a partition of those. Exact: when at least
// k entries reach the threshold the k largest are among them; otherwise the vocabulary is partitioned.
const int32_t *top_k_ids(const SamplingKernels &K, const float *x, int64_t n, int64_t k, Workspace &ws) {
    int32_t *cand = grow(ws.ids, size_t(n));
    int64_t c = -1;
    if (n >= kTopkSampleMinN && k * 64 < n) {
        const int64_t ms = (n + kTopkStride - 1) / kTopkStride;
        float *s = grow(ws.sample, size_t(ms));
        for (int64_t j = 0; j < ms; ++j) s[j] = x[j * kTopkStride];
        const int64_t rank = std::min(ms - 1, 4 * k * ms / n + 4);  // from the top of the sample
        std::nth_element(s, s + (ms - 1 - rank), s + ms);
        c = K.select_ge(x, n, s[ms - 1 - rank], cand);
        if (c < k || c > 64 * k) c = -1;
    }
    if (c < 0) {
        std::iota(cand, cand + n, 0);
        c = n;
    }
    if (c > k) {
        std::nth_element(cand, cand + k, cand + c,
                         [x](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); });
        std::sort(cand, cand + k);
    }
    return cand;
}

// The weights before top-p/min-p. False when 1/T overflows the logits' scale (T → 0: the caller
// takes the argmax, the limit of the distribution).
bool weights(const SamplingKernels &K, const float *x, int64_t n, float x_max, const Params &p, Workspace &ws,
             Kept &kept) {
    if (p.top_k > 0 && p.top_k < n) {
        const int64_t k = p.top_k;
        const int32_t *ids = top_k_ids(K, x, n, k, ws);
        float *w = grow(ws.wk, size_t(k));
        double xs_max = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < k; ++j) xs_max = std::max(xs_max, double(x[ids[j]]) / p.temperature);
        if (!std::isfinite(xs_max)) return false;
        for (int64_t j = 0; j < k; ++j) w[j] = float(std::exp(double(x[ids[j]]) / p.temperature - xs_max));
        kept.w = w;
        kept.n = k;
        kept.ids = ids;
        return true;
    }
    const float scale = float(1.0 / p.temperature);
    // rounding is monotonic, so the largest x·scale is (largest x)·scale
    const float y_max = x_max * scale;
    if (!std::isfinite(scale) || !std::isfinite(y_max)) return false;
    float *w = grow(ws.w, size_t(n));
    K.exp_scaled(x, n, scale, y_max, w);
    kept.w = w;
    kept.n = n;
    return true;
}

// top-p by a full sort of (weight desc, position asc) and the float64 running sum in that order.
void top_p_exact(Kept &kept, double target, Workspace &ws) {
    const float *w = kept.w;
    int32_t *order = grow(ws.order, size_t(kept.n));
    int64_t m = 0;
    for (int64_t i = 0; i < kept.n; ++i)
        if (w[i] > 0.0f) order[m++] = int32_t(i);
    std::sort(order, order + m, [w](int32_t a, int32_t b) { return w[a] > w[b] || (w[a] == w[b] && a < b); });
    double cum = 0.0;
    int64_t keep = m;
    for (int64_t j = 0; j < m; ++j) {
        cum += double(w[order[j]]);
        if (cum >= target) {
            keep = j + 1;
            break;
        }
    }
    const int32_t last = order[keep - 1];
    kept.v = w[last];
    kept.tie_end = keep == m ? kept.n : int64_t(last) + 1;  // ties in position order: the last one taken
    kept.top_p_path = "sort";
}

// Walks buckets from the highest: the first whose mass brings the running sum `above` to the
// target; returns it (above: the mass of the buckets passed), or -1 if none does.
int walk_down(const double *mass, int n_buckets, double target, double &above) {
    for (int b = n_buckets - 1; b >= 0; --b) {
        if (above + mass[b] >= target) return b;
        above += mass[b];
    }
    return -1;
}

// The radix select's result: the value v of the cut, how many weights equal it, and the mass of
// the weights above it.
struct Cut {
    float v = 0.0f;
    int64_t n_v = 0;
    double above = 0.0;
};

// Finds the cut among `bits` [n] (weights as float bits, all below the weights whose mass is
// `above`): the value where the running sum in decreasing order reaches `target`. Three levels of
// bucket masses (bits 31..19, 18..7, 6..0; the last level's buckets are single values), each level
// over the previous level's bucket only. False when the band does not reach the target.
bool radix_cut(uint32_t *bits, int64_t n, double above, double target, Cut &cut) {
    static thread_local double h[4][kBuckets1];  // level 1: 4 interleaved copies, so that runs of
    std::memset(h, 0, sizeof h);                 // equal keys do not chain on one memory cell
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        for (int l = 0; l < 4; ++l) h[l][bits[i + l] >> kShift1] += double(std::bit_cast<float>(bits[i + l]));
    for (; i < n; ++i) h[0][bits[i] >> kShift1] += double(std::bit_cast<float>(bits[i]));
    double mass1[kBuckets1];
    for (int b = 0; b < kBuckets1; ++b) mass1[b] = ((h[0][b] + h[1][b]) + h[2][b]) + h[3][b];
    const int b1 = walk_down(mass1, kBuckets1, target, above);
    if (b1 < 0) return false;
    int64_t m = 0;
    for (int64_t j = 0; j < n; ++j)  // a branch: one bucket holds few of the band, so it is predicted
        if ((bits[j] >> kShift1) == uint32_t(b1)) bits[m++] = bits[j];
    double mass2[kBuckets2] = {};
    for (int64_t j = 0; j < m; ++j) mass2[(bits[j] >> kShift2) & (kBuckets2 - 1)] += double(std::bit_cast<float>(bits[j]));
    const int b2 = walk_down(mass2, kBuckets2, target, above);
    if (b2 < 0) return false;
    double mass3[kBuckets3] = {};
    int64_t count3[kBuckets3] = {};
    for (int64_t j = 0; j < m; ++j)
        if (int((bits[j] >> kShift2) & (kBuckets2 - 1)) == b2) {
            mass3[bits[j] & (kBuckets3 - 1)] += double(std::bit_cast<float>(bits[j]));
            ++count3[bits[j] & (kBuckets3 - 1)];
        }
    const int b3 = walk_down(mass3, kBuckets3, target, above);
    if (b3 < 0) return false;
    cut.v = std::bit_cast<float>((uint32_t(b1) << kShift1) | (uint32_t(b2) << kShift2) | uint32_t(b3));
    cut.n_v = count3[b3];
    cut.above = above;
    return true;
}

// Where the cut is among the weights `vals` [n] (their mass and the mass `above` of the weights
// above them both count toward the target): a strided sample of vals estimates the cut's level-1
// bucket b, continuing the running sum from est_start with the sample's weights below bucket
// top_key (those above are summed exactly in est_start); one vector pass then takes the band
// within d buckets of b, d = 1 (1/16 octave), then 8, then from 8 octaves below b up to top_key
// (a heavy-tailed tail the sample cannot estimate), and the search continues in it. A band is
// only taken when the target lies inside its mass (with the margin); failing that, or for a few
// thousand weights, the radix select runs on all of vals.
bool find_cut(const SamplingKernels &K, const float *vals, int64_t n, double above, double est_start, int top_key,
              double target, double margin, Workspace &ws, int level, Cut &cut) {
    uint32_t *out = grow(ws.band[2 + level], size_t(n) + 16);
    if (n > 4096 && level < 2) {
        double hs[kBuckets1] = {}, s1 = 0.0, s2 = 0.0;
        const int64_t stride = std::max<int64_t>(1, n / 2048), ms = n / stride;
        for (int64_t j = 0; j < ms; ++j) {
            const float x = vals[j * stride];
            const int k = int(std::bit_cast<uint32_t>(x) >> kShift1);
            if (k < top_key) {
                hs[k] += double(x);
                s1 += double(x);
                s2 += double(x) * double(x);
            }
        }
        const double scale = double(n) / double(ms);
        double est = est_start;
        int b = top_key - 1;
        for (; b > 0 && est + hs[b] * scale < target; --b) est += hs[b] * scale;
        // the sample's effective size: with a few hundred, the estimate is good to a fraction of
        // an octave; with fewer (a heavy tail: a few sampled weights carry its mass) only the
        // wide band is worth a pass
        const bool reliable = s2 > 0.0 && s1 * s1 / s2 >= 256.0;
        for (const int d : {1, 8, 128}) {
            if (d < 128 && !reliable) continue;
            const int lo = std::max(b - d, 0), hi = d == 128 ? top_key : std::min(b + d + 1, kBuckets1);
            double mass[3];
            int64_t nb = 0;
            K.split_pass(vals, n, uint32_t(lo) << kShift1, uint32_t(hi) << kShift1, mass, out, &nb, nullptr, nullptr);
            const double a = above + mass[2];
            if (a < target - margin && a + mass[1] >= target + margin)
                return find_cut(K, reinterpret_cast<const float *>(out), nb, a, a, hi, target, margin, ws, level + 1, cut);
        }
    }
    std::memcpy(out, vals, size_t(n) * sizeof(float));
    return radix_cut(out, n, above, target, cut);
}

// The shortest prefix of (w desc, position asc) whose float64 mass reaches top_p · Σw, as a
// threshold (kept.v, kept.tie_end). The running sum of the sorted order at the cut is the mass of
// the weights above the cut's value plus the ties at it, added one by one; here those masses are
// summed in other orders, which differ from the sorted order's only by rounding (any order of n
// non-negative terms is within n·2^-53 of the sum). So where the target is further than a margin
// from the running sums at the cut, the cut is the same token; otherwise the exact sort decides.
//
// Where to look: the first vector pass sums the weights below 2^-16 of the largest (which is 1) and
// collects those >= 2^-8 and those in [2^-16, 2^-8). A language model's distribution is usually
// peaked, and then the nucleus is among the first few ("heavy"); in a flat one it reaches into the
// second list ("middle"), rarely below it ("tail"). The search goes on by bands (find_cut) there.
void top_p_cut(const SamplingKernels &K, Kept &kept, double top_p, Workspace &ws) {
    const float *w = kept.w;
    const int64_t n = kept.n;
    const int heavy = int(std::bit_cast<uint32_t>(0x1p-8f) >> kShift1);
    const int light = int(std::bit_cast<uint32_t>(0x1p-16f) >> kShift1);
    uint32_t *hi = grow(ws.band[0], size_t(n) + 16), *mid = grow(ws.band[1], size_t(n) + 16);
    double mass[3];
    int64_t n_hi = 0, n_mid = 0;
    K.split_pass(w, n, uint32_t(light) << kShift1, uint32_t(heavy) << kShift1, mass, mid, &n_mid, hi, &n_hi);
    const double mass_mid = mass[1], mass_hi = mass[2];
    const double total = mass[0] + mass_mid + mass_hi;
    const double target = top_p * total;
    const double margin = 8.0 * double(n) * 0x1p-53 * total;
    Cut cut;
    bool found;
    if (mass_hi >= target + margin) {
        kept.top_p_path = "heavy";
        found = find_cut(K, reinterpret_cast<const float *>(hi), n_hi, 0.0, 0.0, kBuckets1, target, margin, ws, 0, cut);
    } else if (mass_hi < target - margin && mass_hi + mass_mid >= target + margin) {
        kept.top_p_path = "middle";
        found = find_cut(K, reinterpret_cast<const float *>(mid), n_mid, mass_hi, mass_hi, heavy, target, margin, ws, 0,
                         cut);
    } else {  // below 2^-16, or the target within rounding of a list's edge: all weights
        kept.top_p_path = "tail";
        const bool tail = mass_hi + mass_mid < target - margin;
        found = find_cut(K, w, n, 0.0, tail ? mass_hi + mass_mid : 0.0, tail ? light : kBuckets1, target, margin, ws,
                         0, cut);
    }
    if (!found) return top_p_exact(kept, target, ws);
    // the ties at v, in position order, one at a time
    double cum = cut.above, prev = cut.above;
    int64_t taken = 0;
    while (taken < cut.n_v) {
        prev = cum;
        cum += double(cut.v);
        ++taken;
        if (cum >= target) break;
    }
    if (cut.v == 0.0f || cum < target + margin || prev > target - margin) return top_p_exact(kept, target, ws);
    kept.v = cut.v;
    if (taken == cut.n_v) {
        kept.tie_end = n;
    } else {
        int64_t seen = 0, j = 0;
        for (; j < n; ++j)
            if (w[j] == cut.v && ++seen == taken) break;
        kept.tie_end = j + 1;
    }
}

// Filters after the weights: top-p, then min-p (the largest weight is 1: the best token's e^0).
void filter(const SamplingKernels &K, Kept &kept, const Params &p, Workspace &ws) {
    if (p.top_p < 1.0) top_p_cut(K, kept, p.top_p, ws);
    if (p.min_p > 0.0) {
        const float t = float(p.min_p * 1.0);
        if (t > kept.v) {
            kept.v = t;
            kept.tie_end = kept.n;
        }
    }
}

int64_t draw_kept(const SamplingKernels &K, const Kept &kept, double u, Workspace &ws) {
    const int64_t n_blocks = (kept.n + kDrawBlock - 1) / kDrawBlock;
    double *sums = grow(ws.sums, size_t(n_blocks));
    K.kept_block_sums(kept.w, kept.n, kept.v, kept.tie_end, kDrawBlock, sums);
    double total = 0.0;
    for (int64_t b = 0; b < n_blocks; ++b) total += sums[b];
    const double target = u * total;
    double before = 0.0;
    int64_t b = 0;
    for (; b < n_blocks - 1 && !(before + sums[b] > target); ++b) before += sums[b];
    const double t = target - before;
    const int64_t start = b * kDrawBlock, end = std::min(kept.n, start + kDrawBlock);
    double cum = 0.0;
    int64_t last = -1;
    for (int64_t i = start; i < end; ++i)
        if (kept.w[i] > 0.0f && kept.keeps(i)) {
            cum += double(kept.w[i]);
            last = i;
            if (cum > t) return i;
        }
    if (last >= 0) return last;  // rounding put the target just past the block's mass
    for (int64_t i = start - 1; i >= 0; --i)  // ... of a block without kept weights (the last one)
        if (kept.w[i] > 0.0f && kept.keeps(i)) return i;
    throw std::logic_error("sampling: nothing to draw from");
}

// x with the tokens the mask disallows at -inf, in ws.x (x itself may be ws.x: penalise wrote it).
// Per word of 32 tokens: all allowed → copied, none (the common case under a grammar) → filled.
const float *apply_mask(const float *x, int64_t n, Mask mask, Workspace &ws) {
    if (!mask.words) return x;
    float *y = grow(ws.x, size_t(n));
    constexpr float kMasked = -std::numeric_limits<float>::infinity();
    const int64_t n_words = (n + 31) / 32;
    for (int64_t wi = 0; wi < n_words; ++wi) {
        const uint32_t bits = mask.words[wi];
        const int64_t base = wi * 32, len = std::min<int64_t>(32, n - base);
        if (bits == 0) {
            std::fill(y + base, y + base + len, kMasked);
        } else if (bits == ~uint32_t(0)) {
            if (x != y) std::memcpy(y + base, x + base, size_t(len) * sizeof(float));
        } else {
            for (int64_t j = 0; j < len; ++j) y[base + j] = (bits >> j) & 1u ? x[base + j] : kMasked;
        }
    }
    return y;
}

// log p(i) = x_i − max − log Σ e^(x_j − max): max and the log of the sum (float64 over the float32
// weights the sampler's exp pass computes; weights below e^-87.3 of the best are 0 there, which
// changes the sum by less than n_vocab · 1e-38).
struct LogZ {
    double max = 0.0, log_sum = 0.0;
    double of(float x) const { return double(x) - max - log_sum; }
};

LogZ log_probs(const SamplingKernels &K, const float *logits, int64_t n, Logprobs &lp, Workspace &ws) {
    if (lp.n_top < 0 || lp.n_top > kMaxTopLogprobs)
        throw std::invalid_argument("sampling: top logprobs must be in [0, " + std::to_string(kMaxTopLogprobs) + "]");
    const float m = checked_max(K, logits, n);
    float *w = grow(ws.w, size_t(n));
    K.exp_scaled(logits, n, 1.0f, m, w);
    const int64_t n_blocks = (n + kDrawBlock - 1) / kDrawBlock;
    double *sums = grow(ws.sums, size_t(n_blocks));
    K.kept_block_sums(w, n, 0.0f, 0, kDrawBlock, sums);  // every w > 0
    double total = 0.0;
    for (int64_t b = 0; b < n_blocks; ++b) total += sums[b];
    LogZ z{double(m), std::log(total)};
    const int64_t k = std::min<int64_t>(lp.n_top, n);
    lp.top_ids.clear();
    lp.top.clear();
    if (k > 0) {
        const int32_t *ids = top_k_ids(K, logits, n, k, ws);
        lp.top_ids.assign(ids, ids + k);
        std::sort(lp.top_ids.begin(), lp.top_ids.end(), [logits](int32_t a, int32_t b) {
            return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
        });
        for (int32_t id : lp.top_ids) lp.top.push_back(z.of(logits[id]));
    }
    return z;
}

void check(int64_t n_vocab, const Params &p) {
    if (n_vocab < 1 || n_vocab > std::numeric_limits<int32_t>::max())
        throw std::invalid_argument("sampling: n_vocab must be in [1, 2^31), got " + std::to_string(n_vocab));
    if (!(p.temperature >= 0.0 && std::isfinite(p.temperature)))
        throw std::invalid_argument("sampling: temperature must be finite and >= 0");
    if (p.top_k < 0) throw std::invalid_argument("sampling: top_k must be >= 0");
    if (!(p.top_p > 0.0 && p.top_p <= 1.0)) throw std::invalid_argument("sampling: top_p must be in (0, 1]");
    if (!(p.min_p >= 0.0 && p.min_p <= 1.0)) throw std::invalid_argument("sampling: min_p must be in [0, 1]");
    if (!(p.repeat_penalty > 0.0 && std::isfinite(p.repeat_penalty)) || !std::isfinite(p.presence_penalty) ||
        !std::isfinite(p.frequency_penalty))
        throw std::invalid_argument("sampling: penalties must be finite (repeat_penalty > 0)");
}

}  // namespace

int32_t sample(const float *logits, int64_t n_vocab, const int64_t *window, int64_t n_window, const Params &p,
               double u, const SamplingKernels *kernels, Mask mask, Logprobs *lp) {
    check(n_vocab, p);
    if (!(u >= 0.0 && u < 1.0)) throw std::invalid_argument("sampling: u must be in [0, 1)");
    Workspace &ws = t_ws;
    const SamplingKernels &K = kernels ? *kernels : sampling_kernels();
    LogZ z;
    if (lp) z = log_probs(K, logits, n_vocab, *lp, ws);
    const float *x = apply_mask(penalise(logits, n_vocab, window, n_window, p, ws), n_vocab, mask, ws);
    const float m = checked_max(K, x, n_vocab);
    Kept kept;
    int32_t token;
    if (p.temperature == 0.0 || !weights(K, x, n_vocab, m, p, ws, kept)) {
        token = first_of_max(K, x, n_vocab, m, ws);
    } else {
        filter(K, kept, p, ws);
        token = kept.id(draw_kept(K, kept, u, ws));
    }
    if (lp) lp->token = z.of(logits[token]);
    return token;
}

Candidates candidates(const float *logits, int64_t n_vocab, const int64_t *window, int64_t n_window,
                      const Params &p, const SamplingKernels *kernels, Mask mask) {
    check(n_vocab, p);
    if (p.temperature == 0.0) throw std::invalid_argument("sampling: candidates need temperature > 0");
    Workspace &ws = t_ws;
    const SamplingKernels &K = kernels ? *kernels : sampling_kernels();
    const float *x = apply_mask(penalise(logits, n_vocab, window, n_window, p, ws), n_vocab, mask, ws);
    const float m = checked_max(K, x, n_vocab);
    Candidates out;
    Kept kept;
    if (!weights(K, x, n_vocab, m, p, ws, kept)) {
        out.ids.push_back(first_of_max(K, x, n_vocab, m, ws));
        out.weights.push_back(1.0f);
        return out;
    }
    filter(K, kept, p, ws);
    for (int64_t i = 0; i < kept.n; ++i)
        if (kept.w[i] > 0.0f && kept.keeps(i)) {
            out.ids.push_back(kept.id(i));
            out.weights.push_back(kept.w[i]);
        }
    out.top_p_path = kept.top_p_path;
    return out;
}

int64_t draw(const float *w, int64_t n, double u, const SamplingKernels *kernels) {
    if (n < 1) throw std::invalid_argument("sampling: draw needs at least one weight");
    if (!(u >= 0.0 && u < 1.0)) throw std::invalid_argument("sampling: u must be in [0, 1)");
    for (int64_t i = 0; i < n; ++i)
        if (!(w[i] >= 0.0f && std::isfinite(w[i])))
            throw std::invalid_argument("sampling: weights must be finite and >= 0");
    Kept kept;
    kept.w = w;
    kept.n = n;
    if (!std::any_of(w, w + n, [](float x) { return x > 0.0f; }))
        throw std::invalid_argument("sampling: all weights are 0");
    return draw_kept(kernels ? *kernels : sampling_kernels(), kept, u, t_ws);
}

}  // namespace ktd::sampling
