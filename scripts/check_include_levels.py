#!/usr/bin/env python3
"""Checks that every header under include/c2f includes only headers of its own level or a lower one.

    python3 scripts/check_include_levels.py [--root DIR] [--levels FILE] [--expect-problems N]

The levels are defined once, in the table of CONTRIBUTING.md's "Header levels" section (between the
markers `<!-- levels:begin` and `<!-- levels:end -->`), lowest first: its first column names the level,
its second lists the headers as backticked paths — a path ending in `/` is a folder and covers every
header below it, any other path is one header. The paragraph after the table names the folders and
headers beside the levels (io, dist): they may include anything, and nothing on a level may include
them. A header no row covers is an error (a new folder needs its row), and so is, on the repository's
own tree, a file row naming a header that does not exist (a stale definition).
Prints every violation as `path:line: ...` and exits 1; else prints a count and exits 0.
"""

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](c2f/[^>"]+)[>"]')
BESIDE = ["c2f/io/", "c2f/dist/", "c2f/dist.hpp"]


def read_levels(contributing):
    """[(level name, [paths])] from the levels table, lowest first."""
    text = Path(contributing).read_text(encoding="utf-8")
    match = re.search(r"<!-- levels:begin.*?-->\n(.*?)<!-- levels:end -->", text, re.S)
    if not match:
        sys.exit(f"check_include_levels: no levels table (<!-- levels:begin ... levels:end -->) in {contributing}")
    levels = []
    for row in match.group(1).splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 2 or cells[0] in ("level", "") or set(cells[0]) <= set("-: "):
            continue
        paths = re.findall(r"`(c2f/[^`]*)`", cells[1])
        if not paths:
            sys.exit(f"check_include_levels: level '{cells[0]}' lists no c2f/ path")
        levels.append((cells[0], paths))
    return levels


def covers(path, header):
    return header.startswith(path) if path.endswith("/") else header == path


def level_of(levels, header):
    """(index, name) of a header's level, (len(levels), 'beside') for io/dist, None when no row covers it.
    The most specific path wins (a file row over a folder row, a deeper folder over a shallower one)."""
    best = None
    for index, (name, paths) in enumerate(levels):
        for path in paths:
            if covers(path, header) and (best is None or len(path) > best[0]):
                best = (len(path), index, name)
    if best is not None:
        return best[1], best[2]
    if any(covers(path, header) for path in BESIDE):
        return len(levels), "beside"
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=str(REPO / "include"),
                        help="the folder that holds c2f/ (default: the repository's include/)")
    parser.add_argument("--levels", default=str(REPO / "CONTRIBUTING.md"),
                        help="the file whose levels table defines the levels (default: CONTRIBUTING.md)")
    parser.add_argument("--expect-problems", type=int, default=None, metavar="N",
                        help="a control: exit 0 only when exactly N problems are found (a tree with N planted "
                             "violations), else 1")
    args = parser.parse_args(argv)
    root = Path(args.root)
    levels = read_levels(args.levels)
    headers = sorted(p.relative_to(root).as_posix() for p in (root / "c2f").rglob("*.hpp"))
    problems, edges = [], 0
    for name, paths in levels if root.resolve() == (REPO / "include").resolve() else []:
        for path in paths:  # on the repository's own tree: every file row names a header that exists
            if not path.endswith("/") and not (root / path).is_file():
                problems.append(f"{args.levels}: level '{name}' lists {path}, which is not in the tree")
    for header in headers:
        own = level_of(levels, header)
        if own is None:
            problems.append(f"{header}:1: no level covers it (add its folder or file to the levels table)")
            continue
        for number, line in enumerate((root / header).read_text(encoding="utf-8").splitlines(), 1):
            match = INCLUDE.match(line)
            if not match:
                continue
            edges += 1
            target = match.group(1)
            other = level_of(levels, target)
            if other is None:
                problems.append(f"{header}:{number}: includes {target}, which no level covers")
            elif other[1] == "beside" and own[1] != "beside":
                problems.append(f"{header}:{number}: includes {target} ({other[1]}): io and dist headers are "
                                f"included by nothing on a level")
            elif other[0] > own[0]:
                problems.append(f"{header}:{number}: includes {target} ({other[1]}), a higher level than "
                                f"{own[1]}")
    for p in problems:
        print(p)
    if args.expect_problems is not None:
        caught = len(problems) == args.expect_problems
        print(f"check_include_levels: {len(problems)} problem(s), {args.expect_problems} planted: "
              f"{'every one caught' if caught else 'NOT what was planted'}")
        return 0 if caught else 1
    if problems:
        print(f"check_include_levels: {len(problems)} problem(s) in {len(headers)} headers")
        return 1
    print(f"check_include_levels: {edges} includes of {len(headers)} headers respect the "
          f"{len(levels)} levels ({', '.join(name for name, _ in levels)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
