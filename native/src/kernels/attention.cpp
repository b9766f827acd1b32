#include "kernels/attention.h"

#include <array>
#include <atomic>

namespace ktd {

namespace {
// Indexed by Isa; written once per ISA at module load (static initialisers), read afterwards.
std::array<std::atomic<AttnKernel>, 3> g_attention_kernels{};

size_t round8(size_t n) { return (n + 7) & ~size_t(7); }
}  // namespace

AttnScratchLayout attn_scratch_layout(int n_rows, int n_group, int64_t head_dim_k, int64_t head_dim_v) {
    const size_t q = size_t(n_rows) * size_t(n_group), tile = size_t(kAttnTile);
    AttnScratchLayout l{};
    l.kf = 0;
    l.vf = l.kf + round8(tile * size_t(head_dim_k));
    l.s = l.vf + round8(tile * size_t(head_dim_v));
    l.m = l.s + q * tile;
    l.l = l.m + round8(q);
    l.acc = l.l + round8(q);
    l.total = l.acc + round8(q * size_t(head_dim_v));
    return l;
}

void register_attention_kernel(Isa isa, AttnKernel fn) { g_attention_kernels[size_t(isa)].store(fn); }

AttnKernel find_attention_kernel(Isa isa) { return g_attention_kernels[size_t(isa)].load(); }

AttnKernel attention_kernel() {
    const Isa isa = active_isa();
    if (AttnKernel fn = find_attention_kernel(isa)) return fn;
    if (isa == Isa::AVX512 && isa_supported_by_cpu(Isa::AVX2))
        if (AttnKernel fn = find_attention_kernel(Isa::AVX2)) return fn;
    return find_attention_kernel(Isa::Ref);
}

}  // namespace ktd
