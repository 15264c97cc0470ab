// c2f — the option macros (PyTorch C++ keeps TORCH_ARG in its own torch/arg.h): a getter, a chainable
// setter and a private field per option. Used by c2f/options.hpp, the kernels' options and c2f::Masks.
#pragma once

/// Declares option `name` of type `T`: a getter `name()`, a chainable setter `name(value)` returning
/// the options object, and the private field `name_`, whose default follows:
///   C2F_ARG(bool, causal) = false;
#define C2F_ARG(T, name)                                   \
 public:                                                   \
  auto name(const T& new_##name)->decltype(*this) {        \
    this->name##_ = new_##name;                            \
    return *this;                                          \
  }                                                        \
  const T& name() const noexcept { return this->name##_; } \
                                                           \
 private:                                                  \
  T name##_

/// C2F_ARG for an option group shared by several options types (a base class template over the
/// options type `Derived`): the setter returns `Derived&`, so chains go on with Derived's setters.
#define C2F_SHARED_ARG(T, name)                            \
 public:                                                   \
  Derived& name(const T& new_##name) {                     \
    this->name##_ = new_##name;                            \
    return static_cast<Derived&>(*this);                   \
  }                                                        \
  const T& name() const noexcept { return this->name##_; } \
                                                           \
 private:                                                  \
  T name##_
