// c2f — what every layer shares: strict state-dict loading and saving around the layer's own
// load(loader, name) / save(state_dict, name).
#pragma once

#include "c2f/detail/state_loader.hpp"

#include <string_view>

namespace c2f {
namespace detail {

/// CRTP base: Derived provides
///   void load(StrictLoader&, const std::string& name)      (name relative to the loader's prefix)
///   void save(StateDict&, const std::string& name) const  (name is the full prefix of its keys)
template <class Derived>
class Module {
 public:
  /// Strict load (PyTorch's strict=True): a missing key, a wrong shape, a dtype that is not floating
  /// point, or an unexpected key under `prefix` throws std::invalid_argument naming the key.
  /// "name" and "name." are the same prefix.
  void load_state_dict(const StateDict& sd, std::string_view prefix = "") {
    StrictLoader loader(sd, prefix);
    static_cast<Derived&>(*this).load(loader, "");
    loader.finish();
  }

  /// PyTorch's names under `prefix`, F32 or F64 as the layer's Scalar.
  StateDict state_dict(std::string_view prefix = "") const {
    StateDict sd;
    static_cast<const Derived&>(*this).save(sd, normalize_prefix(prefix));
    return sd;
  }

 protected:
  Module() = default;
};

}  // namespace detail
}  // namespace c2f
