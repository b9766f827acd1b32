#include <pybind11/pybind11.h>

#include "bindings.h"
#include "common/error.h"

namespace py = pybind11;

namespace ktd {

void bind_common(py::module_ &m) {
    py::register_exception<GGUFError>(m, "GGUFError", PyExc_ValueError);
    py::register_exception<ResourceError>(m, "ResourceError", PyExc_RuntimeError);
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const SysError &e) {
            // OSError(errno, message) so Python code can test e.errno.
            py::object err = py::module_::import("builtins").attr("OSError")(e.err, e.what());
            PyErr_SetObject(PyExc_OSError, err.ptr());
        }
    });
}

}  // namespace ktd
