// c2f's process-wide settings for one scope: each guard sets one setting and gives back the value it had
// when the scope ends — also when an ASSERT_* leaves the test early, so that no test leaks its threads,
// engine or cache limit into the tests after it.
//
//   const auto threads = c2f_test::scoped_threads(4);
#pragma once

#include "c2f/cpu/bf16_gemm.hpp"
#include "c2f/detail/scratch.hpp"
#include "c2f/runtime.hpp"

#include <cstddef>

namespace c2f_test {

/// Sets a setting through set(value) and restores get()'s value of before when it goes out of scope.
template <class T>
class SettingGuard {
 public:
  SettingGuard(T (*get)(), void (*set)(T), T value) : set_(set), saved_(get()) { set_(value); }
  SettingGuard(const SettingGuard&) = delete;
  SettingGuard& operator=(const SettingGuard&) = delete;
  ~SettingGuard() { set_(saved_); }

 private:
  void (*set_)(T);
  T saved_;
};

/// c2f::set_num_threads(n) for the scope.
inline SettingGuard<int> scoped_threads(int n) { return {c2f::get_num_threads, c2f::set_num_threads, n}; }
/// c2f::set_min_parallel_work(flop) for the scope.
inline SettingGuard<double> scoped_min_parallel_work(double flop) {
  return {c2f::get_min_parallel_work, c2f::set_min_parallel_work, flop};
}
/// c2f::set_bf16_engine(engine) for the scope.
inline SettingGuard<c2f::Bf16Engine> scoped_bf16_engine(c2f::Bf16Engine engine) {
  return {c2f::get_bf16_engine, c2f::set_bf16_engine, engine};
}
/// c2f::set_scratch_cache_limit(bytes) for the scope.
inline SettingGuard<std::size_t> scoped_scratch_cache_limit(std::size_t bytes) {
  return {c2f::scratch_cache_limit, c2f::set_scratch_cache_limit, bytes};
}

}  // namespace c2f_test
