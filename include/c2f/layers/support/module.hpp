// c2f — what every layer shares: strict state-dict loading and saving around the layer's own
// load(loader, name) / save(state_dict, name).
#pragma once

#include "c2f/layers/support/state_loader.hpp"

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

namespace c2f {
namespace detail {

/// A number no other layer object or parameter state has had in this process (never 0).
inline std::uint64_t fresh_parameters_id() {
  static std::atomic<std::uint64_t> next{1};
  return next.fetch_add(1, std::memory_order_relaxed);
}

/// CRTP base: Derived provides either
///   void load(StrictLoader&, const std::string& name)      (name relative to the loader's prefix)
///   void save(StateDict&, const std::string& name) const  (name is the full prefix of its keys)
/// or, for a layer made of named submodules (PyTorch's named_children), only
///   template <class Self, class Fn> static void children(Self& self, Fn&& fn)
/// calling fn("child_name.", self.child_) for each child, which serves both load and save.
/// Every module object has a parameters_id(): new for each object (a copy or move too) and after each
/// load_state_dict (an optimizer's step loads), so that backward() can refuse a saved state that another
/// object, or these parameters before they changed, made.
template <class Derived>
class Module {
 public:
  /// Loads every child under name + its child name.
  void load(StrictLoader& loader, const std::string& name) {
    Derived::children(static_cast<Derived&>(*this),
                      [&](const char* child, auto& module) { module.load(loader, name + child); });
  }
  /// Saves every child under name + its child name.
  void save(StateDict& sd, const std::string& name) const {
    Derived::children(static_cast<const Derived&>(*this),
                      [&](const char* child, const auto& module) { module.save(sd, name + child); });
  }
  /// Sets `own`, the layer's options, to n worker threads and every child too.
  template <class Options>
  void set_num_threads_of(Options& own, int n) {
    own.num_threads(n);
    Derived::children(static_cast<Derived&>(*this), [&](const char*, auto& module) { module.set_num_threads(n); });
  }

  /// Initialises child i (in the order children() names them) afresh from seed + i.
  void reset_parameters(std::uint64_t seed) {
    std::uint64_t i = 0;
    Derived::children(static_cast<Derived&>(*this),
                      [&](const char*, auto& module) { module.reset_parameters(seed + i++); });
  }

  /// Strict load (PyTorch's strict=True): a missing key, a wrong shape, a dtype that is not floating
  /// point, or an unexpected key under `prefix` throws std::invalid_argument naming the layer and the
  /// key. All or nothing: the tensors are read into a copy of the layer, which replaces it only when
  /// every key, shape and dtype checked out — a failed load leaves the layer as it was (at the cost of
  /// its weights held twice during the load). "name" and "name." are the same prefix.
  void load_state_dict(const StateDict& sd, std::string_view prefix = "") {
    with_layer_name(Derived::type_name, [&] {
      Derived staged = static_cast<const Derived&>(*this);
      StrictLoader loader(sd, prefix);
      staged.load(loader, "");
      loader.finish();
      static_cast<Derived&>(*this) = std::move(staged);  // a new parameters_id() (operator=)
    });
  }

  /// This object's current parameters: see the class comment.
  std::uint64_t parameters_id() const { return parameters_id_; }

  /// PyTorch's names under `prefix`, F32 or F64 as the layer's Scalar.
  StateDict state_dict(std::string_view prefix = "") const {
    StateDict sd;
    static_cast<const Derived&>(*this).save(sd, normalize_prefix(prefix));
    return sd;
  }

 protected:
  Module() = default;
  Module(const Module&) {}
  Module(Module&&) noexcept {}
  Module& operator=(const Module&) {
    parameters_id_ = fresh_parameters_id();
    return *this;
  }
  Module& operator=(Module&&) noexcept {
    parameters_id_ = fresh_parameters_id();
    return *this;
  }
  ~Module() = default;

 private:
  std::uint64_t parameters_id_ = fresh_parameters_id();
};

}  // namespace detail
}  // namespace c2f
