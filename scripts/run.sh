#!/usr/bin/env bash
# The main job: install what is missing, build Release, and run the examples.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cmake --workflow --preset release
for example in build/release/examples/*; do
  if [ -x "$example" ] && [ -f "$example" ]; then
    echo "== $(basename "$example")"
    "$example"
  fi
done
