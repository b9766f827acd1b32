// Context::score: the negative log-likelihood of given next tokens under the model, for perplexity.
// The logits of the scored rows are reduced here, piece by piece, to -log softmax(logits)[target]:
// a perplexity run over n_ctx = 4096 with a 150k vocabulary never holds more than kScoreRows rows of
// logits (78 MB there, instead of 1.2 GB for the scored half of a chunk) and Python sees one float
// per token.
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/sampling.h"
#include "model/blocks.h"
#include "model/context.h"
#include "model/model.h"

namespace ktd {

void Context::score(const Batch &b, const int32_t *targets, double *nll) {
    const HParams &hp = model_.hparams();
    check_batch(b);
    std::vector<uint8_t> want(size_t(b.n));
    for (int64_t i = 0; i < b.n; ++i) {
        if (targets[i] < -1 || targets[i] >= hp.n_vocab)
            throw std::invalid_argument("score: target " + std::to_string(targets[i]) + " of row " + std::to_string(i) +
                                        " out of range [-1, " + std::to_string(hp.n_vocab) + ")");
        want[size_t(i)] = targets[i] >= 0;
    }
    Batch sb = b;
    sb.want_logits = want.data();
    const int64_t V = hp.n_vocab;
    std::vector<float> logits(size_t(std::min(b.n, kScoreRows)) * size_t(V));
    std::vector<int32_t> tgt;
    const SamplingKernels &sk = sampling_kernels();
    int64_t k = 0;  // scored rows written
    for (int64_t r0 = 0; r0 < b.n;) {
        // A piece: up to n_batch rows, ending at the kScoreRows-th scored row.
        int64_t n = 0, n_out = 0;
        tgt.clear();
        while (r0 + n < b.n && n < n_batch_ && n_out < kScoreRows) {
            if (want[size_t(r0 + n)]) {
                tgt.push_back(targets[r0 + n]);
                ++n_out;
            }
            ++n;
        }
        forward_chunk(sb, r0, n, n_out ? logits.data() : nullptr, nullptr, nullptr);
        // Per scored row: log Σ e^(x - max) - (x[t] - max), the sum in float64; e^ as the
        // sampler's vector pass (in place: the row's logits are not needed afterwards).
        double *out = nll + k;
        for_each_row(model_.pool(), n_out, 1, [&](int64_t j) {
            float *x = logits.data() + size_t(j) * size_t(V);
            bool nan = false;
            const float m = sk.max(x, V, &nan);
            const float xt = x[tgt[size_t(j)]];
            if (nan || !std::isfinite(m)) {
                out[j] = std::numeric_limits<double>::quiet_NaN();
                return;
            }
            sk.exp_scaled(x, V, 1.0f, m, x);
            double sum = 0.0;
            for (int64_t v = 0; v < V; ++v) sum += x[v];
            out[j] = std::log(sum) - (double(xt) - double(m));
        });
        k += n_out;
        r0 += n;
    }
}

}  // namespace ktd
