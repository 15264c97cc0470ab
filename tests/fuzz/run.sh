#!/usr/bin/env bash
# Builds the safetensors fuzz targets with clang++ (libFuzzer + ASan + UBSan) and runs each one for a
# while on a copy of the committed seed corpus.
#
#   tests/fuzz/run.sh                      # 60 s per target, build dir build/fuzz
#   C2F_FUZZ_SECONDS=600 tests/fuzz/run.sh
#   C2F_FUZZ_BUILD=/tmp/fuzz tests/fuzz/run.sh
#
# Environment: C2F_FUZZ_BUILD (build directory, default <repo>/build/fuzz; relative paths are taken
# from the repository root), C2F_FUZZ_SECONDS (seconds per target, default 60), C2F_FUZZ_CXX (the
# Clang C++ compiler, default clang++), C2F_FUZZ_JOBS (build parallelism, default 2).
#
# The working corpus lives in the build dir (<build>/corpus/<target>, seeded from tests/fuzz/corpus/
# and grown across runs); nothing is written into the repository. Exits non-zero when a target finds a
# crash, leak, timeout or out-of-memory input; the input is saved under <build>/artifacts/<target>/.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$repo"
fuzz_src=$repo/tests/fuzz
build=${C2F_FUZZ_BUILD:-build/fuzz}
case $build in /*) ;; *) build=$repo/$build ;; esac
seconds=${C2F_FUZZ_SECONDS:-60}
cxx=${C2F_FUZZ_CXX:-clang++}
jobs=${C2F_FUZZ_JOBS:-2}

if ! [[ $seconds =~ ^[0-9]+$ ]] || [[ $seconds -eq 0 ]]; then
  echo "run.sh: C2F_FUZZ_SECONDS must be a positive integer, got '$seconds'" >&2
  exit 2
fi
if ! command -v "$cxx" >/dev/null 2>&1; then
  echo "run.sh: '$cxx' not found; the fuzz targets need Clang with libFuzzer" \
       "(Debian: clang-14 and libclang-rt-14-dev)" >&2
  exit 2
fi

cmake -S "$fuzz_src" -B "$build" -DCMAKE_CXX_COMPILER="$cxx"
cmake --build "$build" -j "$jobs"

status=0
for target in parse roundtrip; do
  exe=$build/fuzz_safetensors_$target
  corpus=$build/corpus/$target
  artifacts=$build/artifacts/$target
  log=$build/logs/fuzz_safetensors_$target.log
  mkdir -p "$corpus" "$artifacts" "$(dirname "$log")"
  # Seeds: the committed corpus and this target's past crash inputs (regressions/<target>-*), copied
  # into the build dir.
  cp -f "$fuzz_src/corpus/$target"/* "$corpus"/
  find "$fuzz_src/regressions" -type f -name "$target-*" -exec cp -f {} "$corpus"/ \;
  extra=()
  [[ $target == parse ]] && extra+=(-dict="$fuzz_src/safetensors.dict")
  list_artifacts() {
    find "$artifacts" -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) | sort
  }
  before=$(list_artifacts)

  echo "=== fuzz_safetensors_$target: ${seconds}s on $corpus (log: $log)"
  rc=0
  "$exe" -max_total_time="$seconds" -max_len=65536 -rss_limit_mb=2048 -timeout=10 \
    -artifact_prefix="$artifacts/" -print_final_stats=1 "${extra[@]}" "$corpus" >"$log" 2>&1 || rc=$?
  grep -E '^#[0-9]+[[:space:]]+DONE|^stat::|^Done [0-9]+ runs' "$log" || true

  new_artifacts=$(comm -13 <(echo "$before") <(list_artifacts) | sed '/^$/d')
  if [[ $rc -ne 0 || -n $new_artifacts ]]; then
    status=1
    echo "!!! fuzz_safetensors_$target FAILED (exit code $rc); end of the log:" >&2
    tail -n 40 "$log" >&2
    if [[ -n $new_artifacts ]]; then
      echo "!!! input(s) that triggered it:" >&2
      for a in $new_artifacts; do echo "    $a" >&2; done
      echo "!!! Copy each into tests/fuzz/regressions/, named $target-<short-description>" \
           "(test_safetensors replays every file there), then fix the bug." >&2
    fi
  fi
done

if [[ $status -ne 0 ]]; then
  echo "run.sh: FAILED: a fuzz target found a crash, leak or timeout (see above)" >&2
else
  echo "run.sh: OK: no crash, leak or timeout in ${seconds}s per target"
fi
exit $status
