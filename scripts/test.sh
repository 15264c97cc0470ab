#!/usr/bin/env bash
# The whole test suite on a fresh Debian machine: install what is missing, then
#   1. the dev preset: configure, build (warnings as errors), run every test;
#   2. the asan preset: the memory-safety tests (bad input, safetensors, kernels, edge cases) again under
#      AddressSanitizer + UndefinedBehaviorSanitizer;
#   3. the tsan preset (clang): the thread runtime and concurrent-callers tests under
#      ThreadSanitizer;
#   4. libFuzzer on the safetensors reader, each target for C2F_FUZZ_SECONDS seconds (default 45 here).
#
#   scripts/test.sh [--quick]     --quick runs step 1 only (for local iteration; CI runs everything)
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
[ "${1:-}" = "--quick" ] && quick=1

scripts/install-deps.sh
cmake --workflow --preset dev
# The Python suite is one ctest (python.pytest): its own counts, for the log.
grep -hE "^(=+ )?[0-9]+ (passed|failed|skipped).* in [0-9.]+s" build/dev/Testing/Temporary/LastTest.log 2>/dev/null |
  sed 's/^/python.pytest: /' || true
if [ "$quick" = 0 ]; then
  cmake --workflow --preset asan
  cmake --workflow --preset tsan
  C2F_FUZZ_SECONDS="${C2F_FUZZ_SECONDS:-45}" tests/fuzz/run.sh
fi
