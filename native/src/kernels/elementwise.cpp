#include "kernels/elementwise.h"

#include <array>
#include <atomic>

namespace ktd {

namespace {
// Indexed by Isa; written once per ISA at module load (static initialisers), read afterwards.
std::array<std::atomic<SwigluKernel>, 3> g_swiglu{};
}  // namespace

void register_swiglu_kernel(Isa isa, SwigluKernel fn) { g_swiglu[size_t(isa)].store(fn); }

SwigluKernel find_swiglu_kernel(Isa isa) { return g_swiglu[size_t(isa)].load(); }

SwigluKernel swiglu_kernel() {
    const Isa isa = active_isa();
    if (SwigluKernel fn = find_swiglu_kernel(isa)) return fn;
    if (isa == Isa::AVX512 && isa_supported_by_cpu(Isa::AVX2))
        if (SwigluKernel fn = find_swiglu_kernel(Isa::AVX2)) return fn;
    return find_swiglu_kernel(Isa::Ref);
}

}  // namespace ktd
