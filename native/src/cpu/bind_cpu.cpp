#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <thread>

#include "bindings.h"
#include "cpu/features.h"
#include "cpu/thread_pool.h"
#include "cpu/topology.h"

namespace py = pybind11;

namespace ktd {

py::dict pool_stats_dict(const PoolStats &s) {
    py::dict d;
    d["runs"] = s.runs;
    d["barriers"] = s.barriers;
    d["run_ns"] = s.run_ns;
    d["join_wait_ns"] = s.join_wait_ns;
    d["join_sleeps"] = s.join_sleeps;
    d["barrier_wait_ns"] = s.barrier_wait_ns;
    d["busy_ns"] = s.busy_ns;
    d["start_ns"] = s.start_ns;
    d["worker_sleeps"] = s.worker_sleeps;
    return d;
}

namespace {

// Python callables run on pool workers: each call takes the GIL, the caller releases it while
// the pool runs (and while a worker waits in barrier), so Python code can drive the pool in tests.
using RangeFn = std::function<void(size_t, size_t, int)>;

RangeFn with_gil(const py::function &fn) {
    return [&fn](size_t b, size_t e, int tid) {
        py::gil_scoped_acquire gil;
        fn(b, e, tid);
    };
}

using ItemFn = std::function<void(size_t, int)>;

ItemFn item_with_gil(const py::function &fn) {
    return [&fn](size_t item, int tid) {
        py::gil_scoped_acquire gil;
        fn(item, tid);
    };
}

// Mean wall time of an empty run() and of one barrier inside a run, in nanoseconds: the cost of
// handing a dependent op to the pool. For reports and `ktd inspect`; tests never assert it.
py::dict handoff_latency(ThreadPool &pool, int iterations) {
    if (iterations < 1) throw std::invalid_argument("iterations must be >= 1");
    using clock = std::chrono::steady_clock;
    py::gil_scoped_release release;
    pool.run([](int, int) {});  // wake everyone from sleep first
    auto t0 = clock::now();
    for (int i = 0; i < iterations; ++i) pool.run([](int, int) {});
    auto t1 = clock::now();
    pool.run([&](int tid, int) {
        for (int i = 0; i < iterations; ++i) pool.barrier(tid);
    });
    auto t2 = clock::now();
    py::gil_scoped_acquire gil;
    py::dict d;
    d["run_ns"] = std::chrono::duration<double, std::nano>(t1 - t0).count() / iterations;
    d["barrier_ns"] = std::chrono::duration<double, std::nano>(t2 - t1).count() / iterations;
    return d;
}

// CpuFeatures: what CPUID says this CPU and OS can run.
void bind_cpu_features(py::module_ &m) {
    py::class_<CpuFeatures> f(m, "CpuFeatures", "CPUID features usable on this CPU and OS");
    for (const auto &[name, value] : cpu_features().flags()) {
        const std::string key = name;
        f.def_property_readonly(key.c_str(), [key](const CpuFeatures &c) {
            for (const auto &[n, v] : c.flags())
                if (n == key) return v;
            return false;
        });
    }
    f.def_readonly("vendor", &CpuFeatures::vendor)
        .def_readonly("model_name", &CpuFeatures::model_name)
        .def_readonly("family", &CpuFeatures::family)
        .def_readonly("model", &CpuFeatures::model)
        .def_readonly("stepping", &CpuFeatures::stepping)
        .def("flags", [](const CpuFeatures &c) {
            py::dict d;
            for (const auto &[n, v] : c.flags()) d[py::str(n)] = v;
            return d;
        }, "name -> bool for every flag (names as in /proc/cpuinfo)");
    m.def("cpu_features", &cpu_features, py::return_value_policy::reference);
}

// The topology (NUMA nodes, cores, allowed CPUs) and the CPUs a pool would choose.
void bind_topology(py::module_ &m) {
    m.def("parse_cpulist", &parse_cpulist, py::arg("text"));
    m.def("process_affinity", &process_affinity);

    py::class_<CpuCore>(m, "CpuCore")
        .def_readonly("node", &CpuCore::node)
        .def_readonly("cpus", &CpuCore::cpus);
    py::class_<NumaNode>(m, "NumaNode")
        .def_readonly("id", &NumaNode::id)
        .def_readonly("cpus", &NumaNode::cpus)
        .def_readonly("cores", &NumaNode::cores);
    py::class_<Topology>(m, "Topology")
        .def_readonly("numa", &Topology::numa)
        .def_readonly("nodes", &Topology::nodes)
        .def_readonly("online_cpus", &Topology::online_cpus)
        .def_readonly("allowed_cpus", &Topology::allowed_cpus)
        .def_readonly("cpus", &Topology::cpus)
        .def("node_of_cpu", &Topology::node_of_cpu, py::arg("cpu"));
    m.def("read_topology", &read_topology, py::arg("sysfs_root") = "/sys", py::arg("affinity") = py::none(),
          "Topology under sysfs_root, intersected with affinity (default: this process's mask).");
    m.def("choose_cpus",
          [](const Topology &t, int n_threads, const std::vector<int> &nodes, bool smt) {
              std::vector<std::pair<int, int>> out;
              for (const auto &s : choose_cpus(t, n_threads, nodes, smt)) out.emplace_back(s.cpu, s.node);
              return out;
          },
          py::arg("topology"), py::arg("n_threads") = 0, py::arg("nodes") = std::vector<int>{},
          py::arg("smt") = false, "(cpu, node) per worker a pool with these options would use");
}

// ThreadPool: the persistent pinned workers and their regions, barriers and claims.
void bind_thread_pool(py::module_ &m) {
    py::class_<ThreadPool>(m, "ThreadPool")
        .def(py::init([](int n_threads, std::vector<int> nodes, bool smt, bool pin,
                         const std::string &sysfs_root, int spin_us, std::vector<int> affinity) {
                 ThreadPoolOptions o;
                 o.n_threads = n_threads;
                 o.nodes = std::move(nodes);
                 o.smt = smt;
                 o.pin = pin;
                 o.sysfs_root = sysfs_root;
                 o.spin_us = spin_us;
                 o.affinity = std::move(affinity);
                 return std::make_unique<ThreadPool>(o);
             }),
             py::arg("n_threads") = 0, py::arg("nodes") = std::vector<int>{}, py::arg("smt") = false,
             py::arg("pin") = true, py::arg("sysfs_root") = "/sys", py::arg("spin_us") = 50,
             py::arg("affinity") = std::vector<int>{},
             "affinity: the allowed CPUs ([] = this process's mask; fake machines: their CPUs, pin=False)")
        .def_property_readonly("size", &ThreadPool::size)
        .def("run",
             [](ThreadPool &p, const py::function &fn) {
                 std::function<void(int, int)> call = [&fn](int tid, int nth) {
                     py::gil_scoped_acquire gil;
                     fn(tid, nth);
                 };
                 py::gil_scoped_release release;
                 p.run(call);
             },
             py::arg("fn"), "fn(tid, nth) on every worker; the caller is tid 0")
        .def("barrier", &ThreadPool::barrier, py::arg("tid"), py::call_guard<py::gil_scoped_release>())
        .def("parallel_for",
             [](ThreadPool &p, size_t n, const py::function &fn) {
                 RangeFn call = with_gil(fn);
                 py::gil_scoped_release release;
                 p.parallel_for(n, call);
             },
             py::arg("n"), py::arg("fn"))
        .def("parallel_for_node",
             [](ThreadPool &p, int node, size_t n, const py::function &fn) {
                 RangeFn call = with_gil(fn);
                 py::gil_scoped_release release;
                 p.parallel_for_node(node, n, call);
             },
             py::arg("node"), py::arg("n"), py::arg("fn"))
        .def("for_each_item",
             [](ThreadPool &p, size_t n, const py::function &fn) {
                 ItemFn call = item_with_gil(fn);
                 py::gil_scoped_release release;
                 p.for_each_item(n, call);
             },
             py::arg("n"), py::arg("fn"), "fn(item, tid) for every item < n, claimed one at a time")
        .def("for_each_item_node",
             [](ThreadPool &p, const std::vector<size_t> &first, const py::function &fn) {
                 ItemFn call = item_with_gil(fn);
                 py::gil_scoped_release release;
                 p.for_each_item_node(first, call);
             },
             py::arg("first"), py::arg("fn"), "items [first[i], first[i+1]) on the workers of nodes()[i]")
        .def("node_index", &ThreadPool::node_index, py::arg("tid"))
        .def("node_of", &ThreadPool::node_of, py::arg("tid"))
        .def("cpu_of", &ThreadPool::cpu_of, py::arg("tid"))
        .def("cpu_slot", &ThreadPool::cpu_slot, py::arg("tid"))
        .def("thread_id", &ThreadPool::thread_id, py::arg("tid"))
        .def("nodes", &ThreadPool::nodes)
        .def("workers_of_node", &ThreadPool::workers_of_node, py::arg("node"))
        .def("pin_caller", &ThreadPool::pin_caller)
        .def("handoff_latency", &handoff_latency, py::arg("iterations") = 10000)
        .def("set_stats", &ThreadPool::set_stats, py::arg("on"),
             "Time every region from now on (sums cleared); off: nothing is timed")
        .def_property_readonly("stats_enabled", &ThreadPool::stats_enabled)
        .def("stats", [](const ThreadPool &p) { return pool_stats_dict(p.stats()); },
             "{runs, barriers, run_ns, join_wait_ns, join_sleeps, barrier_wait_ns, busy_ns: [tid], start_ns: [tid], "
             "worker_sleeps}")
        .def("reset_stats", &ThreadPool::reset_stats)
        .def_property("spin_us", &ThreadPool::spin_us, &ThreadPool::set_spin_us,
                      "the bounded spin of every wait, microseconds (0 and unchangeable when oversubscribed)");
}

// The work lists threads claim items from inside a region (WorkList, RangeList).
void bind_work_lists(py::module_ &m) {
    // For tests of the in-region use (claims between barriers of one run).
    py::class_<WorkList>(m, "WorkList")
        .def(py::init<>())
        .def("reset", py::overload_cast<size_t>(&WorkList::reset), py::arg("n"))
        .def("reset_slices",
             [](WorkList &w, const std::vector<size_t> &first) {
                 if (first.size() < 2) throw std::invalid_argument("WorkList: expected >= 2 range bounds");
                 w.reset(first.data(), int(first.size() - 1));
             },
             py::arg("first"))
        .def_property_readonly("n_slices", &WorkList::n_slices)
        .def("claim",
             [](WorkList &w, int slice) -> std::optional<size_t> {
                 if (slice < 0 || slice >= w.n_slices()) throw std::out_of_range("WorkList: no slice " + std::to_string(slice));
                 size_t item;
                 if (w.claim(slice, item)) return item;
                 return std::nullopt;
             },
             py::arg("slice") = 0, "the next item of the slice, or None when it has none left");

    py::class_<RangeList>(m, "RangeList")
        .def(py::init<>())
        .def("reset", &RangeList::reset, py::arg("n"), py::arg("n_owner"))
        .def_property_readonly("n_owners", &RangeList::n_owners)
        .def(
            "claim",
            [](RangeList &r, int tid) -> std::optional<size_t> {
                if (tid < 0 || tid >= r.n_owners()) throw std::out_of_range("RangeList: no owner " + std::to_string(tid));
                size_t item;
                if (r.claim(tid, item)) return item;
                return std::nullopt;
            },
            py::arg("tid"), "the front of tid's range, else the back of another's; None when all are empty");
    // For the tests: `rounds` regions in which every worker of `pool` drains one RangeList of n
    // items without the GIL (slow_tid's items sleep a while, so the others run out and steal).
    // Returns (claims per item summed over the rounds, the worker that ran each item last round).
    m.def(
        "range_list_exercise",
        [](ThreadPool &pool, size_t n, int slow_tid, int rounds) {
            RangeList list;
            std::unique_ptr<std::atomic<int>[]> hits(new std::atomic<int>[n]);
            for (size_t i = 0; i < n; ++i) hits[i].store(0);
            std::vector<int> by(n, -1);
            {
                py::gil_scoped_release release;
                for (int r = 0; r < rounds; ++r) {
                    list.reset(n, pool.size());
                    pool.run([&](int tid, int) {
                        list.drain(tid, [&](size_t it) {
                            hits[it].fetch_add(1, std::memory_order_relaxed);
                            by[it] = tid;
                            if (tid == slow_tid) std::this_thread::sleep_for(std::chrono::microseconds(50));
                        });
                    });
                }
            }
            std::vector<int> counts(n);
            for (size_t i = 0; i < n; ++i) counts[i] = hits[i].load();
            return py::make_tuple(counts, by);
        },
        py::arg("pool"), py::arg("n"), py::arg("slow_tid") = -1, py::arg("rounds") = 1);
}

}  // namespace

void bind_cpu(py::module_ &m) {
    bind_cpu_features(m);
    bind_topology(m);
    bind_thread_pool(m);
    bind_work_lists(m);
}

}  // namespace ktd
