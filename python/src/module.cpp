// c2f python — the extension module c2f._c2f: the layers in float32 and float64 (layers_float*.cpp), state
// dicts and safetensors files as dicts of numpy arrays, the thread runtime, c2f.keep() for masks whose
// True means "may attend", and the debug switches the tests use. python/c2f/__init__.py is the public
// face (c2f.MultiHeadAttention(..., dtype=...)).
#include "c2f/io/safetensors.hpp"
#include "layers.hpp"

#include <pybind11/stl.h>

#include <cstring>
#include <map>
#include <string>

namespace c2f_py {
namespace {

struct DTypeName {
  c2f::DType dtype;
  const char* numpy;
};
// numpy's name of each safetensors dtype numpy has (BF16 is read as float32; F8 is refused).
constexpr DTypeName kDTypes[] = {
    {c2f::DType::BOOL, "bool"}, {c2f::DType::U8, "uint8"},   {c2f::DType::I8, "int8"},
    {c2f::DType::I16, "int16"}, {c2f::DType::U16, "uint16"}, {c2f::DType::F16, "float16"},
    {c2f::DType::I32, "int32"}, {c2f::DType::U32, "uint32"}, {c2f::DType::F32, "float32"},
    {c2f::DType::I64, "int64"}, {c2f::DType::U64, "uint64"}, {c2f::DType::F64, "float64"},
};

py::array tensor_to_numpy(const std::string& name, const c2f::TensorData& t) {
  const std::vector<py::ssize_t> shape(t.shape().begin(), t.shape().end());
  if (t.dtype() == c2f::DType::BF16) {
    py::array_t<float> a(shape);
    t.copy_to(a.mutable_data());
    return std::move(a);
  }
  for (const DTypeName& d : kDTypes) {
    if (d.dtype != t.dtype()) continue;
    py::array a(py::dtype(d.numpy), shape);
    if (!t.bytes().empty()) std::memcpy(a.mutable_data(), t.bytes().data(), t.bytes().size());
    return a;
  }
  throw py::value_error("c2f: tensor '" + name + "' has dtype " + c2f::dtype_name(t.dtype()) +
                        ", which numpy has no type for");
}

}  // namespace

py::dict to_dict(const c2f::StateDict& sd) {
  py::dict d;
  for (const auto& [name, t] : sd) d[py::str(name)] = tensor_to_numpy(name, t);
  return d;
}

c2f::StateDict from_mapping(py::handle mapping) {
  if (!py::hasattr(mapping, "items")) {
    throw py::type_error("state_dict: expected a dict of arrays (e.g. module.state_dict()), got " + type_name(mapping));
  }
  c2f::StateDict sd;
  for (py::handle item : mapping.attr("items")()) {
    const py::tuple kv = py::reinterpret_borrow<py::tuple>(item);
    if (!py::isinstance<py::str>(kv[0])) {
      throw py::type_error("state_dict: keys must be str, got " + type_name(kv[0]));
    }
    const std::string key = kv[0].cast<std::string>(), what = "state_dict['" + key + "']";
    py::object value = py::reinterpret_borrow<py::object>(kv[1]);
    if (py::hasattr(value, "detach")) value = value.attr("detach")();  // a torch parameter
    bool bf16 = false;
    if (py::hasattr(value, "dtype") && std::string(py::str(value.attr("dtype"))) == "torch.bfloat16") {
      value = value.attr("contiguous")().attr("view")(py::module_::import("torch").attr("int16"));
      bf16 = true;
    }
    const py::array a = py::array::ensure(as_array(value, what, "an array"), py::array::c_style);
    const std::string dtype = py::str(a.dtype());
    c2f::DType t = c2f::DType::BF16;
    bool known = bf16;
    for (const DTypeName& d : kDTypes) {
      if (!known && dtype == d.numpy) {
        t = d.dtype;
        known = true;
      }
    }
    if (!known) throw py::type_error(what + ": a tensor of dtype " + dtype + ", which safetensors has no type for");
    std::vector<std::int64_t> shape(a.shape(), a.shape() + a.ndim());
    const auto* p = static_cast<const std::uint8_t*>(a.data());
    sd.set(key, c2f::TensorData(t, std::move(shape), std::vector<std::uint8_t>(p, p + a.nbytes())));
  }
  return sd;
}

/// An unreadable or unwritable file is an OSError (a malformed one a ValueError, from SafetensorsError).
template <class Fn>
decltype(auto) file_errors(Fn&& fn) {
  try {
    return fn();
  } catch (const std::invalid_argument&) {
    throw;
  } catch (const std::runtime_error& e) {
    PyErr_SetString(PyExc_OSError, e.what());
    throw py::error_already_set();
  }
}

}  // namespace c2f_py

PYBIND11_MODULE(_c2f, m) {
  namespace py = pybind11;
  using namespace c2f_py;
  m.doc() = "c2f's attention layers (C++, Eigen) from Python: see docs/python.md";
#ifdef C2F_VERSION
  m.attr("__version__") = C2F_VERSION;
#endif

  py::class_<KeepMask>(m, "KeepMask", "a boolean mask whose True means 'may attend' (c2f.keep)")
      .def_readonly("mask", &KeepMask::mask);
  m.def(
      "keep", [](py::object mask) { return KeepMask{std::move(mask)}; }, py::arg("mask"),
      "marks a bool mask as True = may attend (SDPA's and the coarse-to-fine article's convention); a plain bool "
      "mask follows nn.MultiheadAttention: True = masked out");

  m.def(
      "load_safetensors",
      [](const std::string& path) { return to_dict(file_errors([&] { return c2f::load_safetensors(path); })); },
      py::arg("path"), "a safetensors file as a dict name → numpy array (BF16 read as float32)");
  m.def(
      "load_safetensors_metadata",
      [](const std::string& path) { return file_errors([&] { return c2f::load_safetensors(path).metadata(); }); },
      py::arg("path"), "the __metadata__ string map of a safetensors file");
  m.def(
      "save_safetensors",
      [](const std::string& path, py::handle tensors, const std::map<std::string, std::string>& metadata) {
        c2f::StateDict sd = from_mapping(tensors);
        sd.metadata() = metadata;
        file_errors([&] { c2f::save_safetensors(path, sd); });
      },
      py::arg("path"), py::arg("tensors"), py::arg("metadata") = std::map<std::string, std::string>(),
      "writes a dict of arrays or tensors (and a str → str metadata map) as a safetensors file");

  m.def("get_num_threads", &c2f::get_num_threads,
        "the most threads one c2f call uses (C2F_NUM_THREADS, else the CPUs)");
  m.def(
      "set_num_threads", [](int n) { c2f::set_num_threads(n); }, py::arg("n"),
      "sets get_num_threads() for the process (0 restores the default); a layer's num_threads caps it further");

  m.def(
      "set_bf16_engine",
      [](const std::string& name) {
        try {
          c2f::set_bf16_engine(c2f::detail::parse_bf16_engine(name, "set_bf16_engine"));
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
      },
      py::arg("engine"),
      "runs compute='bfloat16' products on 'auto', 'fallback', 'dot' (AVX512_BF16) or 'tiles' (AMX); "
      "ValueError for a name that is none or an engine this CPU lacks");
  m.def(
      "get_bf16_engine", [] { return std::string(c2f::bf16_engine_name(c2f::get_bf16_engine())); },
      "the engine asked for ('auto' unless set_bf16_engine or C2F_BF16_ENGINE named one)");
  m.def(
      "bf16_engine", [] { return std::string(c2f::bf16_engine_name(c2f::bf16_engine())); },
      "the engine bfloat16 products run on now: 'fallback', 'dot' or 'tiles'");

  py::module_ dbg = m.def_submodule("_debug", "switches the tests use to show that a property's test can fail");
  dbg.def(
      "set_force_copy", [](bool on) { debug().force_copy = on; }, "copy every input (breaks zero-copy)");
  dbg.def(
      "set_hold_gil", [](bool on) { debug().hold_gil = on; }, "keep the GIL during forward and decode");
  dbg.def(
      "last_input_address", [] { return debug().last_input.load(); },
      "the data address of the last input array a layer read");

  bind_layers<float>(m);
  bind_layers<double>(m);
}
