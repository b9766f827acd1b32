// CPU features for ISA dispatch, read once. x86-64: CPUID, checked against what the OS enables
// (XGETBV: a CPU may have AVX-512 while the kernel does not save its registers). aarch64: the
// kernel's hardware capability words getauxval(AT_HWCAP / AT_HWCAP2), which already say only what
// the kernel lets user space use.
#pragma once
#include <string>
#include <utility>
#include <vector>

namespace ktd {

struct CpuFeatures {
    // Each flag is true only when both the CPU has it and the OS saves the register state it
    // needs. Names follow /proc/cpuinfo where it has one (avx512_vnni there = avx512vnni here).
    bool sse42 = false, popcnt = false, avx = false, avx2 = false, fma = false, f16c = false,
         bmi2 = false;
    bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false, avx512cd = false,
         avx512ifma = false, avx512vnni = false, avx512vbmi = false, avx512vbmi2 = false,
         avx512bf16 = false, avx512fp16 = false;
    bool avx_vnni = false;
    // AMX: CPU and XCR0 support. Linux additionally requires each process to ask for the tile
    // data state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) before using tiles.
    bool amx_tile = false, amx_int8 = false, amx_bf16 = false;
    // aarch64 (all false on x86-64): names as in /proc/cpuinfo's Features line. asimd = NEON,
    // asimddp = the dot product instructions (SDOT/UDOT, FEAT_DotProd), i8mm = the int8 matrix
    // multiply (SMMLA, FEAT_I8MM), asimdhp = half-precision arithmetic, bf16 = BFloat16.
    bool fp = false, asimd = false, asimdhp = false, asimddp = false, i8mm = false, bf16 = false,
         sve = false, sve2 = false;
    // x86-64: "GenuineIntel", "AuthenticAMD", ...; aarch64: the MIDR implementer ("ARM",
    // "Ampere", "NVIDIA", ... or its hex code), family = implementer code, model = part number,
    // stepping = variant << 4 | revision (from sysfs midr_el1; 0 and "" when unreadable).
    std::string vendor;
    std::string model_name;  // brand string, trimmed
    int family = 0, model = 0, stepping = 0;

    // (name, value) for every flag of this build's architecture, in declaration order; names as in
    // /proc/cpuinfo.
    std::vector<std::pair<std::string, bool>> flags() const;
};

// Detected once (thread-safe static) and cached.
const CpuFeatures &cpu_features();


}  // namespace ktd
