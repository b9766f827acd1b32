// CRC-32C (Castagnoli), the checksum of the prepared-weights cache's sections.
//
// crc32c(): the standard CRC-32C of a buffer (init and final xor 0xFFFFFFFF; "123456789" →
// 0xE3069283), on the SSE4.2 crc32 instruction where the CPU has it (CPUID; the baseline build
// stays SSE2), a table otherwise.
//
// crc32c_x4(): the cache's block checksum: the buffer cut into four contiguous quarters (the first
// three of floor(n/4) bytes rounded down to 8, the last the rest), each with its own CRC-32C, the
// four computed in one loop so that the instruction's 3-cycle latency is hidden (about 3× the
// speed of one stream). Each quarter's value equals crc32c() of that quarter.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>

namespace ktd {

uint32_t crc32c(const void *data, size_t n, uint32_t crc = 0);
std::array<uint32_t, 4> crc32c_x4(const void *data, size_t n);
// Whether the hardware instruction is used (for the log and the benchmark).
bool crc32c_hardware();

}  // namespace ktd
