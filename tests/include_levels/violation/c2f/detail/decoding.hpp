// Runtime plumbing that includes a kernel-level header (the key/value cache) — as the decoding helpers
// once did from detail/: scripts/check_include_levels.py must refuse it.
#pragma once
#include "c2f/kv_cache.hpp"
