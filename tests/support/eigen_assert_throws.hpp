// Included first by every test translation unit: makes Eigen's internal assertions throw, so a
// shape bug inside c2f fails the test with a message instead of aborting the whole binary.
#pragma once

#include <stdexcept>

#ifdef eigen_assert
#error "eigen_assert_throws.hpp must be included before any Eigen header"
#endif
#define eigen_assert(x)                                           \
  do {                                                            \
    if (!(x)) throw std::logic_error("eigen_assert failed: " #x); \
  } while (false)
