#!/usr/bin/env bash
# Runs check_fixtures.py under a Python that has torch (Debian's python3-torch lives in /usr/bin's
# python3; a pyenv/venv python3 earlier on PATH may lack it). Exit 77 = skipped (no torch anywhere).
here="$(cd "$(dirname "$0")" && pwd)"
for py in /usr/bin/python3 python3; do
  if command -v "$py" >/dev/null 2>&1 && "$py" -c "import torch, numpy" >/dev/null 2>&1; then
    exec "$py" "$here/check_fixtures.py" "$@"
  fi
done
echo "SKIPPED: no python3 with torch and numpy found (install python3-torch python3-numpy)"
exit 77
