// c2f python — what every binding converts: arrays in (zero-copy when C-contiguous), arrays out (numpy
// arrays over the C++ result, no copy), masks, option values, and the errors of bad input (TypeError
// naming what was expected and what was given). Layer-independent; bind_layer.hpp binds the layers on it.
#pragma once

#include "c2f/c2f.hpp"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace c2f_py {

namespace py = pybind11;
using c2f::Index;

/// A C-contiguous array of S: what the C++ layers read in place.
template <class S>
using Array = py::array_t<S, py::array::c_style>;

/// Switches for the tests that prove a property by breaking it (python/tests): force_copy copies every
/// input (the zero-copy test must then fail), hold_gil keeps the GIL during forward and decode (the
/// two-threads test must then fail). last_input is the data address of the last input a layer read.
struct Debug {
  std::atomic<bool> force_copy{false};
  std::atomic<bool> hold_gil{false};
  std::atomic<std::uintptr_t> last_input{0};
};
inline Debug& debug() {
  static Debug d;
  return d;
}

/// fn() with the GIL released (unless Debug::hold_gil): Python threads calling c2f run in parallel.
template <class Fn>
decltype(auto) without_gil(Fn&& fn) {
  if (debug().hold_gil.load(std::memory_order_relaxed)) return fn();
  py::gil_scoped_release release;
  return fn();
}

inline std::string type_name(py::handle obj) { return Py_TYPE(obj.ptr())->tp_name; }

template <class S>
constexpr const char* dtype_name() {
  return std::is_same<S, float>::value ? "float32" : "float64";
}

/// "a 2-D float64 array of shape (5, 8)" for an array, else the type's name.
inline std::string describe(py::handle obj) {
  if (!py::isinstance<py::array>(obj)) return type_name(obj);
  const py::array a = py::reinterpret_borrow<py::array>(obj);
  return "a " + std::to_string(a.ndim()) + "-D " + std::string(py::str(a.dtype())) + " array of shape " +
         std::string(py::str(py::tuple(a.attr("shape"))));
}

/// obj as a numpy array: itself, or numpy.asarray(obj) — no copy for a torch CPU tensor (Tensor.__array__
/// shares its memory) or anything with the buffer protocol or __array_interface__. What numpy cannot
/// take (a tensor that requires grad, on another device, a string) is a TypeError naming `what`.
inline py::array as_array(py::handle obj, const std::string& what, const std::string& expected) {
  if (py::isinstance<py::array>(obj)) return py::reinterpret_borrow<py::array>(obj);
  if (obj.is_none()) throw py::type_error(what + ": expected " + expected + ", got None");
  static py::object* asarray = new py::object(py::module_::import("numpy").attr("asarray"));  // never freed: no
  try {                                                                                       // teardown order
    return (*asarray)(obj);
  } catch (py::error_already_set& e) {
    throw py::type_error(what + ": expected " + expected + " (a numpy array or a torch CPU tensor), got " +
                         type_name(obj) + ", which numpy cannot read: " + e.what());
  }
}

/// `obj` as a C-contiguous array of S with `ndim` dimensions named `dims` (e.g. "[batch, seq, features]"):
/// the same memory when it already is one, else one copy (another layout). A wrong dtype or ndim is a
/// TypeError naming the expected and the given.
template <class S>
Array<S> input(py::handle obj, const std::string& what, int ndim, const char* dims) {
  const std::string expected = "a " + std::to_string(ndim) + "-D " + dtype_name<S>() + " array " + dims;
  py::array a = as_array(obj, what, expected);
  if (!py::array_t<S>::check_(a)) {
    throw py::type_error(what + ": expected " + expected + ", got " + describe(a) +
                         " (c2f converts no dtype: convert it, or build the layer with dtype='" +
                         std::string(py::str(a.dtype())) + "')");
  }
  if (a.ndim() != ndim) throw py::type_error(what + ": expected " + expected + ", got " + describe(a));
  if (!Array<S>::check_(a) && a.nbytes() > c2f::detail::kMaxBufferBytes) {  // e.g. a broadcast view of huge sizes
    throw py::value_error(what + ": a C-contiguous copy of " + describe(a) + " needs " + std::to_string(a.nbytes()) +
                          " bytes, more than the 1 TiB (2^40 bytes) c2f allocates at most");
  }
  Array<S> c = Array<S>::check_(a) ? py::reinterpret_borrow<Array<S>>(a) : Array<S>::ensure(a);
  if (debug().force_copy.load(std::memory_order_relaxed)) c = Array<S>::ensure(c.attr("copy")());
  debug().last_input.store(reinterpret_cast<std::uintptr_t>(c.data()), std::memory_order_relaxed);
  return c;
}

/// An input of `Rank` dimensions, held for the call, and the C++ view of it.
template <class S, int Rank>
struct In {
  In(py::handle obj, const std::string& what, const char* dims) : array(input<S>(obj, what, Rank, dims)) {}
  c2f::ConstTensorRef<S, Rank> view() const {
    std::array<Index, Rank> d{};
    for (int i = 0; i < Rank; ++i) d[static_cast<std::size_t>(i)] = array.shape(i);
    return c2f::ConstTensorRef<S, Rank>(array.data(), d);
  }
  Array<S> array;
};

/// `t` as a numpy array over the same memory: t moved to the heap, owned by the array's base.
template <class S, class Owned>
py::array owned_array(Owned&& t) {
  using T = std::decay_t<Owned>;
  auto* owned = new T(std::move(t));
  py::capsule base(owned, [](void* p) { delete static_cast<T*>(p); });
  std::vector<py::ssize_t> shape(owned->dimensions().begin(), owned->dimensions().end());
  return py::array_t<S>(shape, owned->data(), base);
}
/// An Eigen tensor as a numpy array over the same memory.
template <class S, int Rank>
py::array to_numpy(Eigen::Tensor<S, Rank, Eigen::RowMajor>&& t) {
  return owned_array<S>(std::move(t));
}
/// A layer's output as a numpy array over the same memory: its buffer goes back to c2f's scratch cache
/// when the array dies (c2f/output.hpp).
template <class S, int Rank>
py::array to_numpy(c2f::Output<S, Rank>&& t) {
  return owned_array<S>(std::move(t));
}

// ------------------------------------------------------------------------------------------------
// Masks: what torch accepts — bool arrays (True = masked out, nn.MultiheadAttention's convention; wrapped
// in c2f.keep(...): True = may attend), uint8 as bool, float arrays (added to the scores) — plus causal.

/// c2f.keep(mask): a boolean mask whose True means "may attend" (SDPA's and the coarse-to-fine article's
/// convention).
struct KeepMask {
  py::object mask;
};

/// The mask `obj` as [n, queries, keys] (leading dimensions flattened into n, so torch's [B·H, L, S] and
/// the article's fine mask [B, m, k, k] both fit) or as [batch, keys] (rank2 = true: key padding).
struct MaskArray {
  py::array array;
  bool keep = false;
  std::array<Index, 3> dims{};
  bool is_bool() const { return array.dtype().kind() == 'b' || (array.dtype().kind() == 'u' && array.itemsize() == 1); }
};

inline MaskArray mask_array(py::handle obj, const std::string& what, bool rank2) {
  MaskArray m;
  py::handle raw = obj;
  if (py::isinstance<KeepMask>(obj)) {
    m.keep = true;
    raw = obj.cast<const KeepMask&>().mask;
  }
  const char* expected =
      rank2 ? "a 2-D bool or float array [batch, keys]" : "a bool or float array [queries, keys] or [n, queries, keys]";
  m.array = as_array(raw, what, expected);
  const char kind = m.array.dtype().kind();
  if (!m.is_bool() && kind != 'f') {
    throw py::type_error(what + ": expected " + std::string(expected) + ", got " + describe(m.array));
  }
  if (m.keep && !m.is_bool()) throw py::type_error(what + ": c2f.keep() takes a bool mask, got " + describe(m.array));
  const py::ssize_t nd = m.array.ndim();
  if (rank2 ? nd != 2 : nd < 2) {
    throw py::type_error(what + ": expected " + std::string(expected) + ", got " + describe(m.array));
  }
  Index n = 1;
  for (py::ssize_t i = 0; i + 2 < nd; ++i) n *= m.array.shape(i);
  m.dims = {n, m.array.shape(nd - 2), m.array.shape(nd - 1)};
  c2f::detail::check_buffer_of<double>(what.c_str(), {m.dims[0], m.dims[1], m.dims[2]});  // before the copies
  return m;
}

/// The mask's values as an Eigen tensor of `dims` (a copy: the mask classes keep their own).
template <class T, int Rank>
Eigen::Tensor<T, Rank, Eigen::RowMajor> mask_values(const MaskArray& m, const std::array<Index, Rank>& dims) {
  Eigen::Tensor<T, Rank, Eigen::RowMajor> t(dims);
  if constexpr (std::is_same<T, bool>::value) {
    const auto flags = py::array_t<std::uint8_t, py::array::c_style | py::array::forcecast>::ensure(m.array);
    for (Index i = 0; i < t.size(); ++i) t.data()[i] = flags.data()[i] != 0;
  } else {
    const auto values = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(m.array);
    std::copy(values.data(), values.data() + t.size(), t.data());
  }
  return t;
}

template <class S>
c2f::AttnMask<S> attn_mask(py::handle obj, const std::string& what) {
  if (obj.is_none()) return {};
  const MaskArray m = mask_array(obj, what, false);
  if (!m.is_bool()) return c2f::AttnMask<S>::additive(mask_values<S, 3>(m, m.dims));
  const c2f::BoolTensor3 flags = mask_values<bool, 3>(m, m.dims);
  return m.keep ? c2f::AttnMask<S>::keep(flags) : c2f::AttnMask<S>::ignore(flags);
}

template <class S>
c2f::KeyPaddingMask<S> key_padding_mask(py::handle obj, const std::string& what) {
  if (obj.is_none()) return {};
  const MaskArray m = mask_array(obj, what, true);
  const std::array<Index, 2> dims{m.dims[1], m.dims[2]};
  if (!m.is_bool()) return c2f::KeyPaddingMask<S>::additive(mask_values<S, 2>(m, dims));
  const c2f::BoolTensor2 flags = mask_values<bool, 2>(m, dims);
  return m.keep ? c2f::KeyPaddingMask<S>::keep(flags) : c2f::KeyPaddingMask<S>::ignore(flags);
}

/// The mask keywords of a forward call, as c2f::Masks. causal=True is the attention mask
/// AttnMask::causal() (given alone). A field the layer does not take is refused by the layer itself
/// (ValueError naming it), as in C++.
template <class S>
c2f::Masks<S> masks(const char* layer, py::handle attn, py::handle padding, py::handle fine, bool causal) {
  const std::string name(layer);
  c2f::Masks<S> m;
  if (causal && !attn.is_none()) {
    throw py::value_error(name + ": give attn_mask or causal=True, not both");
  }
  m.attn_mask(causal ? c2f::AttnMask<S>::causal() : attn_mask<S>(attn, name + ": attn_mask"));
  m.key_padding_mask(key_padding_mask<S>(padding, name + ": key_padding_mask"));
  m.fine_attn_mask(attn_mask<S>(fine, name + ": fine_attn_mask"));
  return m;
}

// ------------------------------------------------------------------------------------------------
// Option and size values from Python: ints, bools, and the enums by name.

inline long long integer(py::handle v, const std::string& what) {
  if (PyBool_Check(v.ptr()) || !PyIndex_Check(v.ptr())) {
    throw py::type_error(what + " must be an int, got " + type_name(v));
  }
  const py::object i = py::reinterpret_steal<py::object>(PyNumber_Index(v.ptr()));
  if (!i) throw py::error_already_set();
  int overflow = 0;
  const long long r = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (overflow != 0) throw py::value_error(what + " is out of range: " + std::string(py::str(v)));
  return r;
}

template <class T>
struct EnumNames;  // {value, name} of an option enum
template <>
struct EnumNames<c2f::AttnKernel> {
  static constexpr std::pair<c2f::AttnKernel, const char*> values[] = {{c2f::AttnKernel::Streaming, "streaming"},
                                                                       {c2f::AttnKernel::Naive, "naive"}};
};
template <>
struct EnumNames<c2f::Compute> {
  static constexpr std::pair<c2f::Compute, const char*> values[] = {{c2f::Compute::Float32, "float32"},
                                                                    {c2f::Compute::BFloat16, "bfloat16"}};
};
template <>
struct EnumNames<c2f::FinePath> {
  static constexpr std::pair<c2f::FinePath, const char*> values[] = {
      {c2f::FinePath::Auto, "auto"}, {c2f::FinePath::Folded, "folded"}, {c2f::FinePath::General, "general"}};
};
template <>
struct EnumNames<c2f::Gating> {
  static constexpr std::pair<c2f::Gating, const char*> values[] = {
      {c2f::Gating::Auto, "auto"}, {c2f::Gating::PerChunk, "per_chunk"}, {c2f::Gating::PerToken, "per_token"}};
};

template <class T, class = void>
struct IsNamedEnum : std::false_type {};
template <class T>
struct IsNamedEnum<T, std::void_t<decltype(EnumNames<T>::values)>> : std::true_type {};

/// A C++ option or size value from the Python value `v`; `what` names it in errors.
template <class T>
T from_py(py::handle v, const std::string& what) {
  if constexpr (std::is_same<T, bool>::value) {
    if (!PyBool_Check(v.ptr())) throw py::type_error(what + " must be a bool, got " + type_name(v));
    return v.ptr() == Py_True;
  } else if constexpr (IsNamedEnum<T>::value) {
    std::string names;
    for (const auto& [value, name] : EnumNames<T>::values)
      names += std::string(names.empty() ? "" : ", ") + "'" + name + "'";
    if (!py::isinstance<py::str>(v)) throw py::type_error(what + " must be one of " + names + ", got " + type_name(v));
    const std::string given = v.cast<std::string>();
    for (const auto& [value, name] : EnumNames<T>::values) {
      if (given == name) return value;
    }
    throw py::value_error(what + " must be one of " + names + ", got '" + given + "'");
  } else if constexpr (std::is_same<T, c2f::HMHALevels>::value) {
    // The reference module's levels=(1, 2, 3): the levels that are on.
    if (!py::isinstance<py::iterable>(v) || py::isinstance<py::str>(v)) {
      throw py::type_error(what + " must be a sequence of levels from (1, 2, 3), got " + type_name(v));
    }
    c2f::HMHALevels on{false, false, false};
    for (py::handle level : v) {
      switch (integer(level, what + " entry")) {
        case 1:
          on.local = true;
          break;
        case 2:
          on.cross = true;
          break;
        case 3:
          on.global = true;
          break;
        default:
          throw py::value_error(what + " must hold levels from (1, 2, 3), got " + std::string(py::str(v)));
      }
    }
    return on;
  } else {
    static_assert(std::is_integral<T>::value, "an option type without a conversion");
    const long long i = integer(v, what);
    if (i < static_cast<long long>(std::numeric_limits<T>::min()) ||
        static_cast<unsigned long long>(i) > static_cast<unsigned long long>(std::numeric_limits<T>::max())) {
      throw py::value_error(what + " is out of range: " + std::to_string(i));
    }
    return static_cast<T>(i);
  }
}

/// The Python value of a C++ option (the inverse of from_py).
template <class T>
py::object to_py(const T& v) {
  if constexpr (IsNamedEnum<T>::value) {
    for (const auto& [value, name] : EnumNames<T>::values) {
      if (value == v) return py::str(name);
    }
    return py::none();
  } else if constexpr (std::is_same<T, c2f::HMHALevels>::value) {
    py::list on;
    if (v.local) on.append(1);
    if (v.cross) on.append(2);
    if (v.global) on.append(3);
    return py::tuple(on);
  } else {
    return py::cast(v);
  }
}

// ------------------------------------------------------------------------------------------------
// State dicts (defined in module.cpp: the same for every layer and dtype).

/// name → numpy array (a copy of each tensor; BF16 widened to float32, numpy has no bfloat16).
py::dict to_dict(const c2f::StateDict& sd);
/// A mapping name → array (numpy arrays, torch tensors — detached — or anything numpy.asarray takes).
c2f::StateDict from_mapping(py::handle mapping);

}  // namespace c2f_py
