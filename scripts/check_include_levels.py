#!/usr/bin/env python3
"""Checks that every header under include/ includes only headers of its own level or a lower one.

    python3 scripts/check_include_levels.py [--root DIR]

Levels, lowest first (CONTRIBUTING.md, "Header levels"):
    core      c2f/core.hpp, runtime.hpp, options.hpp, state_dict.hpp, train.hpp, detail/arg.hpp
    detail    c2f/detail/*              (the helpers kernels use)
    mask      c2f/mask.hpp, mask_view.hpp
    kernels   c2f/kernels/*
    kv_cache  c2f/kv_cache.hpp, detail/decoding.hpp
    layers    c2f/layers/*, detail/layer_support.hpp
    umbrella  c2f/c2f.hpp
and beside them c2f/io/*, c2f/dist.hpp and c2f/dist/*, c2f/python/*: they may include anything, and nothing on a level
may include them. A header that fits no rule is an error too (a new header needs its level here).
Prints every violation as `path:line: ...` and exits 1; else prints a count and exits 0.
"""

import argparse
import fnmatch
import re
import sys
from pathlib import Path

LEVELS = [
    ("core", ["c2f/core.hpp", "c2f/runtime.hpp", "c2f/options.hpp", "c2f/state_dict.hpp", "c2f/train.hpp",
              "c2f/detail/arg.hpp"]),
    ("detail", ["c2f/detail/*"]),
    ("mask", ["c2f/mask.hpp", "c2f/mask_view.hpp"]),
    ("kernels", ["c2f/kernels/*"]),
    ("kv_cache", ["c2f/kv_cache.hpp", "c2f/detail/decoding.hpp"]),
    ("layers", ["c2f/layers/*", "c2f/detail/layer_support.hpp"]),
    ("umbrella", ["c2f/c2f.hpp"]),
]
BESIDE = ["c2f/io/*", "c2f/dist.hpp", "c2f/dist/*", "c2f/python/*"]
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](c2f/[^>"]+)[>"]')


def level_of(header):
    """(index, name) of a header's level, 'beside' for io/dist/python, None when no rule fits. An exact
    name wins over a pattern (detail/decoding.hpp is not at the detail level)."""
    for exact in (True, False):
        for index, (name, rules) in enumerate(LEVELS):
            for rule in rules:
                if ("*" not in rule) == exact and fnmatch.fnmatch(header, rule):
                    return index, name
    if any(fnmatch.fnmatch(header, rule) for rule in BESIDE):
        return len(LEVELS), "beside"
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parent.parent / "include"),
                        help="the folder that holds c2f/ (default: the repository's include/)")
    root = Path(parser.parse_args(argv).root)
    headers = sorted(p.relative_to(root).as_posix() for p in (root / "c2f").rglob("*.hpp"))
    problems, edges = [], 0
    for header in headers:
        own = level_of(header)
        if own is None:
            problems.append(f"{header}:1: fits no level (add it to scripts/check_include_levels.py)")
            continue
        for number, line in enumerate((root / header).read_text(encoding="utf-8").splitlines(), 1):
            match = INCLUDE.match(line)
            if not match:
                continue
            edges += 1
            target = match.group(1)
            other = level_of(target)
            if other is None:
                problems.append(f"{header}:{number}: includes {target}, which fits no level")
            elif other[1] == "beside" and own[1] != "beside":
                problems.append(f"{header}:{number}: includes {target} ({other[1]}): io, dist and python headers "
                                f"are included by nothing on a level")
            elif other[0] > own[0]:
                problems.append(f"{header}:{number}: includes {target} ({other[1]}), a higher level than {own[1]}")
    for p in problems:
        print(p)
    if problems:
        print(f"check_include_levels: {len(problems)} problem(s) in {len(headers)} headers")
        return 1
    print(f"check_include_levels: {edges} includes of {len(headers)} headers respect the levels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
