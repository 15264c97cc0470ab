// c2f — StateDict: named tensors with dtype and shape, as in `torch.nn.Module.state_dict()`.
#pragma once

#include "c2f/core.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "c2f stores tensors little-endian (the safetensors byte order) and supports little-endian hosts only"
#endif

namespace c2f {

/// Element types of the safetensors format (byte-sized ones).
enum class DType : std::uint8_t { BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, F16, BF16, I32, U32, F32, I64, U64, F64 };

/// Size in bytes of one element.
inline std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::BOOL:
    case DType::U8:
    case DType::I8:
    case DType::F8_E5M2:
    case DType::F8_E4M3:
      return 1;
    case DType::I16:
    case DType::U16:
    case DType::F16:
    case DType::BF16:
      return 2;
    case DType::I32:
    case DType::U32:
    case DType::F32:
      return 4;
    case DType::I64:
    case DType::U64:
    case DType::F64:
      return 8;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::BOOL:
      return "BOOL";
    case DType::U8:
      return "U8";
    case DType::I8:
      return "I8";
    case DType::F8_E5M2:
      return "F8_E5M2";
    case DType::F8_E4M3:
      return "F8_E4M3";
    case DType::I16:
      return "I16";
    case DType::U16:
      return "U16";
    case DType::F16:
      return "F16";
    case DType::BF16:
      return "BF16";
    case DType::I32:
      return "I32";
    case DType::U32:
      return "U32";
    case DType::F32:
      return "F32";
    case DType::I64:
      return "I64";
    case DType::U64:
      return "U64";
    case DType::F64:
      return "F64";
  }
  return "?";
}

/// Parses a safetensors dtype name ("F32", "BF16", ...); std::nullopt when unknown.
inline std::optional<DType> dtype_from_name(std::string_view name) {
  static constexpr DType all[] = {DType::BOOL, DType::U8,  DType::I8,  DType::F8_E5M2, DType::F8_E4M3,
                                  DType::I16,  DType::U16, DType::F16, DType::BF16,    DType::I32,
                                  DType::U32,  DType::F32, DType::I64, DType::U64,     DType::F64};
  for (DType t : all) {
    if (name == dtype_name(t)) return t;
  }
  return std::nullopt;
}

template <class Scalar>
constexpr DType dtype_of() {
  detail::check_scalar<Scalar>();
  return std::is_same<Scalar, float>::value ? DType::F32 : DType::F64;
}

namespace detail {
/// Product of `shape`, formed left to right as the reference reader does, or std::nullopt when a size is
/// negative or a partial product overflows `limit`.
inline std::optional<std::uint64_t> checked_numel(const std::vector<std::int64_t>& shape,
                                                  std::uint64_t limit = std::numeric_limits<std::uint64_t>::max()) {
  std::uint64_t n = 1;
  for (std::int64_t d : shape) {
    if (d < 0) return std::nullopt;
    const auto ud = static_cast<std::uint64_t>(d);
    if (ud != 0 && n > limit / ud) return std::nullopt;
    n *= ud;
  }
  return n;
}
}  // namespace detail

/// One tensor of a state dict: dtype, shape and little-endian bytes (row-major, contiguous).
class TensorData {
 public:
  /// An empty F32 tensor of shape [0].
  TensorData() = default;

  /// Takes ownership of `bytes`; throws std::invalid_argument when the byte count does not equal
  /// numel(shape) × dtype_size(dtype).
  TensorData(DType dtype, std::vector<std::int64_t> shape, std::vector<std::uint8_t> bytes)
      : dtype_(dtype), shape_(std::move(shape)), bytes_(std::move(bytes)) {
    // The element count, then the byte count, each within 64 bits ([2^63 − 1, 0] holds 0 elements).
    const std::optional<std::uint64_t> n = detail::checked_numel(shape_);
    if (!n || *n > std::numeric_limits<std::uint64_t>::max() / dtype_size(dtype_)) {
      detail::fail("tensor shape ", detail::shape_string(shape_), " is negative or overflows");
    }
    if (*n * dtype_size(dtype_) != bytes_.size()) {
      detail::fail("tensor of dtype ", dtype_name(dtype_), " and shape ", detail::shape_string(shape_), " needs ",
                   *n * dtype_size(dtype_), " bytes, got ", bytes_.size());
    }
  }

  /// Copies `numel(shape)` values of a float/double array into a new F32/F64 tensor.
  template <class Scalar>
  static TensorData from_values(const Scalar* values, std::vector<std::int64_t> shape) {
    const std::optional<std::uint64_t> n = detail::checked_numel(shape);
    if (!n) detail::fail("tensor shape ", detail::shape_string(shape), " is negative or overflows");
    std::vector<std::uint8_t> bytes(static_cast<std::size_t>(*n) * sizeof(Scalar));
    if (!bytes.empty()) std::memcpy(bytes.data(), values, bytes.size());
    return TensorData(dtype_of<Scalar>(), std::move(shape), std::move(bytes));
  }

  DType dtype() const { return dtype_; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  const std::vector<std::uint8_t>& bytes() const { return bytes_; }
  std::int64_t numel() const { return static_cast<std::int64_t>(bytes_.size() / dtype_size(dtype_)); }

  /// Converts the elements to `Scalar` (float or double). F16 and BF16 widen exactly; F64 → float
  /// rounds to nearest. Any other dtype throws std::invalid_argument.
  template <class Scalar>
  void copy_to(Scalar* out) const {
    detail::check_scalar<Scalar>();
    const std::int64_t n = numel();
    const std::uint8_t* p = bytes_.data();
    switch (dtype_) {
      case DType::F32:
        convert<float>(p, n, out, [](float v) { return v; });
        break;
      case DType::F64:
        convert<double>(p, n, out, [](double v) { return v; });
        break;
      case DType::F16:
        convert<std::uint16_t>(
            p, n, out, [](std::uint16_t b) { return static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(b)); });
        break;
      case DType::BF16:
        convert<std::uint16_t>(
            p, n, out, [](std::uint16_t b) { return static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(b)); });
        break;
      default:
        detail::fail("cannot convert a tensor of dtype ", dtype_name(dtype_),
                     " to a floating-point scalar (supported: F16, BF16, F32, F64)");
    }
  }

  template <class Scalar>
  std::vector<Scalar> to_vector() const {
    std::vector<Scalar> out(static_cast<std::size_t>(numel()));
    copy_to(out.data());
    return out;
  }

 private:
  template <class Stored, class Out, class Fn>
  static void convert(const std::uint8_t* p, std::int64_t n, Out* out, Fn fn) {
    for (std::int64_t i = 0; i < n; ++i) {
      Stored s;
      std::memcpy(&s, p + i * static_cast<std::int64_t>(sizeof(Stored)), sizeof(Stored));
      out[i] = static_cast<Out>(fn(s));
    }
  }

  DType dtype_ = DType::F32;
  std::vector<std::int64_t> shape_{0};  // a default tensor is empty: shape [0], no bytes
  std::vector<std::uint8_t> bytes_;
};

/// Name → tensor, ordered by name, plus the optional safetensors `__metadata__` string map.
class StateDict {
 public:
  using Map = std::map<std::string, TensorData, std::less<>>;

  /// Inserts or replaces `name`.
  void set(std::string name, TensorData tensor) { tensors_[std::move(name)] = std::move(tensor); }

  bool contains(std::string_view name) const { return tensors_.find(name) != tensors_.end(); }

  /// The tensor called `name`; throws std::invalid_argument naming it when absent.
  const TensorData& at(std::string_view name) const {
    auto it = tensors_.find(name);
    if (it == tensors_.end()) detail::fail("state dict has no tensor named '", name, "'");
    return it->second;
  }

  std::size_t size() const { return tensors_.size(); }
  bool empty() const { return tensors_.empty(); }
  Map::const_iterator begin() const { return tensors_.begin(); }
  Map::const_iterator end() const { return tensors_.end(); }

  /// Names that start with `prefix`, in order.
  std::vector<std::string> keys(std::string_view prefix = "") const {
    std::vector<std::string> out;
    for (auto it = tensors_.lower_bound(prefix); it != tensors_.end(); ++it) {
      if (it->first.compare(0, prefix.size(), prefix) != 0) break;
      out.push_back(it->first);
    }
    return out;
  }

  /// Copies every tensor of `other` in, each name prefixed with `prefix`.
  void merge(const StateDict& other, std::string_view prefix = "") {
    for (const auto& [name, t] : other) set(std::string(prefix) + name, t);
  }

  std::map<std::string, std::string>& metadata() { return metadata_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  Map tensors_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace c2f
