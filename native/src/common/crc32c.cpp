#include "common/crc32c.h"

#include <cstring>

namespace ktd {

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Table {
    uint32_t t[256];
    constexpr Table() : t{} {
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1) ? kPoly : 0);
            t[i] = c;
        }
    }
};
constexpr Table kTable;

uint32_t sw_update(uint32_t c, const uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; ++i) c = kTable.t[(c ^ p[i]) & 0xFF] ^ (c >> 8);
    return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t hw_update(uint32_t c, const uint8_t *p, size_t n) {
    uint64_t c64 = c;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t v;
        std::memcpy(&v, p, 8);
        c64 = __builtin_ia32_crc32di(c64, v);
    }
    c = uint32_t(c64);
    for (; n; --n, ++p) c = __builtin_ia32_crc32qi(c, *p);
    return c;
}

// Four streams at once: a, b, c, d each of len bytes (a multiple of 8), consecutive.
__attribute__((target("sse4.2"))) void hw_update4(uint32_t *crc, const uint8_t *p, size_t len) {
    uint64_t c0 = crc[0], c1 = crc[1], c2 = crc[2], c3 = crc[3];
    const uint8_t *p0 = p, *p1 = p + len, *p2 = p + 2 * len, *p3 = p + 3 * len;
    for (size_t i = 0; i < len; i += 8) {
        uint64_t v0, v1, v2, v3;
        std::memcpy(&v0, p0 + i, 8);
        std::memcpy(&v1, p1 + i, 8);
        std::memcpy(&v2, p2 + i, 8);
        std::memcpy(&v3, p3 + i, 8);
        c0 = __builtin_ia32_crc32di(c0, v0);
        c1 = __builtin_ia32_crc32di(c1, v1);
        c2 = __builtin_ia32_crc32di(c2, v2);
        c3 = __builtin_ia32_crc32di(c3, v3);
    }
    crc[0] = uint32_t(c0);
    crc[1] = uint32_t(c1);
    crc[2] = uint32_t(c2);
    crc[3] = uint32_t(c3);
}
#else
// No SSE4.2 off x86-64 (use_hw() is false there, so these are never called): the table-driven
// code, so the file builds for aarch64.
uint32_t hw_update(uint32_t c, const uint8_t *p, size_t n) { return sw_update(c, p, n); }
void hw_update4(uint32_t *crc, const uint8_t *p, size_t len) {
    for (size_t i = 0; i < 4; ++i) crc[i] = sw_update(crc[i], p + i * len, len);
}
#endif

// The CPUID bit through the compiler's own query (libgcc), not cpu/features.h: common/ is the
// bottom layer and depends on no other. The same bit as cpu_features().sse42 (a test holds them
// equal).
bool use_hw() {
#if defined(__x86_64__)
    static const bool hw = __builtin_cpu_supports("sse4.2");
    return hw;
#else
    return false;
#endif
}

}  // namespace

bool crc32c_hardware() { return use_hw(); }

uint32_t crc32c(const void *data, size_t n, uint32_t crc) {
    const auto *p = static_cast<const uint8_t *>(data);
    const uint32_t c = ~crc;
    return ~(use_hw() ? hw_update(c, p, n) : sw_update(c, p, n));
}

std::array<uint32_t, 4> crc32c_x4(const void *data, size_t n) {
    const auto *p = static_cast<const uint8_t *>(data);
    const size_t q = n / 4 / 8 * 8;
    std::array<uint32_t, 4> out{~0u, ~0u, ~0u, ~0u};
    if (use_hw() && q) hw_update4(out.data(), p, q);
    else
        for (int i = 0; i < 4; ++i) out[size_t(i)] = sw_update(out[size_t(i)], p + size_t(i) * q, q);
    // The last quarter's tail (n - 4q bytes) continues its stream.
    const size_t tail = n - 4 * q;
    out[3] = use_hw() ? hw_update(out[3], p + 4 * q, tail) : sw_update(out[3], p + 4 * q, tail);
    for (auto &c : out) c = ~c;
    return out;
}

}  // namespace ktd
