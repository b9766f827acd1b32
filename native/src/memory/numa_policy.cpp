#include "memory/numa_policy.h"

#include <linux/mempolicy.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/error.h"

namespace ktd {

namespace {

// Node ids accepted before asking the kernel (CONFIG_NODES_SHIFT is at most 10).
constexpr int kMaxNode = 1024;
constexpr size_t kBitsPerWord = 8 * sizeof(unsigned long);

// A nodemask with one bit set, sized for the kernel's maxnode convention: the kernel reads
// maxnode - 1 bits, so pass the bit count + 1.
struct NodeMask {
    std::vector<unsigned long> words;
    unsigned long maxnode = 0;
    explicit NodeMask(int node) : NodeMask(std::vector<int>{node}) {}
    explicit NodeMask(const std::vector<int> &nodes) {
        for (int node : nodes) {
            if (words.size() <= size_t(node) / kBitsPerWord) words.resize(size_t(node) / kBitsPerWord + 1, 0);
            words[size_t(node) / kBitsPerWord] |= 1UL << (size_t(node) % kBitsPerWord);
        }
        maxnode = (unsigned long)(words.size() * kBitsPerWord + 1);
    }
};

void check_node(int node) {
    if (node < 0 || node >= kMaxNode)
        throw std::invalid_argument("NUMA node must be in [0, " + std::to_string(kMaxNode) + "), got " +
                                    std::to_string(node));
}

}  // namespace

void bind_range_to_node(void *addr, size_t len, int node, bool move_existing) {
    check_node(node);
    NodeMask mask(node);
    unsigned flags = move_existing ? MPOL_MF_MOVE | MPOL_MF_STRICT : 0;
    if (syscall(SYS_mbind, addr, len, MPOL_BIND, mask.words.data(), mask.maxnode, flags) != 0)
        throw SysError("mbind(MPOL_BIND, node " + std::to_string(node) + ")", errno);
}

void interleave_range(void *addr, size_t len, const std::vector<int> &nodes) {
    if (nodes.empty()) throw std::invalid_argument("interleave_range: no nodes");
    std::string names;
    for (int node : nodes) {
        check_node(node);
        if (!names.empty()) names += ',';
        names += std::to_string(node);
    }
    NodeMask mask(nodes);
    if (syscall(SYS_mbind, addr, len, MPOL_INTERLEAVE, mask.words.data(), mask.maxnode, 0U) != 0)
        throw SysError("mbind(MPOL_INTERLEAVE, nodes " + names + ")", errno);
}

std::vector<int> range_policy_nodes(const void *addr) {
    std::vector<unsigned long> words(size_t(kMaxNode) / kBitsPerWord, 0);
    int mode = 0;
    if (syscall(SYS_get_mempolicy, &mode, words.data(), (unsigned long)(kMaxNode + 1), addr, MPOL_F_ADDR) != 0)
        throw SysError("get_mempolicy(MPOL_F_ADDR)", errno);
    std::vector<int> nodes;
    if (mode == MPOL_DEFAULT) return nodes;
    for (int node = 0; node < kMaxNode; ++node)
        if (words[size_t(node) / kBitsPerWord] >> (size_t(node) % kBitsPerWord) & 1) nodes.push_back(node);
    return nodes;
}

void bind_thread_memory(int node) {
    if (node == -1) {
        if (syscall(SYS_set_mempolicy, MPOL_DEFAULT, nullptr, 0UL) != 0)
            throw SysError("set_mempolicy(MPOL_DEFAULT)", errno);
        return;
    }
    check_node(node);
    NodeMask mask(node);
    if (syscall(SYS_set_mempolicy, MPOL_BIND, mask.words.data(), mask.maxnode) != 0)
        throw SysError("set_mempolicy(MPOL_BIND, node " + std::to_string(node) + ")", errno);
}

std::vector<int> page_nodes(const void *addr, size_t len, size_t page_size) {
    if (page_size == 0) throw std::invalid_argument("page_size must be > 0");
    const uintptr_t start = reinterpret_cast<uintptr_t>(addr) & ~(uintptr_t(page_size) - 1);
    const uintptr_t end = reinterpret_cast<uintptr_t>(addr) + len;
    std::vector<void *> pages;
    for (uintptr_t p = start; p < end; p += page_size) pages.push_back(reinterpret_cast<void *>(p));
    std::vector<int> status(pages.size(), 0);
    if (!pages.empty() &&
        syscall(SYS_move_pages, 0, (unsigned long)pages.size(), pages.data(), nullptr, status.data(), 0) != 0)
        throw SysError("move_pages", errno);
    return status;
}

}  // namespace ktd
