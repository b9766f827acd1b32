#include "memory/page_report.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace ktd {

namespace {

bool is_hex_range(const std::string &tok, uintptr_t &lo, uintptr_t &hi) {
    size_t dash = tok.find('-');
    if (dash == std::string::npos || dash == 0 || dash + 1 == tok.size()) return false;
    if (tok.find_first_not_of("0123456789abcdef-") != std::string::npos || dash > 16 ||
        tok.size() - dash - 1 > 16)
        return false;
    lo = std::stoull(tok.substr(0, dash), nullptr, 16);
    hi = std::stoull(tok.substr(dash + 1), nullptr, 16);
    return true;
}

uint64_t read_u64(const std::string &path, bool &ok) {
    std::ifstream in(path);
    uint64_t v = 0;
    ok = bool(in >> v);
    return v;
}

}  // namespace

std::map<std::string, uint64_t> smaps_range(const void *addr, size_t len, const std::string &path) {
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot read " + path);
    const uintptr_t a = reinterpret_cast<uintptr_t>(addr), b = a + len;
    std::map<std::string, uint64_t> out;
    out["vmas"] = 0;
    bool inside = false;
    std::string line;
    while (std::getline(in, line)) {
        std::istringstream ls(line);
        std::string first;
        ls >> first;
        uintptr_t lo, hi;
        // A VMA header line starts with "lo-hi"; field lines start with "Name:".
        if (!first.empty() && first.back() != ':' && is_hex_range(first, lo, hi)) {
            inside = lo < b && a < hi;
            if (inside) ++out["vmas"];
            continue;
        }
        if (!inside || first.size() < 2 || first.back() != ':') continue;
        std::string name = first.substr(0, first.size() - 1), unit;
        uint64_t value = 0;
        if (!(ls >> value)) continue;  // VmFlags and other non-numeric fields
        ls >> unit;
        if (unit == "kB") value *= 1024;
        if (name == "KernelPageSize" || name == "MMUPageSize" || name == "THPeligible")
            out[name] = std::max(out[name], value);
        else
            out[name] += value;
    }
    return out;
}

std::map<std::string, uint64_t> read_meminfo(const std::string &path) {
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot read " + path);
    std::map<std::string, uint64_t> out;
    std::string name, unit, line;
    while (std::getline(in, line)) {
        std::istringstream ls(line);
        uint64_t value;
        if (!(ls >> name >> value) || name.empty() || name.back() != ':') continue;
        name.pop_back();
        unit.clear();
        ls >> unit;
        out[name] = unit == "kB" ? value * 1024 : value;
    }
    return out;
}

std::vector<HugePagePool> hugepage_pools(const std::string &sysfs_root) {
    namespace fs = std::filesystem;
    std::vector<HugePagePool> out;
    auto scan = [&](const std::string &dir, int node) {
        std::error_code ec;
        std::vector<HugePagePool> found;
        for (const auto &e : fs::directory_iterator(dir, ec)) {
            std::string name = e.path().filename().string();  // hugepages-2048kB
            if (name.rfind("hugepages-", 0) != 0 || name.size() < 13 ||
                name.compare(name.size() - 2, 2, "kB") != 0)
                continue;
            std::string kb = name.substr(10, name.size() - 12);
            if (kb.empty() || kb.size() > 12 || kb.find_first_not_of("0123456789") != std::string::npos) continue;
            HugePagePool p;
            p.page_size = std::stoull(kb) * 1024;
            p.node = node;
            bool ok;
            const std::string d = e.path().string() + "/";
            p.nr = read_u64(d + "nr_hugepages", ok);
            p.free = read_u64(d + "free_hugepages", ok);
            p.surplus = read_u64(d + "surplus_hugepages", ok);
            p.resv = node < 0 ? read_u64(d + "resv_hugepages", ok) : 0;
            found.push_back(p);
        }
        std::sort(found.begin(), found.end(),
                  [](const HugePagePool &x, const HugePagePool &y) { return x.page_size < y.page_size; });
        out.insert(out.end(), found.begin(), found.end());
    };
    scan(sysfs_root + "/kernel/mm/hugepages", -1);
    std::error_code ec;
    std::vector<int> nodes;
    for (const auto &e : fs::directory_iterator(sysfs_root + "/devices/system/node", ec)) {
        std::string name = e.path().filename().string();
        if (name.size() > 4 && name.size() < 10 && name.rfind("node", 0) == 0 &&
            name.find_first_not_of("0123456789", 4) == std::string::npos)
            nodes.push_back(std::stoi(name.substr(4)));
    }
    std::sort(nodes.begin(), nodes.end());
    for (int n : nodes) scan(sysfs_root + "/devices/system/node/node" + std::to_string(n) + "/hugepages", n);
    return out;
}

std::string thp_setting(const std::string &file, const std::string &sysfs_root) {
    std::ifstream in(sysfs_root + "/kernel/mm/transparent_hugepage/" + file);
    std::string text;
    if (!in || !std::getline(in, text)) return "";
    // "always [madvise] never": the bracketed word is the current value.
    size_t lb = text.find('['), rb = text.find(']');
    if (lb != std::string::npos && rb != std::string::npos && rb > lb) return text.substr(lb + 1, rb - lb - 1);
    return text;
}

}  // namespace ktd
