// One registration function per area of the native core; module.cpp calls them in order.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

namespace ktd {
void bind_common(pybind11::module_ &m);   // exception types
void bind_gguf(pybind11::module_ &m);     // GGUF reader
void bind_memory(pybind11::module_ &m);   // weights arena, huge pages
void bind_cpu(pybind11::module_ &m);      // CPU features, topology, thread pool
void bind_kernels(pybind11::module_ &m);  // block types and matrix kernels
void bind_float_kernels(pybind11::module_ &m);  // attention and element-wise kernels per ISA
void bind_model(pybind11::module_ &m);    // model, context (KV cache), forward
void bind_context(pybind11::module_ &m);  // context (model/bind_context.cpp; bind_model calls it)
void bind_sampling(pybind11::module_ &m); // token sampler
void bind_cuda(pybind11::module_ &m);     // optional CUDA backend: status, block math

struct PoolStats;
// A pool's region timing as a dict (bind_cpu.cpp): runs, barriers, run_ns, join_wait_ns,
// join_sleeps, barrier_wait_ns, busy_ns [tid], start_ns [tid].
pybind11::dict pool_stats_dict(const PoolStats &s);

// h as a C-contiguous 1-D array of T (converted when it is not one); std::invalid_argument naming
// it otherwise.
template <class T>
pybind11::array_t<T, pybind11::array::c_style | pybind11::array::forcecast> vec1d(const pybind11::handle &h,
                                                                                  const char *name) {
    auto a = pybind11::array_t<T, pybind11::array::c_style | pybind11::array::forcecast>::ensure(h);
    if (!a || a.ndim() != 1) throw std::invalid_argument(std::string(name) + " must be a 1-D array");
    return a;
}
}  // namespace ktd
