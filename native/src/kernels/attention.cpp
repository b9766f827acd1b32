#include "kernels/attention.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>

namespace ktd {

namespace {
// Indexed by Isa; written once per ISA at module load (static initialisers), read afterwards.
std::array<std::atomic<AttnKernel>, kIsaCount> g_attention_kernels{};

size_t round8(size_t n) { return (n + 7) & ~size_t(7); }
}  // namespace

AttnScratchLayout attn_scratch_layout(int n_rows, int n_group, int64_t head_dim_k, int64_t head_dim_v) {
    const size_t q = size_t(n_rows) * size_t(n_group), tile = size_t(kAttnTile);
    AttnScratchLayout l{};
    l.pad = 0;  // 2 × kAttnMaxKeyGroup × head_dim_k F16 values = kAttnMaxKeyGroup × head_dim_k floats
    l.s = l.pad + round8(size_t(kAttnMaxKeyGroup) * size_t(head_dim_k));
    l.m = l.s + q * tile;
    l.l = l.m + round8(q);
    l.acc = l.l + round8(q);
    l.total = l.acc + round8(q * size_t(head_dim_v));
    return l;
}

void attn_pad_key_groups(const AttnBlock &b, int64_t t0, int64_t ta, int64_t tb, int width, uint16_t *pad,
                         int pad_at[2]) {
    const int64_t hdk = b.head_dim_k;
    const int64_t first = (ta - t0) / width * width, last = (tb - 1 - t0) / width * width;
    pad_at[0] = pad_at[1] = -1;
    int n = 0;
    for (const int64_t g : {first, last}) {
        if ((t0 + g >= ta && t0 + g + width <= tb) || (n == 1 && g == pad_at[0])) continue;
        uint16_t *dst = pad + size_t(n) * size_t(width) * size_t(hdk);
        for (int64_t key = t0 + g; key < t0 + g + width; ++key, dst += hdk) {
            if (key >= ta && key < tb)
                std::memcpy(dst, b.k + size_t(key) * b.k_stride, size_t(hdk) * sizeof(uint16_t));
            else
                std::memset(dst, 0, size_t(hdk) * sizeof(uint16_t));
        }
        pad_at[n++] = int(g);
    }
}

void attn_merge(int n_parts, const float *m, const float *l, size_t ml_stride, const float *o, size_t o_stride,
                int64_t head_dim_v, float *out) {
    float m_max = -INFINITY;
    for (int c = 0; c < n_parts; ++c) m_max = std::max(m_max, m[size_t(c) * ml_stride]);
    std::fill(out, out + head_dim_v, 0.0f);
    float sum = 0.0f;
    for (int c = 0; c < n_parts; ++c) {
        const float lc = l[size_t(c) * ml_stride];
        if (!(lc > 0.0f)) continue;  // an empty range
        const float w = lc * std::exp(m[size_t(c) * ml_stride] - m_max);
        sum += w;
        const float *oc = o + size_t(c) * o_stride;
        for (int64_t d = 0; d < head_dim_v; ++d) out[d] += w * oc[d];
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t d = 0; d < head_dim_v; ++d) out[d] *= inv;
}

void register_attention_kernel(Isa isa, AttnKernel fn) { g_attention_kernels[size_t(isa)].store(fn); }

AttnKernel find_attention_kernel(Isa isa) { return g_attention_kernels[size_t(isa)].load(); }

AttnKernel attention_kernel() {
    const Isa isa = active_isa();
    for (Isa i = isa;; i = isa_fallback(i))
        if (AttnKernel fn = find_attention_kernel(i); fn || i == Isa::Ref) return fn;
}

}  // namespace ktd
