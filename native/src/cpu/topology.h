// CPU topology from sysfs, intersected with the process's CPU affinity (so taskset, cpusets,
// systemd's CPUAffinity=/AllowedCPUs= are honoured). No libnuma/hwloc: plain files under
// <sysfs_root>/devices/system/{node,cpu}. The root is a parameter so tests can present fake
// machines.
#pragma once
#include <optional>
#include <string>
#include <vector>

namespace ktd {

// Parses the kernel's cpulist/nodelist syntax: "0-3,8-11", "0,2", "" (empty), the pattern
// "0-15:2/4" (first 2 of every 4) and "0-6:2" (read as every 2nd); a trailing newline is allowed.
// Result sorted and unique. Throws std::invalid_argument on bad input.
std::vector<int> parse_cpulist(const std::string &text);

struct CpuCore {
    int node = 0;           // NUMA node of the core
    std::vector<int> cpus;  // usable (online and allowed) hardware threads of one physical core,
                            // ascending; cpus[0] is the one used when SMT is off
};

struct NumaNode {
    int id = 0;
    std::vector<int> cpus;        // usable CPUs of this node, ascending (may be empty: CPU-less
                                  // memory nodes, or none allowed by the affinity mask)
    std::vector<CpuCore> cores;   // physical cores with at least one usable CPU, by first CPU
};

struct Topology {
    bool numa = false;             // false: no <root>/devices/system/node/online (one node 0)
    std::vector<NumaNode> nodes;   // online nodes, ascending id
    std::vector<int> online_cpus;  // online CPUs, ascending
    std::vector<int> allowed_cpus; // the affinity mask used, ascending
    std::vector<int> cpus;         // usable = online ∩ allowed, ascending

    const NumaNode *node(int id) const;  // nullptr if not an online node
    int node_of_cpu(int cpu) const;      // -1 if cpu is not usable
};

// The calling thread's affinity mask (sched_getaffinity). Throws SysError.
std::vector<int> process_affinity();

// Reads the topology under sysfs_root. affinity: the allowed CPUs; default = process_affinity().
// Throws std::runtime_error naming the file when a sysfs file it needs is unreadable or
// malformed.
Topology read_topology(const std::string &sysfs_root = "/sys",
                       const std::optional<std::vector<int>> &affinity = std::nullopt);

// One chosen worker slot: the CPU and its node.
struct CpuSlot {
    int cpu = -1;
    int node = 0;
};

// The CPUs a pool of n_threads would use: one per physical core (all hardware threads if smt),
// on the given nodes (empty = every node with usable CPUs), grouped by node in ascending order.
// n_threads = 0: all of them; fewer: spread round-robin over the nodes so each node gets an
// equal share (±1), then grouped. Throws std::invalid_argument when a node is not online, when
// the nodes have no usable CPU, or when n_threads exceeds the CPUs available.
std::vector<CpuSlot> choose_cpus(const Topology &topo, int n_threads, const std::vector<int> &nodes,
                                 bool smt);

}  // namespace ktd
