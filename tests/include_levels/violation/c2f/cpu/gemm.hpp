// A micro-kernel that includes the mask vocabulary, a level above it: refused.
#pragma once
#include "c2f/mask.hpp"
