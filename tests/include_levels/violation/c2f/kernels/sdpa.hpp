// A kernel that includes a layer: scripts/check_include_levels.py must refuse it (ctest
// docs.include_levels_catches_violation).
#pragma once
#include "c2f/layers/linear.hpp"
