#include <pybind11/stl.h>

#include <vector>

#include "bindings.h"
#include "memory/arena.h"
#include "memory/numa_policy.h"
#include "memory/page_report.h"

namespace py = pybind11;

namespace ktd {

namespace {

void *as_ptr(uintptr_t address) { return reinterpret_cast<void *>(address); }

}  // namespace

void bind_memory(py::module_ &m) {
    py::class_<Arena>(m, "Arena", py::buffer_protocol(),
                      "Weights arena: one mapping of `capacity` bytes, bump-allocated. The object "
                      "exposes the whole mapping as a writable uint8 buffer (numpy.frombuffer).")
        .def(py::init([](size_t capacity, const std::string &hugepages, size_t hugetlb_page_size,
                         bool mlock, int node, const std::string &sysfs_root, std::vector<int> interleave) {
                 ArenaOptions o;
                 o.hugepages = parse_hugepages(hugepages);
                 o.hugetlb_page_size = hugetlb_page_size;
                 o.mlock = mlock;
                 o.node = node;
                 o.sysfs_root = sysfs_root;
                 o.interleave = std::move(interleave);
                 py::gil_scoped_release release;  // prefaulting a large hugetlb arena takes a while
                 return std::make_unique<Arena>(capacity, o);
             }),
             py::arg("capacity"), py::arg("hugepages") = "auto", py::arg("hugetlb_page_size") = kPage2M,
             py::arg("mlock") = false, py::arg("node") = -1, py::arg("sysfs_root") = "/sys",
             py::arg("interleave") = std::vector<int>{})
        .def("alloc",
             [](Arena &a, size_t nbytes, size_t align) {
                 return size_t(static_cast<char *>(a.alloc(nbytes, align)) - static_cast<char *>(a.base()));
             },
             py::arg("nbytes"), py::arg("align") = 64, "Allocate; returns the offset in the arena.")
        .def_property_readonly("address", [](const Arena &a) { return reinterpret_cast<uintptr_t>(a.base()); })
        .def_property_readonly("capacity", &Arena::capacity)
        .def_property_readonly("used", &Arena::used)
        .def_property_readonly("page_size", &Arena::page_size)
        .def_property_readonly("kind", [](const Arena &a) { return std::string(arena_kind_name(a.kind())); })
        .def_property_readonly("node", &Arena::node)
        .def_property_readonly("locked", &Arena::locked)
        .def_property_readonly("fallback_reason", &Arena::fallback_reason)
        .def("smaps", &Arena::smaps, "smaps counters of the arena's mapping (bytes), read now")
        .def_buffer([](Arena &a) {
            return py::buffer_info(a.base(), 1, py::format_descriptor<uint8_t>::format(), 1,
                                   {py::ssize_t(a.capacity())}, {py::ssize_t(1)});
        });

    m.def("smaps_range",
          [](uintptr_t address, size_t length, const std::string &path) {
              return smaps_range(as_ptr(address), length, path);
          },
          py::arg("address"), py::arg("length"), py::arg("path") = "/proc/self/smaps");
    m.def("read_meminfo", &read_meminfo, py::arg("path") = "/proc/meminfo");
    m.def("hugepage_pools",
          [](const std::string &root) {
              py::list out;
              for (const auto &p : hugepage_pools(root)) {
                  py::dict d;
                  d["page_size"] = p.page_size;
                  d["node"] = p.node;
                  d["nr"] = p.nr;
                  d["free"] = p.free;
                  if (p.node < 0) {
                      d["resv"] = p.resv;
                      d["surplus"] = p.surplus;
                  }
                  out.append(d);
              }
              return out;
          },
          py::arg("sysfs_root") = "/sys",
          "Huge page pools: system-wide (node -1) then per node, one dict per page size.");
    m.def("thp_setting", &thp_setting, py::arg("file") = "enabled", py::arg("sysfs_root") = "/sys");
    m.def("bind_range_to_node",
          [](uintptr_t address, size_t length, int node, bool move_existing) {
              bind_range_to_node(as_ptr(address), length, node, move_existing);
          },
          py::arg("address"), py::arg("length"), py::arg("node"), py::arg("move_existing") = false);
    m.def("interleave_range",
          [](uintptr_t address, size_t length, const std::vector<int> &nodes) {
              interleave_range(as_ptr(address), length, nodes);
          },
          py::arg("address"), py::arg("length"), py::arg("nodes"));
    m.def("range_policy_nodes",
          [](uintptr_t address) { return range_policy_nodes(reinterpret_cast<const void *>(address)); },
          py::arg("address"), "Nodes of the NUMA policy governing the page at address ([] = default policy).");
    m.def("bind_thread_memory", &bind_thread_memory, py::arg("node"));
    m.def("page_nodes",
          [](uintptr_t address, size_t length, size_t page_size) {
              return page_nodes(as_ptr(address), length, page_size);
          },
          py::arg("address"), py::arg("length"), py::arg("page_size") = 4096);
}

}  // namespace ktd
