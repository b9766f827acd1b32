// ktd._native: the per-token core of ktd. Thin, grouped bindings; the public API is Python.
#include "bindings.h"

PYBIND11_MODULE(_native, m) {
    m.doc() = "ktd native core (GGUF reader, weights arena, CPU topology and thread pool, kernels, forward, sampling)";
    ktd::bind_common(m);
    ktd::bind_gguf(m);
    ktd::bind_memory(m);
    ktd::bind_cpu(m);
    ktd::bind_kernels(m);
    ktd::bind_float_kernels(m);
    ktd::bind_model(m);
    ktd::bind_sampling(m);
    ktd::bind_cuda(m);
}
