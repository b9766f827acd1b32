#include "bindings.h"

namespace py = pybind11;

namespace ktd {

void bind_gguf(py::module_ &m) { (void)m; }

}  // namespace ktd
