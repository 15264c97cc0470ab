#!/usr/bin/env bash
# The whole test suite on a fresh Debian machine: install what is missing, configure, build, test.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake --workflow --preset dev
