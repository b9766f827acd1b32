// Error types of the native core. The core never aborts or exits on input: it throws one of
// these, and the bindings turn them into Python exceptions (see bind_common.cpp).
#pragma once
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace ktd {

// Malformed or unsupported GGUF input. Python: ktd.GGUFError (a ValueError).
// The message names the field, the tensor or key, and the byte offset.
struct GGUFError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// A failed system call. Python: OSError with errno set; the message names the call.
struct SysError : std::runtime_error {
    int err;
    SysError(const std::string &call, int e)
        : std::runtime_error(call + ": " + std::strerror(e)), err(e) {}
};

// A request the machine cannot satisfy as configured (e.g. huge pages demanded but the pool is
// short). Python: ktd.ResourceError (a RuntimeError); the message says how to fix it.
struct ResourceError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

}  // namespace ktd
