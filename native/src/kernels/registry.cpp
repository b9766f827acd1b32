#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "cpu/features.h"
#include "kernels/kernels.h"

namespace ktd {

namespace {
struct Registry {
    std::mutex mu;
    std::map<std::pair<int, uint32_t>, TypeKernels> entries;
};
Registry &registry() {
    static Registry r;
    return r;
}

Isa g_active = Isa::Ref;
std::once_flag g_active_once;
bool g_isa_chosen = false;  // KTD_ISA or set_active_isa picked the ISA (no per-type preference then)

// Types whose AVX-512 (VNNI) kernels were measured at least as fast as their AVX2 ones (repacked
// GEMV and GEMM at n = 1..512, and the plain-layout tile used by tied output heads): while
// AVX-512 is not the default ISA, these still use it where the CPU has it. The other AVX-512
// kernels (Q2_K, Q3_K, Q5_K, IQ4_XS, TQ1_0, TQ2_0) have not been compared yet.
bool avx512_preferred(GGMLType type) {
    return type == GGMLType::Q4_K || type == GGMLType::Q6_K || type == GGMLType::Q5_0 || type == GGMLType::Q8_0;
}

Isa default_isa() {
    if (const char *env = std::getenv("KTD_ISA"); env && *env) {
        Isa isa = parse_isa(env);
        if (!isa_compiled(isa)) throw std::invalid_argument(std::string("KTD_ISA=") + env + ": not compiled into this build");
        if (!isa_supported_by_cpu(isa))
            throw std::invalid_argument(std::string("KTD_ISA=") + env + ": this CPU does not support it");
        g_isa_chosen = true;
        return isa;
    }
    // AVX-512 is not the default ISA: only the types measured faster with it prefer it
    // (avx512_preferred, in kernels_for).
    for (Isa isa : {Isa::AVX2, Isa::I8MM, Isa::DOTPROD, Isa::NEON})
        if (isa_compiled(isa) && isa_supported_by_cpu(isa)) return isa;
    return Isa::Ref;
}
}  // namespace

std::string_view isa_name(Isa isa) {
    switch (isa) {
        case Isa::Ref: return "ref";
        case Isa::AVX2: return "avx2";
        case Isa::AVX512: return "avx512";
        case Isa::NEON: return "neon";
        case Isa::DOTPROD: return "dotprod";
        case Isa::I8MM: return "i8mm";
    }
    return "?";
}

Isa isa_fallback(Isa isa) {
    switch (isa) {
        case Isa::AVX512: return Isa::AVX2;
        case Isa::I8MM: return Isa::DOTPROD;
        case Isa::DOTPROD: return Isa::NEON;
        default: return Isa::Ref;
    }
}

Isa parse_isa(std::string_view name) {
    if (name == "ref") return Isa::Ref;
    if (name == "avx2") return Isa::AVX2;
    if (name == "avx512") return Isa::AVX512;
    if (name == "neon") return Isa::NEON;
    if (name == "dotprod") return Isa::DOTPROD;
    if (name == "i8mm") return Isa::I8MM;
    throw std::invalid_argument("unknown ISA '" + std::string(name) +
                                "' (expected ref, avx2, avx512, neon, dotprod or i8mm)");
}

bool isa_compiled(Isa isa) {
    switch (isa) {
        case Isa::Ref: return true;
#ifdef KTD_HAVE_ISA_AVX2
        case Isa::AVX2: return true;
#endif
#ifdef KTD_HAVE_ISA_AVX512
        case Isa::AVX512: return true;
#endif
#ifdef KTD_HAVE_ISA_NEON
        case Isa::NEON: return true;
#endif
#ifdef KTD_HAVE_ISA_DOTPROD
        case Isa::DOTPROD: return true;
#endif
#ifdef KTD_HAVE_ISA_I8MM
        case Isa::I8MM: return true;
#endif
        default: return false;
    }
}

bool isa_supported_by_cpu(Isa isa) {
    // Must match KTD_ISA_FLAGS_<isa> in CMakeLists.txt: a TU may use any instruction its flags allow.
    const CpuFeatures &f = cpu_features();
    const bool avx2 = f.avx2 && f.fma && f.f16c && f.bmi2 && f.popcnt;
    switch (isa) {
        case Isa::Ref: return true;
        case Isa::AVX2: return avx2;
        case Isa::AVX512:
            return avx2 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512vnni && f.avx512vbmi;
        case Isa::NEON: return f.asimd && f.fp;
        case Isa::DOTPROD: return f.asimd && f.fp && f.asimddp;
        case Isa::I8MM: return f.asimd && f.fp && f.asimddp && f.i8mm;
    }
    return false;
}

Isa active_isa() {
    std::call_once(g_active_once, [] {
        g_active = default_isa();
        // KTD_DECODE_PREFETCH is read here too, so that a bad value is reported where the kernels
        // are chosen (the model load), not by the first decode's worker threads.
        k_decode_prefetch();
    });
    return g_active;
}

bool isa_chosen_explicitly() {
    active_isa();  // KTD_ISA is read on first use
    return g_isa_chosen;
}

void set_active_isa(Isa isa) {
    if (!isa_compiled(isa)) throw std::invalid_argument("ISA " + std::string(isa_name(isa)) + " is not compiled into this build");
    if (!isa_supported_by_cpu(isa)) throw std::invalid_argument("this CPU does not support ISA " + std::string(isa_name(isa)));
    std::call_once(g_active_once, [] {});
    g_active = isa;
    g_isa_chosen = true;
}

namespace {
// -1: not decided yet; a mode once k_decode_prefetch has run (or set_k_decode_prefetch).
std::atomic<int> g_k_prefetch{-1};

// The tuning (k_decode_prefetch_tune_begin): where the setting came from, and the step times.
struct PrefetchTune {
    std::mutex mu;
    const char *source = "default";             // "env" and "set" never tune
    std::vector<uint64_t> ns[kPrefetchModes];   // step times per mode
    int next = 0;                               // the mode of the next tuning step
    double med_ms[kPrefetchModes] = {};
    void restart() {
        for (auto &v : ns) v.clear();
        next = 0;
        for (double &m : med_ms) m = 0;
    }
};
PrefetchTune &prefetch_tune() {
    static PrefetchTune t;
    return t;
}

int k_prefetch_initial() {
    if (const char *env = std::getenv("KTD_DECODE_PREFETCH"); env && *env) {
        const std::string v(env);
        PrefetchTune &t = prefetch_tune();
        std::lock_guard<std::mutex> l(t.mu);
        t.source = "env";
        for (int m = 0; m < kPrefetchModes; ++m)
            if (v == std::to_string(m) || v == prefetch_mode_name(m)) return m;
        throw std::invalid_argument("KTD_DECODE_PREFETCH=" + v + ": expected 0|1|2 or off|l1|l2");
    }
    return k_decode_prefetch_default();
}

double median_ms(std::vector<uint64_t> v) {
    std::sort(v.begin(), v.end());
    return double(v[v.size() / 2]) / 1e6;
}
}  // namespace

const char *prefetch_mode_name(int mode) {
    switch (mode) {
        case kPrefetchOff: return "off";
        case kPrefetchL1: return "l1";
        case kPrefetchL2: return "l2";
    }
    return "?";
}

int k_decode_prefetch_default() {
    // Measured (kernels/x86/k_repack.h at kPrefetchBytes, kernels/avx2/q32.h): l1 made the n = 1
    // GEMV from DRAM faster at one thread on a Xeon (Q32 layouts) and on an AVX2-only AMD Zen 3
    // (K-quants, 1.1-1.3x), and slower, up to 1.5x, on an AMD Zen 4 (family 25 model 17), in both
    // the AVX2 and the AVX-512 tier. Zen 4 is AMD family 25 with AVX-512F (Zen 3 is family 25
    // without it); later AMD families (Zen 5: 26) are unmeasured and taken to be as Zen 4. On an
    // Intel Xeon with a 480 MiB L3 (family 6 model 167) l1 was 1.2-1.35x slower than off and l2
    // 0.82-0.91x (2 GiB Q4_K/Q6_K GEMVs, a 7B decode), so Intel starts at l2 (unmeasured on the
    // Xeon where l1 paid: the tuning decides there). Other x86 cores start at l1. No aarch64
    // kernel reads this.
    const CpuFeatures &f = cpu_features();
    const bool amd_zen4_or_later = f.vendor == "AuthenticAMD" && (f.family > 25 || (f.family == 25 && f.avx512f));
    if (amd_zen4_or_later) return kPrefetchOff;
    return f.vendor == "GenuineIntel" ? kPrefetchL2 : kPrefetchL1;
}

int k_decode_prefetch() {
    int v = g_k_prefetch.load(std::memory_order_relaxed);
    if (v < 0) {
        int expected = -1;
        g_k_prefetch.compare_exchange_strong(expected, k_prefetch_initial(), std::memory_order_relaxed);
        v = g_k_prefetch.load(std::memory_order_relaxed);
    }
    return v;
}

void set_k_decode_prefetch(int mode) {
    if (mode < -1 || mode >= kPrefetchModes)
        throw std::invalid_argument("set_k_decode_prefetch: expected a mode 0 (off), 1 (l1), 2 (l2) or -1 (the default), got " +
                                    std::to_string(mode));
    PrefetchTune &t = prefetch_tune();
    std::lock_guard<std::mutex> l(t.mu);
    // -1: the CPU's default, and the tuning starts over; a mode: fixed, no tuning.
    t.source = mode < 0 ? "default" : "set";
    t.restart();
    g_k_prefetch.store(mode < 0 ? k_decode_prefetch_default() : mode, std::memory_order_relaxed);
}

int k_decode_prefetch_tune_begin() {
#if !defined(__x86_64__)
    return -1;  // only the x86 kernels read the setting: nothing to tune
#else
    k_decode_prefetch();  // KTD_DECODE_PREFETCH is read on first use
    PrefetchTune &t = prefetch_tune();
    std::lock_guard<std::mutex> l(t.mu);
    if (std::string_view(t.source) != "default" && std::string_view(t.source) != "tuning") return -1;
    t.source = "tuning";
    const int s = t.next;
    g_k_prefetch.store(s, std::memory_order_relaxed);
    return s;
#endif
}

void k_decode_prefetch_tune_end(int mode, uint64_t ns) {
    if (mode < 0 || mode >= kPrefetchModes) return;
    PrefetchTune &t = prefetch_tune();
    std::lock_guard<std::mutex> l(t.mu);
    if (std::string_view(t.source) != "tuning") return;  // fixed meanwhile
    t.ns[mode].push_back(ns);
    t.next = (mode + 1) % kPrefetchModes;
    for (const auto &v : t.ns)
        if (v.size() < size_t(kPrefetchTuneSteps)) return;
    int best = 0;
    for (int m = 0; m < kPrefetchModes; ++m) {
        t.med_ms[m] = median_ms(t.ns[m]);
        if (t.med_ms[m] < t.med_ms[best]) best = m;
    }
    const int def = k_decode_prefetch_default();
    const int chosen = best != def && t.med_ms[best] < (1.0 - kPrefetchTuneMargin) * t.med_ms[def] ? best : def;
    g_k_prefetch.store(chosen, std::memory_order_relaxed);
    t.source = "tuned";
}

DecodePrefetchState k_decode_prefetch_state() {
    const int mode = k_decode_prefetch();
    PrefetchTune &t = prefetch_tune();
    std::lock_guard<std::mutex> l(t.mu);
    DecodePrefetchState s{mode, t.source, {}};
    for (int m = 0; m < kPrefetchModes; ++m) s.median_ms[m] = t.med_ms[m];
    return s;
}

void register_type_kernels(Isa isa, const TypeKernels &tk) {
    auto &r = registry();
    std::lock_guard<std::mutex> lk(r.mu);
    r.entries[{int(isa), uint32_t(tk.type)}] = tk;
}

const TypeKernels *find_type_kernels(GGMLType type, Isa isa) {
    auto &r = registry();
    std::lock_guard<std::mutex> lk(r.mu);
    auto it = r.entries.find({int(isa), uint32_t(type)});
    return it == r.entries.end() ? nullptr : &it->second;
}

const TypeKernels *kernels_for(GGMLType type) {
    const Isa isa = active_isa();
    if (isa == Isa::AVX2 && !g_isa_chosen && avx512_preferred(type) && isa_compiled(Isa::AVX512) &&
        isa_supported_by_cpu(Isa::AVX512))
        if (const TypeKernels *tk = find_type_kernels(type, Isa::AVX512)) return tk;
    // Types without kernels of the active ISA use its fallbacks' (AVX512 → AVX2, I8MM → DOTPROD → NEON;
    // every CPU we select for an ISA runs them) rather than the scalar reference.
    for (Isa i = isa;; i = isa_fallback(i)) {
        if (const TypeKernels *tk = find_type_kernels(type, i)) return tk;
        if (i == Isa::Ref) return nullptr;
    }
}

std::vector<GGMLType> supported_types(Isa isa) {
    auto &r = registry();
    std::lock_guard<std::mutex> lk(r.mu);
    std::vector<GGMLType> out;
    for (const auto &[key, tk] : r.entries)
        if (key.first == int(isa)) out.push_back(tk.type);
    return out;
}

size_t act_row_size(const TypeKernels &tk, int64_t k) {
    auto sz = ggml_row_size(tk.act_type, uint64_t(k));
    if (!sz) throw std::invalid_argument("row length " + std::to_string(k) + " is not a whole number of " +
                                         std::string(ggml_type_name(tk.act_type)) + " blocks");
    return *sz;
}

}  // namespace ktd
