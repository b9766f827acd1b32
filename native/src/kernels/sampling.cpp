#include "kernels/sampling.h"

#include <array>
#include <atomic>
#include <stdexcept>

namespace ktd {

namespace {
// Indexed by Isa; each written once at module load (static initialisers), read afterwards.
std::array<std::atomic<const SamplingKernels *>, kIsaCount> g_sampling{};
}  // namespace

void register_sampling_kernels(Isa isa, const SamplingKernels &k) { g_sampling[size_t(isa)].store(&k); }

const SamplingKernels *find_sampling_kernels(Isa isa) { return g_sampling[size_t(isa)].load(); }

const SamplingKernels &sampling_kernels() {
    const Isa isa = active_isa();
    // Every ISA gives the same bits here, so the fastest the CPU has is used unless the ISA was
    // fixed explicitly (as the matrix kernels' per-type AVX-512 preference).
    if (isa == Isa::AVX2 && !isa_chosen_explicitly() && isa_supported_by_cpu(Isa::AVX512))
        if (const SamplingKernels *k = find_sampling_kernels(Isa::AVX512)) return *k;
    for (Isa i = isa;; i = isa_fallback(i)) {
        if (const SamplingKernels *k = find_sampling_kernels(i)) return *k;
        if (i == Isa::Ref) break;
    }
    throw std::logic_error("no sampling kernels registered");
}

}  // namespace ktd
