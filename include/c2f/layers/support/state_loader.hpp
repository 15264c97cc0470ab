// c2f — strict state-dict loading shared by every layer.
#pragma once

#include "c2f/state_dict.hpp"

#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace c2f {
namespace detail {

/// "mha" and "mha." both mean the prefix "mha."; "" stays "".
inline std::string normalize_prefix(std::string_view prefix) {
  std::string p(prefix);
  if (!p.empty() && p.back() != '.') p.push_back('.');
  return p;
}

/// Reads a layer's tensors out of a StateDict under a prefix and remembers which keys were used, so
/// that finish() can reject keys nobody asked for (PyTorch's strict=True).
class StrictLoader {
 public:
  StrictLoader(const StateDict& sd, std::string_view prefix) : sd_(sd), prefix_(normalize_prefix(prefix)) {}

  const std::string& prefix() const { return prefix_; }
  bool has(std::string_view name) const { return sd_.contains(prefix_ + std::string(name)); }

  /// Copies `name` (relative to the prefix) into `dst`: a vector for a 1-D shape, else a row-major
  /// matrix [shape[0], product of the other dimensions]. Throws naming the key when it is missing, has
  /// another shape, or has a dtype that is not floating point.
  template <class Derived>
  void read(std::string_view name, const std::vector<std::int64_t>& shape, Eigen::PlainObjectBase<Derived>& dst) {
    static_assert(Derived::IsRowMajor || Derived::ColsAtCompileTime == 1, "read() fills row-major data");
    const std::string key = prefix_ + std::string(name);
    if (!sd_.contains(key)) fail("missing key '", key, "' (expected shape ", shape_string(shape), ")");
    const TensorData& t = sd_.at(key);
    if (t.shape() != shape) {
      fail("key '", key, "' has shape ", shape_string(t.shape()), ", expected ", shape_string(shape));
    }
    if constexpr (Derived::ColsAtCompileTime == 1) {
      dst.resize(static_cast<Index>(shape.at(0)));
    } else {
      Index cols = 1;
      for (std::size_t i = 1; i < shape.size(); ++i) cols *= static_cast<Index>(shape[i]);
      dst.resize(static_cast<Index>(shape.at(0)), cols);
    }
    try {
      t.copy_to(dst.data());
    } catch (const std::invalid_argument& e) {
      fail("key '", key, "': ", e.what());
    }
    used_.insert(key);
  }

  /// Throws naming the first key under the prefix that no read() consumed.
  void finish() const {
    for (const std::string& key : sd_.keys(prefix_)) {
      if (used_.count(key) == 0) {
        fail("unexpected key '", key, "' in state dict", prefix_.empty() ? "" : " under prefix '", prefix_,
             prefix_.empty() ? "" : "'");
      }
    }
  }

 private:
  const StateDict& sd_;
  std::string prefix_;
  std::set<std::string> used_;
};

/// Adds a matrix or vector to a state dict as an F32/F64 tensor of the given shape.
template <class Derived>
void store(StateDict& sd, const std::string& key, const Eigen::PlainObjectBase<Derived>& src,
           std::vector<std::int64_t> shape) {
  static_assert(Derived::IsRowMajor || Derived::ColsAtCompileTime == 1, "store() writes row-major data");
  sd.set(key, TensorData::from_values(src.data(), std::move(shape)));
}

}  // namespace detail
}  // namespace c2f
