// Python binding of GGUFFile (ktd._native.GGUFFile). The public API is ktd.model.gguf, which wraps it.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>

#include "bindings.h"
#include "common/error.h"
#include "gguf/gguf_file.h"

namespace py = pybind11;

namespace ktd {

namespace {

// A string value: str when it is valid UTF-8, else the raw bytes (GGUF does not require
// string values to be UTF-8, and a lossy decode would not be exact).
py::object to_py_string(std::string_view s) {
    PyObject *o = PyUnicode_DecodeUTF8(s.data(), Py_ssize_t(s.size()), "strict");
    if (o) return py::reinterpret_steal<py::object>(o);
    PyErr_Clear();
    return py::bytes(s.data(), s.size());
}

// numpy dtype of a fixed-size GGUF element type (little-endian, as in the file).
const char *numpy_dtype(GGUFValueType t) {
    switch (t) {
        case GGUFValueType::UINT8: return "u1";
        case GGUFValueType::INT8: return "i1";
        case GGUFValueType::UINT16: return "<u2";
        case GGUFValueType::INT16: return "<i2";
        case GGUFValueType::UINT32: return "<u4";
        case GGUFValueType::INT32: return "<i4";
        case GGUFValueType::FLOAT32: return "<f4";
        case GGUFValueType::BOOL: return "?";
        case GGUFValueType::UINT64: return "<u8";
        case GGUFValueType::INT64: return "<i8";
        case GGUFValueType::FLOAT64: return "<f8";
        case GGUFValueType::STRING: case GGUFValueType::ARRAY: break;
    }
    return nullptr;
}

// Arrays of numbers become numpy arrays (a copy: metadata values do not pin the mapping), arrays
// of strings lists of str, nested arrays lists.
py::object to_py_array(const GGUFArray &a) {
    if (a.elem_type == GGUFValueType::STRING) {
        py::list out(a.strings.size());
        for (size_t i = 0; i < a.strings.size(); i++) out[i] = to_py_string(a.strings[i]);
        return out;
    }
    if (a.elem_type == GGUFValueType::ARRAY) {
        py::list out(a.arrays.size());
        for (size_t i = 0; i < a.arrays.size(); i++) out[i] = to_py_array(a.arrays[i]);
        return out;
    }
    py::dtype dt(numpy_dtype(a.elem_type));
    py::array out(dt, std::vector<py::ssize_t>{py::ssize_t(a.size)});
    if (a.size) std::memcpy(out.mutable_data(), a.data, a.size * size_t(dt.itemsize()));
    return out;
}

py::object to_py(const GGUFValue &v) {
    return std::visit(
        [](const auto &x) -> py::object {
            using V = std::decay_t<decltype(x)>;
            if constexpr (std::is_same_v<V, std::string_view>) return to_py_string(x);
            else if constexpr (std::is_same_v<V, GGUFArray>) return to_py_array(x);
            else if constexpr (std::is_same_v<V, bool>) return py::bool_(x);
            else if constexpr (std::is_floating_point_v<V>) return py::float_(double(x));
            else return py::int_(x);
        },
        v);
}

const GGUFKeyValue &lookup(const GGUFFile &f, const std::string &key) {
    const GGUFKeyValue *kv = f.find_key(key);
    if (!kv) throw py::key_error(key);
    return *kv;
}

}  // namespace

// The strings of a GGUF string array starting at byte pos of buf ({u64 length, bytes} × n), for
// the tokenizer's metadata reader (its Python loop over a 150k-token vocabulary was most of a
// tokenizer's load). None when the array runs past the buffer or n is implausible: the caller's
// own reader then says where, with its message.
py::object string_array(py::buffer buf, uint64_t pos, uint64_t n) {
    const py::buffer_info info = buf.request();
    const auto *p = static_cast<const uint8_t *>(info.ptr);
    const uint64_t end = uint64_t(info.size) * uint64_t(info.itemsize);
    if (info.ndim != 1 || n > end / 8) return py::none();
    py::list out(n);
    for (uint64_t i = 0; i < n; ++i) {
        if (pos > end || end - pos < 8) return py::none();
        uint64_t len;
        std::memcpy(&len, p + pos, 8);
        pos += 8;
        if (len > end - pos) return py::none();
        PyObject *b = PyBytes_FromStringAndSize(reinterpret_cast<const char *>(p + pos), Py_ssize_t(len));
        if (!b) throw py::error_already_set();
        PyList_SET_ITEM(out.ptr(), Py_ssize_t(i), b);  // steals the reference
        pos += len;
    }
    return py::make_tuple(out, pos);
}

void bind_gguf(py::module_ &m) {
    m.def("gguf_string_array", &string_array, py::arg("buf"), py::arg("pos"), py::arg("n"),
          "(list of bytes, end position) of the GGUF string array of n strings at byte pos of buf; None when it "
          "runs past the end (the tokenizer's metadata reader)");
    py::class_<GGUFFile>(m, "GGUFFile",
                         "A GGUF v2/v3 file, mapped read-only and fully validated on open "
                         "(GGUFError on malformed input, OSError when it cannot be read).")
        .def(py::init([](const std::string &path, bool willneed) {
                 py::gil_scoped_release nogil;
                 return GGUFFile::open(path, GGUFOpenOptions{.willneed = willneed});
             }),
             py::arg("path"), py::arg("willneed") = true)
        .def_property_readonly("path", &GGUFFile::path)
        .def_property_readonly("version", &GGUFFile::version)
        .def_property_readonly("file_size", &GGUFFile::file_size)
        .def_property_readonly("alignment", &GGUFFile::alignment)
        .def_property_readonly("data_offset", &GGUFFile::data_offset)
        .def("keys",
             [](const GGUFFile &f) {
                 py::list out;
                 for (const auto &kv : f.metadata()) out.append(py::str(kv.key.data(), kv.key.size()));
                 return out;
             },
             "Metadata keys in file order.")
        .def("value", [](const GGUFFile &f, const std::string &key) { return to_py(lookup(f, key).value); },
             py::arg("key"), "The value of a metadata key (KeyError if absent).")
        .def("value_type",
             [](const GGUFFile &f, const std::string &key) {
                 return std::string(gguf_value_type_name(gguf_value_type(lookup(f, key).value)));
             },
             py::arg("key"))
        .def("array_type",
             [](const GGUFFile &f, const std::string &key) -> py::object {
                 const auto *a = std::get_if<GGUFArray>(&lookup(f, key).value);
                 if (!a) return py::none();
                 return py::str(std::string(gguf_value_type_name(a->elem_type)));
             },
             py::arg("key"), "Element type name of an array value; None for a scalar.")
        .def("tensor_infos",
             [](const GGUFFile &f) {
                 // (name, type_name, type_id, shape in GGML order, absolute offset, nbytes)
                 py::list out;
                 for (const auto &t : f.tensors()) {
                     py::tuple shape(t.n_dims);
                     for (uint32_t d = 0; d < t.n_dims; d++) shape[d] = py::int_(t.ne[d]);
                     out.append(py::make_tuple(py::str(t.name.data(), t.name.size()),
                                               std::string(ggml_type_name(t.type)), uint32_t(t.type), shape,
                                               t.offset, t.nbytes));
                 }
                 return out;
             })
        .def("tensor_data",
             [](py::object self, const std::string &name) {
                 const auto &f = self.cast<const GGUFFile &>();
                 const GGUFTensorInfo *t = f.find_tensor(name);
                 if (!t) throw py::key_error(name);
                 // Zero-copy view of the mapping; `self` is the base, so the mapping outlives it.
                 // The mapping is PROT_READ: the array must not be writeable.
                 py::array out(py::dtype("u1"), std::vector<py::ssize_t>{py::ssize_t(t->nbytes)},
                               std::vector<py::ssize_t>{1}, f.tensor_data(*t), self);
                 out.attr("setflags")(py::arg("write") = false);
                 return out;
             },
             py::arg("name"), "Read-only uint8 view of a tensor's raw bytes (no copy).");
}

}  // namespace ktd
