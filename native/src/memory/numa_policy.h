// NUMA memory placement through raw system calls (no libnuma): bind a range to a node before it
// is first touched, bind the calling thread's future allocations, and ask where pages are.
// Kernel errors surface as SysError naming the call and the node (Python: OSError with errno);
// e.g. a node that is not online gives EINVAL.
#pragma once
#include <cstddef>
#include <vector>

namespace ktd {

// mbind(addr, len, MPOL_BIND, {node}): pages of [addr, addr+len) are allocated on node.
// addr must be page aligned. move_existing adds MPOL_MF_MOVE (migrate pages already faulted).
// Throws std::invalid_argument for node < 0 or above the limit, SysError from the kernel.
void bind_range_to_node(void *addr, size_t len, int node, bool move_existing = false);

// mbind(addr, len, MPOL_INTERLEAVE, nodes): pages of [addr, addr+len) are allocated round-robin
// over nodes (page by page), so every node streams an equal share. Same rules as
// bind_range_to_node; std::invalid_argument for an empty list. The kernel keeps only the listed
// nodes it has memory on (EINVAL when none): see range_policy_nodes.
void interleave_range(void *addr, size_t len, const std::vector<int> &nodes);

// The nodes of the policy that governs the page at addr (get_mempolicy(MPOL_F_ADDR)): the nodes
// the kernel kept, which for MPOL_INTERLEAVE are the requested ones it has memory on (it drops
// the others silently). Empty for the default policy (local allocation).
std::vector<int> range_policy_nodes(const void *addr);

// set_mempolicy(MPOL_BIND, {node}) for the calling thread; node = -1 restores MPOL_DEFAULT.
void bind_thread_memory(int node);

// The node of each page in [addr, addr+len) (page_size steps), via move_pages(0, ..., NULL):
// the node number, or a negative errno for a page not present (-ENOENT: never touched).
std::vector<int> page_nodes(const void *addr, size_t len, size_t page_size);

}  // namespace ktd
