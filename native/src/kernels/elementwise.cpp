#include "kernels/elementwise.h"

#include <array>
#include <atomic>

namespace ktd {

namespace {
// Indexed by [Glu][Isa]; written once per pair at module load (static initialisers), read afterwards.
std::array<std::array<std::atomic<GluKernel>, 3>, kNumGlu> g_glu{};
}  // namespace

const char *glu_name(Glu g) {
    switch (g) {
        case Glu::SwiGLU: return "swiglu";
        case Glu::GeGLU: return "geglu";
        case Glu::ReLU2: return "relu2glu";
    }
    return "?";
}

void register_glu_kernel(Glu glu, Isa isa, GluKernel fn) { g_glu[size_t(glu)][size_t(isa)].store(fn); }

GluKernel find_glu_kernel(Glu glu, Isa isa) { return g_glu[size_t(glu)][size_t(isa)].load(); }

GluKernel glu_kernel(Glu glu) {
    const Isa isa = active_isa();
    if (GluKernel fn = find_glu_kernel(glu, isa)) return fn;
    if (isa == Isa::AVX512 && isa_supported_by_cpu(Isa::AVX2))
        if (GluKernel fn = find_glu_kernel(glu, Isa::AVX2)) return fn;
    return find_glu_kernel(glu, Isa::Ref);
}

}  // namespace ktd
