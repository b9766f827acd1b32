#include "kernels/elementwise.h"

#include <array>
#include <atomic>

namespace ktd {

namespace {
// Indexed by [Glu][Isa]; written once per pair at module load (static initialisers), read afterwards.
std::array<std::array<std::atomic<GluKernel>, kIsaCount>, kNumGlu> g_glu{};
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
    for (Isa i = isa;; i = isa_fallback(i))
        if (GluKernel fn = find_glu_kernel(glu, i); fn || i == Isa::Ref) return fn;
}

}  // namespace ktd
