#!/usr/bin/env python3
"""Writes (or checks) the Layout section of CONTRIBUTING.md from the tree, so that it cannot drift.

    python3 scripts/readme_layout.py            print the layout
    python3 scripts/readme_layout.py --write    replace the block between the layout markers in CONTRIBUTING.md
    python3 scripts/readme_layout.py --check    exit 1 when CONTRIBUTING.md's block differs (ctest docs.readme_layout)

Headers under include/ are described by the first line of their leading comment; every other folder
and top-level file needs a line in DESCRIPTIONS below (a new one without a description is an error).
Files are the ones git tracks (all files when git is unavailable), except the fixture data.
"""

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGET = "CONTRIBUTING.md"  # the file whose Layout section this script owns
BEGIN, END = "<!-- layout:begin (scripts/readme_layout.py --write) -->", "<!-- layout:end -->"

DESCRIPTIONS = {
    ".ci/": "CI entry point: runs scripts/test.sh",
    "benchmarks/": "Google Benchmark binaries (bench_machine: the FMA peaks, copy bandwidth and reference GEMMs; bench_dist under mpirun: run_dist.sh), the PyTorch and ONNX Runtime peers and the sweep (sweep.py: tables, plots), python_bench.py (c2f from Python against PyTorch, the binding's overhead); README.md: how to run and compare",
    "cmake/": "package config template (find_package(c2f [COMPONENTS safetensors dist]))",
    "docs/": "documentation (layers, training, errors, threads, decoding, distributed, python, bf16, benchmarks: how each figure is measured and the current results per machine kind)",
    "examples/": "programs that load PyTorch weights and compare with PyTorch (and their export scripts), a 2-D pyramid, token-by-token decoding, a sequence split over MPI ranks; python/accelerate.py: a PyTorch model before and after c2f.torch.accelerate",
    "python/": "the Python module c2f (pybind11: src/ binds every layer through one template; c2f/torch.py: accelerate a PyTorch model), its pytest suite (tests/) and setup.py for pip",
    "scripts/": "install-deps.sh (the one package list), run.sh (examples, benchmarks), test.sh (tests), doc checks",
    "tests/": "GoogleTest suites (one executable per area)",
    "tests/consumers/": "downstream CMake projects: find_package (core, safetensors, dist), add_subdirectory",
    "tests/dist/": "the c2f::dist tests, run under mpirun by ctest, and their GoogleTest main (the result reduced over the ranks)",
    "tests/data/": "committed PyTorch fixtures, one folder per family, with manifest.json",
    "tests/format/": "unformatted.cpp: the control of the format check (docs.format_catches_unformatted)",
    "tests/fuzz/": "libFuzzer targets for the safetensors reader, seed corpus, regressions",
    "tests/include_levels/": "a header tree with three planted include-level violations: the level check must find exactly those",
    "tests/odr/": "two translation units that include every header (one-definition rule)",
    "tests/openmp/": "the reference outputs of a build without OpenMP, for test_openmp",
    "tests/reference/": "PyTorch reference modules, fixture generator and checker (generate.py, check_fixtures.py)",
    "tests/support/": "test helpers: fixtures, comparisons, random inputs, dense twins",
    "tools/": "malloc_counter.hpp: heap counting for tests and benchmarks; layer_hashes.cpp: a hash of every layer's output bits, to compare two builds of one machine",
    "CHANGELOG.md": "user-visible changes per version, one line each",
    "CONTRIBUTING.md": "presets, tests, fixtures, adding a layer, the header levels, and this layout",
    "CMakeLists.txt": "targets c2f::c2f (Eigen, Threads) and c2f::safetensors (+ nlohmann_json); install rules",
    "CMakePresets.json": "presets dev, release, release-native, asan, tsan (workflows: configure, build, test)",
}
MAX_SUMMARY = 90  # characters of a header's summary
SKIP_FILES = {".gitignore", ".clang-format", "LICENSE", "README.md"}


def tracked_files():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, check=True, capture_output=True, text=True).stdout
        return [Path(line) for line in out.splitlines() if line]
    except (OSError, subprocess.CalledProcessError):
        return [p.relative_to(REPO) for p in REPO.rglob("*") if p.is_file() and ".git" not in p.parts]


def header_summary(path: Path) -> str:
    """The first sentence of the header's leading comment, without its "c2f … —" lead."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("//") or line.strip() == "//":
            break
        lines.append(line[2:].strip())
    text = " ".join(lines)
    if " — " in text:
        text = text.split(" — ", 1)[1]
    text = text.split(". ", 1)[0].rstrip(".")
    if len(text) > MAX_SUMMARY:
        text = text[:MAX_SUMMARY].rsplit(" ", 1)[0].rstrip(",;:") + " …"
    return text


def layout():
    files = tracked_files()
    rows, missing = [], []
    headers = sorted(f for f in files if f.parts[0] == "include" and f.suffix == ".hpp")
    for h in headers:
        rows.append((str(h), header_summary(REPO / h)))
    folders = set()
    for f in files:
        if f.parts[0] == "include" or len(f.parts) == 1:
            continue
        folders.add(f.parts[0] + "/")
        if f.parts[0] == "tests" and len(f.parts) > 2:
            folders.add("/".join(f.parts[:2]) + "/")
    for d in sorted(folders):
        if d not in DESCRIPTIONS:
            missing.append(d)
        else:
            rows.append((d, DESCRIPTIONS[d]))
    for f in sorted(f for f in files if len(f.parts) == 1 and f.name not in SKIP_FILES):
        if f.name not in DESCRIPTIONS:
            missing.append(f.name)
        else:
            rows.append((f.name, DESCRIPTIONS[f.name]))
    if missing:
        sys.exit("readme_layout.py: no description for " + ", ".join(missing) + " (add it to DESCRIPTIONS)")
    width = max(len(r[0]) for r in rows) + 2
    return "```\n" + "".join(f"{name.ljust(width)}{text}\n" for name, text in rows) + "```"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    block = layout()
    if not (args.write or args.check):
        print(block)
        return 0
    readme = REPO / TARGET
    text = readme.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        sys.exit(f"{TARGET} has no layout markers ({BEGIN} … {END})")
    head, rest = text.split(BEGIN, 1)
    current, tail = rest.split(END, 1)
    wanted = f"\n{block}\n"
    if args.check:
        if current != wanted:
            print(f"{TARGET}'s Layout differs from the tree; run python3 scripts/readme_layout.py --write")
            return 1
        print(f"{TARGET}'s Layout matches the tree")
        return 0
    readme.write_text(head + BEGIN + wanted + END + tail, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
