#include "cpu/topology.h"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

#include "common/error.h"

namespace ktd {

namespace {

// Upper bound on CPU and node ids we accept from text: far above any real machine, low enough
// that a corrupted "0-2000000000" cannot make us allocate gigabytes.
constexpr int kMaxId = 1 << 16;

std::optional<std::string> read_text(const std::string &path) {
    std::ifstream in(path);
    if (!in) return std::nullopt;
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

int parse_id(const std::string &s, const std::string &whole) {
    if (s.empty() || s.size() > 6 || s.find_first_not_of("0123456789") != std::string::npos)
        throw std::invalid_argument("bad cpulist '" + whole + "': '" + s + "' is not a number");
    int v = std::stoi(s);
    if (v >= kMaxId)
        throw std::invalid_argument("bad cpulist '" + whole + "': " + s + " is out of range");
    return v;
}

std::vector<int> cpulist_file(const std::string &path) {
    auto text = read_text(path);
    if (!text) throw std::runtime_error("cannot read " + path);
    try {
        return parse_cpulist(*text);
    } catch (const std::invalid_argument &e) {
        throw std::runtime_error(path + ": " + e.what());
    }
}

std::vector<int> intersect(const std::vector<int> &a, const std::vector<int> &b) {
    std::vector<int> out;
    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(out));
    return out;
}

// Identifies the physical core of a CPU: the lowest CPU of its thread_siblings_list, else
// (package, core_id), else the CPU itself.
std::pair<long, long> core_key(const std::string &cpu_dir, int cpu) {
    const std::string topo = cpu_dir + "/cpu" + std::to_string(cpu) + "/topology/";
    if (std::filesystem::exists(topo + "thread_siblings_list")) {
        auto sib = cpulist_file(topo + "thread_siblings_list");
        if (!sib.empty()) return {-1, sib.front()};
    }
    auto core = read_text(topo + "core_id"), pkg = read_text(topo + "physical_package_id");
    if (core && pkg) {
        try {
            return {std::stol(*pkg), std::stol(*core)};
        } catch (const std::exception &) {
            throw std::runtime_error("bad core_id/physical_package_id under " + topo);
        }
    }
    return {-2, cpu};
}

}  // namespace

std::vector<int> parse_cpulist(const std::string &text) {
    std::string s = text;
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    std::vector<int> out;
    if (s.empty()) return out;
    std::stringstream ss(s);
    std::string item;
    while (std::getline(ss, item, ',')) {
        size_t dash = item.find('-');
        if (dash == std::string::npos) {
            out.push_back(parse_id(item, s));
            continue;
        }
        size_t colon = item.find(':', dash);
        int lo = parse_id(item.substr(0, dash), s);
        int hi = parse_id(item.substr(dash + 1, colon == std::string::npos ? std::string::npos
                                                                            : colon - dash - 1),
                          s);
        // Patterns: the kernel's "a-b:used/group" takes the first `used` CPUs of every `group`
        // (bitmap_parselist); "a-b:g" is read as "a-b:1/g", every g-th CPU.
        int used = 1, group = 1;
        if (colon != std::string::npos) {
            std::string pat = item.substr(colon + 1);
            size_t slash = pat.find('/');
            if (slash == std::string::npos) {
                group = parse_id(pat, s);
            } else {
                used = parse_id(pat.substr(0, slash), s);
                group = parse_id(pat.substr(slash + 1), s);
            }
        }
        if (hi < lo || group < 1 || used < 1 || used > group)
            throw std::invalid_argument("bad cpulist '" + s + "': range '" + item + "'");
        for (int g = lo; g <= hi; g += group)
            for (int c = g; c < g + used && c <= hi; ++c) out.push_back(c);
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
}

std::vector<int> process_affinity() {
    // Start with a set for 1024 CPUs and grow when the kernel's mask is larger (EINVAL).
    for (int ncpu = 1024; ncpu <= (1 << 20); ncpu *= 2) {
        cpu_set_t *set = CPU_ALLOC(ncpu);
        if (!set) throw SysError("CPU_ALLOC", ENOMEM);
        size_t sz = CPU_ALLOC_SIZE(ncpu);
        CPU_ZERO_S(sz, set);
        if (sched_getaffinity(0, sz, set) == 0) {
            std::vector<int> cpus;
            for (int c = 0; c < ncpu; ++c)
                if (CPU_ISSET_S(c, sz, set)) cpus.push_back(c);
            CPU_FREE(set);
            return cpus;
        }
        int e = errno;
        CPU_FREE(set);
        if (e != EINVAL) throw SysError("sched_getaffinity", e);
    }
    throw SysError("sched_getaffinity", EINVAL);
}

const NumaNode *Topology::node(int id) const {
    for (const auto &n : nodes)
        if (n.id == id) return &n;
    return nullptr;
}

int Topology::node_of_cpu(int cpu) const {
    for (const auto &n : nodes)
        if (std::binary_search(n.cpus.begin(), n.cpus.end(), cpu)) return n.id;
    return -1;
}

Topology read_topology(const std::string &sysfs_root, const std::optional<std::vector<int>> &affinity) {
    namespace fs = std::filesystem;
    Topology t;
    const std::string cpu_dir = sysfs_root + "/devices/system/cpu";
    const std::string node_dir = sysfs_root + "/devices/system/node";

    if (fs::exists(cpu_dir + "/online")) {
        t.online_cpus = cpulist_file(cpu_dir + "/online");
    } else {
        // Old or stripped sysfs: every cpuN directory, online unless its "online" file says 0.
        std::error_code ec;
        for (const auto &e : fs::directory_iterator(cpu_dir, ec)) {
            std::string name = e.path().filename().string();
            if (name.size() < 4 || name.size() > 9 || name.compare(0, 3, "cpu") != 0 ||
                name.find_first_not_of("0123456789", 3) != std::string::npos)
                continue;
            auto on = read_text(e.path().string() + "/online");
            if (!on || on->empty() || (*on)[0] != '0') t.online_cpus.push_back(std::stoi(name.substr(3)));
        }
        if (ec) throw std::runtime_error("cannot list " + cpu_dir + ": " + ec.message());
        std::sort(t.online_cpus.begin(), t.online_cpus.end());
    }
    if (t.online_cpus.empty()) throw std::runtime_error("no online CPUs found under " + cpu_dir);

    if (affinity) {
        t.allowed_cpus = *affinity;
        std::sort(t.allowed_cpus.begin(), t.allowed_cpus.end());
        t.allowed_cpus.erase(std::unique(t.allowed_cpus.begin(), t.allowed_cpus.end()),
                             t.allowed_cpus.end());
    } else {
        t.allowed_cpus = process_affinity();
    }
    t.cpus = intersect(t.online_cpus, t.allowed_cpus);

    t.numa = fs::exists(node_dir + "/online");
    if (t.numa) {
        for (int id : cpulist_file(node_dir + "/online")) {
            NumaNode n;
            n.id = id;
            n.cpus = intersect(cpulist_file(node_dir + "/node" + std::to_string(id) + "/cpulist"), t.cpus);
            t.nodes.push_back(std::move(n));
        }
    } else {
        NumaNode n;
        n.id = 0;
        n.cpus = t.cpus;
        t.nodes.push_back(std::move(n));
    }

    for (auto &n : t.nodes) {
        std::map<std::pair<long, long>, size_t> index;  // core key -> position in n.cores
        for (int cpu : n.cpus) {
            auto key = core_key(cpu_dir, cpu);
            auto it = index.find(key);
            if (it == index.end()) {
                index.emplace(key, n.cores.size());
                n.cores.push_back(CpuCore{n.id, {cpu}});
            } else {
                n.cores[it->second].cpus.push_back(cpu);
            }
        }
    }
    return t;
}

std::vector<CpuSlot> choose_cpus(const Topology &topo, int n_threads, const std::vector<int> &nodes,
                                 bool smt) {
    if (n_threads < 0) throw std::invalid_argument("n_threads must be >= 0, got " + std::to_string(n_threads));
    std::vector<const NumaNode *> use;
    if (nodes.empty()) {
        for (const auto &n : topo.nodes)
            if (!n.cpus.empty()) use.push_back(&n);
    } else {
        std::vector<int> sorted = nodes;
        std::sort(sorted.begin(), sorted.end());
        sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
        for (int id : sorted) {
            const NumaNode *n = topo.node(id);
            if (!n) throw std::invalid_argument("NUMA node " + std::to_string(id) + " is not online");
            use.push_back(n);
        }
    }
    // Per node, the candidate CPUs in order: each core's first thread, then (smt) the second
    // threads of every core, and so on, so a partial pool still lands on distinct cores first.
    std::vector<std::vector<int>> cand(use.size());
    size_t total = 0;
    for (size_t i = 0; i < use.size(); ++i) {
        for (size_t level = 0;; ++level) {
            bool any = false;
            for (const auto &core : use[i]->cores)
                if (level < core.cpus.size()) {
                    cand[i].push_back(core.cpus[level]);
                    any = true;
                }
            if (!any || !smt) break;
        }
        total += cand[i].size();
    }
    if (total == 0)
        throw std::invalid_argument("no usable CPU on the chosen NUMA nodes (check the CPU affinity "
                                    "mask and node cpulists)");
    if (size_t(n_threads) > total)
        throw std::invalid_argument("n_threads " + std::to_string(n_threads) + " exceeds the " +
                                    std::to_string(total) + " usable " +
                                    (smt ? "hardware threads" : "physical cores (SMT off)") +
                                    " on the chosen nodes");
    size_t want = n_threads == 0 ? total : size_t(n_threads);
    std::vector<size_t> take(use.size(), 0);
    for (size_t given = 0; given < want;)
        for (size_t i = 0; i < use.size() && given < want; ++i)
            if (take[i] < cand[i].size()) {
                ++take[i];
                ++given;
            }
    std::vector<CpuSlot> out;
    for (size_t i = 0; i < use.size(); ++i)
        for (size_t k = 0; k < take[i]; ++k) out.push_back(CpuSlot{cand[i][k], use[i]->id});
    return out;
}

}  // namespace ktd
