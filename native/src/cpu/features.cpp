#include "cpu/features.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define KTD_CPU_X86 1
#elif defined(__aarch64__)
#include <sys/auxv.h>
#define KTD_CPU_AARCH64 1
#else
#error "ktd supports x86-64 and aarch64 only (native/src/cpu/features.cpp)"
#endif

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <stdexcept>

namespace ktd {

namespace {

[[maybe_unused]] std::string trim(const std::string &s) {
    size_t b = s.find_first_not_of(' '), e = s.find_last_not_of(' ');
    return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

#if KTD_CPU_X86
struct Regs {
    uint32_t eax = 0, ebx = 0, ecx = 0, edx = 0;
};

Regs cpuid(uint32_t leaf, uint32_t subleaf = 0) {
    Regs r;
    __cpuid_count(leaf, subleaf, r.eax, r.ebx, r.ecx, r.edx);
    return r;
}

bool bit(uint32_t reg, int n) { return (reg >> n) & 1u; }

// XCR0: which register states the OS saves on context switch. Only valid when OSXSAVE is set.
uint64_t xgetbv0() {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return (uint64_t(hi) << 32) | lo;
}

CpuFeatures detect() {
    CpuFeatures f;
    Regs r0 = cpuid(0);
    const uint32_t max_leaf = r0.eax;
    char vendor[13] = {};
    // The vendor string is EBX, EDX, ECX in that order.
    for (int i = 0; i < 4; ++i) {
        vendor[i] = char(r0.ebx >> (8 * i));
        vendor[4 + i] = char(r0.edx >> (8 * i));
        vendor[8 + i] = char(r0.ecx >> (8 * i));
    }
    f.vendor = vendor;

    uint32_t max_ext = cpuid(0x80000000u).eax;
    if (max_ext >= 0x80000004u) {
        std::string brand;
        for (uint32_t leaf = 0x80000002u; leaf <= 0x80000004u; ++leaf) {
            Regs r = cpuid(leaf);
            for (uint32_t v : {r.eax, r.ebx, r.ecx, r.edx})
                for (int i = 0; i < 4; ++i) {
                    char c = char(v >> (8 * i));
                    if (c) brand.push_back(c);
                }
        }
        f.model_name = trim(brand);
    }
    if (max_leaf < 1) return f;

    Regs r1 = cpuid(1);
    int base_family = (r1.eax >> 8) & 0xf, base_model = (r1.eax >> 4) & 0xf;
    f.family = base_family == 0xf ? base_family + int((r1.eax >> 20) & 0xff) : base_family;
    f.model = (base_family == 0x6 || base_family == 0xf) ? base_model | int((r1.eax >> 12) & 0xf0)
                                                         : base_model;
    f.stepping = r1.eax & 0xf;

    const bool osxsave = bit(r1.ecx, 27);
    const uint64_t xcr0 = osxsave ? xgetbv0() : 0;
    // XCR0 bits: 1 SSE, 2 AVX (YMM upper halves), 5-7 opmask/ZMM upper/ZMM16-31, 17-18 AMX tiles.
    const bool os_avx = (xcr0 & 0x6) == 0x6;
    const bool os_avx512 = os_avx && (xcr0 & 0xe0) == 0xe0;
    const bool os_amx = (xcr0 & 0x60000) == 0x60000;

    f.sse42 = bit(r1.ecx, 20);
    f.popcnt = bit(r1.ecx, 23);
    f.avx = os_avx && bit(r1.ecx, 28);
    f.fma = os_avx && bit(r1.ecx, 12);
    f.f16c = os_avx && bit(r1.ecx, 29);
    if (max_leaf < 7) return f;

    Regs r7 = cpuid(7, 0);
    f.bmi2 = bit(r7.ebx, 8);
    f.avx2 = os_avx && bit(r7.ebx, 5);
    f.avx512f = os_avx512 && bit(r7.ebx, 16);
    if (f.avx512f) {
        f.avx512dq = bit(r7.ebx, 17);
        f.avx512ifma = bit(r7.ebx, 21);
        f.avx512cd = bit(r7.ebx, 28);
        f.avx512bw = bit(r7.ebx, 30);
        f.avx512vl = bit(r7.ebx, 31);
        f.avx512vbmi = bit(r7.ecx, 1);
        f.avx512vbmi2 = bit(r7.ecx, 6);
        f.avx512vnni = bit(r7.ecx, 11);
        f.avx512fp16 = bit(r7.edx, 23);
    }
    f.amx_bf16 = os_amx && bit(r7.edx, 22);
    f.amx_tile = os_amx && bit(r7.edx, 24);
    f.amx_int8 = os_amx && bit(r7.edx, 25);
    if (r7.eax >= 1) {
        Regs r71 = cpuid(7, 1);
        f.avx_vnni = os_avx && bit(r71.eax, 4);
        f.avx512bf16 = f.avx512f && bit(r71.eax, 5);
    }
    return f;
}
#endif  // KTD_CPU_X86

#if KTD_CPU_AARCH64
// Bit numbers of the Linux arm64 ABI (Documentation/arch/arm64/elf_hwcaps.rst); spelled out so
// the build does not depend on how new the toolchain's <asm/hwcap.h> is.
constexpr int kHwcapFp = 0, kHwcapAsimd = 1, kHwcapAsimdhp = 10, kHwcapAsimddp = 20, kHwcapSve = 22;
constexpr int kHwcap2Sve2 = 1, kHwcap2I8mm = 13, kHwcap2Bf16 = 14;

bool bit(unsigned long word, int n) { return (word >> n) & 1ul; }

std::string implementer_name(unsigned code) {
    switch (code) {
        case 0x41: return "ARM";
        case 0x42: return "Broadcom";
        case 0x43: return "Cavium";
        case 0x46: return "Fujitsu";
        case 0x48: return "HiSilicon";
        case 0x4e: return "NVIDIA";
        case 0x51: return "Qualcomm";
        case 0x61: return "Apple";
        case 0xc0: return "Ampere";
    }
    char buf[8];
    std::snprintf(buf, sizeof buf, "0x%02x", code);
    return buf;
}

CpuFeatures detect() {
    CpuFeatures f;
    const unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    f.fp = bit(hw, kHwcapFp);
    f.asimd = bit(hw, kHwcapAsimd);
    f.asimdhp = bit(hw, kHwcapAsimdhp);
    f.asimddp = bit(hw, kHwcapAsimddp);
    f.sve = bit(hw, kHwcapSve);
    f.sve2 = bit(hw2, kHwcap2Sve2);
    f.i8mm = bit(hw2, kHwcap2I8mm);
    f.bf16 = bit(hw2, kHwcap2Bf16);
    // MIDR_EL1 of cpu0: implementer [31:24], variant [23:20], part [15:4], revision [3:0].
    std::ifstream midr_file("/sys/devices/system/cpu/cpu0/regs/identification/midr_el1");
    std::string text;
    if (midr_file >> text) {
        try {
            const unsigned long midr = std::stoul(text, nullptr, 16);
            const unsigned implementer = unsigned(midr >> 24) & 0xff;
            f.vendor = implementer_name(implementer);
            f.family = int(implementer);
            f.model = int((midr >> 4) & 0xfff);
            f.stepping = int(((midr >> 20) & 0xf) << 4 | (midr & 0xf));
        } catch (const std::exception &) {
            // unreadable: identity stays empty (dispatch uses only the hwcaps)
        }
    }
    return f;
}
#endif  // KTD_CPU_AARCH64

}  // namespace

std::vector<std::pair<std::string, bool>> CpuFeatures::flags() const {
#if KTD_CPU_AARCH64
    return {
        {"fp", fp},     {"asimd", asimd}, {"asimdhp", asimdhp}, {"asimddp", asimddp},
        {"i8mm", i8mm}, {"bf16", bf16},   {"sve", sve},         {"sve2", sve2},
    };
#else
    return {
        {"sse4_2", sse42},           {"popcnt", popcnt},           {"avx", avx},
        {"avx2", avx2},              {"fma", fma},                 {"f16c", f16c},
        {"bmi2", bmi2},              {"avx512f", avx512f},         {"avx512bw", avx512bw},
        {"avx512vl", avx512vl},      {"avx512dq", avx512dq},       {"avx512cd", avx512cd},
        {"avx512ifma", avx512ifma},  {"avx512_vnni", avx512vnni},  {"avx512vbmi", avx512vbmi},
        {"avx512_vbmi2", avx512vbmi2}, {"avx512_bf16", avx512bf16}, {"avx512_fp16", avx512fp16},
        {"avx_vnni", avx_vnni},      {"amx_tile", amx_tile},       {"amx_int8", amx_int8},
        {"amx_bf16", amx_bf16},
    };
#endif
}

const CpuFeatures &cpu_features() {
    static const CpuFeatures f = detect();
    return f;
}

}  // namespace ktd
