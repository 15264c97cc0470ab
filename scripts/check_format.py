#!/usr/bin/env python3
"""Checks that every C++ file of the repository is formatted as .clang-format says (clang-format 14).

    python3 scripts/check_format.py [--clang-format PATH] [FILE ...]

Without FILE: the C++ files git tracks (.hpp, .cpp, .h), except tests/format/ — the deliberately
unformatted control files. With FILE: those files only. Runs `clang-format --dry-run -Werror` on them,
which prints each difference as file:line and fails; prints a count and exits 0 when none differs. To
format: `clang-format-14 -i <files>` (the list: `git ls-files '*.hpp' '*.cpp' '*.h'`).
Another clang-format major version formats some constructs differently: the check needs 14 (Debian 12's).
"""

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONTROLS = "tests/format/"
SKIPPED = 77  # ctest's SKIP_RETURN_CODE


def find_clang_format(given):
    for candidate in ([given] if given else ["clang-format-14", "clang-format"]):
        path = shutil.which(candidate)
        if path:
            version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
            if " version 14." in version:
                return path
            if given:
                sys.exit(f"check_format: {given} is not clang-format 14: {version.strip()}")
    print("check_format: skipped: clang-format 14 not found (Debian: apt-get install clang-format-14; "
          "scripts/install-deps.sh installs it)")
    sys.exit(SKIPPED)


def tracked_files():
    out = subprocess.run(["git", "ls-files", "*.hpp", "*.cpp", "*.h"], cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:  # not a git checkout: every C++ file below the repository
        files = [p.relative_to(REPO).as_posix() for ext in ("hpp", "cpp", "h") for p in REPO.rglob(f"*.{ext}")
                 if "build" not in p.relative_to(REPO).parts[:1] and "node_modules" not in p.parts]
    else:
        files = out.stdout.split()
    return sorted(f for f in files if not f.startswith(CONTROLS))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clang-format", default=None, help="the clang-format 14 binary (default: found on PATH)")
    parser.add_argument("files", nargs="*", help="files to check (default: every tracked C++ file)")
    args = parser.parse_args(argv)
    clang_format = find_clang_format(args.clang_format)
    files = args.files or tracked_files()
    bad, shown = [], 0
    for start in range(0, len(files), 64):  # a few calls, not one per file
        chunk = files[start:start + 64]
        run = subprocess.run([clang_format, "--dry-run", "-Werror", "--style=file", *chunk], cwd=REPO,
                             capture_output=True, text=True)
        if run.returncode != 0:
            for line in run.stderr.splitlines():  # the first differences, as file:line:column
                if shown < 30:
                    print(line)
                    shown += 1
            bad.extend(f for f in chunk if f"{f}:" in run.stderr)
    if bad:
        print(f"check_format: {len(bad)} of {len(files)} files are not formatted as .clang-format says:")
        for f in bad:
            print(f"  {f}")
        print("check_format: `clang-format-14 -i <file>` formats one")
        return 1
    print(f"check_format: {len(files)} files formatted as .clang-format says")
    return 0


if __name__ == "__main__":
    sys.exit(main())
